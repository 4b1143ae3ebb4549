"""Hugging Face ``transformers`` architectures through ``xq.export``, on the real runtime.

Small seeded configurations (``hf_models.py``) of BERT, RoBERTa, DistilBERT, GPT-2, Llama, Qwen2,
ViT, ResNet, ConvNeXt, PoolFormer, MobileNetV2, EfficientNet, Whisper's encoder and T5's encoder, with transformers'
eager and SDPA attention, text models fed token ids (a mixed program: embedding lookups and
masks on ExecuTorch's portable kernels) and fed embeddings (float), under fp32, qc8w and
qb4w:32 (qc8w on each architecture's first variant; with the default ``fallback="auto"``).  Every export runs its self-check; the
program is then run on ExecuTorch's runtime and compared with the module in eager torch.

Bounds: fp32 programs differ from torch by the rounding of float32 sums (a few ulps of
sums of at most a few hundred products, through two layers) and by XNNPACK's approximations
of softmax, GELU, SiLU and tanh, which it accepts within 1e-5 of each value on any CPU:
``float_bounds.APPROXIMATED`` of the output's largest magnitude.  Quantized programs carry int8 or int4 weights and int8 activations
on random weights, which are not trained to be quantized: judged by the cosine between
the program's and the module's outputs, at least 0.9 (the lowest measured was 0.94,
MobileNetV2 at qb4w:32); a wrong program is near 0.
"""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import hf_models  # noqa: E402  (needs transformers)
from float_bounds import APPROXIMATED  # noqa: E402

pytestmark = [pytest.mark.xnnpack, pytest.mark.slow]

FP32_BOUND = APPROXIMATED
MIN_COSINE = 0.9

VARIANTS = [(name, attention, inputs) for name in hf_models.ARCHITECTURES
            for attention in (("eager", "sdpa") if name in hf_models.WITH_ATTENTION else ("eager",))
            for inputs in (("ids", "embeds") if name in hf_models.TEXT else ("float",))]
# every scheme on each architecture's first variant; its other variants (SDPA attention, float
# embeddings) change what is lowered around the linears, not how a linear stores its weight:
# there fp32 (exact) and qb4w:32 (the dynamic int8 path) alone
CASES = [(*variant, weights) for i, variant in enumerate(VARIANTS)
         for weights in (("fp32", "qc8w", "qb4w:32") if i == 0 or VARIANTS[i - 1][0] != variant[0]
                         else ("fp32", "qb4w:32"))]


@pytest.mark.parametrize(("name", "attention", "inputs", "weights"), CASES, ids=["-".join(c) for c in CASES])
def test_architecture_exports_and_runs(name: str, attention: str, inputs: str, weights: str) -> None:
    built = hf_models.ARCHITECTURES[name](attention)
    module, example = hf_models.with_float_inputs(built) if inputs == "embeds" else built
    exported = xq.export(module, example, weights=weights, progress=False)
    assert exported.self_check.nodes > 0
    assert exported.mixed == (inputs == "ids")
    (got,) = exported.run(*example)
    with torch.no_grad():
        ref = module(*example).numpy().astype(np.float64)
    got = got.astype(np.float64)
    if weights == "fp32":
        assert np.abs(got - ref).max() <= FP32_BOUND * np.abs(ref).max()
    else:
        cosine = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
        assert cosine >= MIN_COSINE


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_a_decoder_runs_at_every_length_of_its_dynamic_dim(name: str) -> None:
    """The causal mask and the grouped-query repeat of keys and values are built at run time on
    the portable kernels (an expand over the dynamic length among them); GPT-2 views its
    hidden states as ``[-1, 64]`` (a dim inferred from the dynamic length)."""
    module, (ids,) = hf_models.ARCHITECTURES[name]("eager")
    module = hf_models.by_ids(module)
    exported = xq.export(module, (ids,), weights="fp32", progress=False,
                         dynamic_shapes=({1: torch.export.Dim("seq", max=32)},))
    for length in (2, hf_models.TOKENS, 32):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
        (got,) = exported.run(ids)
        with torch.no_grad():
            ref = module(ids).numpy()
        assert np.abs(got - ref).max() <= FP32_BOUND * np.abs(ref).max()


@pytest.mark.parametrize("name", ["convnext", "resnet", "whisper_encoder", "vit", "poolformer"])
def test_full_integer_int8(name: str) -> None:
    """ConvNeXt leaves its layer norms in fp32 and, its branches scaled by 1e-6, its residual
    adds (scale ratios XNNPACK's int8 add refuses): an fp32 add reading an fp32 layer norm's
    output, which the self-check must give torch as the graph does (not its int8 twin).
    Whisper's layer norms are computed in fp32 and their outputs converted to int8: judged
    on the int8 grid, computed from the fp32 values they read.  ViT concatenates a constant
    (its class token) with the patches: that concatenation stays fp32.  PoolFormer's int8
    ``avg_pool(x) - x`` reads ``x`` through a transpose to channels-last: judged on that
    layout's int8 twin."""
    module, (x,) = hf_models.ARCHITECTURES[name]()
    calibration = [(torch.randn(1, *x.shape[1:], generator=torch.Generator().manual_seed(10 + i)),) for i in range(8)]
    exported = xq.export(module, (x,), weights="qc8w", activations="qint8", calibration=calibration, progress=False)
    assert exported.self_check.int8_nodes > 0
    (got,) = exported.run(x)
    with torch.no_grad():
        ref = module(x).numpy().astype(np.float64)
    got = got.astype(np.float64)
    # measured 0.9994 (convnext), 0.9990 (vit), 0.9996 (poolformer), 1.0000 (resnet, whisper_encoder)
    assert float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref)) >= 0.99


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_gptq_calibrates_on_batches_of_three_lengths_with_their_padding_masks(name: str) -> None:
    """Three shapes: the module is traced once with the lengths dynamic, its ``forward(*inputs)``
    given a spec by its signature; GPT-2's linears read the rows flattened (``view(-1, K)``)
    and take the masks flattened alike."""
    module, example = hf_models.ARCHITECTURES[name]("eager")
    batches, masks = [], []
    for i, length in enumerate((9, 14, 20)):
        ids = torch.randint(2, 128, (3, length), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        batches.append((ids, mask) if len(example) == 2 else (ids,))
        masks.append(mask.bool())
    exported = xq.export(module, example, weights="qb4w:32", method="gptq", calibration=batches,
                         calibration_mask=masks, progress=False)
    (got,) = exported.run(*example)
    with torch.no_grad():
        ref = module(*example).numpy().astype(np.float64)
    got = got.astype(np.float64)
    # measured 1.0000 (bert) and 0.9965 (gpt2)
    assert float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref)) >= 0.99
