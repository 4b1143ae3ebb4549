"""Min-max codes and scales against torchao 0.18's quant_primitives (an independent oracle).

Given our scales and the same quant range, torchao's ``quantize_affine`` must give our
codes, for per-channel int8, per-channel int4 and blockwise int4.  Our min-max scales
must also equal torchao's ``choose_qparams_affine`` (symmetric), rounded to bf16 for
blockwise; per-tensor qint8/quint8 must equal torchao's asymmetric rule.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq

try:
    import torch
    from torchao.quantization import quant_primitives as qp
except ImportError:
    if os.environ.get("CI", "").lower() == "true":  # CI installs the dev extra: never skip silently there
        raise
    pytest.skip("needs torch and torchao (the dev extra)", allow_module_level=True)

RANGES = {8: (-128, 127), 4: (-8, 7)}


def weights(rng: np.random.Generator, rows: int, cols: int, half: float) -> np.ndarray:
    """float32 ``[rows, cols]`` mixing normal, heavy-tailed, tie, tiny and all-zero rows.

    Tie rows: max|w| = half * 2**e, so the min-max scale is exactly 2**e and the values,
    odd multiples of 2**(e-1), sit exactly on rounding ties.
    """
    w = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 2, (rows, 1))).astype(np.float32)
    w[1::5] = rng.standard_t(1.2, (len(w[1::5]), cols)).astype(np.float32)
    e = np.exp2(rng.integers(-10, 5, (len(w[2::5]), 1))).astype(np.float32)
    odd = (2 * rng.integers(-int(half), int(half), (len(w[2::5]), cols)) + 1).astype(np.float32)
    ties = odd * e / 2
    ties[:, 0] = -np.float32(half) * e[:, 0]
    w[2::5] = ties
    w[3] = 0.0
    w[4] *= np.float32(1e-37)
    return w


def torchao_codes(w: np.ndarray, block: tuple[int, ...], scale: np.ndarray, bits: int) -> np.ndarray:
    qmin, qmax = RANGES[bits]
    zero = torch.zeros(scale.shape, dtype=torch.int32)
    out = qp.quantize_affine(torch.from_numpy(w), block, torch.from_numpy(scale), zero, torch.int8, qmin, qmax)
    return out.numpy()


def torchao_symmetric_scale(w: np.ndarray, block: tuple[int, ...], bits: int) -> np.ndarray:
    qmin, qmax = RANGES[bits]
    scale, _ = qp.choose_qparams_affine(torch.from_numpy(w), qp.MappingType.SYMMETRIC, block, torch.int8, qmin, qmax)
    return scale.numpy()


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_minmax_codes_and_scales_equal_torchao(bits: int) -> None:
    rng = np.random.default_rng(bits)
    w = weights(rng, 60, 96, RANGES[bits][1] + 0.5)
    qt = xq.quantize_per_channel(w, bits=bits, method="minmax")
    assert qt.datatype == (xq.Datatype.qcint8 if bits == 8 else xq.Datatype.qcint4)
    np.testing.assert_array_equal(qt.codes, torchao_codes(w, (1, 96), qt.scale, bits))
    ref_scale = torchao_symmetric_scale(w, (1, 96), bits).reshape(-1)
    nonzero = np.abs(w).max(axis=1) > 0
    np.testing.assert_array_equal(qt.scale[nonzero], ref_scale[nonzero])
    assert np.all(qt.scale[~nonzero] == 1)  # ours: 1.0 for all-zero rows; torchao: smallest normal


@pytest.mark.parametrize("bits", [8, 4])
def test_per_channel_mse_codes_equal_torchao_given_the_searched_scales(bits: int) -> None:
    rng = np.random.default_rng(10 + bits)
    w = weights(rng, 40, 64, RANGES[bits][1] + 0.5)
    qt = xq.quantize_per_channel(w, bits=bits, method="mse")
    np.testing.assert_array_equal(qt.codes, torchao_codes(w, (1, 64), qt.scale, bits))


def test_per_channel_other_axes_equal_torchao() -> None:
    rng = np.random.default_rng(5)
    conv = rng.standard_normal((1, 3, 3, 24)).astype(np.float32)  # depthwise [1, KH, KW, OC]
    qt = xq.quantize_per_channel(conv, bits=8, axis=3)
    assert qt.channel_dim == 3 and qt.scale.shape == (24,)
    np.testing.assert_array_equal(qt.codes, torchao_codes(conv, (1, 3, 3, 1), qt.scale, 8))
    np.testing.assert_array_equal(qt.scale, torchao_symmetric_scale(conv, (1, 3, 3, 1), 8).reshape(-1))
    w = rng.standard_normal((10, 7)).astype(np.float32)
    qt = xq.quantize_per_channel(w, bits=4, axis=-1)
    assert qt.channel_dim == 1
    np.testing.assert_array_equal(qt.codes, torchao_codes(w, (10, 1), qt.scale, 4))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("method", ["minmax", "mse"])
def test_blockwise_codes_equal_torchao(group_size: int, method: str) -> None:
    rng = np.random.default_rng(group_size)
    w = weights(rng, 30, 128, 7.5)
    qt = xq.quantize_blockwise(w, group_size=group_size, method=method)
    assert qt.scale.shape == (30, 128 // group_size) and qt.group_size == group_size
    np.testing.assert_array_equal(qt.codes, torchao_codes(w, (1, group_size), qt.scale, 4))
    if method == "minmax":
        ref = torchao_symmetric_scale(w, (1, group_size), 4).reshape(qt.scale.shape)
        ref_bf16 = ref.astype(ml_dtypes.bfloat16).astype(np.float32)
        nonzero = np.abs(w.reshape(30, -1, group_size)).max(axis=2) > 0
        np.testing.assert_array_equal(qt.scale[nonzero], ref_bf16[nonzero])


@pytest.mark.parametrize("dtype, torch_dtype", [(xq.Datatype.qint8, "int8"), (xq.Datatype.quint8, "uint8")])
def test_per_tensor_asymmetric_equals_torchao(dtype: xq.Datatype, torch_dtype: str) -> None:
    rng = np.random.default_rng(7)
    facts = xq.storage(dtype)
    for trial in range(20):
        x = (rng.standard_normal((6, 17)) * 10.0 ** rng.uniform(-4, 4) + rng.uniform(-3, 3)).astype(np.float32)
        if trial % 4 == 1:
            x = np.abs(x)
        qt = xq.quantize_per_tensor(x, dtype=dtype)
        tdtype = getattr(torch, torch_dtype)
        scale, zp = qp.choose_qparams_affine(
            torch.from_numpy(x), qp.MappingType.ASYMMETRIC, x.shape, tdtype, facts.code_min, facts.code_max
        )
        assert qt.scale == scale.numpy().reshape(()) and qt.zero_point == int(zp)
        codes = qp.quantize_affine(torch.from_numpy(x), x.shape, scale, zp, tdtype, facts.code_min, facts.code_max)
        np.testing.assert_array_equal(qt.codes, codes.numpy())


def test_per_tensor_symmetric_equals_torchao() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 9)).astype(np.float32)
    for dtype, tdtype in ((xq.Datatype.qint8, torch.int8), (xq.Datatype.quint8, torch.uint8)):
        facts = xq.storage(dtype)
        qt = xq.quantize_per_tensor(x, dtype=dtype, symmetric=True)
        scale, zp = qp.choose_qparams_affine(
            torch.from_numpy(x), qp.MappingType.SYMMETRIC, x.shape, tdtype, facts.code_min, facts.code_max
        )
        assert qt.scale == scale.numpy().reshape(()) and qt.zero_point == int(zp)


def test_bias_codes_equal_torchao_inside_the_int32_range() -> None:
    rng = np.random.default_rng(9)
    b = (rng.standard_normal(50) * 3).astype(np.float32)
    w_scale = (rng.uniform(0.5, 2, 50) * 1e-3).astype(np.float32)
    qt = xq.quantize_bias(b, 0.02, w_scale)
    assert qt.datatype == xq.Datatype.qcint32
    np.testing.assert_array_equal(qt.scale, np.float32(0.02) * w_scale)
    ref = qp.quantize_affine(
        torch.from_numpy(b), (1,), torch.from_numpy(qt.scale), torch.zeros(50, dtype=torch.int32),
        torch.int32, -(2**31), 2**31 - 1,
    )
    np.testing.assert_array_equal(qt.codes, ref.numpy())


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_half_precision_torch_inputs_give_the_codes_of_their_float32_values(low: str) -> None:
    rng = np.random.default_rng(11)
    t = torch.from_numpy(rng.standard_normal((16, 64)).astype(np.float32)).to(getattr(torch, low))
    widened = t.to(torch.float32).numpy()
    for quantize in (
        lambda x: xq.quantize_per_channel(x, bits=4),
        lambda x: xq.quantize_blockwise(x, 32, method="mse"),
        lambda x: xq.quantize_per_tensor(x),
    ):
        got, expected = quantize(t), quantize(widened)
        np.testing.assert_array_equal(got.codes, expected.codes)
        np.testing.assert_array_equal(got.scale, expected.scale)
