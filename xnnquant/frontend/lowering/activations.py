"""Activations: clamps (fused into the producer when exact), softmax, and the compositions.

Clamps (``relu``, ``relu6`` / ``hardtanh``, ``clamp``) become the producing node's
``output_min`` / ``output_max`` when the runtime applies bounds on that node kind and
nothing else reads its output (``LoweringContext.fuse_clamp``); otherwise an XNNClamp node.

Compositions, with their largest error against a float64 reference (measured on the
real XNNPACK over x in [-12, 12]; the tests hold them):

==================  ===========================================================  ==========
op                  nodes                                                        max error
==================  ===========================================================  ==========
hardsigmoid         clamp(x * (1/6) + 0.5, 0, 1): XNNMultiply, XNNAdd (bounds)    1 ulp
silu                x * sigmoid(x)                                               3e-7 |x|
gelu (tanh)         x * sigmoid(x * (c1 + c2 x^2)), c1 = 2 sqrt(2/pi),            4e-7 abs
                    c2 = 0.044715 c1: the tanh formula, exactly rewritten         vs tanh formula
gelu (exact), xn01  relu(x) - |x| q(x), q = erfc(|x|/sqrt 2) / 2 by Abramowitz &   4e-7 abs
                    Stegun 7.1.26 (5th-degree polynomial in t = 1/(1 + p|x|/sqrt 2)
                    times exp(-x^2/2), the exponential as XNNELU(-x^2/2) + 1):
                    20 element-wise nodes
gelu (exact), 1.4.1 XNNGelu                                                      1e-6 abs
log1p (1.4.1)       log(1 + x) - ((1 + x) - 1 - x) / (1 + x)  (``log1p_value``)   1.2e-7 abs
softplus (1.4.1)    (relu(bx) + log1p(exp(-|bx|))) / b, threshold >= 15, the      see tests
                    log1p as 2 atanh(e / (2 + e)) by a polynomial (``log1p_unit``)
mish (1.4.1)        x tanh(softplus(x))                                          see tests
==================  ===========================================================  ==========
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...compute.special import ERFC_A, ERFC_P
from ...errors import XnnquantError
from . import lowers
from .context import Activation, LoweringContext

aten = torch.ops.aten

GELU_TANH_C1 = 2.0 * math.sqrt(2.0 / math.pi)
GELU_TANH_C2 = GELU_TANH_C1 * 0.044715


def clamped(ctx: LoweringContext, x: Any, low: float, high: float) -> Activation:
    """``x`` clipped to ``[low, high]``: fused into its producer when exact, else XNNClamp."""
    x = ctx.value(x)
    if low > high:
        raise XnnquantError(f"clamp bounds are reversed: got min {low}, max {high}")
    fused = ctx.fuse_clamp(x, low, high)
    if fused is not None:
        return fused
    return ctx.tensor(ctx.graph.clamp(x.id, low, high), x.shape, x.perm)


def _bound(value: Any, default: float, what: str) -> float:
    if value is None:
        return default
    if hasattr(value, "shape"):
        if getattr(value, "numel", lambda: 0)() != 1:
            raise XnnquantError(f"clamp with a tensor {what} of shape {tuple(value.shape)}: expected a number")
        value = float(value)
    return float(value)


@lowers(aten.relu.default, emits=("XNNClamp",))
def relu(ctx: LoweringContext, x: Any) -> Activation:
    return clamped(ctx, x, 0.0, math.inf)


@lowers(aten.hardtanh.default, emits=("XNNClamp",))
def hardtanh(ctx: LoweringContext, x: Any, min_val: float = -1.0, max_val: float = 1.0) -> Activation:
    return clamped(ctx, x, float(min_val), float(max_val))


@lowers(aten.relu6.default, emits=("XNNClamp",))
def relu6(ctx: LoweringContext, x: Any) -> Activation:
    return clamped(ctx, x, 0.0, 6.0)


@lowers(aten.clamp.default, aten.clamp.Tensor, emits=("XNNClamp",))
def clamp(ctx: LoweringContext, x: Any, min: Any = None, max: Any = None) -> Activation:  # noqa: A002  (ATen's names)
    return clamped(ctx, x, _bound(min, -math.inf, "min"), _bound(max, math.inf, "max"))


@lowers(aten.clamp_min.default, emits=("XNNClamp",))
def clamp_min(ctx: LoweringContext, x: Any, min: Any) -> Activation:  # noqa: A002
    return clamped(ctx, x, _bound(min, -math.inf, "min"), math.inf)


@lowers(aten.clamp_max.default, emits=("XNNClamp",))
def clamp_max(ctx: LoweringContext, x: Any, max: Any) -> Activation:  # noqa: A002
    return clamped(ctx, x, -math.inf, _bound(max, math.inf, "max"))


@lowers(aten.hardsigmoid.default, emits=("XNNMultiply", "XNNAdd"))
def hardsigmoid(ctx: LoweringContext, x: Any) -> Activation:
    """``clamp(x / 6 + 1/2, 0, 1)``: a multiply, then an add carrying the bounds."""
    x = ctx.value(x)
    g = ctx.graph
    scaled = g.multiply(x.id, ctx.constant_like(1.0 / 6.0, x))
    return ctx.tensor(g.add(scaled, ctx.constant_like(0.5, x), output_min=0.0, output_max=1.0), x.shape, x.perm)


@lowers(aten.silu.default, emits=("XNNSigmoid", "XNNMultiply"))
def silu(ctx: LoweringContext, x: Any) -> Activation:
    """``x * sigmoid(x)``."""
    x = ctx.value(x)
    return ctx.tensor(ctx.graph.multiply(x.id, ctx.graph.sigmoid(x.id)), x.shape, x.perm)


@lowers(aten.leaky_relu.default, emits=("XNNLeakyReLU",))
def leaky_relu(ctx: LoweringContext, x: Any, negative_slope: float = 0.01) -> Activation:
    x = ctx.value(x)
    return ctx.tensor(ctx.graph.leaky_relu(x.id, float(negative_slope)), x.shape, x.perm)


@lowers(aten.elu.default, emits=("XNNELU",))
def elu(ctx: LoweringContext, x: Any, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Activation:
    if scale != 1 or input_scale != 1:
        raise XnnquantError(f"elu with scale={scale}, input_scale={input_scale} is not supported: expected 1 and 1")
    x = ctx.value(x)
    return ctx.tensor(ctx.graph.elu(x.id, float(alpha)), x.shape, x.perm)


@lowers(aten.prelu.default, aten._prelu_kernel.default, emits=("XNNPReLU",))
def prelu(ctx: LoweringContext, x: Any, weight: Any) -> Activation:
    """``x if x > 0 else a * x``, one slope per channel (dim 1) or one for all."""
    x = ctx.value(x)
    if isinstance(weight, Activation):
        raise XnnquantError("prelu with a computed slope is not supported: expected a constant weight")
    slope = ctx.constant_array(weight, "prelu weight")
    if slope.size not in (1, x.shape[1] if x.rank > 1 else 1):
        raise XnnquantError(f"prelu weight of shape {slope.shape} does not match channels {x.shape[1:2]}")
    if slope.size > 1:
        slope = slope.reshape((slope.size,) + (1,) * (x.rank - 2))
    return ctx.tensor(ctx.graph.prelu(x.id, ctx.constant_like(torch.from_numpy(slope), x)), x.shape, x.perm)


@lowers(aten._softmax.default, aten.softmax.int, emits=("XNNSoftmax", "XNNStaticTranspose", "XNNStaticReshape"))
def softmax(ctx: LoweringContext, x: Any, dim: int, half_to_float: Any = None) -> Activation:
    """XNNSoftmax works on the last dim of the value: relay ``x`` so that ``dim`` comes last."""
    x = ctx.value(x)
    dim = dim % x.rank
    if x.perm[-1] != dim:
        x = ctx.relaid(x, tuple(p for p in x.perm if p != dim) + (dim,))
    return ctx.tensor(ctx.graph.softmax(x.id), x.shape, x.perm)


GELU_KINDS = ("XNNGelu", "XNNAbs", "XNNMultiply", "XNNAdd", "XNNDiv", "XNNSquare", "XNNELU", "XNNClamp",
              "XNNSubtract", "XNNSigmoid")


@lowers(aten.gelu.default, emits=GELU_KINDS)
def gelu(ctx: LoweringContext, x: Any, approximate: str = "none") -> Activation:
    """GELU: XNNGelu (1.4.1, exact), or a composition (see the module docstring)."""
    x = ctx.value(x)
    if approximate == "tanh":
        return ctx.tensor(_gelu_tanh(ctx, x), x.shape, x.perm)
    if approximate != "none":
        raise XnnquantError(f"gelu approximate={approximate!r}: expected 'none' or 'tanh'")
    if "XNNGelu" in ctx.graph.target.node_kinds:
        return ctx.tensor(ctx.graph.gelu(x.id), x.shape, x.perm)
    return ctx.tensor(_gelu_erf(ctx, x), x.shape, x.perm)


def _gelu_tanh(ctx: LoweringContext, x: Activation) -> int:
    g = ctx.graph

    def c(v: float) -> int:
        return ctx.constant_like(v, x)

    inner = g.add(g.multiply(g.square(x.id), c(GELU_TANH_C2)), c(GELU_TANH_C1))
    return g.multiply(x.id, g.sigmoid(g.multiply(x.id, inner)))


def _gelu_erf(ctx: LoweringContext, x: Activation) -> int:
    """``relu(x) - |x| erfc(|x| / sqrt 2) / 2`` (= x Phi(x) on both sides of 0)."""
    g = ctx.graph

    def c(v: float) -> int:
        return ctx.constant_like(v, x)

    a = g.abs(x.id)
    t = g.divide(c(1.0), g.add(g.multiply(a, c(ERFC_P / math.sqrt(2.0))), c(1.0)))
    half = [0.5 * k for k in ERFC_A]  # the 1/2 of erfc / 2 folded into the coefficients
    poly = g.multiply(t, c(half[4]))
    for k in reversed(half[:4]):
        poly = g.multiply(g.add(poly, c(k)), t)
    exp_minus_1 = g.elu(g.multiply(g.square(x.id), c(-0.5)), 1.0)  # exp(-x^2 / 2) - 1, argument <= 0
    q = g.add(g.multiply(poly, exp_minus_1), poly)  # poly * exp(-x^2 / 2)
    return g.subtract(g.clamp(x.id, 0.0, math.inf), g.multiply(a, q))


def _needs(ctx: LoweringContext, op: str, *kinds: str) -> None:
    for kind in kinds:
        if kind not in ctx.graph.target.node_kinds:
            raise XnnquantError(f"{op} needs {kind} (target '1.4.1')")


def log1p_value(ctx: LoweringContext, x: int) -> int:
    """``log1p(x) = log(u) - ((u - 1) - x) / u`` with ``u = 1 + x`` rounded: the second term
    corrects the rounding of ``u`` to first order (``u - 1`` is exact for u in [1/2, 2]), and
    ``x`` too small to change ``u`` gives ``x`` itself.  The error is XNNPACK's log's: near
    1 it is accurate to about an ulp of 1 (1.2e-7 absolute), not of its result, so for
    1e-7 < |x| < 1e-3 the result is right to 1.2e-7 absolute only.  (x = -1 gives NaN where
    torch gives -inf.)"""
    g = ctx.graph
    one = ctx.constant(np.ones(1, np.float32))
    u = g.add(x, one)
    return g.subtract(g.log(u), g.divide(g.subtract(g.subtract(u, one), x), u))


LOG1P_KINDS = ("XNNAdd", "XNNLog", "XNNSubtract", "XNNDiv")


@lowers(aten.log1p.default, emits=LOG1P_KINDS)
def log1p(ctx: LoweringContext, x: Any) -> Activation:
    """``aten::log1p`` (``log1p_value``)."""
    _needs(ctx, "log1p", "XNNLog")
    x = ctx.value(x)
    return ctx.tensor(log1p_value(ctx, x.id), x.shape, x.perm)


#: the smallest ``beta * threshold`` for which softplus's ``y + log1p(exp(-y))`` rounds to ``y``
#: for every float32 ``y`` above it (exp(-15) = 3.1e-7 < half an ulp of 15, 4.8e-7), so that
#: torch's switch to the identity above the threshold needs no select
SOFTPLUS_LEAST_THRESHOLD = 15.0


def softplus_check(node: Any) -> str | None:
    args = list(node.args) + [None] * 3
    beta = args[1] if args[1] is not None else node.kwargs.get("beta", 1.0)
    threshold = args[2] if args[2] is not None else node.kwargs.get("threshold", 20.0)
    if float(threshold) < SOFTPLUS_LEAST_THRESHOLD:
        return (f"softplus with threshold={threshold} (beta={beta}) is not supported: torch switches to the identity "
                f"where softplus still differs from it, which needs a select; expected threshold >= "
                f"{SOFTPLUS_LEAST_THRESHOLD:g}")
    return None


#: ``atanh(z) / z`` as a polynomial in ``w = z^2`` on [0, 1/9] (z <= 1/3), times 2: a least-squares
#: fit on 400 Chebyshev nodes, within 4.0e-9 relative of it (checked on 200,001 points)
ATANH_OVER_Z = tuple(2 * c for c in (1.0000000039388746, 0.3333315796753935, 0.20012426861776536,
                                     0.139807094166033, 0.1408732863544537))


def log1p_unit(ctx: LoweringContext, e: int) -> int:
    """``log1p(e)`` for ``e`` in [0, 1], accurate relative to its result (XNNPACK's log is not,
    near 1): ``log1p(e) = 2 atanh(z)``, ``z = e / (2 + e)`` in [0, 1/3], the atanh as
    ``z P(z^2)`` with ``P = ATANH_OVER_Z`` by Horner's rule (a few float32 roundings)."""
    g = ctx.graph

    def c(v: float) -> int:
        return ctx.constant(np.array([v], np.float32))

    z = g.divide(e, g.add(e, c(2.0)))
    w = g.square(z)
    poly = g.add(g.multiply(w, c(ATANH_OVER_Z[4])), c(ATANH_OVER_Z[3]))
    for k in (2, 1, 0):
        poly = g.add(g.multiply(poly, w), c(ATANH_OVER_Z[k]))
    return g.multiply(z, poly)


def softplus_value(ctx: LoweringContext, x: int, beta: float) -> int:
    """``(relu(y) + log1p(exp(-|y|))) / beta`` with ``y = beta x``: no overflow, and equal to
    torch's ``log1p(exp(y)) / beta`` (below its threshold) and ``x`` (above it); the
    ``log1p`` of a value in (0, 1] by ``log1p_unit``, so that a tiny softplus (y << 0) keeps
    its relative precision."""
    g = ctx.graph
    y = x if beta == 1 else g.multiply(x, ctx.constant(np.array([beta], np.float32)))
    out = g.add(g.clamp(y, 0.0, math.inf), log1p_unit(ctx, g.exp(g.negate(g.abs(y)))))
    return out if beta == 1 else g.divide(out, ctx.constant(np.array([beta], np.float32)))


SOFTPLUS_KINDS = ("XNNMultiply", "XNNClamp", "XNNAbs", "XNNNegate", "XNNExp", "XNNDiv", "XNNAdd", "XNNSquare")


@lowers(aten.softplus.default, emits=SOFTPLUS_KINDS, check=softplus_check)
def softplus(ctx: LoweringContext, x: Any, beta: float = 1.0, threshold: float = 20.0) -> Activation:
    """``aten::softplus(input, beta, threshold)`` (``softplus_value``)."""
    _needs(ctx, "softplus", "XNNExp")
    x = ctx.value(x)
    return ctx.tensor(softplus_value(ctx, x.id, float(beta)), x.shape, x.perm)


@lowers(aten.mish.default, emits=SOFTPLUS_KINDS + ("XNNTanh",))
def mish(ctx: LoweringContext, x: Any) -> Activation:
    """``mish(x) = x tanh(softplus(x))`` (softplus with beta 1, threshold 20, as torch's)."""
    _needs(ctx, "mish", "XNNExp", "XNNTanh")
    x = ctx.value(x)
    g = ctx.graph
    return ctx.tensor(g.multiply(x.id, g.tanh(softplus_value(ctx, x.id, 1.0))), x.shape, x.perm)
