"""Full-integer static int8 (qint8) graphs: the interpreter's codes equal the real XNNPACK's.

Oracle: the real XNNPACK inside executorch 1.4.1 (``run``).  Reference: ``interpret``,
whose qint8 nodes follow ``xnnquant.graph.int8`` (integer accumulation, XNNPACK's
requantizations).  Every comparison is ``np.array_equal`` on int8 codes: no tolerance.
Scales, zero points and shapes are random (odd sizes, saturating outputs, output bounds);
several cases share one graph (independent outputs) to keep the runtime's load cost low.
The requantization helpers also get hand-derived golden values, and the configurations
XNNPACK refuses or computes wrongly are pinned (what the runtime does, what validation says).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from xnnquant import Datatype as D
from xnnquant import QuantizedTensor, quantize_bias
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, PerTensorQuant, interpret, rules, run
from xnnquant.graph import int8 as q

pytestmark = pytest.mark.xnnpack

Rng = np.random.Generator
F32 = np.float32


# ------------------------------------------------------- golden values by hand


def test_requantize_fp32_rounds_the_float32_product_half_to_even() -> None:
    # scale 1/4, zero point 3: 10/4 = 2.5 -> 2, 14/4 = 3.5 -> 4, -10/4 = -2.5 -> -2; then + 3
    np.testing.assert_array_equal(q.requantize_fp32(np.array([10, 14, -10]), F32(0.25), 3), [5, 7, 1])
    # 1000 / 2 = 500 clamps to 127 - (-3) = 130 before the zero point: 127; likewise -128
    np.testing.assert_array_equal(q.requantize_fp32(np.array([1000, -1000]), F32(0.5), -3), [127, -128])
    # output bounds [-5, 6] with zero point 1: 40 * 0.25 = 10 -> 6; -40 * 0.25 = -10 -> -5
    np.testing.assert_array_equal(q.requantize_fp32(np.array([40, -40]), F32(0.25), 1, -5, 6), [6, -5])
    # 2^24 + 1 becomes 2^24 in float32: 2^24 * 2^-25 = 0.5 -> 0 (exact arithmetic would give 1)
    assert q.requantize_fp32(np.array([2**24 + 1]), F32(2.0**-25), 0)[0] == 0


def test_add_multipliers_shift_and_ties_upwards() -> None:
    p = q.AddParams(0.5, 0.25, 1.0)
    # largest ratio 0.5 = 2^-1: shift 20 - (-1) = 21, multipliers 0.5 * 2^21 and 0.25 * 2^21
    assert (p.shift, p.a_multiplier, p.b_multiplier) == (21, 2**20, 2**19)
    # 3 * 0.5 + 1 * 0.25 = 1.75 -> 2; 0.5 -> 1 and -0.5 -> 0 (the rounding adds 2^20, then floors)
    a, b = np.array([3, 1, -1]), np.array([1, 0, 0])
    np.testing.assert_array_equal(p.apply(a, 0, b, 0, 0), [2, 1, 0])
    assert q.AddParams(0.5, 0.25, 1.0, -1).b_multiplier == -(2**19)  # subtract negates b's multiplier


def test_q8_fixed_point_and_bounds() -> None:
    assert q.q8_multiplier(F32(0.3)) == 77  # 256 * 0.3 = 76.8
    # (10 * 77 + 128) >> 8 = 898 >> 8 = 3; (-770 + 128) >> 8 = floor(-2.51) = -3
    np.testing.assert_array_equal(q.q8_apply(np.array([10, -10]), 0, 77, 0), [3, -3])
    assert q.quantize_bound(6.0, 0.05, -128) == -8  # 6 / 0.05 = 120, - 128
    assert (q.quantize_bound(np.inf, 0.1, 0), q.quantize_bound(-np.inf, 0.1, 0)) == (127, -128)
    # fp32 -> qint8: 0.25 / 0.1 = 2.5 -> 2 (ties to even); NaN and +inf -> 127, -inf -> -128
    x = np.array([0.25, np.nan, np.inf, -np.inf], F32)
    np.testing.assert_array_equal(q.quantize_fp32(x, 0.1, 0), [2, 127, 127, -128])


def test_mean_and_bilinear_golden() -> None:
    g = Graph()
    x = g.input((1, 2, 2, 1), D.qint8, PerTensorQuant(1.0, 1))
    g.output(g.global_avg_pooling_2d(x, output=g.tensor((1, 1, 1, 1), D.qint8, PerTensorQuant(1.0, 0))))
    # sum of codes 11, scale 1 * (1/4), zero point 0 - 4 * 1 * 1/4 = -1: 11/4 - 1 = 1.75 -> 2
    assert interpret(g, [np.array([1, 2, 3, 5], np.int8).reshape(1, 2, 2, 1)])[0].item() == 2
    g = Graph()
    x = g.input((1, 1, 2, 1), D.qint8, PerTensorQuant(0.5, 0))
    g.output(g.static_resize_bilinear_2d(x, 1, 4))
    # half-pixel sources 0, 0.25, 0.75, 1 -> weights 0, 512, 1536, 0 of 2048:
    # (100 * 512 << 11 + 2^21) >> 22 = 25 (25.5 floored), (100 * 1536 << 11 + 2^21) >> 22 = 75
    out = interpret(g, [np.array([0, 100], np.int8).reshape(1, 1, 2, 1)])[0]
    np.testing.assert_array_equal(out.ravel(), [0, 25, 75, 100])


# ----------------------------------------------------------- random cases


def scale(rng: Rng, lo: float = -6.0, hi: float = 0.0) -> float:
    return float(F32(np.exp(rng.uniform(lo, hi))))


def zp(rng: Rng) -> int:
    return int(rng.integers(-128, 128))


def codes(rng: Rng, dims: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-128, 128, dims).astype(np.int8)


class Cases:
    """One graph holding several independent cases (each its own inputs and output)."""

    def __init__(self, target: str = "xn01") -> None:
        self.g = Graph(target=target)
        self.inputs: list[np.ndarray] = []

    def input(self, rng: Rng, dims: tuple[int, ...], s: float | None = None, z: int | None = None,
              data: np.ndarray | None = None) -> int:
        vid = self.g.input(dims, D.qint8, PerTensorQuant(scale(rng) if s is None else s, zp(rng) if z is None else z))
        self.inputs.append(codes(rng, dims) if data is None else data)
        return vid

    def tensor(self, rng: Rng, dims: tuple[int, ...], s: float | None = None, z: int | None = None) -> int:
        return self.g.tensor(dims, D.qint8, PerTensorQuant(scale(rng, -5, 1) if s is None else s,
                                                          zp(rng) if z is None else z))

    def check(self) -> None:
        got, ref = run(self.g.to_bytes(), self.inputs), interpret(self.g, self.inputs)
        assert len(got) == len(ref) == len(self.g.outputs)
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.dtype == b.dtype and a.shape == b.shape, i
            assert np.array_equal(a, b), f"output {i}: {int((a != b).sum())} of {a.size} codes differ"


def bounds(rng: Rng, s: float) -> dict[str, float]:
    """Random output bounds on a third of the cases (real values, some cutting into the range)."""
    if rng.random() < 0.66:
        return {}
    return {"output_min": float(rng.uniform(-100, 0) * s), "output_max": float(rng.uniform(0, 100) * s)}


def qc_filter(g: Graph, rng: Rng, dims: tuple[int, ...], channel_dim: int) -> tuple[int, np.ndarray]:
    s_w = np.exp(rng.uniform(-8, -2, dims[channel_dim])).astype(F32)
    return g.constant(QuantizedTensor(D.qcint8, codes(rng, dims).clip(-127), s_w, 0, channel_dim=channel_dim)), s_w


def bias(g: Graph, rng: Rng, s_x: float, s_w: np.ndarray, n: int) -> int:
    real = rng.normal(0, 2**12, n) * (F32(s_x) * s_w)
    return g.constant(quantize_bias(real.astype(F32), s_x, s_w))


@pytest.mark.parametrize("seed", [0, 1])
def test_fully_connected(seed: int) -> None:
    rng = np.random.default_rng(seed)
    c = Cases()
    for case in range(8):
        m, k, n = int(rng.integers(1, 6)), int(rng.integers(1, 70)), int(rng.integers(1, 40))
        s_x = scale(rng)
        x = c.input(rng, (m, k), s_x)
        transposed = case % 4 == 3
        w, s_w = qc_filter(c.g, rng, (k, n) if transposed else (n, k), 1 if transposed else 0)
        if case % 4 == 2:  # a per-tensor qint8 filter with a qint32 bias
            s_w = np.asarray(F32(0.01))
            w = c.g.constant(QuantizedTensor(D.qint8, codes(rng, (n, k)), s_w, 0))
        b = bias(c.g, rng, s_x, s_w, n) if case % 5 else None
        y = c.tensor(rng, (m, n), s=scale(rng, -6, -2) if case == 1 else None)  # case 1 saturates
        c.g.output(c.g.fully_connected(x, w, b, transpose_weights=transposed, output=y, **bounds(rng, 1.0)))
    c.check()


@pytest.mark.parametrize("depthwise", [False, True])
def test_convolutions(depthwise: bool) -> None:
    rng = np.random.default_rng(10 + depthwise)
    c = Cases()
    for _case in range(8):
        n, h, w = int(rng.integers(1, 3)), int(rng.integers(5, 10)), int(rng.integers(5, 10))
        kernel = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        padding = tuple(int(p) for p in rng.integers(0, 3, 4))
        s_x = scale(rng)
        if depthwise:
            channels = int(rng.integers(1, 9))
            oc = channels * int(rng.integers(1, 3))
            x = c.input(rng, (n, h, w, channels), s_x)
            wid, s_w = qc_filter(c.g, rng, (1, *kernel, oc), 3)
            y = c.g.depthwise_conv2d(x, wid, bias(c.g, rng, s_x, s_w, oc), padding=padding, stride=stride,
                                     dilation=dilation, **bounds(rng, 1.0))
        else:
            groups, gic, goc = int(rng.integers(1, 4)), int(rng.integers(1, 6)), int(rng.integers(1, 6))
            x = c.input(rng, (n, h, w, groups * gic), s_x)
            wid, s_w = qc_filter(c.g, rng, (groups * goc, *kernel, gic), 0)
            y = c.g.conv2d(x, wid, bias(c.g, rng, s_x, s_w, groups * goc), padding=padding, stride=stride,
                           dilation=dilation, groups=groups, **bounds(rng, 1.0))
        c.g.value(y).quant = PerTensorQuant(scale(rng, -4, 1), zp(rng))  # the output's own parameters
        c.g.output(y)
    c.check()


def test_add_subtract_multiply_with_broadcast() -> None:
    rng = np.random.default_rng(20)
    c = Cases()
    for case in range(12):
        kind = ("add", "subtract", "multiply")[case % 3]
        dims = (2, int(rng.integers(1, 5)), int(rng.integers(1, 40)))
        other = dims if case % 4 else (1, 1, dims[2])  # every fourth broadcasts a row
        s_a, s_b = scale(rng), scale(rng)
        a, b = c.input(rng, dims, s_a), c.input(rng, other, s_b)
        s_y = float(F32(s_a * s_b * np.exp(rng.uniform(-3, 3))) if kind == "multiply"
                    else F32(max(s_a, s_b) * np.exp(rng.uniform(-2, 3))))
        y = getattr(c.g, kind)(a, b, output=c.tensor(rng, dims, s_y), **bounds(rng, s_y))
        c.g.output(y)
    c.check()


UNARY: dict[str, Callable[[Graph, int, Rng], dict[str, object]]] = {
    "sigmoid": lambda g, x, rng: {},
    "tanh": lambda g, x, rng: {},
    "gelu": lambda g, x, rng: {},
    "hardswish": lambda g, x, rng: {},
    "elu": lambda g, x, rng: {"alpha": float(rng.uniform(0.2, 2))},
    "leaky_relu": lambda g, x, rng: {"negative_slope": float(rng.choice([0.01, 0.1, 0.5, 1.5, -0.3]))},
}


def test_unary_nodes() -> None:
    """Table-driven (sigmoid, tanh, GELU, hardswish, ELU) and 8-bit fixed-point (leaky ReLU) nodes,
    each over all 256 input codes."""
    rng = np.random.default_rng(30)
    c = Cases(target="1.4.1")
    ramp = np.arange(-128, 128, dtype=np.int8).reshape(2, 128)
    for name, params in UNARY.items():
        for case in range(3):
            s_x = scale(rng)
            x = c.input(rng, (2, 128), s_x, data=ramp)
            s_y = float(F32(s_x * np.exp(rng.uniform(-3, 3)))) if name == "leaky_relu" else None
            s_y = 1 / 256 if name == "sigmoid" and case == 0 else s_y  # the usual sigmoid output grid
            y = c.tensor(rng, (2, 128), s_y, -128 if s_y == 1 / 256 else None)
            c.g.output(getattr(c.g, name)(x, **params(c.g, x, rng), output=y))  # type: ignore[arg-type]
    c.check()


@pytest.mark.parametrize(("s_x", "s_y", "z_y"), [(0.02, 0.004, -100), (0.05, 0.002, -120), (0.03, 0.02, -10)])
def test_gelu_is_a_table_of_the_exact_gelu(s_x: float, s_y: float, z_y: int) -> None:
    """qint8 GELU over all 256 codes, on output grids fine enough that the tanh approximation of
    GELU (within 3e-4 of it) would give other codes: the runtime's are the exact GELU's table
    (``int8._gelu``, erf in double as XNNPACK's reference), and the approximation's differ."""
    g = Graph(target="1.4.1")
    x = g.input((2, 128), D.qint8, PerTensorQuant(s_x, 0))
    g.output(g.gelu(x, output=g.tensor((2, 128), D.qint8, PerTensorQuant(s_y, z_y))))
    got = run(g.to_bytes(), [np.arange(-128, 128, dtype=np.int8).reshape(2, 128)])[0].reshape(-1)
    assert np.array_equal(got, q.lookup_table(q._gelu, s_x, 0, s_y, z_y))

    def tanh_approximation(v: np.ndarray) -> np.ndarray:
        w = v.astype(np.float64)
        return (w / 2 * (1 + np.tanh(np.sqrt(2 / np.pi) * (w + 0.044715 * w**3)))).astype(F32)

    assert not np.array_equal(got, q.lookup_table(tanh_approximation, s_x, 0, s_y, z_y))


def test_clamp_and_conversions() -> None:
    rng = np.random.default_rng(40)
    c = Cases()
    ramp = np.arange(-128, 128, dtype=np.int8).reshape(2, 128)
    for _case in range(4):
        s_x, z_x = scale(rng), zp(rng)
        lo, hi = sorted(rng.uniform(-130, 130, 2) * s_x)
        same = c.tensor(rng, (2, 128), s_x, z_x)  # an integer clamp of the codes
        c.g.output(c.g.clamp(c.input(rng, (2, 128), s_x, z_x, data=ramp), float(lo), float(hi), output=same))
        other = c.tensor(rng, (2, 128))  # other output parameters: a table
        c.g.output(c.g.clamp(c.input(rng, (2, 128), s_x, z_x, data=ramp), float(lo), float(hi), output=other))
        c.g.output(c.g.clamp(c.input(rng, (2, 128), s_x, z_x, data=ramp), 0.0, 6.0,  # relu6
                             output=c.tensor(rng, (2, 128), s_x, z_x)))
        x = c.input(rng, (2, 128), s_x, z_x, data=ramp)
        s_y = float(F32(s_x * np.exp(rng.uniform(-4, 4))))
        c.g.output(c.g.convert(x, D.qint8, scale=s_y, zero_point=zp(rng)))  # requantize
        c.g.output(c.g.convert(c.input(rng, (2, 128), s_x, z_x, data=ramp), D.fp32))  # dequantize
        real = c.g.input((3, 37))
        s_q = scale(rng)
        values = rng.normal(0, 200 * s_q, (3, 37)).astype(F32)
        values[0, :4] = [0.5 * s_q, 2.5 * s_q, np.inf, -np.inf]  # ties and saturation
        values[1, 0] = np.nan
        c.inputs.append(values)
        c.g.output(c.g.convert(real, D.qint8, scale=s_q, zero_point=zp(rng)))  # quantize
    c.check()


def test_pooling_resize_and_data_movement() -> None:
    rng = np.random.default_rng(50)
    c = Cases(target="1.4.1")
    for case in range(4):
        dims = (1 + case % 2, int(rng.integers(2, 12)), int(rng.integers(2, 12)), int(rng.integers(1, 20)))
        n, h, w, ch = dims
        s_x, z_x = scale(rng), zp(rng)
        kernel = (int(rng.integers(1, min(h, 3) + 1)), int(rng.integers(1, min(w, 3) + 1)))
        pool = c.g.max_pooling_2d(c.input(rng, dims, s_x, z_x), kernel=kernel, stride=1,
                                  padding=1 if min(kernel) > 1 else 0, **bounds(rng, s_x))
        c.g.output(pool)
        mean = c.tensor(rng, (n, 1, 1, ch), float(F32(s_x * np.exp(rng.uniform(-2, 2)))))
        c.g.output(c.g.global_avg_pooling_2d(c.input(rng, dims, s_x, z_x), output=mean, **bounds(rng, s_x)))
        c.g.output(c.g.static_resize_bilinear_2d(c.input(rng, dims, s_x, z_x), int(rng.integers(1, 20)),
                                                 int(rng.integers(1, 20)), align_corners=bool(case % 2)))
        c.g.output(c.g.static_constant_pad(c.input(rng, dims, s_x, z_x), [0, 1, 2, 0], [0, 2, 1, 1],
                                           float(rng.uniform(-300, 300) * s_x)))
        x = c.input(rng, dims, s_x, z_x)
        c.g.output(c.g.static_slice(x, [0, 0, 1, 0], [n, h, w - 1, max(1, ch - 1)]))
        c.g.output(c.g.static_transpose(c.input(rng, dims, s_x, z_x), [0, 3, 1, 2]))
        c.g.output(c.g.static_reshape(c.input(rng, dims, s_x, z_x), [n, h * w * ch]))
        c.g.output(c.g.concatenate([c.input(rng, dims, s_x, z_x), c.input(rng, dims, s_x, z_x)], axis=3))
    c.check()


def test_small_network_end_to_end() -> None:
    """conv -> relu6 (clamp) -> depthwise -> add residual -> global average pooling -> FC,
    qint8 from the first quantize to the last dequantize."""
    rng = np.random.default_rng(60)
    g = Graph()
    image = g.input((2, 9, 11, 3))
    s_in, s_a, s_b, s_c, s_p, s_out = 0.02, 0.05, 0.04, 0.06, 0.03, 0.1
    x = g.convert(image, D.qint8, scale=s_in, zero_point=-5)
    w1, s_w1 = qc_filter(g, rng, (8, 3, 3, 3), 0)
    h = g.conv2d(x, w1, bias(g, rng, s_in, s_w1, 8), padding=1, output=g.tensor((2, 9, 11, 8), D.qint8,
                                                                             PerTensorQuant(s_a, -128)))
    h = g.clamp(h, 0.0, 6.0, output=g.tensor((2, 9, 11, 8), D.qint8, PerTensorQuant(s_a, -128)))
    w2, s_w2 = qc_filter(g, rng, (1, 3, 3, 8), 3)
    d = g.depthwise_conv2d(h, w2, bias(g, rng, s_a, s_w2, 8), padding=1,
                           output=g.tensor((2, 9, 11, 8), D.qint8, PerTensorQuant(s_b, 3)))
    r = g.add(d, h, output=g.tensor((2, 9, 11, 8), D.qint8, PerTensorQuant(s_c, -10)))
    p = g.global_avg_pooling_2d(r, output=g.tensor((2, 1, 1, 8), D.qint8, PerTensorQuant(s_p, 0)))
    flat = g.static_reshape(p, [2, 8])
    w3, s_w3 = qc_filter(g, rng, (5, 8), 0)
    logits = g.fully_connected(flat, w3, bias(g, rng, s_p, s_w3, 5), output=g.tensor((2, 5), D.qint8,
                                                                                   PerTensorQuant(s_out, 2)))
    g.output(logits)
    g.output(g.convert(logits, D.fp32))
    images = rng.uniform(-2, 2, (2, 9, 11, 3)).astype(F32)
    got, ref = run(g.to_bytes(), [images]), interpret(g, [images])
    assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    assert len(np.unique(got[0])) > 3  # the codes carry information (not all saturated)


# ------------------------------------------------- refused or computed wrongly


def _unvalidated(g: Graph, monkeypatch: pytest.MonkeyPatch) -> bytes:
    with monkeypatch.context() as m:
        m.setattr(rules, "validate", lambda *args, **kwargs: None)
        return g.to_bytes()


def _fc(filter_zero_point: int = 0, bias_factor: float = 1.0) -> Graph:
    rng = np.random.default_rng(70)
    g = Graph()
    x = g.input((2, 8), D.qint8, PerTensorQuant(0.05, 1))
    w = g.constant(QuantizedTensor(D.qint8, codes(rng, (4, 8)), F32(0.01), filter_zero_point))
    b = g.constant(QuantizedTensor(D.qint32, rng.integers(-500, 500, 4).astype(np.int32),
                                   F32(F32(0.05) * F32(0.01) * F32(bias_factor)), 0))
    g.output(g.fully_connected(x, w, b, output=g.tensor((2, 4), D.qint8, PerTensorQuant(0.02, 0))))
    return g


def test_filter_zero_point_is_ignored_by_the_runtime_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(71).integers(-128, 128, (2, 8)).astype(np.int8)
    got = run(_unvalidated(_fc(filter_zero_point=5), monkeypatch), [x], validate=False)[0]
    as_if_zero = run(_fc(filter_zero_point=0).to_bytes(), [x])[0]
    np.testing.assert_array_equal(got, as_if_zero)  # same codes: the zero point 5 was never read
    with pytest.raises(UnsupportedConfigError) as info:
        _fc(filter_zero_point=5).validate()
    assert str(info.value) == (
        "node 0 (XNNFullyConnected): a qint8 filter needs zero point 0: got 5 (value 1); XNNPACK 1adaa7c7 "
        "ignores a filter's zero point and computes as if it were 0")


def test_bias_scale_is_never_read_by_the_runtime_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(72).integers(-128, 128, (2, 8)).astype(np.int8)
    got = run(_unvalidated(_fc(bias_factor=2.0), monkeypatch), [x], validate=False)[0]
    np.testing.assert_array_equal(got, run(_fc().to_bytes(), [x])[0])
    with pytest.raises(UnsupportedConfigError) as info:
        _fc(bias_factor=2.0).validate()
    assert str(info.value) == (
        "node 0 (XNNFullyConnected): the int32 bias scale must be input_scale * filter_scale: got 0.00100000005, "
        "expected 0.000500000024 (channel 0); XNNPACK 1adaa7c7 adds the bias codes to the accumulator and "
        "never reads the bias scale (use xq.quantize_bias)")


def test_requantize_ratio_above_128_is_computed_wrongly_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def graph() -> Graph:
        g = Graph()
        g.output(g.convert(g.input((256,), D.qint8, PerTensorQuant(1.0, 0)), D.qint8, scale=1 / 200, zero_point=0))
        return g
    ramp = np.arange(-128, 128, dtype=np.int8)
    got = run(_unvalidated(graph(), monkeypatch), [ramp], validate=False)[0]
    assert not np.array_equal(got, q.q8_apply(ramp, 0, 51200, 0))  # the 16-bit multiplier overflows
    with pytest.raises(UnsupportedConfigError) as info:
        graph().validate()
    assert str(info.value) == (
        "node 0 (XNNConvert): qint8 Convert needs input scale / output scale in [2^-8, 2^7]: got 200; "
        "XNNPACK 1adaa7c7 asserts this range and computes other codes outside it (choose closer scales)")


@pytest.mark.parametrize("kind", ["avg_pooling_2d", "softmax"])
def test_nodes_without_qint8_kernels_are_refused(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    g = Graph()
    x = g.input((1, 4, 4, 3), D.qint8, PerTensorQuant(0.1, 3))
    g.output(g.avg_pooling_2d(x, kernel=2) if kind == "avg_pooling_2d" else g.softmax(x))
    with pytest.raises(UnsupportedConfigError, match="xnn_status_invalid_parameter"):
        run(_unvalidated(g, monkeypatch), [np.zeros((1, 4, 4, 3), np.int8)], validate=False)
    with pytest.raises(XnnquantError, match=r"XNNPACK 1adaa7c7 has no qint8 (AvgPooling2d|Softmax)"):
        g.validate()


def test_concatenate_needs_one_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    g = Graph()
    a = g.input((2, 3), D.qint8, PerTensorQuant(0.1, 3))
    b = g.input((2, 3), D.qint8, PerTensorQuant(0.2, 3))
    g.output(g.concatenate([a, b], 1))
    with pytest.raises(UnsupportedConfigError, match="Failed to create cat2 node"):
        run(_unvalidated(g, monkeypatch), [np.zeros((2, 3), np.int8)] * 2, validate=False)
    with pytest.raises(XnnquantError) as info:
        g.validate()
    assert str(info.value) == (
        "node 0 (XNNConcatenate2): XNNConcatenate2 needs the same scale and zero point on input and output: got "
        "PerTensorQuant(scale=0.2, zero_point=3) (value 1) and PerTensorQuant(scale=0.1, zero_point=3)")
