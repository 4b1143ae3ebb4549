"""Measurement helpers: hand-derived golden values, exhaustive bf16 sweeps, error text."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xnnquant import Datatype, QuantizedTensor, XnnquantError
from xnnquant.metrics import bits_per_weight, relative_error, runtime_bf16, sqnr_db
from xnnquant.rounding import bf16_bits_to_float32, to_bf16

# ------------------------------------------------------------------------------- sqnr


def test_sqnr_golden_values() -> None:
    # signal 3^2 + 4^2 = 25, noise 0^2 + 1^2 = 1  ->  10 log10 25
    assert sqnr_db(np.array([3.0, 4.0], np.float32), np.array([3.0, 3.0], np.float32)) == pytest.approx(
        10 * math.log10(25)
    )
    # halving every value: noise is a quarter of the signal -> 10 log10 4 = 6.02 dB
    x = np.arange(1, 9, dtype=np.float32)
    assert sqnr_db(x, x / 2) == pytest.approx(6.0206, abs=1e-4)


def test_sqnr_edge_cases() -> None:
    x = np.array([1.0, -2.0], np.float32)
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(np.zeros(2, np.float32), x) == -math.inf
    assert math.isnan(sqnr_db(np.zeros(2, np.float32), np.zeros(2, np.float32)))


def test_sqnr_along_an_axis() -> None:
    ref = np.array([[3.0, 4.0], [1.0, 1.0]], np.float32)
    app = np.array([[3.0, 3.0], [1.0, 1.0]], np.float32)
    out = sqnr_db(ref, app, axis=1)
    assert out.shape == (2,)
    assert out[0] == pytest.approx(10 * math.log10(25)) and out[1] == math.inf


def test_sqnr_accepts_torch_and_checks_shapes() -> None:
    torch = pytest.importorskip("torch")
    assert sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 3.0], dtype=torch.bfloat16)) == pytest.approx(13.9794, abs=1e-4)
    with pytest.raises(XnnquantError, match=r"same shape: got \(2,\) and \(3,\)"):
        sqnr_db(np.zeros(2, np.float32), np.zeros(3, np.float32))
    with pytest.raises(XnnquantError, match="floating-point"):
        sqnr_db(np.zeros(2, np.int32), np.zeros(2, np.float32))


def test_relative_error() -> None:
    out = relative_error(np.array([2.0, -4.0, 0.0, 0.0], np.float32), np.array([2.5, -5.0, 0.0, 1.0], np.float32))
    assert out[:3].tolist() == [0.25, -0.25, 0.0] and math.isinf(out[3])


# ------------------------------------------------------------------------------- bits per weight


def _qt(datatype: Datatype, codes: np.ndarray, scale: np.ndarray, **kw: object) -> QuantizedTensor:
    return QuantizedTensor(datatype, codes, scale, **kw)  # type: ignore[arg-type]


def test_bits_per_weight_golden() -> None:
    # qcint8 384x384: 8 bits per code, one fp32 scale per row of 384 -> 8 + 32/384
    qc8 = _qt(Datatype.qcint8, np.zeros((384, 384), np.int8), np.ones(384), channel_dim=0)
    assert bits_per_weight(qc8) == pytest.approx(8 + 32 / 384)
    # qbint4 group 32: 4 bits per code plus one bf16 scale per 32 codes -> 4.5
    qb4 = _qt(Datatype.qbint4, np.zeros((4, 64), np.int8), np.ones((4, 2)), group_size=32)
    assert bits_per_weight(qb4) == 4.5
    # qcint4 with odd K=5: 3 bytes per row (one padding nibble) + one fp32 scale -> (24 + 32) / 5
    qc4 = _qt(Datatype.qcint4, np.zeros((2, 5), np.int8), np.ones(2), channel_dim=0)
    assert bits_per_weight(qc4) == pytest.approx((24 + 32) / 5)
    # per-tensor qint8, 10 codes: 80 bits + fp32 scale + int32 zero point -> 14.4
    q8 = _qt(Datatype.qint8, np.zeros(10, np.int8), np.float32(0.5), zero_point=3)
    assert bits_per_weight(q8) == pytest.approx(14.4)
    # per-token qdint8, 3 rows of 4: 8 bits + (fp32 scale + int32 zero point) / 4 -> 24
    qd8 = _qt(Datatype.qdint8, np.zeros((3, 4), np.int8), np.ones(3), zero_point=np.zeros(3, np.int32))
    assert bits_per_weight(qd8) == 24


@pytest.mark.parametrize("k", [1, 2, 7, 64])
def test_bits_per_weight_counts_the_bytes_to_bytes_writes(k: int) -> None:
    qc4 = _qt(Datatype.qcint4, np.zeros((3, k), np.int8), np.ones(3), channel_dim=0)
    stored_bits = 8 * len(qc4.to_bytes()) + 32 * 3
    assert bits_per_weight(qc4) * 3 * k == pytest.approx(stored_bits)


def test_bits_per_weight_rejects_empty() -> None:
    empty = _qt(Datatype.qcint8, np.zeros((0, 4), np.int8), np.ones(0), channel_dim=0)
    with pytest.raises(XnnquantError, match=r"non-empty tensor: got shape \(0, 4\)"):
        bits_per_weight(empty)


# ------------------------------------------------------------------------------- runtime bf16


def test_runtime_bf16_golden_values() -> None:
    # 1 + 2^-8 is half-way between bf16 1.0 and 1.0078125: RNE picks the even 1.0, while the
    # runtime's product 1.00781249... rounds (in float32) to 1.0078125 and truncates there.
    tie = np.array([1 + 2**-8], np.float32)
    assert to_bf16(tie).bits[0] == 0x3F80
    assert runtime_bf16(tie).bits[0] == 0x3F81 and runtime_bf16(tie).values[0] == 1.0078125
    # 1.984375 + 0.1 step (significand near 2): RNE keeps 1.984375, the runtime adds
    # 1.985 * 0.00389 = 0.99 step and lands on the next bf16 value 1.9921875.
    near_top = np.array([1.984375 + 0.1 * 2**-7], np.float32)
    assert to_bf16(near_top).values[0] == 1.984375
    assert runtime_bf16(near_top).values[0] == 1.9921875
    # sign is kept
    assert runtime_bf16(-near_top).bits[0] == 0x8000 | runtime_bf16(near_top).bits[0]


def test_runtime_bf16_keeps_every_finite_bf16_value() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bf16_bits_to_float32(bits)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(runtime_bf16(values[finite]).bits, bits[finite])


def test_runtime_bf16_against_rne_on_a_whole_binade() -> None:
    """Every float32 in [1, 2): never below RNE, at most one bf16 step above, about 1 in 4 above."""
    x = np.arange(0x3F800000, 0x40000000, dtype=np.uint32).view(np.float32)
    step = runtime_bf16(x).bits.astype(np.int32) - to_bf16(x).bits.astype(np.int32)
    assert step.min() == 0 and step.max() == 1
    assert 0.24 < step.mean() < 0.25


@pytest.mark.xnnpack
def test_runtime_bf16_is_what_the_executorch_runtime_computes() -> None:
    """Oracle: the real ExecuTorch 1.4.1 runtime, reading fp32 qbint4 scales that are not bf16 values.

    The builder refuses such scales, so they are swapped into the constant's quant params
    after it was added.  One-hot inputs make each output one weight times its scale.
    """
    from xnnquant.graph import Graph, PerChannelGroupQuant
    from xnnquant.graph.program import run

    n, k, g = 16, 64, 32
    bf16 = to_bf16(np.random.default_rng(0).uniform(0.01, 0.1, (n, k // g)).astype(np.float32)).values
    # a quarter to half a bf16 step above a bf16 value: RNE rounds down, the runtime up when the
    # significand is above about 1.6
    scale = (bf16 * np.float32(1 + 2**-10)).astype(np.float32)
    differs = runtime_bf16(scale).bits != to_bf16(scale).bits
    assert differs.any() and not differs.all()

    codes = np.zeros((n, k), np.int8)
    codes[:, 0], codes[:, g] = 7, -5
    qt = QuantizedTensor(Datatype.qbint4, codes, bf16, group_size=g, channel_dim=0)
    graph = Graph(write_scale_bf16=False)
    x = graph.input((2, k))
    w = graph.constant(qt)
    graph.output(graph.fully_connected(graph.convert(x, Datatype.qdint8), w))
    graph.values[w].quant = PerChannelGroupQuant(scale.ravel().copy(), 0, g, None)
    one_hot = np.zeros((2, k), np.float32)
    one_hot[0, 0] = one_hot[1, g] = 1
    y = run(graph.to_bytes(), [one_hot], validate=False)[0]

    used = np.stack([y[0] / 7, y[1] / -5], axis=1)  # the scale XNNPACK multiplied by, (n, 2)
    np.testing.assert_allclose(used, runtime_bf16(scale).values, rtol=1e-6)
    assert np.all(np.abs(used - to_bf16(scale).values)[differs] > 1e-3 * used[differs])
