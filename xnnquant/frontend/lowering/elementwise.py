"""Element-wise ops from two tables: binary (``BINARY``) and unary (``UNARY``).

Each entry maps an ATen overload to a ``Graph`` method; one generic lowering per table
does the rest.  Binary ops broadcast as torch does; a constant operand (a tensor or a
Python number) becomes a graph constant laid out like the other operand, so an NHWC
activation times a per-channel constant ``[C, 1, 1]`` needs no transpose::

    torch:  x [N, C, H, W] * s [C, 1, 1]   ->  graph: x NHWC [N, H, W, C] * s [1, 1, 1, C]

Unary entries name the node kind they emit and, for kinds that only ExecuTorch 1.4.1's
schema has, a composition from XN01 kinds (in ``activations``) used for target ``"xn01"``:

=======================  ============================  ======================================
ATen op                  1.4.1                         xn01
=======================  ============================  ======================================
``rsqrt``                XNNReciprocalSquareRoot       1 / XNNSquareRoot
``tanh``                 XNNTanh                       2 sigmoid(2x) - 1
``exp``, ``log``,        XNNExp, XNNLog, XNNSin,       refused (no XN01 composition)
``sin``, ``cos``         XNNCos
=======================  ============================  ======================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...datatypes import Datatype
from ...errors import XnnquantError
from . import lowers
from .context import Activation, LoweringContext, identity

aten = torch.ops.aten

#: Binary ATen op -> (Graph method, node kind).  ``add`` / ``sub`` take ``alpha``.
BINARY: dict[Any, tuple[str, str]] = {
    aten.add.Tensor: ("add", "XNNAdd"),
    aten.add.Scalar: ("add", "XNNAdd"),
    aten.sub.Tensor: ("subtract", "XNNSubtract"),
    aten.sub.Scalar: ("subtract", "XNNSubtract"),
    aten.mul.Tensor: ("multiply", "XNNMultiply"),
    aten.mul.Scalar: ("multiply", "XNNMultiply"),
    aten.div.Tensor: ("divide", "XNNDiv"),
    aten.div.Scalar: ("divide", "XNNDiv"),
    aten.minimum.default: ("minimum", "XNNMinimum"),
    aten.maximum.default: ("maximum", "XNNMaximum"),
}


def _numel(t: Activation) -> int:
    out = 1
    for d in t.shape:
        out *= d
    return out


def aligned(ctx: LoweringContext, a: Any, b: Any) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Two operands as graph values that broadcast like torch's: (a id, b id, out shape, out perm).

    Activations of one rank meet in the layout of the larger (the smaller is transposed,
    or reshaped when only size-1 dims move); of different ranks, in torch's order with the
    lower rank given leading ones, or, when it has two dynamic dims (a reshape infers one),
    as it is: XNNPACK's binary nodes align ranks from the right as torch does (a causal mask
    ``[L, S]`` added to scores ``[B, H, L, S]``).  A constant follows the activation's layout.
    """
    try:
        shape = tuple(int(d) for d in torch.broadcast_shapes(_shape(a), _shape(b)))
    except RuntimeError:
        raise XnnquantError(f"shapes do not broadcast: got {_shape(a)} and {_shape(b)}") from None
    if not isinstance(b, Activation):
        wide = widened(ctx, a, len(shape))
        return wide.id, ctx.constant_like(b, wide), shape, wide.perm
    if not isinstance(a, Activation):
        wide = widened(ctx, b, len(shape))
        return ctx.constant_like(a, wide), wide.id, shape, wide.perm
    if a.rank == b.rank:
        big, small = (a, b) if _numel(a) >= _numel(b) else (b, a)
        ids = {id(big): big.id, id(small): ctx.in_layout(small, big.perm)}
        return ids[id(a)], ids[id(b)], shape, big.perm
    ranked = []
    for t in (a, b):
        vid = ctx.canonical(t)
        if t.rank < len(shape) and sum(e is not None for e in t.exprs) <= 1:
            lead = len(shape) - t.rank
            vid = ctx.reshape(vid, (1,) * lead + t.shape, (None,) * lead + t.exprs)
        ranked.append(vid)
    return ranked[0], ranked[1], shape, identity(len(shape))


def _shape(x: Any) -> tuple[int, ...]:
    if isinstance(x, Activation):
        return x.shape
    return tuple(getattr(x, "shape", ()))


def widened(ctx: LoweringContext, t: Activation, rank: int) -> Activation:
    """``t`` with leading size-1 dims up to ``rank`` (a constant of higher rank broadcasts it up).

    The new dims go first in the value too, so its elements keep their memory order and
    one XNNStaticReshape does it, whatever ``t``'s layout::

        t [N, C, H, W] laid out NHWC [N, H, W, C]  ->  [1, N, C, H, W] laid out [1, N, H, W, C]
    """
    lead = rank - t.rank
    if lead <= 0:
        return t
    perm = tuple(range(lead)) + tuple(p + lead for p in t.perm)
    vid = ctx.reshape(t.id, (1,) * lead + t.dims, (None,) * lead + t.physical_exprs)
    return ctx.tensor(vid, (1,) * lead + t.shape, perm, (None,) * lead + t.exprs)


def binary(ctx: LoweringContext, method: str, a: Any, b: Any) -> Activation:
    """``method`` on two operands (activations or constants), broadcast as torch does."""
    ia, ib, shape, perm = aligned(ctx, a, b)
    out = getattr(ctx.graph, method)(ia, ib)
    return ctx.tensor(out, shape, perm)


def _scaled(ctx: LoweringContext, b: Any, alpha: Any) -> Any:
    """``alpha * b`` for add / sub (folded into a constant ``b``)."""
    if alpha == 1:
        return b
    if not isinstance(b, Activation):
        return b * alpha
    return binary(ctx, "multiply", b, float(alpha))


def _make_binary(op: Any, method: str, kind: str) -> None:
    takes_alpha = method in ("add", "subtract")
    emits = (kind, "XNNMultiply", "XNNStaticTranspose", "XNNStaticReshape") if takes_alpha else \
        (kind, "XNNStaticTranspose", "XNNStaticReshape")

    @lowers(op, emits=emits)
    def lower(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1, rounding_mode: Any = None) -> Activation:
        if rounding_mode is not None:
            raise XnnquantError(f"division with rounding_mode={rounding_mode!r} is not supported")
        if takes_alpha:
            b = _scaled(ctx, b, alpha)
        return binary(ctx, method, a, b)

    lower.__name__ = lower.__qualname__ = f"lower_{method}_{op.__name__.replace('.', '_')}"


for _op, (_method, _kind) in BINARY.items():
    _make_binary(_op, _method, _kind)


@lowers(aten.rsub.Scalar, aten.rsub.Tensor, emits=("XNNSubtract", "XNNMultiply", "XNNStaticTranspose",
                                                   "XNNStaticReshape"))
def rsub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Activation:
    """``b - alpha * a`` (``1 - x`` in attention masks)."""
    return binary(ctx, "subtract", b, _scaled(ctx, a, alpha))


@lowers(aten.pow.Tensor_Scalar, emits=("XNNSquare", "XNNSquareRoot", "XNNMultiply", "XNNDiv",
                                       "XNNReciprocalSquareRoot"))
def power(ctx: LoweringContext, x: Activation, exponent: Any) -> Activation:
    """``x ** e`` for e in {1, 2, 3, 0.5, -0.5, -1} (what models use); other exponents are refused."""
    g = ctx.graph
    if exponent == 1:
        return x
    if exponent == 2:
        return ctx.tensor(g.square(x.id), x.shape, x.perm)
    if exponent == 3:
        return ctx.tensor(g.multiply(g.square(x.id), x.id), x.shape, x.perm)
    if exponent == 0.5:
        return ctx.tensor(g.square_root(x.id), x.shape, x.perm)
    if exponent == -0.5:
        return reciprocal_square_root(ctx, x)
    if exponent == -1:
        return ctx.tensor(g.divide(ctx.constant_like(1.0, x), x.id), x.shape, x.perm)
    raise XnnquantError(f"pow with exponent {exponent!r} is not supported: expected 1, 2, 3, 0.5, -0.5 or -1")


def reciprocal_square_root(ctx: LoweringContext, x: Activation) -> Activation:
    """``1 / sqrt(x)``: one node for 1.4.1, sqrt then a division for XN01 (both correctly
    rounded twice at most: 1 ulp)."""
    g = ctx.graph
    if "XNNReciprocalSquareRoot" in g.target.node_kinds:
        return ctx.tensor(g.reciprocal_square_root(x.id), x.shape, x.perm)
    return ctx.tensor(g.divide(ctx.constant_like(1.0, x), g.square_root(x.id)), x.shape, x.perm)


def tanh_composed(ctx: LoweringContext, x: Activation) -> Activation:
    """``tanh(x) = 2 sigmoid(2x) - 1`` from XN01 kinds (absolute error below 3e-7: the
    sigmoid's rounding doubled; relative error grows for |x| < 1e-3, where tanh(x) ~ x)."""
    g = ctx.graph
    two = ctx.constant_like(2.0, x)
    s = g.sigmoid(g.multiply(x.id, two))
    return ctx.tensor(g.subtract(g.multiply(s, two), ctx.constant_like(1.0, x)), x.shape, x.perm)


@dataclass(frozen=True)
class Unary:
    """A unary op: the ``Graph`` method, its node kind, and an XN01 composition when the
    kind is one of the 1.4.1 kinds (None: refused for target xn01)."""

    method: str
    kind: str
    composed: Callable[[LoweringContext, Activation], Activation] | None = None
    composed_kinds: tuple[str, ...] = ()


UNARY: dict[Any, Unary] = {
    aten.abs.default: Unary("abs", "XNNAbs"),
    aten.neg.default: Unary("negate", "XNNNegate"),
    aten.floor.default: Unary("floor", "XNNFloor"),
    aten.ceil.default: Unary("ceiling", "XNNCeiling"),
    aten.sqrt.default: Unary("square_root", "XNNSquareRoot"),
    aten.square.default: Unary("square", "XNNSquare"),
    aten.sigmoid.default: Unary("sigmoid", "XNNSigmoid"),
    aten.hardswish.default: Unary("hardswish", "XNNHardswish"),
    aten.rsqrt.default: Unary("reciprocal_square_root", "XNNReciprocalSquareRoot",
                              reciprocal_square_root, ("XNNSquareRoot", "XNNDiv")),
    aten.tanh.default: Unary("tanh", "XNNTanh", tanh_composed, ("XNNMultiply", "XNNSigmoid", "XNNSubtract")),
    aten.exp.default: Unary("exp", "XNNExp"),
    aten.log.default: Unary("log", "XNNLog"),
    aten.sin.default: Unary("sin", "XNNSin"),
    aten.cos.default: Unary("cos", "XNNCos"),
}


def unary(ctx: LoweringContext, entry: Unary, x: Any, op: str = "") -> Activation:
    """The generic lowering of ``UNARY``: one node, keeping the input's layout."""
    x = ctx.value(x)
    if entry.kind in ctx.graph.target.node_kinds:
        return ctx.tensor(getattr(ctx.graph, entry.method)(x.id), x.shape, x.perm)
    if entry.composed is not None:
        return entry.composed(ctx, x)
    raise XnnquantError(f"{entry.kind} is one of ExecuTorch 1.4.1's node kinds and has no composition from "
                        f"XN01 kinds: export with target='1.4.1'")


def _make_unary(op: Any, entry: Unary) -> None:
    @lowers(op, emits=(entry.kind, *entry.composed_kinds))
    def lower(ctx: LoweringContext, x: Any) -> Activation:
        return unary(ctx, entry, x)

    lower.__name__ = lower.__qualname__ = f"lower_{entry.method}"


for _op, _entry in UNARY.items():
    _make_unary(_op, _entry)


def _int8_to_float(node: Any) -> str | None:
    from ..passes.partition import reads_int8

    if reads_int8(node):
        return None
    return "XNNPACK converts only int8 values to float32 here (the other dtypes run on ExecuTorch's portable kernels)"


@lowers(aten._to_copy.default, emits=("XNNConvert",), check=_int8_to_float)
def int8_to_float(ctx: LoweringContext, x: Activation, **kwargs: Any) -> Activation:
    """``aten::_to_copy(int8 -> float32)``: XNNConvert of the qint8 value (scale 1, zero point
    0: the delegate's int8 input, ``walk._int8_input``) to fp32, each code its integer."""
    return Activation(ctx.graph.convert(x.id, Datatype.fp32), x.shape, x.perm, x.sym)
