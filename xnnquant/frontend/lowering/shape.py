"""Shape and data-movement ops: reshapes, permutes, slices, concatenation, padding, resizing.

``permute`` / ``transpose`` emit nothing: they change the ``Activation``'s ``perm`` (see
lowering.py), and a transpose is emitted later only where a consumer needs another
layout.  A reshape reads the value in torch's order: when the layout only moves size-1
dims (an NHWC ``[N, 1, 1, C]`` read as ``[N, C]``), the value's memory order already is
torch's and one XNNStaticReshape does it; otherwise an XNNStaticTranspose comes first.

Slicing, concatenation and padding work in the value's own layout: the torch dim is
mapped to the value's dim (``Activation.physical``), so an NHWC value stays NHWC.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import XnnquantError
from . import lowers
from .context import NHWC, Activation, LoweringContext, inverse, moves_only_ones

aten = torch.ops.aten

RESHAPE_KINDS = ("XNNStaticReshape", "XNNStaticTranspose")


def _resolve(shape: Any, count: int) -> tuple[int, ...]:
    dims = [int(d) for d in shape]
    if dims.count(-1) > 1:
        raise XnnquantError(f"a shape may hold one -1: got {tuple(dims)}")
    if -1 in dims:
        known = 1
        for d in dims:
            known *= d if d != -1 else 1
        dims[dims.index(-1)] = count // known if known else 0
    return tuple(dims)


def reshaped(ctx: LoweringContext, x: Any, shape: Any, exprs: tuple[Any, ...] = ()) -> Activation:
    """``x`` read in torch's element order as ``shape`` (ints; -1 resolved); ``exprs``: the
    new dims' dynamic sizes (``shape`` then holds their bounds; see ``LoweringContext.reshape``)."""
    x = ctx.value(x)
    count = 1
    for d in x.shape:
        count *= d
    new = _resolve(shape, count)
    exprs = tuple(exprs) if any(e is not None for e in exprs) else ()
    if new == x.shape and exprs == x.sym:
        return x
    total = 1
    for d in new:
        total *= d
    if total != count:
        raise XnnquantError(f"cannot reshape {x.shape} to {new}")
    vid = x.id if moves_only_ones(x.shape, x.perm) else ctx.canonical(x)
    return ctx.tensor(ctx.reshape(vid, new, exprs), new, sym=exprs)


@lowers(aten.view.default, aten.reshape.default, aten._unsafe_view.default, emits=RESHAPE_KINDS)
def view(ctx: LoweringContext, x: Any, shape: Any) -> Activation:
    """``x.view(shape)``; a size may be a ``torch.SymInt`` (a dynamic dim, ``sym_size``)."""
    sizes = [ctx.program.size(d, "a view's size") if not (isinstance(d, int) and d == -1) else None for d in shape]
    return reshaped(ctx, x, tuple(-1 if s is None else s.bound for s in sizes),
                    tuple(None if s is None else s.expr for s in sizes))


@lowers(aten.flatten.using_ints, emits=RESHAPE_KINDS)
def flatten(ctx: LoweringContext, x: Any, start_dim: int = 0, end_dim: int = -1) -> Activation:
    x = ctx.value(x)
    if x.rank == 0:
        return reshaped(ctx, x, (1,))
    start, end = start_dim % x.rank, end_dim % x.rank
    merged, merged_expr = 1, None
    for d in range(start, end + 1):
        merged *= x.shape[d]
    if any(x.is_dynamic(d) for d in range(start, end + 1)):
        merged_expr = math.prod(x.exprs[d] if x.is_dynamic(d) else x.shape[d] for d in range(start, end + 1))
    return reshaped(ctx, x, x.shape[:start] + (merged,) + x.shape[end + 1:],
                    x.exprs[:start] + (merged_expr,) + x.exprs[end + 1:])


@lowers(aten.unsqueeze.default, emits=RESHAPE_KINDS)
def unsqueeze(ctx: LoweringContext, x: Any, dim: int) -> Activation:
    x = ctx.value(x)
    dim = dim % (x.rank + 1)
    return reshaped(ctx, x, x.shape[:dim] + (1,) + x.shape[dim:], x.exprs[:dim] + (None,) + x.exprs[dim:])


@lowers(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, emits=RESHAPE_KINDS)
def squeeze(ctx: LoweringContext, x: Any, dim: Any = None) -> Activation:
    x = ctx.value(x)
    dims = range(x.rank) if dim is None else [dim] if isinstance(dim, int) else dim
    drop = {d % x.rank for d in dims if x.shape[d % x.rank] == 1 and not x.is_dynamic(d)}
    keep = [i for i in range(x.rank) if i not in drop]
    return reshaped(ctx, x, tuple(x.shape[i] for i in keep), tuple(x.exprs[i] for i in keep))


@lowers(aten.permute.default, emits=())
def permute(ctx: LoweringContext, x: Any, dims: Any) -> Activation:
    """No node: the result is the same value with torch dims reordered (``perm`` updated)."""
    x = ctx.value(x)
    order = tuple(int(d) % x.rank for d in dims)
    if sorted(order) != list(range(x.rank)):
        raise XnnquantError(f"permute dims must be a permutation of 0..{x.rank - 1}: got {tuple(dims)}")
    back = inverse(order)
    return Activation(x.id, tuple(x.shape[d] for d in order), tuple(back[p] for p in x.perm),
                      tuple(x.exprs[d] for d in order) if x.sym else ())


@lowers(aten.transpose.int, emits=())
def transpose(ctx: LoweringContext, x: Any, dim0: int, dim1: int) -> Activation:
    x = ctx.value(x)
    order = list(range(x.rank))
    a, b = dim0 % x.rank, dim1 % x.rank
    order[a], order[b] = order[b], order[a]
    return permute(ctx, x, order)


@lowers(aten.t.default, emits=())
def t(ctx: LoweringContext, x: Any) -> Activation:
    x = ctx.value(x)
    return x if x.rank < 2 else permute(ctx, x, (1, 0))


@lowers(aten.expand.default, emits=("XNNAdd", "XNNStaticReshape", "XNNStaticTranspose"))
def expand(ctx: LoweringContext, x: Any, size: Any, implicit: bool = False) -> Activation:
    """Broadcast ``x`` to ``size``: nothing when the shape is unchanged, else an XNNAdd of zeros."""
    x = ctx.value(x)
    lead = len(size) - x.rank
    target = []
    for i, d in enumerate(size):
        own = x.exprs[i - lead] if i >= lead else None
        symbolic = not isinstance(d, int)
        kept = i >= lead and ((not symbolic and d == -1)
                              or (symbolic and own is not None and ctx.program.size(d, "").expr == own))
        if kept:
            target.append(x.shape[i - lead])
        elif not isinstance(d, int):
            raise XnnquantError(f"expand to the dynamic size {ctx.program.size(d, '').expr} (dim {i}): XNNPACK "
                                "broadcasts only inside element-wise nodes; expand only to static sizes")
        else:
            target.append(int(d))
    if tuple(target) == x.shape:
        return x
    if x.dynamic:
        raise XnnquantError(f"expand of a tensor with dynamic dims {x.sym} to {tuple(target)}: the zeros it is "
                            "added to would have the bound's size; broadcast in the element-wise op instead")
    from .elementwise import binary

    if lead:
        x = reshaped(ctx, x, (1,) * lead + x.shape)
    return binary(ctx, "add", x, torch.zeros(tuple(target)))


def _range(size: int, start: Any, end: Any) -> tuple[int, int]:
    lo = 0 if start is None else int(start)
    hi = size if end is None else int(end)
    lo, hi = (lo + size if lo < 0 else lo), (hi + size if hi < 0 else hi)
    return max(0, min(lo, size)), max(0, min(hi, size))


def sliced(ctx: LoweringContext, x: Activation, dim: int, lo: int, hi: int) -> Activation:
    """``x`` restricted to ``lo:hi`` along torch dim ``dim``, in ``x``'s layout.

    On a dynamic dim (bound B, size d at run time) ``lo`` and ``hi`` are non-negative and
    ``hi = B`` means "to the end": XNNPACK keeps ``[min(lo, d), min(hi, d))`` of the dim on
    each call, which is torch's ``lo:hi`` there.
    """
    dim %= x.rank
    if (lo, hi) == (0, x.shape[dim]):
        return x
    if hi <= lo:
        raise XnnquantError(f"an empty slice {lo}:{hi} of dim {dim} (size {x.shape[dim]}) is not supported")
    offsets = [0] * x.rank
    sizes = list(x.dims)
    p = x.physical(dim)
    offsets[p], sizes[p] = lo, hi - lo
    shape = tuple(hi - lo if i == dim else s for i, s in enumerate(x.shape))
    exprs = x.exprs
    if exprs[dim] is not None:
        exprs = exprs[:dim] + ((exprs[dim] - lo) if hi == x.shape[dim] else None,) + exprs[dim + 1:]
    return ctx.tensor(ctx.graph.static_slice(x.id, offsets, sizes), shape, x.perm, exprs)


def _dynamic_bounds(ctx: LoweringContext, x: Activation, dim: int, start: Any, end: Any) -> tuple[int, int]:
    """``start:end`` on dynamic dim ``dim`` of ``x`` as (lo, hi) of ``sliced`` (see there)."""
    bound, expr = x.shape[dim], x.exprs[dim]

    def position(v: Any, default: int) -> int:
        if v is None:
            return default
        if not isinstance(v, int):
            size = ctx.program.size(v, "a slice bound")
            if size.expr == expr:
                return bound  # the dim's own size: to the end
            raise XnnquantError(f"a slice of dynamic dim {dim} ({expr}) ends at {size.expr}: XNNPACK slices "
                                "only at fixed positions")
        if v < 0:
            raise XnnquantError(f"a slice of dynamic dim {dim} ({expr}) at {v}, from its end: XNNPACK slices only at "
                                "positions from its start")
        return min(v, bound)

    return position(start, 0), position(end, bound)


@lowers(aten.slice.Tensor, emits=("XNNStaticSlice",))
def slice_(ctx: LoweringContext, x: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Activation:
    x = ctx.value(x)
    if step != 1:
        raise XnnquantError(f"slices with step {step} are not supported: expected step 1")
    if x.is_dynamic(dim):
        lo, hi = _dynamic_bounds(ctx, x, dim % x.rank, start, end)
    else:
        lo, hi = _range(x.shape[dim % x.rank], start, end)
    return sliced(ctx, x, dim, lo, hi)


@lowers(aten.select.int, emits=("XNNStaticSlice", "XNNStaticReshape", "XNNStaticTranspose"))
def select(ctx: LoweringContext, x: Any, dim: int, index: int) -> Activation:
    x = ctx.value(x)
    dim %= x.rank
    if x.is_dynamic(dim) and index < 0:
        raise XnnquantError(f"select of index {index} on dynamic dim {dim} ({x.exprs[dim]}), from its end: "
                            "XNNPACK slices only at positions from its start")
    index = index + x.shape[dim] if index < 0 else index
    one = sliced(ctx, x, dim, index, index + 1)
    return reshaped(ctx, one, one.shape[:dim] + one.shape[dim + 1:], one.exprs[:dim] + one.exprs[dim + 1:])


@lowers(aten.split_with_sizes.default, aten.split.Tensor, emits=("XNNStaticSlice",))
def split(ctx: LoweringContext, x: Any, sizes: Any, dim: int = 0) -> tuple[Activation, ...]:
    x = ctx.value(x)
    total = x.shape[dim % x.rank]
    if x.is_dynamic(dim):
        raise XnnquantError(f"a split of dynamic dim {dim % x.rank} ({x.exprs[dim % x.rank]}): its parts' sizes "
                            "would change with it; XNNPACK slices only at fixed positions")
    if isinstance(sizes, int):
        sizes = [min(sizes, total - i) for i in range(0, total, sizes)]
    parts, lo = [], 0
    for size in sizes:
        parts.append(sliced(ctx, x, dim, lo, lo + int(size)))
        lo += int(size)
    return tuple(parts)


@lowers(aten.cat.default, emits=("XNNConcatenate2", "XNNConcatenate3", "XNNConcatenate4", "XNNConcatenate5",
                                 "XNNStaticTranspose", "XNNStaticReshape"))
def cat(ctx: LoweringContext, tensors: Any, dim: int = 0) -> Activation:
    """Concatenation in the first input's layout, chained when there are more inputs than
    one node takes (4 for XN01, 5 for 1.4.1)."""
    parts = [ctx.value(t) for t in tensors]
    parts = [p for p in parts if p.shape[dim % p.rank] > 0] if len(parts) > 1 else parts
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    dim %= first.rank
    ids = [ctx.in_layout(p, first.perm) for p in parts]
    axis = first.physical(dim)
    most = 5 if "XNNConcatenate5" in ctx.graph.target.node_kinds else 4
    while len(ids) > 1:
        head = ctx.graph.concatenate(ids[:most], axis)
        ids = [head] + ids[most:]
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return ctx.tensor(ids[0], tuple(shape), first.perm)


@lowers(aten.constant_pad_nd.default, emits=("XNNStaticConstantPad",))
def constant_pad_nd(ctx: LoweringContext, x: Any, pad: Any, value: float = 0.0) -> Activation:
    """``F.pad(x, pad, value=...)``: ``pad`` lists (before, after) from the last dim backwards."""
    x = ctx.value(x)
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > x.rank or min(pad, default=0) < 0:
        raise XnnquantError(f"constant_pad_nd needs non-negative (before, after) pairs: got {pad}")
    pre, post = [0] * x.rank, [0] * x.rank
    for i in range(len(pad) // 2):
        p = x.physical(x.rank - 1 - i)
        pre[p], post[p] = pad[2 * i], pad[2 * i + 1]
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[x.rank - 1 - i] += pad[2 * i] + pad[2 * i + 1]
    return ctx.tensor(ctx.graph.static_constant_pad(x.id, pre, post, float(value)), tuple(shape), x.perm)


@lowers(aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default,
        emits=("XNNStaticResizeBilinear2D", "XNNStaticTranspose", "XNNStaticReshape"))
def upsample_bilinear2d(ctx: LoweringContext, x: Any, output_size: Any, align_corners: bool,
                        *scales: Any) -> Activation:
    """Bilinear resize (NHWC), to ``output_size`` or ``floor(size * scale)``.

    With scale factors, torch maps coordinates by the given scale while XNNPACK maps by
    the size ratio; they agree when ``size * scale`` is a whole number, and anything else
    is refused.
    """
    x = ctx.value(x)
    if x.rank != 4:
        raise XnnquantError(f"bilinear upsampling needs a 4-D input: got {x.shape}")
    h, w = x.shape[2], x.shape[3]
    factors = scales[0] if len(scales) == 1 else scales
    if x.is_dynamic(2) or x.is_dynamic(3):
        raise XnnquantError(f"bilinear upsampling of dynamic H or W {x.exprs[2:]}: XNNPACK resizes to the fixed size "
                            "computed at export")
    if output_size:
        oh, ow = (int(d) for d in output_size)
    else:
        if not factors or any(f is None for f in factors):
            raise XnnquantError("upsample_bilinear2d needs output_size or scale factors")
        fh, fw = (float(f) for f in factors)
        if (h * fh) % 1 or (w * fw) % 1:
            raise XnnquantError(f"scale factors {fh}, {fw} do not give whole sizes from {h}x{w}: pass a size")
        oh, ow = int(h * fh), int(w * fw)
    out = ctx.graph.static_resize_bilinear_2d(ctx.in_layout(x, NHWC), oh, ow, align_corners=bool(align_corners))
    return ctx.tensor(out, (x.shape[0], x.shape[1], oh, ow), NHWC)

