"""Reductions over any dims: sums, maxima and minima, variances, log-softmax.

The schema has no reduction node.  Every reduction first lays its input out as rows
(the kept dims first, the reduced ones last, merged: ``[R, n]``), then:

=====================  ===================================================================
op                     nodes on the rows ``[R, n]``
=====================  ===================================================================
``sum``                XNNFullyConnected with a ``[1, n]`` filter of ones -> ``[R, 1]``
``amax``, ``max.dim``  XNNMaxPooling2d over ``[1, R, n, 1]`` with a ``1 x n`` window
``amin``, ``min.dim``  ``-max(-x)`` (negation is exact)
``var``, ``std``       ``m = FC(x, 1/n)``, ``FC((x - m)^2, 1/(n - correction))`` (then sqrt)
``log_softmax``        ``xc = x - max(x)``, ``xc - log(FC(exp(xc), ones))``
``linalg_vector_norm`` ord 2: ``sqrt(FC(x^2, ones))``; 1: ``FC(|x|, ones)``; inf: ``max(|x|)``;
                       -inf: ``-max(-|x|)``
=====================  ===================================================================

A max pooling selects one of its inputs, so maxima are exact; sums are float32 dot
products (within ``gamma(n) * sum|x|`` of the exact sum, ``tests/float_bounds.py``).
``max.dim`` / ``min.dim`` give their values only: XNNPACK computes no indices here, so a
program that reads them is refused by the registration's check (a mixed program runs it
outside XNNPACK).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import XnnquantError
from . import all_of, lowers, reads_later_outputs, static_shapes
from .context import Activation, LoweringContext

aten = torch.ops.aten

ROW_KINDS = ("XNNStaticTranspose", "XNNStaticReshape")


def reduced_dims(x: Activation, dims: Any) -> list[int]:
    """The torch dims ``dims`` (an int, a list, or None / [] for all) of ``x``, sorted."""
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return list(range(x.rank))
    listed = [dims] if isinstance(dims, int) else list(dims)
    return sorted({int(d) % max(x.rank, 1) for d in listed})


def as_rows(ctx: LoweringContext, x: Activation, reduced: list[int]) -> tuple[int, tuple[int, ...], int]:
    """``x`` as rows: (value id ``[*kept, n]``, the kept dims' sizes, n).

    The kept dims come first in their torch order, the reduced ones last (a transpose only
    when the value is not laid out so already), merged by one reshape.
    """
    rest = [d for d in range(x.rank) if d not in reduced]
    laid = ctx.in_layout(x, tuple(rest) + tuple(reduced))
    kept = tuple(x.shape[d] for d in rest)
    n = math.prod(x.shape[d] for d in reduced)
    rows = kept + (n,) if kept else (1, n)
    return (laid if ctx.graph.value(laid).dims == rows else ctx.graph.static_reshape(laid, rows)), kept, n


def _result(ctx: LoweringContext, vid: int, x: Activation, reduced: list[int], keepdim: bool) -> Activation:
    """The reduced rows ``[*kept, 1]`` (or ``[1, 1]``) as the op's torch result."""
    if keepdim:
        shape = tuple(1 if d in reduced else s for d, s in enumerate(x.shape))
    else:
        shape = tuple(s for d, s in enumerate(x.shape) if d not in reduced)
    if tuple(ctx.graph.value(vid).dims) != shape:
        vid = ctx.graph.static_reshape(vid, shape)
    return ctx.tensor(vid, shape)


def row_sums(ctx: LoweringContext, rows: int, n: int, weight: float, bias: float | None = None) -> int:
    """``weight * sum`` of each row of ``rows`` ``[..., n]`` (+ ``bias``): a fully connected node
    with a ``[1, n]`` filter, giving ``[..., 1]``."""
    b = None if bias is None else ctx.filled((1,), bias)
    return ctx.graph.fully_connected(rows, ctx.filled((1, n), weight), b)


def row_max(ctx: LoweringContext, rows: int, n: int) -> int:
    """The maximum of each row of ``rows`` ``[..., n]``, as ``[..., 1]``: XNNMaxPooling2d over
    ``[1, R, n, 1]`` with a ``1 x n`` window (a window of one element is the value itself)."""
    g = ctx.graph
    dims = tuple(g.value(rows).dims)
    if n == 1:
        return rows
    r = math.prod(dims[:-1])
    pooled = g.max_pooling_2d(g.static_reshape(rows, (1, r, n, 1)), kernel=(1, n), stride=(1, 1))
    return g.static_reshape(pooled, dims[:-1] + (1,))


def not_scalar(node: Any) -> str | None:
    """Why a reduction node cannot be lowered: its (first) result is 0-d."""
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) else val
    if first is not None and len(getattr(first, "shape", (1,))) == 0:
        return (f"{node.target} over every dim gives a 0-d tensor: XNNPACK values have at least one dim; expected "
                "keepdim=True or a reduction that keeps a dim")
    return None


def _dtype_ok(dtype: Any, op: str) -> None:
    if dtype is not None and dtype != torch.float32:
        raise XnnquantError(f"{op} with dtype={dtype} is not supported: expected float32")


@lowers(aten.sum.dim_IntList, aten.sum.default, emits=("XNNFullyConnected",) + ROW_KINDS,
        check=all_of(not_scalar, static_shapes))
def sum_(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Activation:
    """``aten::sum.dim_IntList(input, dim, keepdim, dtype)`` and ``sum.default`` (all dims)."""
    if isinstance(dim, torch.dtype):  # sum.default(input, dtype)
        dim, dtype = None, dim
    _dtype_ok(dtype, "sum")
    x = ctx.value(x)
    reduced = reduced_dims(x, dim)
    rows, _, n = as_rows(ctx, x, reduced)
    return _result(ctx, row_sums(ctx, rows, n, 1.0), x, reduced, bool(keepdim))


def _extreme(ctx: LoweringContext, x: Any, dims: Any, keepdim: bool, lowest: bool) -> Activation:
    x = ctx.value(x)
    reduced = reduced_dims(x, dims)
    rows, _, n = as_rows(ctx, x, reduced)
    g = ctx.graph
    if lowest:
        out = g.negate(row_max(ctx, g.negate(rows), n))
    else:
        out = row_max(ctx, rows, n)
    return _result(ctx, out, x, reduced, keepdim)


EXTREME_KINDS = ("XNNMaxPooling2d", "XNNNegate") + ROW_KINDS


@lowers(aten.amax.default, aten.amin.default, aten.max.default, aten.min.default, emits=EXTREME_KINDS,
        check=all_of(not_scalar, static_shapes))
def amax(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False) -> Activation:
    """``aten::amax / amin(input, dim, keepdim)``, ``max / min(input)`` (all dims)."""
    lowest = ctx.node.target in (aten.amin.default, aten.min.default)
    return _extreme(ctx, x, dim, bool(keepdim), lowest)


def values_only(node: Any) -> str | None:
    """Why ``node`` (an op returning (values, indices)) cannot be lowered: its indices are read."""
    if reads_later_outputs(node):
        return (f"the indices output of {node.target} is used: XNNPACK computes the values only (a mixed program "
                "runs this op outside XNNPACK)")
    return None


@lowers(aten.max.dim, aten.min.dim, emits=EXTREME_KINDS,
        check=all_of(values_only, not_scalar, static_shapes))
def max_dim(ctx: LoweringContext, x: Any, dim: int, keepdim: bool = False) -> tuple[Activation, None]:
    """``aten::max.dim / min.dim(input, dim, keepdim) -> (values, indices)``: the values."""
    return _extreme(ctx, x, [dim], bool(keepdim), ctx.node.target is aten.min.dim), None


NORM_ORDERS = (2, 1, math.inf, -math.inf)


def norm_order(node: Any) -> str | None:
    """Why a vector norm cannot be lowered: an order other than ``NORM_ORDERS``."""
    order = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
    if order not in NORM_ORDERS:
        return f"linalg_vector_norm of order {order} is not supported: expected one of 2, 1, inf, -inf"
    return None


@lowers(aten.linalg_vector_norm.default,
        emits=("XNNFullyConnected", "XNNSquare", "XNNSquareRoot", "XNNAbs") + EXTREME_KINDS,
        check=all_of(norm_order, not_scalar, static_shapes))
def vector_norm(ctx: LoweringContext, x: Any, order: Any = 2, dim: Any = None, keepdim: bool = False, *,
                dtype: Any = None) -> Activation:
    """``aten::linalg_vector_norm(input, ord, dim, keepdim, *, dtype)`` over rows (module docstring)."""
    _dtype_ok(dtype, "linalg_vector_norm")
    x = ctx.value(x)
    reduced = reduced_dims(x, dim)
    rows, _, n = as_rows(ctx, x, reduced)
    g = ctx.graph
    if order == 2:
        out = g.square_root(row_sums(ctx, g.square(rows), n, 1.0))
    elif order == 1:
        out = row_sums(ctx, g.abs(rows), n, 1.0)
    elif order == math.inf:
        out = row_max(ctx, g.abs(rows), n)
    else:
        out = g.negate(row_max(ctx, g.negate(g.abs(rows)), n))
    return _result(ctx, out, x, reduced, bool(keepdim))


def _correction(correction: Any, unbiased: Any) -> float:
    if correction is not None:
        return float(correction)
    return 1.0 if unbiased is None or unbiased else 0.0


VAR_KINDS = ("XNNFullyConnected", "XNNSubtract", "XNNSquare", "XNNSquareRoot") + ROW_KINDS


@lowers(aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, emits=VAR_KINDS,
        check=all_of(not_scalar, static_shapes))
def var(ctx: LoweringContext, x: Any, dim: Any = None, *args: Any, correction: Any = None,
        keepdim: bool = False) -> Activation:
    """``aten::var / std(input, dim, *, correction, keepdim)`` (and the ``unbiased`` forms):
    ``sum((x - mean)^2) / (n - correction)``, its square root for ``std``."""
    unbiased = None
    if ctx.node.target in (aten.var.dim, aten.std.dim):  # (input, dim, unbiased, keepdim)
        unbiased = args[0] if args else True
        keepdim = args[1] if len(args) > 1 else keepdim
    elif args:
        raise XnnquantError(f"unexpected positional arguments {args}")
    x = ctx.value(x)
    reduced = reduced_dims(x, dim)
    rows, _, n = as_rows(ctx, x, reduced)
    divisor = n - _correction(correction, unbiased)
    if divisor <= 0:
        raise XnnquantError(f"variance over {n} element(s) with correction {n - divisor:g} divides by "
                            f"{divisor:g}: expected more elements than the correction")
    g = ctx.graph
    centered = g.subtract(rows, row_sums(ctx, rows, n, 1.0 / n))
    out = row_sums(ctx, g.square(centered), n, 1.0 / divisor)
    if ctx.node.target in (aten.std.correction, aten.std.dim):
        out = g.square_root(out)
    return _result(ctx, out, x, reduced, bool(keepdim))


@lowers(aten._log_softmax.default, aten.log_softmax.int,
        emits=("XNNMaxPooling2d", "XNNSubtract", "XNNExp", "XNNLog", "XNNFullyConnected") + ROW_KINDS,
        check=static_shapes)
def log_softmax(ctx: LoweringContext, x: Any, dim: int, half_to_float: Any = None) -> Activation:
    """``log_softmax(x, dim) = xc - log(sum(exp(xc)))``, ``xc = x - max(x)`` (no overflow, and the
    largest entry's ``exp`` is 1, so the sum is >= 1 and its log never -inf)."""
    if half_to_float not in (None, False) and not isinstance(half_to_float, torch.dtype):
        raise XnnquantError(f"log_softmax with half_to_float={half_to_float} is not supported")
    if isinstance(half_to_float, torch.dtype) and half_to_float != torch.float32:
        raise XnnquantError(f"log_softmax with dtype={half_to_float} is not supported: expected float32")
    g = ctx.graph
    for kind in ("XNNExp", "XNNLog"):
        if kind not in g.target.node_kinds:
            raise XnnquantError(f"log_softmax needs {kind} (target '1.4.1')")
    x = ctx.value(x)
    d = int(dim) % x.rank
    rest = tuple(p for p in x.perm if p != d)
    laid = ctx.relaid(x, rest + (d,))
    n = x.shape[d]
    rows = g.static_reshape(laid.id, (math.prod(laid.dims[:-1]), n)) if laid.rank != 2 else laid.id
    centered = g.subtract(rows, row_max(ctx, rows, n))
    out = g.subtract(centered, g.log(row_sums(ctx, g.exp(centered), n, 1.0)))
    if laid.rank != 2:
        out = g.static_reshape(out, laid.dims)
    return ctx.tensor(out, x.shape, laid.perm)
