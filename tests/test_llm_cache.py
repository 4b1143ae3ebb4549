"""The LLM program's cache layouts against transformers' own models, far past their windows.

* Sliding windows: each windowed layer keeps a ring of ``window + max_seq_len - 1``
  positions, full layers the whole context.  A float32 program, fed its prompt in chunks of
  ``max_seq_len`` then one token a call, gives the logits of transformers' eager model on
  the whole sequence at every position, up to 6x the window, for Mistral, Gemma 2 (which
  also soft-caps its scores and logits), Gemma 3, Phi-3 and Qwen2 configurations.
* ``kv_cache="int8"``: the same program with int8 keys and values, against an independent
  reference of the same arithmetic: transformers' eager attention whose keys and values are
  rounded to the cache's grid in plain torch (a scale per position and head, max |x| / 127),
  on the whole sequence.
* StableLM and rotary Falcon (new-architecture grouped heads, and multi-query), which the
  program used to refuse; ALiBi Falcons are refused.

Tolerances, relative to the logits' largest magnitude: float32 sums taken in other orders
(XNNPACK's tiles, ExecuTorch's attention kernel) and XNNPACK's approximated SiLU, GELU and
softmax, which its kernels of each CPU compute to their own few ulps (``RTOL``: the bound of
``float_bounds.APPROXIMATED``; measured here below 6e-7); with int8 keys, a key computed a
rounding away from torch's can fall on the other side of a code boundary (``INT8_RTOL``).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import transformers as tf
from et_lowered import planned_tensors
from float_bounds import APPROXIMATED

import xnnquant as xq
from xnnquant.llm.decoder import INT8_CODE_MAX

pytestmark = pytest.mark.xnnpack

RTOL = APPROXIMATED
#: measured 2.9e-7, 4.8e-7 and 6.1e-7 (Llama, Gemma 2, Gemma 3; no code of the program's differs
#: from the reference's; the program multiplies a score by its key's scale where the reference
#: multiplies the key's D values, other float32 roundings of the same sum); a key computed an ulp
#: away from torch's can round to the neighbouring code at a tie, which moves it one step of its
#: grid (max |x| / 127): one such flip moved the logits by at most 1.7e-4 in 40 random trials
#: on this model; the float model is 5.3e-3 away from the reference (the control below)
INT8_RTOL = 5e-4
VOCAB = 96
WINDOW, MAX_SEQ_LEN, CONTEXT, TOKENS = 5, 4, 40, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)

WINDOWED = {
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=WINDOW)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**COMMON, head_dim=32, sliding_window=WINDOW,
                                                           attn_logit_softcapping=4.0, final_logit_softcapping=3.0)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=WINDOW,
                                                               sliding_window_pattern=2)),
    "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**COMMON, sliding_window=WINDOW)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                                        max_window_layers=1)),
}


def _model(make) -> torch.nn.Module:
    torch.manual_seed(0)
    return make().eval()


def _ids(n: int = TOKENS) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))


def _stepped(llm: xq.LLM, ids: torch.Tensor, prompt: int) -> list[np.ndarray]:
    """Logits of positions prompt-1 .. n-1: the prompt in chunks of MAX_SEQ_LEN, then a token a call."""
    for start in range(0, prompt, MAX_SEQ_LEN):
        logits = llm.forward(ids[0, start:min(start + MAX_SEQ_LEN, prompt)].tolist(), start)
    out = [logits]
    for i in range(prompt, ids.shape[1]):
        out.append(llm.forward([int(ids[0, i])], i))
    return out


def _assert_close(got: list[np.ndarray], want: np.ndarray, prompt: int, rtol: float) -> None:
    scale = float(np.abs(want).max())
    errors = [float(np.abs(g - want[prompt - 1 + k]).max()) / scale for k, g in enumerate(got)]
    worst = int(np.argmax(errors))
    assert errors[worst] <= rtol, f"position {prompt - 1 + worst}: {errors[worst]:.3g} of the logits' magnitude"


@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_layers_keep_a_ring_and_give_transformers_logits_far_past_the_window(family: str) -> None:
    model = _model(WINDOWED[family])
    exported = xq.export_llm(model, max_context=CONTEXT, max_seq_len=MAX_SEQ_LEN, weights="fp32", embeddings=None,
                             progress=False)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    _assert_close(_stepped(xq.LLM(exported), ids, 7), want, 7, RTOL)


def test_the_ring_holds_window_plus_max_seq_len_minus_one_positions() -> None:
    from xnnquant.llm.decoder import Decoder, family_of

    model = _model(WINDOWED["gemma3"])
    decoder = Decoder(model, family_of(model), CONTEXT, max_seq_len=MAX_SEQ_LEN)
    assert [(p.size, p.window) for p in decoder.plans] == [(WINDOW + MAX_SEQ_LEN - 1, WINDOW), (CONTEXT, None)]
    assert decoder.cache_k0.shape == (1, WINDOW + MAX_SEQ_LEN - 1, 2, 32)
    assert decoder.cache_k1.shape == (1, CONTEXT, 2, 32)


# --- int8 keys and values against transformers with its keys and values on the same grid -------------------


def _on_int8_grid(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] rounded to the cache's grid: per (position, head) scale max|x| / 127."""
    peak = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    scale = peak / INT8_CODE_MAX
    return torch.clamp(torch.round(x / scale), -INT8_CODE_MAX, INT8_CODE_MAX) * scale


def _int8_reference(module, query, key, value, attention_mask, **kwargs):
    own = sys.modules[type(module).__module__].eager_attention_forward
    return own(module, query, _on_int8_grid(key), _on_int8_grid(value), attention_mask, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])  # full, soft-capped ring, ring
def test_an_int8_cache_is_transformers_attention_on_int8_keys_and_values(family: str) -> None:
    make = WINDOWED[family] if family in WINDOWED else (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)))
    model = _model(make)
    exported = xq.export_llm(model, max_context=CONTEXT, max_seq_len=MAX_SEQ_LEN, weights="fp32", embeddings=None,
                             kv_cache="int8", progress=False)
    ids = _ids()
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    tf.AttentionInterface.register("int8_reference", _int8_reference)
    AttentionMaskInterface.register("int8_reference", eager_mask)  # the eager implementation's masks
    before = model.config._attn_implementation
    model.set_attn_implementation("int8_reference")
    try:
        with torch.no_grad():
            want = model(ids).logits[0].numpy()
    finally:
        model.set_attn_implementation(before)
    with torch.no_grad():
        float_logits = model(ids).logits[0].numpy()
    got = _stepped(xq.LLM(exported), ids, 7)
    _assert_close(got, want, 7, INT8_RTOL)
    # the reference is not the float model: int8 keys move the logits by far more than the bound
    assert np.abs(float_logits - want).max() > 5 * INT8_RTOL * np.abs(want).max()


def test_an_int8_cache_takes_a_quarter_of_the_float_cache() -> None:
    from xnnquant.llm.decoder import Decoder, family_of

    model = _model(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)))
    sizes = {}
    for kv_cache in ("fp32", "int8"):
        decoder = Decoder(model, family_of(model), CONTEXT, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache)
        sizes[kv_cache] = sum(b.numel() * b.element_size() for name, b in decoder.named_buffers()
                              if name.startswith("cache_"))
    # per position and head, D = 16 values of 4 bytes against 16 codes of a byte and a 4-byte scale
    dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    assert sizes["int8"] * 4 * dim == sizes["fp32"] * (dim + 4)


def test_quantize_int8_rounds_half_to_even_and_zeros_stay_zero() -> None:
    """Ties both ways (0.5 -> 0, 1.5 -> 2, -2.5 -> -2: torch.round's rule, which the program's
    add-and-subtract of 1.5 * 2**23 follows), the extremes at +-127, an all-zero vector."""
    from xnnquant.llm.decoder import quantize_int8

    x = torch.tensor([[[127.0, 0.5, 1.5, -2.5, 0.0, -127.0, 2.5, 126.5]], [[0.0] * 8]])
    codes, scale = quantize_int8(x)
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert scale[0].item() == 1.0 and scale[1].item() == (tiny / 127).item()
    assert codes[0, 0].tolist() == [127, 0, 2, -2, 0, -127, 2, 126]
    assert codes[1, 0].tolist() == [0] * 8
    y = torch.randn(50, 3, 64) * 10  # the rounding trick is torch.round on every value
    codes, scale = quantize_int8(y)
    assert torch.equal(codes, torch.clamp(torch.round(y / scale), -127, 127).to(torch.int8))


# --- families the program used to refuse ------------------------------------------------------------------

FAMILIES = {
    "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**COMMON)),
    "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2, alibi=False, bias=True, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)),
    "falcon multi-query": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True, alibi=False,
        parallel_attn=True, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stablelm_and_falcon_give_transformers_logits(family: str) -> None:
    model = _model(FAMILIES[family])
    exported = xq.export_llm(model, max_context=CONTEXT, max_seq_len=MAX_SEQ_LEN, weights="fp32", embeddings=None,
                             progress=False)
    ids = _ids(20)
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    _assert_close(_stepped(xq.LLM(exported), ids, 7), want, 7, RTOL)


def test_an_alibi_falcon_is_refused_by_name() -> None:
    model = _model(lambda: tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2)))
    with pytest.raises(xq.XnnquantError, match="this Falcon adds ALiBi position biases to its attention scores"):
        xq.export_llm(model, max_context=16, weights="fp32", embeddings=None, progress=False)


@pytest.mark.parametrize("kv_cache", ["fp32", "int8"])
def test_the_programs_header_says_each_layers_positions_and_the_caches_bytes(kv_cache: str) -> None:
    """The line export_llm's report starts with: a ring's positions, not max_context, for each
    windowed layer, and the cache's bytes as the Decoder's buffers hold them."""
    from xnnquant.llm.decoder import Decoder, family_of
    from xnnquant.llm.export import LLMInfo

    model = _model(WINDOWED["gemma3"])
    family = family_of(model)
    decoder = Decoder(model, family, CONTEXT, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache)
    held = sum(b.numel() * b.element_size() for name, b in decoder.named_buffers() if name.startswith("cache_"))
    info = LLMInfo(CONTEXT, VOCAB, 2, 1, (2,), cache=tuple(family.cache_shapes(model)), max_seq_len=MAX_SEQ_LEN,
                   kv_cache=kv_cache, slots=tuple(p.size for p in decoder.plans))
    assert info.cache_bytes() == held
    ring = WINDOW + MAX_SEQ_LEN - 1
    assert f"{kv_cache} KV cache of {CONTEXT} positions x 1 layers, {ring} positions x 1 layers (sliding windows), " \
           f"{held / 1e6:.1f} MB;" in str(info)


def test_the_int8_read_is_planned_at_the_caches_size_not_past_it() -> None:
    """What the attention reads of an int8 cache, the codes and scales of the positions written so
    far (start + n of them), is sliced with the cache's size as its bound: planned at
    [1, heads, CONTEXT, D] codes and [1, heads, 1, CONTEXT] scales, not at start's and n's
    separate bounds (2048 + 128 - 2 = 2174 for SmolLM2 at 2048, measured before). Read with
    ExecuTorch's own deserializer."""
    model = _model(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)))
    exported = xq.export_llm(model, max_context=CONTEXT, max_seq_len=MAX_SEQ_LEN, weights="fp32", embeddings=None,
                             kv_cache="int8", progress=False)
    heads, dim = COMMON["num_key_value_heads"], COMMON["hidden_size"] // COMMON["num_attention_heads"]
    planned = [(kind, sizes) for kind, sizes in planned_tensors(exported.to_pte()) if len(sizes) == 4
               and sizes[1] == heads]
    # the cache's buffers and the reads (2 each a layer), not a call's own codes and scales (at most
    # MAX_SEQ_LEN positions)
    codes = [sizes for kind, sizes in planned if kind == 1 and sizes[3] == dim and sizes[2] > MAX_SEQ_LEN]  # CHAR
    scales = [sizes for kind, sizes in planned if kind == 6 and sizes[2] == 1 and sizes[3] > MAX_SEQ_LEN]  # FLOAT
    layers = COMMON["num_hidden_layers"]
    assert codes == [[1, heads, CONTEXT, dim]] * 4 * layers, codes
    assert scales == [[1, heads, 1, CONTEXT]] * 4 * layers, scales


def test_an_int8_program_plans_no_mask_and_one_rotary_table() -> None:
    """The full layers' mask is made in each layer's delegate from two vectors (decoder.py), so
    no float32 [MAX_SEQ_LEN, CONTEXT] mask is planned; the layers' equal unsqueezes of the
    rotary cos and sin are one each: two [1, 1, MAX_SEQ_LEN, D] tensors, not two a layer.
    Read with ExecuTorch's own deserializer; fails if either comes back."""
    config = dict(COMMON, num_hidden_layers=3)
    model = _model(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**config)))
    exported = xq.export_llm(model, max_context=CONTEXT, max_seq_len=MAX_SEQ_LEN, weights="fp32", embeddings=None,
                             kv_cache="int8", progress=False)
    planned = [sizes for _, sizes in planned_tensors(exported.to_pte())]
    dim = config["hidden_size"] // config["num_attention_heads"]
    assert [MAX_SEQ_LEN, CONTEXT] not in planned
    assert planned.count([1, 1, MAX_SEQ_LEN, dim]) == 2, planned
