"""fully_connected / static_fully_connected against the real XNNPACK.

The references below are written from the arithmetic alone (integer accumulation in
int64, then scales in float64), not from the code under test.  The per-token
quantization of x that the dynamic path applies is re-derived here in numpy from
XNNPACK's rule (see ``_per_token``) and checked against XNNPACK's own convert operator.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from float_bounds import assert_within, dynamic_gemm_bound, gamma, half_ulp

from xnnquant import Datatype, QuantizedTensor
from xnnquant.constants import XNN_INVALID_VALUE_ID, XNN_VALUE_FLAG_EXTERNAL_INPUT, XNN_VALUE_FLAG_EXTERNAL_OUTPUT
from xnnquant.errors import UnsupportedConfigError, XnnquantError

pytestmark = pytest.mark.xnnpack

xx = pytest.importorskip("xnnquant.xnnpack")



# --- independent references -----------------------------------------------------------


def _per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """qdint8 per row as XNNPACK documents it: codes int8 (M, K), zero points (M,), scales (M,)."""
    f32 = np.float32
    rmin = np.minimum(x.min(axis=1), f32(0))
    rmax = np.maximum(x.max(axis=1), f32(0))
    span = (rmax - rmin).astype(f32)
    s = np.where(span == 0, f32(1), f32(255) / np.where(span == 0, f32(1), span)).astype(f32)
    dmin, dmax = (rmin * s).astype(f32), (rmax * s).astype(f32)
    zp = np.where((f32(-128) + dmin) + (f32(127) + dmax) > 0, f32(-128) - dmin, f32(127) - dmax)
    zp = np.rint(np.clip(zp, -128, 127)).astype(np.int32)
    codes = np.clip(np.rint((x * s[:, None]).astype(f32)) + zp[:, None], -128, 127).astype(np.int8)
    return codes, zp, (f32(1) / s).astype(f32)


def _weight_values(w: QuantizedTensor) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64 (N, K), per-element scale float64 (N, K)) of a (N, K) weight."""
    codes = w.codes.astype(np.int64)
    if w.datatype is Datatype.qbint4:
        scale = np.repeat(w.scale.astype(np.float64), w.group_size, axis=1)
    else:
        scale = np.broadcast_to(w.scale.astype(np.float64)[:, None], codes.shape)
    return codes, scale


def _reference_dynamic(x: np.ndarray, w: QuantizedTensor, bias: np.ndarray | None) -> np.ndarray:
    """Integer accumulation per (row, block), then float64 scales."""
    q, zp, xs = _per_token(x)
    codes, scale = _weight_values(w)
    centered = q.astype(np.int64) - zp[:, None]
    g = w.group_size if w.datatype is Datatype.qbint4 else codes.shape[1]
    m, k = centered.shape
    blocks = k // g
    acc = np.einsum("mbk,nbk->mnb", centered.reshape(m, blocks, g), codes.reshape(-1, blocks, g))  # int64
    block_scale = scale[:, ::g]  # (N, blocks)
    y = (acc.astype(np.float64) * block_scale[None]).sum(axis=2) * xs[:, None].astype(np.float64)
    return y + (0 if bias is None else bias.astype(np.float64))


def _reference_weight_only(x: np.ndarray, w: QuantizedTensor | np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    if isinstance(w, QuantizedTensor):
        codes, scale = _weight_values(w)
        wf = codes.astype(np.float64) * scale
    else:
        wf = w.astype(np.float64)
    return x.astype(np.float64) @ wf.T + (0 if bias is None else bias.astype(np.float64))


def _relerr(y: np.ndarray, ref: np.ndarray) -> float:
    """Largest error relative to the largest reference value: for results that must be wrong."""
    return float(np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))


def _dynamic_bound(x: np.ndarray, w: QuantizedTensor, bias: np.ndarray | None, ref: np.ndarray) -> np.ndarray:
    """What any XNNPACK kernel may differ from the exact result by (``dynamic_gemm_bound``)."""
    q, zp, xs = _per_token(x)
    group = w.group_size if w.datatype is Datatype.qbint4 else None
    return dynamic_gemm_bound(q, zp, xs, w.codes, w.scale, group, bias) + half_ulp(ref)


def _weight_only_bound(x: np.ndarray, w: QuantizedTensor | np.ndarray, bias: np.ndarray | None,
                       ref: np.ndarray) -> np.ndarray:
    """fp32 x fp32 / qc8w / qc4w: K products and the bias summed in float32 in any order;
    with a quantized filter the bias was divided by the scale and the sum is multiplied
    by it (two more roundings)."""
    if isinstance(w, QuantizedTensor):
        codes, scale = _weight_values(w)
        w_abs, extra = np.abs(codes) * scale, 3
    else:
        w_abs, extra = np.abs(w.astype(np.float64)), 1
    size = np.abs(x.astype(np.float64)) @ w_abs.T + (0 if bias is None else np.abs(bias.astype(np.float64)))
    return gamma(x.shape[1] + extra) * size + half_ulp(ref)


def _assert_dynamic(y: np.ndarray, x: np.ndarray, w: QuantizedTensor, bias: np.ndarray | None, what: object) -> None:
    ref = _reference_dynamic(x, w, bias)
    assert_within(y, ref, _dynamic_bound(x, w, bias, ref), str(what))


def _assert_weight_only(y: np.ndarray, x: np.ndarray, w: QuantizedTensor | np.ndarray, bias: np.ndarray | None,
                        what: object) -> None:
    ref = _reference_weight_only(x, w, bias)
    assert_within(y, ref, _weight_only_bound(x, w, bias, ref), str(what))


# --- inputs -----------------------------------------------------------------------------


def _weight(kind: str, n: int, k: int, rng: np.random.Generator, group_size: int = 32) -> QuantizedTensor:
    if kind == "qcint8":
        codes = rng.integers(-127, 128, (n, k)).astype(np.int8)
        return QuantizedTensor(Datatype.qcint8, codes, rng.uniform(1e-3, 1e-2, n).astype(np.float32), channel_dim=0)
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    if kind == "qcint4":
        return QuantizedTensor(Datatype.qcint4, codes, rng.uniform(1e-2, 1e-1, n).astype(np.float32), channel_dim=0)
    scales = rng.uniform(1e-2, 1e-1, (n, k // group_size)).astype(ml_dtypes.bfloat16).astype(np.float32)
    return QuantizedTensor(Datatype.qbint4, codes, scales, group_size=group_size)


def _x(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    return (rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)


SHAPES = [(1, 16, 64), (2, 7, 32), (5, 33, 128), (17, 100, 256), (64, 24, 384)]


# --- convert_f32_qd8 vs the reference used above --------------------------------------


def test_reference_per_token_matches_xnnpack() -> None:
    rng = np.random.default_rng(0)
    x = _x(512, 96, rng)
    x[:4] = 0.0
    x[4:8] = np.abs(x[4:8])
    x[8:12] = -np.abs(x[8:12])
    codes, zp, scale = _per_token(x)
    qt = xx.convert_f32_qd8(x)
    np.testing.assert_array_equal(qt.codes, codes)
    np.testing.assert_array_equal(qt.zero_point, zp)
    np.testing.assert_array_equal(qt.scale.view(np.uint32), scale.view(np.uint32))


# --- dynamic path ----------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("kind", "group_size"), [("qcint8", 0), ("qcint4", 0), ("qbint4", 32), ("qbint4", 64),
                                                  ("qbint4", 128)])
def test_dynamic_path(kind: str, group_size: int, with_bias: bool) -> None:
    rng = np.random.default_rng([len(kind), group_size, with_bias])
    for m, n, k in SHAPES:
        if group_size and k % group_size:
            continue
        w = _weight(kind, n, k, rng, group_size or 32)
        x = _x(m, k, rng)
        b = rng.standard_normal(n).astype(np.float32) if with_bias else None
        y = xx.fully_connected(x, w, b, dynamic=True)
        assert y.shape == (m, n) and y.dtype == np.float32
        _assert_dynamic(y, x, w, b, (m, n, k))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind", ["qcint8", "qcint4", "float"])
def test_weight_only_path(kind: str, with_bias: bool) -> None:
    rng = np.random.default_rng([len(kind), with_bias])
    for m, n, k in [*SHAPES, (3, 9, 33), (4, 16, 255), (1, 2, 1)]:
        w = rng.standard_normal((n, k)).astype(np.float32) if kind == "float" else _weight(kind, n, k, rng)
        x = _x(m, k, rng)
        b = (rng.standard_normal(n) * 3).astype(np.float32) if with_bias else None
        y = xx.fully_connected(x, w, b, dynamic=False)
        _assert_weight_only(y, x, w, b, (m, n, k))


@pytest.mark.parametrize("dynamic", [True, False])
def test_odd_k_that_xnnpack_computes_right(dynamic: bool) -> None:
    """Measured: qcint8 on both paths and qcint4 weight-only are right for odd K."""
    rng = np.random.default_rng(7)
    kinds = ["qcint8"] if dynamic else ["qcint8", "qcint4"]
    for kind in kinds:
        for m, n, k in [(1, 1, 1), (2, 7, 1), (3, 16, 3), (5, 33, 63), (17, 7, 67), (2, 16, 129), (5, 1, 255)]:
            if kind == "qcint4" and (n, k) == (1, 1):
                continue  # refused: crashes XNNPACK
            w, x = _weight(kind, n, k, rng), _x(m, k, rng)
            b = rng.standard_normal(n).astype(np.float32)
            y = xx.fully_connected(x, w, b, dynamic=dynamic)
            (_assert_dynamic if dynamic else _assert_weight_only)(y, x, w, b, (kind, m, n, k))


def test_transposed_weights() -> None:
    """(K, N) filters with XNN_FLAG_TRANSPOSE_WEIGHTS: qcint8 both paths, qcint4 dynamic (even N, K)."""
    rng = np.random.default_rng(11)
    m, n, k = 3, 16, 64
    x = _x(m, k, rng)
    b = rng.standard_normal(n).astype(np.float32)
    for kind, dynamic in [("qcint8", True), ("qcint8", False), ("qcint4", True)]:
        w = _weight(kind, n, k, rng)
        wt = QuantizedTensor(w.datatype, np.ascontiguousarray(w.codes.T), w.scale, channel_dim=1)
        y = xx.fully_connected(x, wt, b, dynamic=dynamic, transpose_weights=True)
        (_assert_dynamic if dynamic else _assert_weight_only)(y, x, w, b, (kind, dynamic))
    wf = rng.standard_normal((k, n)).astype(np.float32)
    y = xx.fully_connected(x, wf, b, dynamic=False, transpose_weights=True)
    _assert_weight_only(y, x, np.ascontiguousarray(wf.T), b, "fp32 transposed")


# --- static int8 path ------------------------------------------------------------------


def _reference_static(x: QuantizedTensor, w: QuantizedTensor, bias: QuantizedTensor | None,
                      out_scale: np.float32, out_zp: int) -> np.ndarray:
    """int64 accumulation; requantization in float32 as the device does it."""
    acc = (x.codes.astype(np.int64) - int(x.zero_point)) @ w.codes.astype(np.int64).T
    if bias is not None:
        acc = acc + bias.codes.astype(np.int64)
    requant = (np.float32(x.scale) * w.scale) / np.float32(out_scale)  # float32, per channel
    return np.clip(np.rint(acc.astype(np.float32) * requant) + out_zp, -128, 127).astype(np.int8)


@pytest.mark.parametrize("with_bias", [False, True])
def test_static_path_exact(with_bias: bool) -> None:
    rng = np.random.default_rng(3 + with_bias)
    for m, n, k in [(1, 1, 1), (3, 7, 5), *SHAPES]:
        xs, xz = np.float32(rng.uniform(0.01, 0.05)), int(rng.integers(-30, 30))
        x = QuantizedTensor(Datatype.qint8, rng.integers(-128, 128, (m, k)).astype(np.int8), xs, xz)
        ws = rng.uniform(1e-3, 1e-2, n).astype(np.float32)
        w = QuantizedTensor(Datatype.qcint8, rng.integers(-127, 128, (n, k)).astype(np.int8), ws, channel_dim=0)
        b = None
        if with_bias:
            b = QuantizedTensor(Datatype.qcint32, rng.integers(-20000, 20000, n).astype(np.int32), xs * ws,
                                channel_dim=0)
        out_scale, out_zp = np.float32(0.04 * np.sqrt(k)), int(rng.integers(-10, 10))
        y = xx.static_fully_connected(x, w, b, output_scale=out_scale, output_zero_point=out_zp)
        assert y.datatype is Datatype.qint8 and y.codes.shape == (m, n)
        assert float(y.scale) == out_scale and y.zero_point == out_zp
        ref = _reference_static(x, w, b, out_scale, out_zp)
        np.testing.assert_array_equal(y.codes, ref)
        assert np.count_nonzero(np.abs(ref) < 127) > 0  # not everything saturated


def test_static_path_rounds_ties_to_even() -> None:
    """Requantization scale exactly 0.5: acc odd gives x.5, rounded to the even neighbour."""
    x = QuantizedTensor(Datatype.qint8, np.array([[1, 3, 5, 7, -1, -3, 2, 0]], np.int8).T.copy(), 0.5, 0)
    w = QuantizedTensor(Datatype.qcint8, np.array([[1]], np.int8), np.array([0.25], np.float32), channel_dim=0)
    y = xx.static_fully_connected(x, w, output_scale=0.25, output_zero_point=0)
    # acc = x; acc * 0.5 = 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, 1, 0
    np.testing.assert_array_equal(y.codes[:, 0], np.array([0, 2, 2, 4, 0, -2, 1, 0], np.int8))


# --- last_operators ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "dynamic", "pattern"),
    [
        ("qcint8", True, r"Fully Connected \(NC, QDU?8, F32, QC8W\)"),
        ("qcint4", True, r"Fully Connected \(NC, QDU?8, F32, QC4W\)"),
        ("qbint4", True, r"Fully Connected \(NC, QDU?8, F32, QB4W\)"),
        ("qcint8", False, r"Fully Connected \(NC, F32, QC8W\)"),
        ("qcint4", False, r"Fully Connected \(NC, F32, QC4W\)"),
        ("float", False, r"Fully Connected \(NC, F32\)"),
    ],
)
def test_last_operators_names_the_kernel(kind: str, dynamic: bool, pattern: str) -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 64)).astype(np.float32) if kind == "float" else _weight(kind, 8, 64, rng)
    xx.fully_connected(_x(2, 64, rng), w, dynamic=dynamic)
    ops = xx.last_operators()
    assert len(ops) == 1 and re.match(pattern, ops[0]), ops


def test_last_operators_static() -> None:
    x = QuantizedTensor(Datatype.qint8, np.ones((2, 4), np.int8), 0.1, 0)
    w = QuantizedTensor(Datatype.qcint8, np.ones((3, 4), np.int8), np.full(3, 0.1, np.float32), channel_dim=0)
    xx.static_fully_connected(x, w, output_scale=0.1)
    assert [re.match(r"Fully Connected \(NC, QS8, QC8W\)", op) is not None for op in xx.last_operators()] == [True]


def test_runtime_profiling_timings() -> None:
    from xnnquant.xnnpack import _capi
    from xnnquant.xnnpack.subgraph import Runtime, Subgraph

    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (2, 3), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        w_id = sg.tensor(Datatype.fp32, (4, 3), np.ones((4, 3), np.float32))
        y_id = sg.tensor(Datatype.fp32, (2, 4), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        sg.fully_connected(x_id, w_id, XNN_INVALID_VALUE_ID, y_id)
        runtime = Runtime(sg)
    with runtime:
        y = np.zeros((2, 4), np.float32)
        runtime.run({0: _capi.padded(np.arange(6, dtype=np.float32).reshape(2, 3)), 1: y})
        np.testing.assert_array_equal(y, [[3, 3, 3, 3], [12, 12, 12, 12]])
        assert len(runtime.operator_timings_us()) == len(runtime.operator_names()) == 1


# --- measured XNNPACK behaviour behind the refusals (raw subgraphs, no checks of ours) ----


def _raw_fc(x_buffer: np.ndarray, m: int, k: int, w: QuantizedTensor, dynamic: bool,
            bias: np.ndarray | None = None) -> np.ndarray:
    """One FC node with exactly the given buffers (no validation, no bias rewriting)."""
    from xnnquant.xnnpack.subgraph import Runtime, Subgraph

    n = w.shape[0]
    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (m, k), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        if dynamic:
            q_id = sg.dynamic_tensor((m, k))
            sg.convert(x_id, q_id)
            x_id = q_id
        zp = 8 if w.datatype is Datatype.qcint4 else 0
        w_id = sg.channelwise_tensor(w.datatype, w.shape, w.scale, 0, zp, np.frombuffer(w.to_bytes(), np.uint8))
        b_id = XNN_INVALID_VALUE_ID if bias is None else sg.tensor(Datatype.fp32, (n,), bias)
        y_id = sg.tensor(Datatype.fp32, (m, n), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        sg.fully_connected(x_id, w_id, b_id, y_id)
        runtime = Runtime(sg)
    y = np.zeros((m, n), np.float32)
    with runtime:
        runtime.run({0: x_buffer, 1: y})
    return y


def test_measured_weight_only_bias_is_added_before_the_scale() -> None:
    rng = np.random.default_rng(2)
    w = _weight("qcint8", 4, 32, rng)
    x = _x(3, 32, rng)
    b = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    from xnnquant.xnnpack import _capi

    y = _raw_fc(_capi.padded(x), 3, 32, w, dynamic=False, bias=b)
    codes, _ = _weight_values(w)
    as_xnnpack_does = (x.astype(np.float64) @ codes.T.astype(np.float64) + b) * w.scale.astype(np.float64)
    size = (np.abs(x.astype(np.float64)) @ np.abs(codes.T) + np.abs(b)) * w.scale.astype(np.float64)
    assert_within(y, as_xnnpack_does, gamma(32 + 2) * size + half_ulp(as_xnnpack_does), "bias before the scale")
    assert _relerr(y, _reference_weight_only(x, w, b)) > 1e-2


def test_measured_qcint4_dynamic_odd_k_reads_one_float_past_each_row() -> None:
    """Row 0's quantization range takes in the first value of row 1 (K + 1 floats per row);
    with a value past the end of the last row, M = 1 is wrong as well."""
    m, n, k = 3, 4, 5
    x = np.full((m, k), 0.5, np.float32)
    x[:, 1] = -0.25
    x[1, 0] = 40.0  # outside row 0's range [-0.25, 0.5]
    w = QuantizedTensor(Datatype.qcint4, np.ones((n, k), np.int8), np.full(n, 0.1, np.float32), channel_dim=0)
    buffer = np.full(m * k + 64, 0.0, np.float32)
    buffer[: m * k] = x.ravel()
    y = _raw_fc(buffer, m, k, w, dynamic=True)
    ref = _reference_dynamic(x, w, None)
    rows_wrong = (np.abs(y - ref) > _dynamic_bound(x, w, None, ref)).any(axis=1)
    assert rows_wrong.tolist() == [True, False, False]

    buffer = np.full(k + 64, 1000.0, np.float32)  # what follows the only row is 1000
    buffer[:k] = x[2]
    y = _raw_fc(buffer, 1, k, w, dynamic=True)
    assert _relerr(y, _reference_dynamic(x[2:], w, None)) > 0.1
    # the same with even K is right whatever follows
    w6 = QuantizedTensor(Datatype.qcint4, np.ones((n, 6), np.int8), np.full(n, 0.1, np.float32), channel_dim=0)
    x6 = np.concatenate([x[2:], np.zeros((1, 1), np.float32)], axis=1)
    buffer = np.full(6 + 64, 1000.0, np.float32)
    buffer[:6] = x6[0]
    _assert_dynamic(_raw_fc(buffer, 1, 6, w6, dynamic=True), x6, w6, None, "even K")


# --- refused configurations ----------------------------------------------------------------


def _qbint4(n: int = 8, k: int = 64, g: int = 32) -> QuantizedTensor:
    return _weight("qbint4", n, k, np.random.default_rng(0), g)


def _transposed(w: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor(w.datatype, np.ascontiguousarray(w.codes.T), w.scale, channel_dim=1)


REFUSED = [
    ("qbint4 weight-only", lambda: xx.fully_connected(np.ones((2, 64), np.float32), _qbint4(), dynamic=False),
     "qbint4 weights need the qdint8 input"),
    ("qbint4 transposed", lambda: xx.fully_connected(
        np.ones((2, 64), np.float32),
        QuantizedTensor(Datatype.qbint4, np.zeros((64, 64), np.int8), np.full((64, 2), 0.5, np.float32),
                        group_size=32),
        transpose_weights=True), "transposed qbint4 weights are not supported"),
    ("qbint4 group 16", lambda: xx.fully_connected(np.ones((2, 64), np.float32), QuantizedTensor(
        Datatype.qbint4, np.zeros((8, 64), np.int8), np.full((8, 4), 0.5, np.float32), group_size=16)),
     "multiple of 32: got 16"),
    ("qcint4 dynamic odd K", lambda: xx.fully_connected(
        np.ones((2, 63), np.float32), _weight("qcint4", 8, 63, np.random.default_rng(0))),
     "odd K on the dynamic path are computed wrongly by XNNPACK: got K=63"),
    ("qcint4 weight-only 1x1", lambda: xx.fully_connected(
        np.ones((3, 1), np.float32), _weight("qcint4", 1, 1, np.random.default_rng(0)), dynamic=False),
     "1 x 1 qcint4 weight crashes XNNPACK"),
    ("qcint4 transposed weight-only", lambda: xx.fully_connected(
        np.ones((2, 64), np.float32), _transposed(_weight("qcint4", 8, 64, np.random.default_rng(0))),
        dynamic=False, transpose_weights=True), "transposed qcint4 weights on the weight-only path crash"),
    ("qcint4 transposed odd N", lambda: xx.fully_connected(
        np.ones((2, 64), np.float32), _transposed(_weight("qcint4", 7, 64, np.random.default_rng(0))),
        transpose_weights=True), "need an even N: got N=7"),
    ("float weight dynamic", lambda: xx.fully_connected(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)),
     "a float weight runs on the fp32 path: got dynamic=True"),
    ("qint8 weight", lambda: xx.fully_connected(np.ones((2, 4), np.float32), QuantizedTensor(
        Datatype.qint8, np.ones((3, 4), np.int8), 0.5, 0)), "weight datatype qint8 is not supported here"),
    ("static requantization >= 256", lambda: xx.static_fully_connected(
        QuantizedTensor(Datatype.qint8, np.ones((2, 4), np.int8), 64.0, 0),
        QuantizedTensor(Datatype.qcint8, np.ones((3, 4), np.int8), np.full(3, 8.0, np.float32), channel_dim=0),
        output_scale=1.0), "x_scale \\* weight_scale / output_scale < 256: got 512"),
]


@pytest.mark.parametrize(("name", "call", "match"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused(name: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=match):
        call()


# --- bad input ---------------------------------------------------------------------------------

_W8 = QuantizedTensor(Datatype.qcint8, np.ones((3, 4), np.int8), np.full(3, 0.5, np.float32), channel_dim=0)
_X8 = QuantizedTensor(Datatype.qint8, np.ones((2, 4), np.int8), 0.5, 1)

BAD = [
    ("K mismatch", lambda: xx.fully_connected(np.ones((2, 5), np.float32), _W8),
     r"weight \(N, K\) does not match x \(M, K=5\): got weight shape \(3, 4\)"),
    ("bias shape", lambda: xx.fully_connected(np.ones((2, 4), np.float32), _W8, np.ones(4, np.float32)),
     r"bias must have shape \(N,\) = \(3,\): got \(4,\)"),
    ("x 1-D", lambda: xx.fully_connected(np.ones(4, np.float32), _W8), r"x must be a non-empty 2-D float array"),
    ("x empty", lambda: xx.fully_connected(np.ones((0, 4), np.float32), _W8), r"got shape \(0, 4\)"),
    ("x int", lambda: xx.fully_connected(np.ones((2, 4), np.int32), _W8), "floating-point array: got dtype int32"),
    ("x nan", lambda: xx.fully_connected(np.full((2, 4), np.nan, np.float32), _W8), "x must be finite"),
    ("bias int", lambda: xx.fully_connected(np.ones((2, 4), np.float32), _W8, np.ones(3, np.int64)),
     "bias must be a floating-point array"),
    ("channel_dim", lambda: xx.fully_connected(np.ones((2, 4), np.float32), QuantizedTensor(
        Datatype.qcint8, np.ones((3, 4), np.int8), np.full(4, 0.5, np.float32), channel_dim=1)),
     "channel_dim must be the output-channel axis: got 1, expected 0"),
    ("zero point", lambda: xx.fully_connected(np.ones((2, 4), np.float32), QuantizedTensor(
        Datatype.qcint8, np.ones((3, 4), np.int8), np.full(3, 0.5, np.float32), zero_point=np.array([0, 1, 0]),
        channel_dim=0)), r"zero_point is out of range for qcint8: got 1 at index \(1,\), expected 0"),
    ("zero scale", lambda: xx.fully_connected(np.ones((2, 4), np.float32), QuantizedTensor(
        Datatype.qcint8, np.ones((3, 4), np.int8), np.array([0.5, 0.0, 0.5], np.float32), channel_dim=0)),
     r"weight scale must be positive normal floats: got 0.0 at index \(1,\)"),
    ("qbint4 scale not bf16", lambda: xx.fully_connected(np.ones((2, 32), np.float32), QuantizedTensor(
        Datatype.qbint4, np.zeros((2, 32), np.int8), np.full((2, 1), 0.1, np.float32), group_size=32)),
     r"qbint4 scales must hold bf16 values: got 0.100000001 at index \(0, 0\)"),
    ("static x float", lambda: xx.static_fully_connected(np.ones((2, 4), np.float32), _W8, output_scale=1.0),
     "x must be a 2-D qint8 QuantizedTensor"),
    ("static weight qcint4", lambda: xx.static_fully_connected(_X8, QuantizedTensor(
        Datatype.qcint4, np.ones((3, 4), np.int8), np.full(3, 0.5, np.float32), channel_dim=0), output_scale=1.0),
     "weight must be a qcint8 QuantizedTensor"),
    ("static bias scale", lambda: xx.static_fully_connected(_X8, _W8, QuantizedTensor(
        Datatype.qcint32, np.ones(3, np.int32), np.full(3, 0.5, np.float32), channel_dim=0), output_scale=1.0),
     "bias scale must be x_scale \\* weight_scale per channel: got 0.5 at channel 0, expected 0.25"),
    ("static bias type", lambda: xx.static_fully_connected(_X8, _W8, _W8, output_scale=1.0),
     r"bias must be a qcint32 QuantizedTensor of shape \(3,\)"),
    ("static output zp", lambda: xx.static_fully_connected(_X8, _W8, output_scale=1.0, output_zero_point=200),
     r"output_zero_point must be in \[-128, 127\]: got 200"),
    ("static x zero point", lambda: xx.static_fully_connected(QuantizedTensor(
        Datatype.qint8, np.ones((2, 4), np.int8), 0.5, 300), _W8, output_scale=1.0),
     "zero_point is out of range for qint8: got 300, expected -128 to 127"),
    ("static output scale", lambda: xx.static_fully_connected(_X8, _W8, output_scale=-1.0),
     "output_scale must be positive normal floats"),
]


@pytest.mark.parametrize(("name", "call", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_input(name: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(XnnquantError, match=match):
        call()


def test_xnnpack_status_becomes_an_error_naming_the_call() -> None:
    from xnnquant.xnnpack.subgraph import Subgraph

    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (2, 4), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        with pytest.raises(XnnquantError, match=r"xnn_define_fully_connected failed: got "
                                                r"xnn_status_invalid_parameter \(2\)"):
            sg.fully_connected(x_id, 12345, XNN_INVALID_VALUE_ID, x_id)
        with pytest.raises(XnnquantError, match=r"xnn_define_channelwise_quantized_tensor_value_v2 failed"):
            sg.channelwise_tensor(Datatype.qcint8, (3, 4), np.zeros(3, np.float32), 0, 0, np.zeros((3, 4), np.int8))


def test_buffers_are_owned_by_the_runtime() -> None:
    """The caller's arrays may be changed or freed once fully_connected has been called with them;
    the runtime keeps its own copies for as long as it lives."""
    from xnnquant.xnnpack import _capi
    from xnnquant.xnnpack.subgraph import Runtime, Subgraph

    scale = np.full(4, 0.5, np.float32)
    codes = np.ones((4, 8), np.int8)
    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (1, 8), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        w_id = sg.channelwise_tensor(Datatype.qcint8, (4, 8), scale, 0, 0, codes)
        y_id = sg.tensor(Datatype.fp32, (1, 4), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        sg.fully_connected(x_id, w_id, XNN_INVALID_VALUE_ID, y_id)
        scale[:] = 100.0
        codes[:] = 7
        runtime = Runtime(sg)
    del scale, codes
    gc.collect()
    y = np.zeros((1, 4), np.float32)
    with runtime:
        runtime.run({0: _capi.padded(np.ones((1, 8), np.float32)), 1: y})
    np.testing.assert_array_equal(y, np.full((1, 4), 4.0, np.float32))


# --- real weights quantized by the library's schemes -------------------------------------------


@pytest.mark.parametrize("scheme", ["qcint8", "qcint4", "qbint4-32", "qbint4-128"])
def test_minilm_layers_quantized_by_the_schemes(scheme: str) -> None:
    """all-MiniLM-L6-v2 intermediate and output layers with their biases, both paths."""
    import xnnquant as xq
    from xnnquant.models.weights import minilm_tensors

    tensors = minilm_tensors()
    rng = np.random.default_rng(9)
    for name in ("encoder.layer.2.intermediate.dense", "encoder.layer.2.output.dense"):
        w, b = tensors[name + ".weight"], tensors[name + ".bias"]
        if scheme.startswith("qbint4"):
            qt = xq.quantize_blockwise(w, group_size=int(scheme.split("-")[1]), method="minmax")
        else:
            qt = xq.quantize_per_channel(w, bits=8 if scheme == "qcint8" else 4, axis=0, method="minmax")
        x = _x(24, w.shape[1], rng)
        for dynamic in ([True] if scheme.startswith("qbint4") else [True, False]):
            y = xx.fully_connected(x, qt, b, dynamic=dynamic)
            (_assert_dynamic if dynamic else _assert_weight_only)(y, x, qt, b, (name, dynamic))
            assert _relerr(y, x.astype(np.float64) @ w.T.astype(np.float64) + b) < 0.2  # it is the layer


def test_weights_cache_reaches_xnnpack() -> None:
    """A Python weights-cache provider passed to fully_connected receives the packed weights:
    qd8/qdu8 x qc8w packs, per output channel, an int32 correction, K int8 weights, a float
    scale and a float bias: 4 + 64 + 4 + 4 = 76 bytes for K = 64, times N = 16 rounded up to
    the kernel's nr (16 on AVX2)."""
    import ctypes

    from xnnquant.xnnpack import _capi

    reserved: list[np.ndarray] = []
    inserted: list[int] = []

    def reserve(_ctx: object, size: int) -> int:
        reserved.append(_capi.padded(np.zeros(size, np.uint8)))
        return reserved[-1].ctypes.data

    def insert(_ctx: object, _key: object, ptr: int, size: int) -> int:
        inserted.append(size)
        return ptr  # the "offset" is the address itself; offset_to_addr is the identity

    callbacks = (
        _capi.LOOK_UP_FN(lambda _ctx, _key: ctypes.c_size_t(-1).value),
        _capi.RESERVE_SPACE_FN(reserve),
        _capi.LOOK_UP_OR_INSERT_FN(insert),
        _capi.IS_FINALIZED_FN(lambda _ctx: True),
        _capi.OFFSET_TO_ADDR_FN(lambda _ctx, offset: offset),
        _capi.DELETE_CACHE_FN(lambda _ctx: 0),
    )
    provider = _capi.WeightsCacheProvider(None, *callbacks)
    rng = np.random.default_rng(4)
    w, x = _weight("qcint8", 16, 64, rng), _x(3, 64, rng)
    y = xx.fully_connected(x, w, weights_cache=provider)
    _assert_dynamic(y, x, w, None, "through the cache")
    assert len(inserted) == 1 and inserted[0] % 76 == 0 and inserted[0] >= 16 * 76


def test_dynamic_path_special_rows() -> None:
    """All-zero, all-positive, all-negative, constant and outlier rows through the Convert."""
    rng = np.random.default_rng(12)
    k = 64
    x = _x(8, k, rng)
    x[0] = 0.0
    x[1] = np.abs(x[1])
    x[2] = -np.abs(x[2])
    x[3] = 0.75
    x[4, 5] = 1e4
    x[5] = x[5] * 1e-30  # tiny values
    b = rng.standard_normal(16).astype(np.float32)
    for kind in ("qcint8", "qcint4", "qbint4"):
        w = _weight(kind, 16, k, rng)
        y = xx.fully_connected(x, w, b)
        _assert_dynamic(y, x, w, b, kind)
        # a zero row gives the bias (exactly for per-channel filters; for qb4w the packed
        # float correction cancels the uncentred block sums only to within the bound)
        assert_within(y[0], b, _dynamic_bound(x, w, b, _reference_dynamic(x, w, b))[0], f"{kind} zero row")


def test_dynamic_path_random_shapes() -> None:
    """Many (M, N, K) drawn at random, qcint8 and qcint4 (K even), both with bias."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(m=st.integers(1, 40), n=st.integers(1, 70), half_k=st.integers(1, 150),
           kind=st.sampled_from(["qcint8", "qcint4"]), seed=st.integers(0, 2**32 - 1))
    def check(m: int, n: int, half_k: int, kind: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        w, x = _weight(kind, n, 2 * half_k, rng), _x(m, 2 * half_k, rng)
        b = rng.standard_normal(n).astype(np.float32)
        _assert_dynamic(xx.fully_connected(x, w, b), x, w, b, (m, n, 2 * half_k, kind))

    check()
