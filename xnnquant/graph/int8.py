"""Static int8 nodes (qint8 per-tensor activations) computed as XNNPACK 1adaa7c7 computes them.

Every function here works on int8 *codes* and returns the codes the real runtime
writes, bit for bit.  A qint8 value ``v`` stands for ``(code - zp_v) * s_v``; ``f32(.)``
below is a float32 rounding (round to nearest even), ``rne`` rounds a float32 to the
nearest integer (ties to even), ``sat(.)`` clamps to ``[-128, 127]`` and ``>>`` is an
arithmetic (flooring) shift.  The measurements behind each formula are in the
project's ``int8-facts`` notes and in ``tests/test_graph_int8.py``.

===============================  ==========================================================
node                             what XNNPACK computes (codes in, codes out)
===============================  ==========================================================
FullyConnected, Conv2d,          ``acc = bias[c] + sum (x - zp_x) * w`` exactly in integers
DepthwiseConv2d                  (padding reads ``zp_x``), ``m[c] = f32(f32(s_x * s_w[c]) / s_y)``,
(qcint8 or qint8 filter)         ``y = rne(clip(f32(f32(acc) * m[c]), lo - zp_y, hi - zp_y)) + zp_y``
                                 (``requantize_fp32``; the bias's own scale is never read)
Add, Subtract                    integer multipliers: ``r_a = f32(s_a / s_y)``, ``r_b = ±f32(s_b / s_y)``,
                                 ``shift = 20 - exponent(max |r|)``, ``M = lrintf(|r| * 2^shift)``,
                                 ``y = sat(((a - zp_a) M_a + (b - zp_b) M_b + 2^(shift-1)) >> shift
                                 + zp_y)`` (``add_multipliers``)
Multiply                         ``m = f32(f32(s_a * s_b) / s_y)``, ``requantize_fp32((a - zp_a)(b - zp_b), m)``
Convert fp32 -> qint8            ``sat(rne(f32(x * f32(1 / s_y))) + zp_y)``; NaN -> 127 (x86 kernels)
Convert qint8 -> fp32            ``f32((x - zp_x) * s_x)``
Convert qint8 -> qint8,          8-bit fixed point: ``M = lrintf(256 f32(s_x / s_y))`` (LeakyReLU: M+ for
LeakyReLU                        ``x > zp_x``, ``M- = lrintf(256 f32(f32(s_x / s_y) * slope))`` else),
                                 ``y = sat(zp_y + (((x - zp_x) M + 128) >> 8))``
Clamp, same scale and zp         ``clip(x, q(min), q(max))`` with ``q(v) = lrintf(clip(f32(v / s) + zp,
                                 -128, 127))`` (``quantize_bound``; also every output_min/max)
Sigmoid, Tanh, Hardswish, ELU,   a 256-entry table made once from float32 reference math:
Gelu,
Clamp with other scale or zp     ``table[x] = sat(rne(f32(f32(op(f32((x - zp_x) s_x)) * f32(1 / s_y)) + zp_y)))``
MaxPooling2d                     max of the codes (padding never wins), then ``clip(lo, hi)``
GlobalAvgPooling2d (a mean)      ``S = sum x`` (raw codes, int32), ``m = f32(f32(s_x / s_y) * f32(1 / N))``,
                                 ``z = f32(zp_y - f32(f32(N * zp_x) * m))``,
                                 ``y = sat(rne(f32(f32(S) * m) + z))``
StaticResizeBilinear2D           11-bit weights ``a = lrintf(frac * 2048)``:
                                 ``t = (tl << 11) + (tr - tl) a_x``, ``b = (bl << 11) + (br - bl) a_x``,
                                 ``y = ((t << 11) + (b - t) a_y + 2^21) >> 22``
StaticConstantPad                pads with ``quantize_bound(padding_value)``
Concatenate, Copy, Slice,        codes moved as they are (the runtime requires equal scale and
Reshape, Transpose               zero point on input and output)
===============================  ==========================================================

``lo`` / ``hi`` are ``quantize_bound(output_min)`` / ``quantize_bound(output_max)``
(-128 / 127 without bounds).  Integer accumulation is exact here (int64, or float64
products of at most 2^53); XNNPACK's own int32 accumulator is exact while
``|acc| < 2^31``.

Which x86-64 CPU runs the graph changes none of these results but one (read from the
kernels each x86 branch of XNNPACK's configs selects, SSE2 to AVX-512 and AMX;
``tests/test_cpu_classes_numerics.py`` gives the sources): the integer sums are exact in
wrapping int32 whatever the instruction (``vpmaddwd`` + ``vpaddd``, ``vpdpbusd`` on inputs
offset by 128 with the offset folded into the packed bias, ``pmullw``/``pmulhw`` pairs), every
requantization is one float32 multiply rounded half to even by ``cvtps2dq`` under the default
MXCSR, the add and leaky ReLU multipliers are integer, and the tables are made once by
XNNPACK's reference code (the same ``libm`` functions on every CPU with FMA).  The one: a
static int8 GEMM (fully connected, convolution) whose ``rne(f32(f32(acc) * m)) + zp_y`` falls
below ``-2^31`` (a negative output zero point) writes 127 on AVX-512 and AVX-VNNI CPUs and
``lo`` elsewhere
(``requantize_fp32(int32_zero_point=...)``); this module computes the latter, and the static
int8 rewrite chooses output scales that keep every accumulator's reach far from it
(``static_int8.rewrite.ACCUMULATOR_STEPS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..constants import XNN_FLAG_ALIGN_CORNERS, XNN_FLAG_TENSORFLOW_LEGACY_MODE, XNN_FLAG_TRANSPOSE_WEIGHTS
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError
from .model import Node, PerTensorQuant, Value
from .shapes import Window, windows

F32 = np.float32
QMIN, QMAX = -128, 127


# ------------------------------------------------------------------ rounding


def rne(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to the nearest integer, ties to even, as int64 (``cvtps2dq``, ``nearbyintf``)."""
    return np.rint(np.asarray(x, F32)).astype(np.int64)


def lrintf(x: float | np.floating[Any]) -> int:
    """``lrintf`` of one float32: nearest integer, ties to even."""
    return int(np.rint(F32(x)))


def quantize_bound(value: float, scale: float, zero_point: int) -> int:
    """``xnn_qs8_quantize``: the code of a float bound (clamp bounds, padding value).

    ``lrintf(clip(f32(value / scale) + zp, -128, 127))``: a division, not a multiply by
    the reciprocal; +-inf give -128 / 127.
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        q = F32(F32(value) / F32(scale)) + F32(zero_point)
    return lrintf(np.clip(q, F32(QMIN), F32(QMAX)))


def output_bounds(node: Node, out: Value) -> tuple[int, int]:
    """``(lo, hi)`` codes of the node's output_min / output_max (-128, 127 when unset)."""
    if node.output_min is None or node.output_max is None:
        return QMIN, QMAX
    s, zp = quant(out)
    return quantize_bound(node.output_min, s, zp), quantize_bound(node.output_max, s, zp)


def requantize_fp32(acc: np.ndarray, scale: np.ndarray | np.floating[Any], zero_point: int,
                    lo: int = QMIN, hi: int = QMAX, int32_zero_point: bool = False) -> np.ndarray:
    """int8 codes from integer accumulators, XNNPACK's "fp32" requantization.

    ``rne(clip(f32(f32(acc) * scale), lo - zp, hi - zp)) + zp``: the accumulator is
    converted to float32 (rounded when ``|acc| > 2^24``), multiplied once by the float32
    ``scale`` (broadcast against ``acc``), clamped, rounded half to even.  ``acc`` int64,
    any shape; returns int8 of ``acc``'s (broadcast) shape.

    ``int32_zero_point``: as the static int8 GEMM kernels of AVX-512 and AVX-VNNI CPUs
    compute it (``xnnpack.cpu.Qs8Gemm``): only the upper bound is applied in float; the
    product converts to int32 (``cvtps2dq``: ``INT32_MIN`` below ``-2^31``), the zero point
    is added in wrapping int32 and the sum saturated to int8, then raised to ``lo``.  That is
    the formula above except where ``rne(f32(f32(acc) * scale)) + zp < -2^31``, which writes
    127 (from a negative zero point) instead of ``lo``.  The default is the other kernels'
    arithmetic (the AVX2, AVX, SSE and 256-bit AVX-512 GEMMs, every depthwise one), which
    saturates first.
    """
    scaled = np.asarray(acc).astype(F32) * np.asarray(scale, F32)
    if not int32_zero_point:
        scaled = np.clip(scaled, F32(lo - zero_point), F32(hi - zero_point))
        return (rne(scaled) + zero_point).astype(np.int8)
    scaled = np.minimum(scaled, F32(hi - zero_point))
    converted = np.where(scaled < F32(-(2**31)), -(2**31), rne(scaled))
    wrapped = (converted + zero_point + 2**31) % 2**32 - 2**31
    return np.maximum(saturate(wrapped), np.int8(lo)).astype(np.int8)


def saturate(x: np.ndarray) -> np.ndarray:
    """int64 -> int8, clamped to ``[-128, 127]``."""
    return np.clip(x, QMIN, QMAX).astype(np.int8)


def quantize_fp32(x: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """Convert fp32 -> qint8: ``sat(rne(f32(x * f32(1 / scale))) + zp)``.

    The x86 kernels take ``min(x * inv, 32767)`` before converting, so NaN (and +inf)
    become 127 and -inf becomes -128.  float32 ``x`` any shape -> int8 of that shape.
    """
    inv = F32(1) / F32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.asarray(x, F32) * inv
    scaled = np.where(np.isnan(scaled), F32(32767), np.clip(scaled, F32(-32768), F32(32767)))
    return saturate(rne(scaled) + zero_point)


def dequantize(codes: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """qint8 -> fp32: ``f32(f32(x - zp) * s)`` (the difference is exact)."""
    return (np.asarray(codes).astype(np.int64) - zero_point).astype(F32) * F32(scale)


def q8_multiplier(ratio: np.floating[Any]) -> int:
    """The 8-bit fixed-point multiplier of qint8 -> qint8 and LeakyReLU: ``lrintf(256 * ratio)``."""
    return lrintf(F32(256) * F32(ratio))


def q8_apply(x: np.ndarray, zp_in: int, multiplier: np.ndarray | int, zp_out: int) -> np.ndarray:
    """``sat(zp_out + (((x - zp_in) * multiplier + 128) >> 8))`` -> int8."""
    return saturate(zp_out + (((np.asarray(x).astype(np.int64) - zp_in) * multiplier + 128) >> 8))


class AddParams:
    """The integer multipliers of qint8 add / subtract (``xnn_init_qs8_add_minmax_scalar_params``).

    ``r = f32(s_in / s_y)`` per input (negated for subtract's second input); with ``e``
    the float32 exponent of ``max(|r_a|, |r_b|)``, ``shift = 20 - e`` and
    ``M = ±lrintf(|r| * 2^shift)`` (the largest ``|M|`` lies in ``[2^20, 2^21]``).
    """

    def __init__(self, s_a: float, s_b: float, s_y: float, b_sign: int = 1) -> None:
        r_a, r_b = F32(s_a) / F32(s_y), F32(s_b) / F32(s_y)
        exponent = math.frexp(float(max(r_a, r_b)))[1] - 1  # float32 exponent: value in [2^e, 2^(e+1))
        self.shift = 20 - exponent
        self.a_multiplier = lrintf(r_a * F32(2.0 ** self.shift))  # exact: a power-of-two scaling
        self.b_multiplier = b_sign * lrintf(r_b * F32(2.0 ** self.shift))

    def apply(self, a: np.ndarray, zp_a: int, b: np.ndarray, zp_b: int, zp_y: int) -> np.ndarray:
        """``sat(((a - zp_a) M_a + (b - zp_b) M_b + 2^(shift-1)) >> shift + zp_y)`` -> int8 (broadcast)."""
        acc = ((np.asarray(a).astype(np.int64) - zp_a) * self.a_multiplier
               + (np.asarray(b).astype(np.int64) - zp_b) * self.b_multiplier + (1 << (self.shift - 1)))
        return saturate((acc >> self.shift) + zp_y)


def lookup_table(op: Callable[[np.ndarray], np.ndarray], s_x: float, zp_x: int, s_y: float,
                 zp_y: int) -> np.ndarray:
    """The 256-entry table XNNPACK builds for a qint8 unary node without an integer kernel.

    Entry for code ``x`` (indexed ``x + 128``): ``op`` on ``f32((x - zp_x) * s_x)``, then
    ``sat(rne(f32(f32(r * f32(1 / s_y)) + zp_y)))``, NaN -> 0 (``round_float_to_int``).
    ``op`` maps float32 ``(256,)`` to float32 ``(256,)``.  Returns int8 ``(256,)``.
    """
    codes = np.arange(QMIN, QMAX + 1)
    real = (codes.astype(F32) - F32(zp_x)) * F32(s_x)
    with np.errstate(all="ignore"):
        result = np.asarray(op(real), F32)
        q = F32(result * (F32(1) / F32(s_y))) + F32(zp_y)
    q = np.where(np.isnan(q), F32(0), q)
    return saturate(rne(np.clip(q, F32(-129), F32(128))))


def apply_table(table: np.ndarray, x: np.ndarray) -> np.ndarray:
    return table[np.asarray(x).astype(np.int64) + 128]


# ----------------------------------------------------- float32 reference math


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """``e / (1 + e)`` with ``e = exp(x)`` in double, rounded to float32; 1 above 100, 0 below -100."""
    with np.errstate(over="ignore"):
        e = np.exp(x.astype(np.float64))
        s = (e / (1.0 + e)).astype(F32)
    return np.where(x > 100, F32(1), np.where(x < -100, F32(0), s))


def _gelu(x: np.ndarray) -> np.ndarray:
    """``f32(f32(x / 2) * (1 + erf(x * sqrt(2) / 2)))``, the product and erf in double, as
    XNNPACK's reference operator computes it for float (``sqrt(2)`` is a double there)."""
    half = (x / F32(2)).astype(np.float64)
    return np.array([h * (1 + math.erf(float(v) * math.sqrt(2) / 2)) for h, v in zip(half, x)]).astype(F32)


def _tanh(x: np.ndarray) -> np.ndarray:
    """``tanhf``: tanh correctly rounded to float32."""
    return np.tanh(x.astype(np.float64)).astype(F32)


def _hardswish(x: np.ndarray) -> np.ndarray:
    """``f32(x / 6) * max(min(f32(x + 3), 6), 0)``, every step float32."""
    return (x / F32(6)) * np.maximum(np.minimum(x + F32(3), F32(6)), F32(0))


def _elu(alpha: float) -> Callable[[np.ndarray], np.ndarray]:
    """``x < 0 ? f32(alpha * expm1f(x)) : x``."""
    def elu(x: np.ndarray) -> np.ndarray:
        return np.where(x < 0, F32(alpha) * np.expm1(x.astype(np.float64)).astype(F32), x)
    return elu


def _clamp(lo: float, hi: float) -> Callable[[np.ndarray], np.ndarray]:
    def clamp(x: np.ndarray) -> np.ndarray:
        return np.minimum(np.maximum(x, F32(lo)), F32(hi))
    return clamp


# ------------------------------------------------------------------- helpers


def quant(v: Value) -> tuple[float, int]:
    """``(scale, zero_point)`` of a per-tensor quantized value."""
    assert isinstance(v.quant, PerTensorQuant)  # validation: qint8 values carry PerTensorQuant
    return float(F32(v.quant.scale)), int(v.quant.zero_point)


def is_int8(v: Value) -> bool:
    """A qint8 activation or constant with one scale (what this module computes on)."""
    return v.datatype is Datatype.qint8 and isinstance(v.quant, PerTensorQuant)


def _filter(w: Value) -> tuple[np.ndarray, np.ndarray]:
    """(codes as float64, scales float32 ``(OC,)`` or ``()``) of a qcint8 / qint8 filter."""
    qt = w.quantized_tensor()
    if qt is None:
        raise UnsupportedConfigError(f"value {w.id}: a static int8 filter must be a constant")
    return qt.codes.astype(np.float64), np.asarray(qt.scale, F32)


def _bias(b: Value | None) -> np.ndarray | int:
    """int64 bias codes (the bias's own scale is not read by XNNPACK), or 0."""
    if b is None:
        return 0
    qt = b.quantized_tensor()
    if qt is None:
        raise UnsupportedConfigError(f"value {b.id}: a static int8 bias must be a constant")
    return qt.codes.astype(np.int64)


def _exact_int(x: np.ndarray) -> np.ndarray:
    """float64 sums of integer products (exact below 2^53) -> int64."""
    return np.rint(x).astype(np.int64)


# --------------------------------------------------------------- node kinds

Args = list[np.ndarray]


def fully_connected(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    """``x [..., K]`` codes, filter ``[N, K]`` (``[K, N]`` transposed) -> ``[..., N]`` codes."""
    x, w = ins[0], ins[1]
    s_x, zp_x = quant(x)
    s_y, zp_y = quant(out)
    codes, s_w = _filter(w)
    if node.flags & XNN_FLAG_TRANSPOSE_WEIGHTS:
        codes = codes.T
    acc = _exact_int((args[0].astype(np.float64) - zp_x) @ codes.T) + _bias(ins[2] if len(ins) > 2 else None)
    scale = (F32(s_x) * s_w) / F32(s_y)
    return requantize_fp32(acc, scale, zp_y, *output_bounds(node, out))


def _conv(node: Node, ins: Sequence[Value], out: Value, x: np.ndarray, w: np.ndarray, groups: int,
          s_w: np.ndarray) -> np.ndarray:
    """Grouped convolution of NHWC codes ``x`` with OHWI ``w [G * OCg, KH, KW, Cg]`` (float64 codes)."""
    s_x, zp_x = quant(ins[0])
    s_y, zp_y = quant(out)
    window = Window.of_conv(node.params).with_padding_for(node.flags, x.shape)
    win = windows(x.astype(np.float64) - zp_x, window, 0.0, node.kind)  # padding reads zp_x
    n, oh, ow, kh, kw, c = win.shape
    oc = w.shape[0]
    win = win.reshape(n, oh, ow, kh, kw, groups, c // groups)
    wg = w.reshape(groups, oc // groups, kh, kw, w.shape[3])
    acc = _exact_int(np.einsum("nhwijgc,goijc->nhwgo", win, wg, optimize=True).reshape(n, oh, ow, oc))
    acc = acc + _bias(ins[2] if len(ins) > 2 else None)
    scale = (F32(s_x) * s_w) / F32(s_y)
    return requantize_fp32(acc, scale, zp_y, *output_bounds(node, out))


def conv2d(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    codes, s_w = _filter(ins[1])
    return _conv(node, ins, out, args[0], codes, node.params["groups"], s_w)


def depthwise_conv2d(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    """Filter ``[1, KH, KW, OC]``; output channel ``o`` reads input channel ``o // (OC / C)``."""
    codes, s_w = _filter(ins[1])
    as_groups = np.ascontiguousarray(codes.transpose(3, 1, 2, 0))  # [OC, KH, KW, 1]
    return _conv(node, ins, out, args[0], as_groups, args[0].shape[3], s_w)


def _binary_add(sign: int) -> Callable[[Node, Sequence[Value], Value, Args], np.ndarray]:
    def add(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
        (s_a, zp_a), (s_b, zp_b), (s_y, zp_y) = quant(ins[0]), quant(ins[1]), quant(out)
        y = AddParams(s_a, s_b, s_y, sign).apply(args[0], zp_a, args[1], zp_b, zp_y)
        return np.clip(y, *output_bounds(node, out)).astype(np.int8)  # a clamp node after it
    return add


def multiply(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    (s_a, zp_a), (s_b, zp_b), (s_y, zp_y) = quant(ins[0]), quant(ins[1]), quant(out)
    product = (args[0].astype(np.int64) - zp_a) * (args[1].astype(np.int64) - zp_b)
    y = requantize_fp32(product, (F32(s_a) * F32(s_b)) / F32(s_y), zp_y)
    return np.clip(y, *output_bounds(node, out)).astype(np.int8)  # a clamp node after it


def convert(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    x = args[0]
    if is_int8(ins[0]) and is_int8(out):
        (s_x, zp_x), (s_y, zp_y) = quant(ins[0]), quant(out)
        return q8_apply(x, zp_x, q8_multiplier(F32(s_x) / F32(s_y)), zp_y)
    if is_int8(out):
        return quantize_fp32(x, *quant(out))
    if out.datatype is Datatype.fp32:
        return dequantize(x, *quant(ins[0]))
    raise UnsupportedConfigError(f"convert qint8 -> {out.datatype.name}: the interpreter models fp32 and qint8 only")


def leaky_relu(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    (s_x, zp_x), (s_y, zp_y) = quant(ins[0]), quant(out)
    positive = F32(s_x) / F32(s_y)
    negative = positive * F32(node.params["negative_slope"])
    multiplier = np.where(args[0].astype(np.int64) > zp_x, q8_multiplier(positive), q8_multiplier(negative))
    return q8_apply(args[0], zp_x, multiplier, zp_y)


def _table_node(make: Callable[[Node], Callable[[np.ndarray], np.ndarray]]
                ) -> Callable[[Node, Sequence[Value], Value, Args], np.ndarray]:
    def handler(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
        return apply_table(lookup_table(make(node), *quant(ins[0]), *quant(out)), args[0])
    return handler


def clamp(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    lo, hi = node.output_min, node.output_max
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    if quant(ins[0]) == quant(out):
        s, zp = quant(out)
        return np.clip(args[0], quantize_bound(lo, s, zp), quantize_bound(hi, s, zp)).astype(np.int8)
    return apply_table(lookup_table(_clamp(lo, hi), *quant(ins[0]), *quant(out)), args[0])


def max_pooling(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    """Max of the codes over each window (padding never wins), then the output bounds."""
    x = args[0]
    window = Window.of_pool(node.params).with_padding_for(node.flags, x.shape)
    y = windows(x.astype(np.int64), window, QMIN - 1, node.kind).max(axis=(3, 4))
    return np.clip(y, *output_bounds(node, out)).astype(np.int8)


def global_avg_pooling(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    """Mean over H and W of NHWC ``[N, H, W, C]`` codes -> ``[N, 1, 1, C]`` (a reduce-mean)."""
    (s_x, zp_x), (s_y, zp_y) = quant(ins[0]), quant(out)
    x = args[0]
    count = x.shape[1] * x.shape[2]
    total = x.astype(np.int64).sum(axis=(1, 2), keepdims=True)
    scale = (F32(s_x) / F32(s_y)) * (F32(1) / F32(count))
    zero = F32(zp_y) - (F32(count * zp_x) * scale)  # N * zp_x is an int32 made float32 (exact < 2^24)
    q = total.astype(F32) * scale + zero
    y = saturate(rne(np.clip(q, F32(-129), F32(128))))
    return np.clip(y, *output_bounds(node, out)).astype(np.int8)  # a clamp node after it


def _bilinear_axis(size_in: int, size_out: int, align: bool, legacy: bool
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(low index, high index, 11-bit weight ``lrintf(frac * 2048)``) per output position."""
    adjust = 1 if align and size_out != 1 else 0
    scale = F32(size_in - adjust) / F32(size_out - adjust)
    o = np.arange(size_out).astype(F32)
    if align or legacy:
        src = o * scale
    else:
        src = np.clip(o * scale + (F32(0.5) * scale - F32(0.5)), F32(0), F32(size_in - 1))
    low = src.astype(np.int64)
    weight = rne((src - low.astype(F32)) * F32(2048))
    return low, np.minimum(low + 1, size_in - 1), weight


def resize_bilinear(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    """Bilinear resize of NHWC codes with 11-bit fixed-point weights (see the module table)."""
    x = args[0].astype(np.int64)
    align = bool(node.flags & XNN_FLAG_ALIGN_CORNERS)
    legacy = bool(node.flags & XNN_FLAG_TENSORFLOW_LEGACY_MODE)
    top, bottom, ay = _bilinear_axis(x.shape[1], node.params["new_height"], align, legacy)
    left, right, ax = _bilinear_axis(x.shape[2], node.params["new_width"], align, legacy)
    ay, ax = ay[None, :, None, None], ax[None, None, :, None]
    rows_t, rows_b = x[:, top], x[:, bottom]
    t = (rows_t[:, :, left] << 11) + (rows_t[:, :, right] - rows_t[:, :, left]) * ax
    b = (rows_b[:, :, left] << 11) + (rows_b[:, :, right] - rows_b[:, :, left]) * ax
    return (((t << 11) + (b - t) * ay + (1 << 21)) >> 22).astype(np.int8)


def constant_pad(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    p = node.params
    code = quantize_bound(p["padding_value"], *quant(out))
    return np.pad(args[0], list(zip(p["pre_paddings"], p["post_paddings"])), constant_values=code)


def _moved(fn: Callable[[Node, np.ndarray], np.ndarray]) -> Callable[[Node, Sequence[Value], Value, Args], np.ndarray]:
    def handler(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
        return fn(node, args[0])
    return handler


def _concatenate(node: Node, ins: Sequence[Value], out: Value, args: Args) -> np.ndarray:
    return np.concatenate(args, axis=node.params["axis"])


def _slice(node: Node, x: np.ndarray) -> np.ndarray:
    return x[tuple(slice(o, o + s) for o, s in zip(node.params["offsets"], node.params["sizes"]))]


Int8Handler = Callable[[Node, Sequence[Value], Value, Args], np.ndarray]

HANDLERS: dict[str, Int8Handler] = {
    "XNNFullyConnected": fully_connected,
    "XNNConv2d": conv2d,
    "XNNDepthwiseConv2d": depthwise_conv2d,
    "XNNAdd": _binary_add(1),
    "XNNSubtract": _binary_add(-1),
    "XNNMultiply": multiply,
    "XNNConvert": convert,
    "XNNLeakyReLU": leaky_relu,
    "XNNClamp": clamp,
    "XNNSigmoid": _table_node(lambda node: _sigmoid),
    "XNNTanh": _table_node(lambda node: _tanh),
    "XNNGelu": _table_node(lambda node: _gelu),
    "XNNHardswish": _table_node(lambda node: _hardswish),
    "XNNELU": _table_node(lambda node: _elu(node.params["alpha"])),
    "XNNMaxPooling2d": max_pooling,
    "XNNGlobalAvgPooling2d": global_avg_pooling,
    "XNNStaticResizeBilinear2D": resize_bilinear,
    "XNNStaticConstantPad": constant_pad,
    "XNNStaticSlice": _moved(_slice),
    "XNNStaticTranspose": _moved(lambda node, x: np.transpose(x, node.params["perm"])),
    "XNNStaticReshape": _moved(lambda node, x: x),  # reshaped to the output's dims by the caller
    "XNNCopy": _moved(lambda node, x: x),
    "XNNConcatenate2": _concatenate,
    "XNNConcatenate3": _concatenate,
    "XNNConcatenate4": _concatenate,
    "XNNConcatenate5": _concatenate,
}


def applies(node: Node, ins: Sequence[Value], outs: Sequence[Value]) -> bool:
    """Whether the node computes in int8: its first input or its output is a qint8 value."""
    return (bool(ins) and is_int8(ins[0])) or (len(outs) == 1 and is_int8(outs[0]))
