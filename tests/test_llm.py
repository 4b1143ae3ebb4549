"""``xq.export_llm`` and ``xq.generate`` against independent oracles.

* transformers' own models (their own attention and cache, the whole sequence at once):
  a float32 program, prefilled then decoding token by token on ExecuTorch's runtime, gives
  their logits at every position, for tiny random decoders of several families; greedy
  generation gives ``model.generate``'s tokens.
* ExecuTorch's own llama ``Transformer`` without a cache, on the whole sequence.
* ExecuTorch's ``TextLLMRunner``: it loads our quantized file with a tokenizer and
  generates what ``xq.generate`` generates.
* ExecuTorch's runtime and deserializer read the metadata methods as written.

Float32 logits agree to float rounding: XNNPACK's kernels and ExecuTorch's attention kernel
sum in other orders than torch's (``RTOL``, relative to the logits' largest magnitude).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from float_bounds import APPROXIMATED

import xnnquant as xq
from xnnquant.errors import XnnquantError
from xnnquant.llm.export import STEP_TOLERANCE
from xnnquant.pte import read_pte

pytestmark = pytest.mark.xnnpack

#: float32 sums in other orders and XNNPACK's approximated SiLU / GELU / softmax kernels, which
#: differ by CPU (float_bounds.APPROXIMATED; measured here: below 5e-7 of the logits' largest
#: magnitude for every family)
RTOL = APPROXIMATED
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: tiny decoders of the families users export: grouped-query attention (llama), q/k norms and
#: a head dim of its own (qwen3), one fused qkv projection (phi3), a tied and scaled token table
#: (gemma), partial rotary with layer norms and biases (phi), learned positions (gpt2)
FAMILIES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON)),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**COMMON, head_dim=32)),
    "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**COMMON)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                    bos_token_id=1, eos_token_id=2)),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def _ids(n: int, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _stepped(llm: xq.LLM, ids: torch.Tensor, prompt: int) -> list[np.ndarray]:
    """Logits of positions prompt-1 .. n-1: the prompt in one call, then one call per token."""
    out = [llm.forward(ids[0, :prompt].tolist(), 0)]
    for i in range(prompt, ids.shape[1]):
        out.append(llm.forward([int(ids[0, i])], i))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_float_program_gives_transformers_logits_at_every_step(family: str) -> None:
    model = _model(family)
    before = model.config._attn_implementation
    exported = xq.export_llm(model, max_context=16, weights="fp32", embeddings=None, progress=False)
    assert model.config._attn_implementation == before  # the model is left as it was
    ids = _ids(9)
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    got = _stepped(xq.LLM(exported), ids, 5)
    scale = float(np.abs(want).max())
    for k, logits in enumerate(got):
        np.testing.assert_allclose(logits, want[4 + k], rtol=0, atol=RTOL * scale)


def test_greedy_generation_is_transformers_generate() -> None:
    model = _model("llama")
    exported = xq.export_llm(model, max_context=24, weights="fp32", embeddings=None, progress=False)
    prompt = _ids(5)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 5:].tolist()
    result = xq.generate(exported, prompt, 12, eos_ids=[])
    assert result.tokens == want and result.stop == "length" and result.prompt_tokens == 5


def test_executorchs_own_llama_transformer() -> None:
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    def make(cache: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        return construct_transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                                               hidden_dim=128, max_seq_len=32, max_context_len=32, use_kv_cache=cache,
                                               enable_dynamic_shape=True, generate_full_logits=not cache)).eval()

    model, whole = make(True), make(False)
    exported = xq.export_llm(model, max_context=32, weights="fp32", embeddings=None, progress=False)
    ids = _ids(9)
    with torch.no_grad():
        want = whole(ids)[0].numpy()  # no cache: the whole sequence at once, every position's logits
    got = _stepped(xq.LLM(exported), ids, 5)
    for k, logits in enumerate(got):
        np.testing.assert_allclose(logits, want[4 + k], rtol=0, atol=RTOL * float(np.abs(want).max()))
    # its cache is the model's own, not the Decoder's: a refusal does not put it at 0 MiB nor advise int8
    with pytest.raises(xq.XnnquantError, match=r"; of that, the KV cache holds max_context=32 positions and the "
                                               r"activations are planned for a call of max_seq_len=32 tokens: "
                                               r"lower either$"):
        xq.export_llm(model, max_context=32, weights="fp32", embeddings=None, progress=False, memory="2KB")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A qb4w:32 program with int8 embeddings, and a byte-level BPE tokenizer of its vocabulary
    whose tokens are all ASCII (the runner's callback decodes each token to UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"])
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog, then naps in the sun. " * 8], trainer)
    folder = tmp_path_factory.mktemp("llm")
    tokenizer.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = dict(COMMON, vocab_size=tokenizer.get_vocab_size(), bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    exported = xq.export_llm(model, max_context=32, progress=False)
    exported.save(folder / "model.pte")
    # the phone's layout: the int8 cache (read in XNNPACK, no llama:: kernel) and prompts in chunks
    xq.export_llm(model, max_context=32, max_seq_len=2, kv_cache="int8", progress=False).save(folder / "int8.pte")
    return str(folder / "model.pte"), str(folder / "tokenizer.json")


@pytest.mark.parametrize("name", ["model.pte", "int8.pte"])
def test_executorchs_text_llm_runner_runs_our_file(quantized: tuple[str, str], name: str) -> None:
    from tokenizers import Tokenizer

    from xnnquant.pte.quantized import load_kernels

    pte, tokenizer_path = quantized
    pte = str(Path(pte).with_name(name))
    load_kernels(read_pte(pte).operators)  # the runner shares the pip runtime's kernels
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    prompt = "the quick brown"
    ids = Tokenizer.from_file(tokenizer_path).encode(prompt).ids
    ours = xq.generate(pte, ids, 10)
    pieces: list[str] = []
    runner = TextLLMRunner(pte, tokenizer_path)
    runner.generate(prompt, GenerationConfig(max_new_tokens=10, temperature=0.0, echo=False),
                    token_callback=pieces.append)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    assert len(ours.tokens) >= 5
    assert "".join(pieces) == tokenizer.decode(ours.tokens, skip_special_tokens=False)


def test_the_metadata_methods_as_executorch_reads_them(quantized: tuple[str, str]) -> None:
    from executorch.exir._serialize import _deserialize_pte_binary, _PTEFile, _serialize_pte_binary
    from executorch.runtime import Runtime

    from xnnquant.pte.quantized import load_kernels

    pte, _ = quantized
    data = Path(pte).read_bytes()
    load_kernels(read_pte(data).operators)
    program = Runtime.get().load_program(data)
    got = {name: program.load_method(name).execute([]) for name in sorted(program.method_names) if name != "forward"}
    assert got == {"enable_dynamic_shape": [True], "get_bos_id": [1], "get_eos_ids": [2], "get_max_context_len": [32],
                   "get_max_seq_len": [32], "get_n_layers": [2], "get_vocab_size": [xq.LLM(pte).info.vocab_size],
                   "use_kv_cache": [True], "use_sdpa_with_kv_cache": [False]}
    meta = program.metadata("forward")
    assert meta.num_inputs() == 2 and meta.num_outputs() == 1
    # ExecuTorch's serializer writes back what its deserializer read (it stores equal named blobs once
    # where ours keeps a streamed delegate's constants apart: the bytes differ, the program does not)
    read = _deserialize_pte_binary(data)
    again = _deserialize_pte_binary(bytes(_serialize_pte_binary(
        _PTEFile(read.program, mutable_data=read.mutable_data, named_data=read.named_data),
        extract_delegate_segments=True)))
    assert again.program == read.program
    assert [bytes(b.storage) for b in again.mutable_data] == [bytes(b.storage) for b in read.mutable_data]


def test_a_quantized_program_stepped_or_whole_agrees_and_generation_is_reproducible(quantized: tuple[str, str]) -> None:
    pte, _ = quantized
    llm = xq.LLM(pte)
    ids = _ids(8, seed=3, vocab=llm.info.vocab_size)
    stepped = _stepped(llm, ids, 4)
    for k, logits in enumerate(stepped):
        llm.reset()
        whole = llm.forward(ids[0, :4 + k].tolist(), 0)
        # per-token int8 activations: each token's codes are its own, so the same program on the whole
        # prompt differs only where sums in another order move a code (bound: export_llm's STEP_TOLERANCE)
        assert np.sqrt(np.mean((logits - whole) ** 2) / np.mean(whole ** 2)) < STEP_TOLERANCE
    first = xq.generate(pte, [5, 6, 7], 12, temperature=0.8, top_p=0.9, seed=7)
    assert xq.generate(pte, [5, 6, 7], 12, temperature=0.8, top_p=0.9, seed=7).tokens == first.tokens


# ---------------------------------------------------------------------- bad input


def test_models_that_are_not_causal_lms_are_refused() -> None:
    with pytest.raises(XnnquantError, match="has no language-model head"):
        xq.export_llm(tf.LlamaModel(tf.LlamaConfig(**COMMON)).eval(), max_context=16)
    with pytest.raises(XnnquantError, match=r"must be a transformers causal LM .* got Linear"):
        xq.export_llm(torch.nn.Linear(2, 2), max_context=16)
    bloom = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4)).eval()
    with pytest.raises(XnnquantError, match="does not compute its attention through transformers' attention interface"):
        xq.export_llm(bloom, max_context=16)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_context": 65}, r"max_context=65 is beyond the 64 positions LlamaForCausalLM was made for"),
    ({"max_context": 1}, r"max_context must be an int >= 2 \(the positions the KV cache holds\): got 1"),
    ({"max_context": "16"}, r"max_context must be an int >= 2"),
    ({"max_context": 16, "eos_ids": [2, 500]}, r"eos_ids 500 is not a token of the vocabulary: expected an id in "
                                               r"\[0, 96\)"),
    ({"max_context": 16, "calibration": [torch.zeros(2, 3, dtype=torch.int64)]},
     r"calibration\[0\] must be a CPU int64 tensor of token ids, shape \[1, n\]"),
    ({"max_context": 16, "calibration": [torch.full((1, 4), 96)]}, r"outside the vocabulary \[0, 96\): 96 .. 96"),
    ({"max_context": 16, "rotation": "spin"}, r"rotation must be None or one of .hadamard.: got .spin."),
    ({"max_context": 16, "memory": "4 parsecs"}, r"^memory must be the memory of the device the program is for: "
                                                 r"got '4 parsecs'"),
    ({"max_context": 16, "max_seq_len": 17}, r"^max_seq_len must be an int in \[2, max_context=16\] \(the most tokens "
                                             r"one forward call takes; a longer prompt is fed in calls of max_seq_len\): "
                                             r"got 17$"),
    ({"max_context": 16, "max_seq_len": 1}, r"^max_seq_len must be an int in \[2, max_context=16\]"),
    ({"max_context": 16, "max_seq_len": 4.0}, r"^max_seq_len must be an int in \[2, max_context=16\]"),
    ({"max_context": 16, "kv_cache": "fp16"}, r"^kv_cache must be one of 'fp32'"),
    ({"max_context": 16, "max_seq_len": 4, "calibration": [torch.zeros(1, 5, dtype=torch.int64)], "method": "gptq"},
     r"calibration\[0\] must be a CPU int64 tensor of token ids, shape \[1, n\] with 1 <= n <= max_seq_len=4"),
])
def test_bad_arguments_are_refused_before_tracing(kwargs: dict, message: str) -> None:
    with pytest.raises(XnnquantError, match=message):
        xq.export_llm(_model("llama"), progress=False, **kwargs)


@pytest.mark.parametrize(("kv_cache", "mib", "advice"), [
    ("fp32", r"0\.007812", r", or take kv_cache='int8'"),  # 2 x 2 x 16 x 2 x 16 x 4 = 8192 bytes
    ("int8", r"0\.002441", r""),  # 2 x 2 x 16 x 2 x (16 codes + a 4-byte scale) = 2560 bytes
])
def test_the_phones_memory_refuses_a_program_that_does_not_fit_and_says_the_caches_share(
        kv_cache: str, mib: str, advice: str) -> None:
    """``memory=`` (the phone's): a program planning more is refused whatever this machine has,
    and the refusal says what the KV cache takes, derived by hand from the config: 2 layers x
    (keys, values) x 16 positions x 2 heads x 16 dims, at 4 bytes (fp32) or 1 byte and a float32
    scale a position and head (int8); int8 is advised only to a float32 cache."""
    from xnnquant.errors import PlannedMemoryError

    model = _model("llama")
    options = dict(max_context=16, max_seq_len=4, weights="fp32", embeddings=None, progress=False, kv_cache=kv_cache)
    with pytest.raises(PlannedMemoryError, match=r"plans \S+ GiB \(\d+ bytes\) of memory, .* and the target has "
                       r"\S+ GiB \(memory=2000\); expected a plan that fits .*; of that, the KV cache takes "
                       rf"{mib} MiB \(max_context=16, kv_cache='{kv_cache}'\) and the activations are planned for a "
                       rf"call of max_seq_len=4 tokens: lower either{advice}$"):
        xq.export_llm(model, memory="2KB", **options)
    exported = xq.export_llm(model, memory="1GiB", **options)
    assert exported.summary["memory"]["checked_against"] == "memory="
    assert exported.summary["memory"]["limit_bytes"] == 2**30


def test_generation_stops_at_the_context_as_text_llm_runner_does(quantized: tuple[str, str]) -> None:
    """TextLLMRunner resolves max_new_tokens to at most max_context - prompt (its
    resolve_max_new_tokens) and refuses a prompt that fills the context; so does generate."""
    from tokenizers import Tokenizer

    from xnnquant.pte.quantized import load_kernels

    pte, tokenizer_path = quantized
    llm = xq.LLM(pte)
    tokenizer = Tokenizer.from_file(tokenizer_path)
    text = "the quick brown fox jumps over the lazy dog, then naps in the sun. " * 2
    ids = tokenizer.encode(text).ids[:28]
    prompt = tokenizer.decode(ids)
    assert tokenizer.encode(prompt).ids == ids  # the runner encodes the text again
    result = llm.generate(ids, 64)
    assert result.stop == "context" and len(result.tokens) == 32 - 28
    load_kernels(read_pte(pte).operators)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    config = GenerationConfig(max_new_tokens=64, temperature=0.0, echo=False)
    assert config.resolve_max_new_tokens(32, 28) == len(result.tokens)  # the runner's own rule
    stats: list = []
    pieces: list[str] = []
    TextLLMRunner(pte, tokenizer_path).generate(prompt, config, token_callback=pieces.append,
                                                stats_callback=stats.append)
    assert "".join(pieces) == tokenizer.decode(result.tokens, skip_special_tokens=False)
    # the runner counts the tokens of its decode loop (the first comes from the prefill)
    assert stats[0].num_generated_tokens + 1 == len(result.tokens) == result.decode_tokens + 1
    with pytest.raises(XnnquantError, match=r"^the prompt's 32 tokens fill the program's context of 32 positions: "
                                            r"expected fewer than 32"):
        llm.generate([5] * 32, 3)


def test_generation_past_the_vocabulary_or_the_context_is_refused(quantized: tuple[str, str]) -> None:
    pte, _ = quantized
    llm = xq.LLM(pte)
    with pytest.raises(XnnquantError, match=r"outside the vocabulary \[0, \d+\), first 4000: was the prompt encoded "
                                            "with this model's tokenizer"):
        llm.generate([5, 4000], 3)
    with pytest.raises(XnnquantError, match="prompt_ids must be a non-empty sequence of token ids"):
        llm.generate([], 3)
    with pytest.raises(XnnquantError, match=r"^positions 31..32 are outside the program's context of 32 positions"):
        llm.forward([5, 6], 31)
    with pytest.raises(XnnquantError, match="failed to run method 'forward'"):  # the program's own check
        llm.session.run("forward", [torch.tensor([[5, 6]]), torch.tensor([31])])
    assert llm.generate([5, 6, 7], 4).tokens == xq.generate(pte, [5, 6, 7], 4).tokens  # it goes on
    with pytest.raises(XnnquantError, match="the program is not an LLM program"):
        xq.LLM(xq.export(torch.nn.Linear(4, 4).eval(), (torch.randn(1, 4),), weights="fp32",
                         progress=False).to_pte())


def test_rates_count_the_tokens_of_their_phase() -> None:
    """An end-of-sequence token made by a decode call is one of its tokens; the first new token
    is the prefill's (TextLLMRunner's stats count the same way)."""
    from xnnquant.cli.llm import speeds

    model = _model("llama")
    exported = xq.export_llm(model, max_context=24, max_seq_len=4, weights="fp32", embeddings=None, progress=False)
    llm = xq.LLM(exported)
    free = llm.generate(_ids(6), 8, eos_ids=[])
    assert (free.stop, len(free.tokens), free.decode_tokens, free.prefill_calls) == ("length", 8, 7, 2)
    stopped = llm.generate(_ids(6), 8, eos_ids=[free.tokens[3]])
    assert (stopped.stop, stopped.tokens, stopped.decode_tokens) == ("eos", free.tokens[:3], 3)
    line = speeds(free)
    assert line.startswith("prefill: 6 tokens in 2 calls in ") and "decode: 7 tokens in " in line
    assert line.endswith("8 new tokens, stopped: length")
    rate = float(line.split("decode: 7 tokens in ")[1].split(" ms (")[1].split(" tokens/s")[0])
    assert rate == pytest.approx(7 / free.decode_seconds, rel=1e-3, abs=0.1)  # the line's rate counts 7


# ---------------------------------------------------------------------- max_seq_len


def test_prompts_longer_than_max_seq_len_go_in_chunks() -> None:
    """A program taking 4 tokens a call: a 10-token prompt in calls of 4, 4 and 2 gives
    transformers' logits at every position (as one call of a 16-token program does), the
    program plans its activations for 4 tokens, and refuses a call of 5."""
    from xnnquant.pte.planned import planned_bytes

    model = _model("llama")
    short = xq.export_llm(model, max_context=16, max_seq_len=4, weights="fp32", embeddings=None, progress=False,
                          full_logits=True)
    whole = xq.export_llm(model, max_context=16, weights="fp32", embeddings=None, progress=False, full_logits=True)
    assert (short.llm.max_seq_len, whole.llm.max_seq_len) == (4, 16)
    ids = _ids(10)
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    llm = xq.LLM(short)
    assert llm.info.max_seq_len == 4 and llm.info.max_context == 16 and llm.info.full_logits
    got = llm.logits(ids[0].tolist(), 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * float(np.abs(want).max()))
    np.testing.assert_allclose(llm.forward(ids[0].tolist(), 0), want[-1], rtol=0, atol=RTOL * float(np.abs(want).max()))
    # the same cache and weights; the activations (and the full logits) planned for 4 tokens instead of 16
    assert planned_bytes(short.to_pte())["forward"] < planned_bytes(whole.to_pte())["forward"]
    with pytest.raises(XnnquantError, match="failed to run method 'forward'"):
        llm.session.run("forward", [ids[:, :5], torch.tensor([0])])


def test_a_program_taking_fewer_tokens_than_its_metadata_says_is_called_in_chunks_it_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecuTorch 1.4.1's recipe reports get_max_seq_len 128 and bounds forward's tokens at 127
    (measured on export_llama --max_seq_length 128): chunks go by the input's bound, the
    smaller. The metadata is made to say 5 of a program taking 4; a call of 5 would fail."""
    from xnnquant.llm import evaluate

    model = _model("llama")
    exported = xq.export_llm(model, max_context=16, max_seq_len=4, weights="fp32", embeddings=None, progress=False)
    path = exported.save(tmp_path / "m.pte")
    ids = _ids(10)
    with torch.no_grad():
        want = model(ids).logits[0, -1].numpy()
    constant, metadata = xq.LLM._constant, evaluate.ProgramStep.metadata
    monkeypatch.setattr(xq.LLM, "_constant", lambda self, name: 5 if name == "get_max_seq_len" else
                        constant(self, name))
    monkeypatch.setattr(evaluate.ProgramStep, "metadata", lambda self, name: 5 if name == "get_max_seq_len" else
                        metadata(self, name))
    llm, step = xq.LLM(path), evaluate.llm_step(path)
    assert llm.info.max_seq_len == step.max_seq_len == 4
    atol = RTOL * float(np.abs(want).max())
    np.testing.assert_allclose(llm.forward(ids[0].tolist(), 0), want, rtol=0, atol=atol)
    np.testing.assert_allclose(step(ids.numpy(), 0), want, rtol=0, atol=atol)


def test_text_llm_runner_chunks_our_prompts_as_we_do(tmp_path: Path, quantized: tuple[str, str]) -> None:
    """ExecuTorch's runner prefills a prompt longer than get_max_seq_len in calls of it
    (TextPrefiller): it generates from our 4-token-a-call program what generate does."""
    from tokenizers import Tokenizer

    from xnnquant.pte.quantized import load_kernels

    _, tokenizer_path = quantized
    tokenizer = Tokenizer.from_file(tokenizer_path)
    torch.manual_seed(0)
    config = dict(COMMON, vocab_size=tokenizer.get_vocab_size(), bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    pte = str(tmp_path / "chunks.pte")
    xq.export_llm(model, max_context=32, max_seq_len=4, weights="qb4w:32", progress=False).save(pte)
    prompt = "the quick brown fox jumps over"
    ids = tokenizer.encode(prompt).ids
    assert len(ids) > 4
    ours = xq.generate(pte, ids, 8)
    load_kernels(read_pte(pte).operators)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    pieces: list[str] = []
    TextLLMRunner(pte, tokenizer_path).generate(prompt, GenerationConfig(max_new_tokens=8, temperature=0.0,
                                                                         echo=False),
                                                token_callback=pieces.append)
    assert len(ours.tokens) >= 4
    assert "".join(pieces) == tokenizer.decode(ours.tokens, skip_special_tokens=False)


def test_a_full_logits_program_gives_every_positions_logits() -> None:
    model = _model("qwen3")
    exported = xq.export_llm(model, max_context=16, max_seq_len=8, weights="fp32", embeddings=None, progress=False,
                             full_logits=True)
    ids = _ids(6)
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    (got,) = exported.session().run(ids, torch.tensor([0]))
    assert got.shape == (1, 6, VOCAB)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=RTOL * float(np.abs(want).max()))
    last = xq.export_llm(model, max_context=16, max_seq_len=8, weights="fp32", embeddings=None, progress=False)
    with pytest.raises(XnnquantError, match=r"returns the logits of each call's last position only: export it with "
                                            r"full_logits=True"):
        xq.LLM(last).logits([1, 2], 0)
