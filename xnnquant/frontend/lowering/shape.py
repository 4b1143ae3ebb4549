"""Shape and data-movement ops: reshapes, permutes, slices, concatenation, padding.

``permute`` / ``transpose`` emit nothing: they change the ``Activation``'s ``perm`` (see
lowering.py), and a transpose is emitted later only where a consumer needs another
layout.  A reshape reads the value in torch's order: when the layout only moves size-1
dims (an NHWC ``[N, 1, 1, C]`` read as ``[N, C]``), the value's memory order already is
torch's and one XNNStaticReshape does it; otherwise an XNNStaticTranspose comes first.

Static gathers (an index list known at export: nearest resizes, flips) are slices and
concatenations (``gathered``).  Slicing, concatenation and padding work in the value's own layout: the torch dim is
mapped to the value's dim (``Activation.physical``), so an NHWC value stays NHWC.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import XnnquantError
from ..program import cancelled
from . import lowers
from .context import Activation, LoweringContext, inverse, moves_only_ones

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


@lowers(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view_copy.default, emits=RESHAPE_KINDS)
def view(ctx: LoweringContext, x: Any, shape: Any) -> Activation:
    """``x.view(shape)``; a size may be a ``torch.SymInt`` (a dynamic dim, ``sym_size``).  The
    dim given as -1 is dynamic when the input's element count is (GPT-2 views its hidden
    states ``(1, seq, 64)`` as ``[-1, 64]``): its size is that count over the other dims'."""
    sizes = [ctx.program.size(d, "a view's size") if not (isinstance(d, int) and d == -1) else None for d in shape]
    exprs = [None if s is None else s.expr for s in sizes]
    x = ctx.value(x)
    if None in sizes and x.sym:
        count = math.prod(x.exprs[d] if x.is_dynamic(d) else x.shape[d] for d in range(x.rank))
        inferred = cancelled(count / math.prod(s.bound if s.expr is None else s.expr for s in sizes if s is not None))
        exprs[sizes.index(None)] = None if getattr(inferred, "is_number", True) else inferred
    return reshaped(ctx, x, tuple(-1 if s is None else s.bound for s in sizes), tuple(exprs))


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


@lowers(aten.unsqueeze.default, aten.unsqueeze_copy.default, emits=RESHAPE_KINDS)
def unsqueeze(ctx: LoweringContext, x: Any, dim: int) -> Activation:
    x = ctx.value(x)
    dim = dim % (x.rank + 1)
    return reshaped(ctx, x, x.shape[:dim] + (1,) + x.shape[dim:], x.exprs[:dim] + (None,) + x.exprs[dim:])


@lowers(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
        aten.squeeze_copy.default, emits=RESHAPE_KINDS)
def squeeze(ctx: LoweringContext, x: Any, dim: Any = None) -> Activation:
    x = ctx.value(x)
    dims = range(x.rank) if dim is None else [dim] if isinstance(dim, int) else dim
    drop = {d % x.rank for d in dims if x.shape[d % x.rank] == 1 and not x.is_dynamic(d)}
    keep = [i for i in range(x.rank) if i not in drop]
    return reshaped(ctx, x, tuple(x.shape[i] for i in keep), tuple(x.exprs[i] for i in keep))


@lowers(aten.permute.default, aten.permute_copy.default, emits=())
def permute(ctx: LoweringContext, x: Any, dims: Any) -> Activation:
    """No node: the result is the same value with torch dims reordered (``perm`` updated)."""
    x = ctx.value(x)
    order = tuple(int(d) % x.rank for d in dims)
    if sorted(order) != list(range(x.rank)):
        raise XnnquantError(f"permute dims must be a permutation of 0..{x.rank - 1}: got {tuple(dims)}")
    back = inverse(order)
    return Activation(x.id, tuple(x.shape[d] for d in order), tuple(back[p] for p in x.perm),
                      tuple(x.exprs[d] for d in order) if x.sym else ())


@lowers(aten.transpose.int, aten.transpose_copy.int, emits=())
def transpose(ctx: LoweringContext, x: Any, dim0: int, dim1: int) -> Activation:
    x = ctx.value(x)
    order = list(range(x.rank))
    a, b = dim0 % x.rank, dim1 % x.rank
    order[a], order[b] = order[b], order[a]
    return permute(ctx, x, order)


@lowers(aten.t.default, aten.t_copy.default, emits=())
def t(ctx: LoweringContext, x: Any) -> Activation:
    x = ctx.value(x)
    return x if x.rank < 2 else permute(ctx, x, (1, 0))


@lowers(aten.expand.default, aten.expand_copy.default, emits=("XNNAdd", "XNNStaticReshape", "XNNStaticTranspose"))
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
    if hi <= lo or 0 in x.shape:
        raise XnnquantError(f"an empty slice {lo}:{hi} of dim {dim} of a value of shape {x.shape} is not supported: "
                            "XNNPACK cannot hold a value of size 0")
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


SLICE_KINDS = ("XNNStaticSlice", "XNNStaticConstantPad", "XNNStaticReshape")


@lowers(aten.slice.Tensor, aten.slice_copy.Tensor, emits=SLICE_KINDS)
def slice_(ctx: LoweringContext, x: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Activation:
    """``x[lo:hi:step]`` along ``dim`` (``strided`` for steps above 1)."""
    x = ctx.value(x)
    if step < 1:
        raise XnnquantError(f"slices with step {step} are not supported: expected a positive step")
    if x.is_dynamic(dim):
        if step != 1:
            raise XnnquantError(f"a slice with step {step} of dynamic dim {dim % x.rank} ({x.exprs[dim % x.rank]}): "
                                "its element count would change with the dim; expected step 1")
        lo, hi = _dynamic_bounds(ctx, x, dim % x.rank, start, end)
    else:
        moving = [v for v in (start, end) if v is not None and not isinstance(v, int)]
        if moving:  # read as the traced value, the slice would be fixed at the example's
            raise XnnquantError(f"a slice of dim {dim % x.rank} (size {x.shape[dim % x.rank]}) between positions "
                                f"computed when the program runs ({', '.join(str(v) for v in moving)}): XNNPACK "
                                "slices only at fixed positions")
        lo, hi = _range(x.shape[dim % x.rank], start, end)
    if step == 1 or hi - lo <= 1:
        return sliced(ctx, x, dim, lo, hi)
    return strided(ctx, x, dim % x.rank, lo, hi, int(step))


def strided(ctx: LoweringContext, x: Activation, dim: int, lo: int, hi: int, step: int) -> Activation:
    """Every ``step``-th element of ``lo:hi`` along torch dim ``dim``: the ``count`` elements'
    span read as ``count`` rows of ``step`` (padded at the end when the last row runs past
    the dim; the padding is never selected), of which the first column is kept::

        [.., S, ..] -slice lo:lo+span, pad to count*step-> [.., count*step, ..]
            -reshape-> [.., count, step, ..] -slice column 0-> [.., count, 1, ..] -reshape-> [.., count, ..]
    """
    if x.rank >= 6:
        raise XnnquantError(f"a strided slice of a {x.rank}-D value is not supported: expected at most 5 dims "
                            "(XNNPACK's 6-D limit, one dim is added)")
    count = -(-(hi - lo) // step)
    span = min(x.shape[dim], lo + count * step) - lo
    part = sliced(ctx, x, dim, lo, lo + span)
    g = ctx.graph
    p = x.physical(dim)
    vid, dims = part.id, list(part.dims)
    if span < count * step:
        post = [0] * x.rank
        post[p] = count * step - span
        vid = g.static_constant_pad(vid, [0] * x.rank, post, 0.0)
        dims[p] = count * step
    pe = list(part.physical_exprs)  # other dims may be dynamic: their reshapes follow them
    rows = ctx.reshape(vid, tuple(dims[:p] + [count, step] + dims[p + 1:]), tuple(pe[:p] + [None, None] + pe[p + 1:]))
    column = g.static_slice(rows, [0] * (x.rank + 1), dims[:p] + [count, 1] + dims[p + 1:])
    shape = tuple(count if i == dim else s for i, s in enumerate(x.shape))
    out = ctx.reshape(column, tuple(dims[:p] + [count] + dims[p + 1:]), tuple(pe[:p] + [None] + pe[p + 1:]))
    return ctx.tensor(out, shape, x.perm, part.exprs)


@lowers(aten.select.int, aten.select_copy.int, emits=("XNNStaticSlice", "XNNStaticReshape", "XNNStaticTranspose"))
def select(ctx: LoweringContext, x: Any, dim: int, index: int) -> Activation:
    x = ctx.value(x)
    dim %= x.rank
    if not isinstance(index, int):  # int(index) would fix the size at its traced value (``sizes_stay_dynamic``)
        raise XnnquantError(f"select at index {ctx.program.size(index, 'an index').expr} of dim {dim}, which changes "
                            "when the program runs: XNNPACK slices only at fixed positions")
    if x.is_dynamic(dim) and index < 0:
        raise XnnquantError(f"select of index {index} on dynamic dim {dim} ({x.exprs[dim]}), from its end: "
                            "XNNPACK slices only at positions from its start")
    index = index + x.shape[dim] if index < 0 else index
    one = sliced(ctx, x, dim, index, index + 1)
    return reshaped(ctx, one, one.shape[:dim] + one.shape[dim + 1:], one.exprs[:dim] + one.exprs[dim + 1:])


@lowers(aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default, aten.split_copy.Tensor,
        emits=("XNNStaticSlice",))
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


@lowers(aten.constant_pad_nd.default, emits=("XNNStaticConstantPad", "XNNStaticSlice"))
def constant_pad_nd(ctx: LoweringContext, x: Any, pad: Any, value: float = 0.0) -> Activation:
    """``F.pad(x, pad, value=...)``: ``pad`` lists (before, after) from the last dim backwards; a
    negative amount removes that many elements (an XNNStaticSlice before the padding)."""
    x = ctx.value(x)
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > x.rank:
        raise XnnquantError(f"constant_pad_nd needs (before, after) pairs for at most {x.rank} dims: got {pad}")
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        d = x.rank - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if x.is_dynamic(d) and min(before, after) < 0:
            raise XnnquantError(f"constant_pad_nd {pad} crops dynamic dim {d} ({x.exprs[d]}): XNNPACK slices only at "
                                "fixed positions from a dim's start; expected non-negative padding there")
        if shape[d] + before + after <= 0:
            raise XnnquantError(f"constant_pad_nd {pad} leaves dim {d} (size {shape[d]}) empty: XNNPACK cannot hold "
                                "a value of size 0")
        x = sliced(ctx, x, d, max(0, -before), shape[d] - max(0, -after))
        shape[d] += before + after
    pre, post = [0] * x.rank, [0] * x.rank
    for i in range(len(pad) // 2):
        p = x.physical(x.rank - 1 - i)
        pre[p], post[p] = max(0, pad[2 * i]), max(0, pad[2 * i + 1])
    if not any(pre) and not any(post):
        return x
    return ctx.tensor(ctx.graph.static_constant_pad(x.id, pre, post, float(value)), tuple(shape), x.perm)


def _plain_constant_pad(node: Any) -> str | None:
    """``aten.pad`` is lowered only in its plain form: constant mode, static amounts, on a float32
    value of static shape.  Any other node is refused here, and so decomposed by torch into ``constant_pad_nd``
    (or gathers), whose own lowering and portable kernel take what XNNPACK does not: the
    portable kernels have no ``aten.pad``."""
    mode = node.kwargs.get("mode", node.args[2] if len(node.args) > 2 else "constant")
    if mode != "constant":
        return f"padding mode {mode!r}: XNNPACK pads with a constant only"
    val = getattr(node.args[0], "meta", {}).get("val")
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad", ())
    if val is None or str(val.dtype) != "torch.float32" or not all(isinstance(d, int) for d in val.shape) \
            or not all(isinstance(p, int) for p in pad):
        return "a padding of other than a float32 value of static shape by static amounts: decomposed"
    return None


@lowers(aten.pad.default, emits=("XNNStaticConstantPad", "XNNStaticSlice"), check=_plain_constant_pad)
def pad(ctx: LoweringContext, x: Any, pad: Any, mode: str = "constant", value: float | None = None) -> Activation:
    """``F.pad(x, pad, mode="constant", value=...)`` as torch.export keeps it (TF-style "same"
    padding, EfficientNet-Lite's): ``constant_pad_nd``, ``value`` None meaning 0; every other form is
    refused by the check, and decomposed (``_plain_constant_pad``)."""
    return constant_pad_nd(ctx, x, pad, 0.0 if value is None else value)


@lowers(aten.unbind.int, aten.unbind_copy.int, emits=("XNNStaticSlice", "XNNStaticReshape", "XNNStaticTranspose"))
def unbind(ctx: LoweringContext, x: Any, dim: int = 0) -> tuple[Activation, ...]:
    """Each index along ``dim``, that dim removed (``select``)."""
    x = ctx.value(x)
    return tuple(select(ctx, x, dim, i) for i in range(x.shape[dim % x.rank]))


def with_unit_dim(ctx: LoweringContext, x: Activation, dim: int) -> Activation:
    """``x`` with a size-1 torch dim inserted at ``dim``, its elements kept in memory order: the
    new dim goes into the value just before the torch dim that follows it (last if none),
    so one XNNStaticReshape does it whatever ``x``'s layout (dynamic dims follow)::

        [N, C, L] laid out [N, L, C], dim 2  ->  [N, C, 1, L] laid out [N, 1, L, C] (NHWC)
    """
    moved = [p + 1 if p >= dim else p for p in x.perm]
    at = moved.index(dim + 1) if dim < x.rank else len(moved)
    perm = tuple(moved[:at] + [dim] + moved[at:])
    shape = x.shape[:dim] + (1,) + x.shape[dim:]
    exprs = x.exprs[:dim] + (None,) + x.exprs[dim:]
    vid = ctx.reshape(x.id, tuple(shape[p] for p in perm), tuple(exprs[p] for p in perm))
    return ctx.tensor(vid, shape, perm, exprs)


def without_unit_dim(ctx: LoweringContext, x: Activation, dim: int, exprs: tuple[Any, ...] = ()) -> Activation:
    """``x`` with its size-1 torch dim ``dim`` removed, the rest of its layout kept (one reshape);
    ``exprs``: the result's dynamic dims (torch's order; default ``x``'s own)."""
    assert x.shape[dim] == 1, (x.shape, dim)
    perm = tuple(p - 1 if p > dim else p for p in x.perm if p != dim)
    shape = x.shape[:dim] + x.shape[dim + 1:]
    exprs = tuple(exprs) if exprs else x.exprs[:dim] + x.exprs[dim + 1:]
    vid = ctx.reshape(x.id, tuple(shape[p] for p in perm), tuple(exprs[p] for p in perm))
    return ctx.tensor(vid, shape, perm, exprs)


GATHER_KINDS = ("XNNStaticSlice", "XNNStaticReshape", "XNNStaticConstantPad", "XNNConcatenate2",
                "XNNConcatenate3", "XNNConcatenate4", "XNNConcatenate5", "XNNStaticTranspose")


def gathered(ctx: LoweringContext, x: Activation, dim: int, sources: list[int]) -> Activation:
    """``x`` indexed along torch dim ``dim`` by the static ``sources``, by data movement only: an
    element repeated in place (``_repeated``), a strided slice, or slices of the runs of
    consecutive sources, concatenated (nearest resizes, flips)."""
    size = x.shape[dim]
    count = len(sources)
    if sources == list(range(size)):
        return x
    if x.dynamic:
        raise XnnquantError(f"a static gather (nearest resize, flip) of a value with dynamic dims {x.sym}: it is "
                            "composed at the sizes seen at export; expected static shapes")
    if count % size == 0 and sources == [i // (count // size) for i in range(count)]:
        return _repeated(ctx, x, dim, count // size)
    if count > 1:
        step = sources[1] - sources[0]
        if step > 1 and sources == list(range(sources[0], sources[0] + step * count, step)):
            return strided(ctx, x, dim, sources[0], sources[-1] + 1, step)
    pieces: list[Activation] = []
    start = 0
    for i in range(1, count + 1):  # maximal runs of consecutive sources become one slice each
        if i == count or sources[i] != sources[i - 1] + 1:
            pieces.append(sliced(ctx, x, dim, sources[start], sources[i - 1] + 1))
            start = i
    return _concatenated(ctx, pieces, dim)


def _repeated(ctx: LoweringContext, x: Activation, dim: int, times: int) -> Activation:
    """Every element of torch dim ``dim`` repeated ``times`` times in place (module docstring)."""
    g = ctx.graph
    p = x.physical(dim)
    dims = list(x.dims)
    unit = g.static_reshape(x.id, dims[:p + 1] + [1] + dims[p + 1:])
    copies = [unit] * times
    most = 5 if "XNNConcatenate5" in g.target.node_kinds else 4
    while len(copies) > 1:  # whole groups of ``most`` copies, then what is left
        done = [g.concatenate(copies[i:i + most], p + 1) if len(copies[i:i + most]) > 1 else copies[i]
                for i in range(0, len(copies), most)]
        copies = done
    merged = dims[:p] + [dims[p] * times] + dims[p + 1:]
    shape = tuple(s * times if i == dim else s for i, s in enumerate(x.shape))
    return ctx.tensor(g.static_reshape(copies[0], merged), shape, x.perm)


def _concatenated(ctx: LoweringContext, parts: list[Activation], dim: int) -> Activation:
    return parts[0] if len(parts) == 1 else cat(ctx, parts, dim)


@lowers(aten.flip.default, emits=GATHER_KINDS)
def flip(ctx: LoweringContext, x: Any, dims: Any) -> Activation:
    """``x`` reversed along each of ``dims``: one slice per element, concatenated (``gathered``)."""
    x = ctx.value(x)
    for d in dims:
        d = int(d) % x.rank
        x = gathered(ctx, x, d, list(range(x.shape[d] - 1, -1, -1)))
    return x


@lowers(aten.repeat.default, emits=("XNNConcatenate2", "XNNConcatenate3", "XNNConcatenate4", "XNNConcatenate5",
                                    "XNNStaticReshape", "XNNStaticTranspose"))
def repeat(ctx: LoweringContext, x: Any, repeats: Any) -> Activation:
    """``x.repeat(*repeats)``: ``x`` tiled, each dim by a concatenation of copies (leading
    repeats beyond ``x``'s rank add dims first)."""
    x = ctx.value(x)
    counts = [int(r) for r in repeats]
    if len(counts) < x.rank or min(counts, default=1) < 1:
        raise XnnquantError(f"repeat {counts} of a value of shape {x.shape}: expected at least {x.rank} counts >= 1")
    if x.dynamic:
        raise XnnquantError(f"repeat of a value with dynamic dims {x.sym}: it is composed at the sizes seen at export; "
                            "expected static shapes")
    lead = len(counts) - x.rank
    if lead:
        x = reshaped(ctx, x, (1,) * lead + x.shape)
    for d, r in enumerate(counts):
        if r > 1:
            x = cat(ctx, [x] * r, d)
    return x
