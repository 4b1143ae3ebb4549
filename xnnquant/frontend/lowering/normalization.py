"""Layer normalization, composed from XN01 kinds (and XNNReciprocalSquareRoot for 1.4.1).

The schema has no reduction node, so each mean over the normalized features is a fully
connected node whose filter is one row of ``1/n`` (``[1, n]``, fp32): the dot product
of every row with a constant vector, an ``[..., n] -> [..., 1]`` reduction XNNPACK runs as
a GEMM.  The variance's FC carries ``eps`` as its bias, so it yields ``var + eps``::

    mean = FC(x, [1/n ... 1/n])                        [..., 1]
    xc   = x - mean                                    XNNSubtract (broadcast)
    v    = FC(xc^2, [1/n ... 1/n], bias=[eps])          XNNSquare, XNNFullyConnected
    y    = xc * rsqrt(v)           (1.4.1)             XNNReciprocalSquareRoot, XNNMultiply
         = xc / sqrt(v)            (xn01)              XNNSquareRoot, XNNDiv
    out  = y * gamma + beta                            XNNMultiply, XNNAdd

Error against torch's layer_norm (float32, one pass over the row in float64 order):
the mean and variance are float32 dot products, so the result differs by a few float32
ulps of the normalized values (the tests bound it by 2e-6 relative on unit-variance rows).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import XnnquantError
from . import all_of, lowers, reads_later_outputs, static_shapes
from .context import Activation, LoweringContext, identity
from .reduction import as_rows, row_sums

aten = torch.ops.aten

LAYER_NORM_KINDS = ("XNNFullyConnected", "XNNSubtract", "XNNSquare", "XNNReciprocalSquareRoot", "XNNMultiply",
                    "XNNSquareRoot", "XNNDiv", "XNNAdd", "XNNStaticReshape", "XNNStaticTranspose")


def layer_norm_value(ctx: LoweringContext, x: Activation, normalized_shape: Any, weight: Any, bias: Any,
                     eps: float) -> Activation:
    """The composition of the module docstring, on ``x``'s last ``len(normalized_shape)`` dims."""
    g = ctx.graph
    dims = tuple(int(d) for d in normalized_shape)
    count = len(dims)
    if count == 0 or x.shape[x.rank - count:] != dims:
        raise XnnquantError(f"layer_norm over {dims} does not match the input's trailing dims {x.shape}")
    n = math.prod(dims)
    if any(x.is_dynamic(d) for d in range(x.rank - count, x.rank)):
        raise XnnquantError(f"layer_norm over dynamic dims {x.exprs[x.rank - count:]}: its mean is a fixed 1/n filter; "
                            "the normalized dims must be static")
    trailing = identity(x.rank)[x.rank - count:]
    if x.perm[x.rank - count:] != trailing:  # the normalized dims must be the value's last, in order
        x = ctx.relaid(x, identity(x.rank))
    lead = x.physical_exprs[: x.rank - count]
    rows = ctx.reshape(x.id, x.dims[: x.rank - count] + (n,), lead + (None,)) if count > 1 else x.id
    centered = g.subtract(rows, row_sums(ctx, rows, n, 1.0 / n))
    variance = row_sums(ctx, g.square(centered), n, 1.0 / n, eps)
    if "XNNReciprocalSquareRoot" in g.target.node_kinds:
        y = g.multiply(centered, g.reciprocal_square_root(variance))
    else:
        y = g.divide(centered, g.square_root(variance))
    if weight is not None:
        y = g.multiply(y, ctx.constant(ctx.constant_array(weight, "layer_norm weight").reshape(n), key=weight))
    if bias is not None:
        y = g.add(y, ctx.constant(ctx.constant_array(bias, "layer_norm bias").reshape(n), key=bias))
    if count > 1:
        y = ctx.reshape(y, x.dims, x.physical_exprs)
    return ctx.tensor(y, x.shape, x.perm)


@lowers(aten.layer_norm.default, emits=LAYER_NORM_KINDS)
def layer_norm(ctx: LoweringContext, x: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
               eps: float = 1e-5, cudnn_enable: Any = True) -> Activation:
    """``aten::layer_norm(input, normalized_shape, weight?, bias?, eps)``."""
    return layer_norm_value(ctx, ctx.value(x), normalized_shape, weight, bias, float(eps))


@lowers(aten.native_layer_norm.default, emits=LAYER_NORM_KINDS)
def native_layer_norm(ctx: LoweringContext, x: Any, normalized_shape: Any, weight: Any, bias: Any,
                      eps: float) -> tuple[Activation, None, None]:
    """``aten::native_layer_norm``: the normalized output (its mean and rstd outputs are refused if used)."""
    return layer_norm_value(ctx, ctx.value(x), normalized_shape, weight, bias, float(eps)), None, None


NORM_KINDS = ("XNNFullyConnected", "XNNSubtract", "XNNSquare", "XNNReciprocalSquareRoot", "XNNMultiply",
              "XNNSquareRoot", "XNNDiv", "XNNAdd", "XNNStaticReshape", "XNNStaticTranspose")


def normalized(ctx: LoweringContext, x: Activation, reduced: list[int], eps: float) -> Activation:
    """``(x - mean) / sqrt(var + eps)`` with mean and (biased) variance over the torch dims
    ``reduced``, computed as in ``layer_norm_value`` on ``x`` read as rows ``[*kept, n]``
    (``reduction.as_rows``); the result is laid out kept dims first, reduced dims last."""
    rows, kept, n = as_rows(ctx, x, reduced)
    order = tuple(d for d in range(x.rank) if d not in reduced) + tuple(reduced)
    flat = ctx.tensor(rows, kept + (n,) if kept else (1, n))
    y = layer_norm_value(ctx, flat, (n,), None, None, eps)
    dims = tuple(x.shape[d] for d in order)
    return ctx.tensor(ctx.graph.static_reshape(y.id, dims), x.shape, order)


def per_channel(ctx: LoweringContext, y: Activation, weight: Any, bias: Any, what: str) -> Activation:
    """``y * weight + bias`` with ``weight`` / ``bias`` ``[C]`` (or None) along torch dim 1."""
    from .elementwise import binary

    channels = (y.shape[1],) + (1,) * (y.rank - 2)
    for param, method in ((weight, "multiply"), (bias, "add")):
        if param is None:
            continue
        if isinstance(param, Activation):
            raise XnnquantError(f"{what} with a computed weight or bias is not supported: expected constants")
        arr = ctx.constant_array(param, f"{what} parameter")
        if arr.size != y.shape[1]:
            raise XnnquantError(f"{what} parameter of shape {arr.shape} does not match {y.shape[1]} channels")
        y = binary(ctx, method, y, arr.reshape(channels))
    return y


def statistics_unused(node: Any, op: str) -> str | None:
    """Why ``node`` cannot be lowered: it returns (out, statistics...) and a statistic is read."""
    if reads_later_outputs(node):
        return f"the statistics outputs of {op} are used: only its normalized output is computed"
    return None


def group_norm_value(ctx: LoweringContext, x: Activation, groups: int, weight: Any, bias: Any,
                     eps: float) -> Activation:
    """Group norm: ``x [N, C, *S]`` read as ``[N, G, C/G * prod(S)]`` (torch's order), each row
    normalized, read back and scaled per channel."""
    from .shape import reshaped

    if x.rank < 2 or groups < 1 or x.shape[1] % groups:
        raise XnnquantError(f"group_norm with {groups} groups of an input of shape {x.shape}: expected a channel "
                            "dim (dim 1) that the groups divide")
    n = math.prod(x.shape[1:]) // groups
    rows = reshaped(ctx, x, (x.shape[0], groups, n))
    y = layer_norm_value(ctx, rows, (n,), None, None, eps)
    return per_channel(ctx, reshaped(ctx, y, x.shape), weight, bias, "group_norm")


@lowers(aten.native_group_norm.default, emits=NORM_KINDS,
        check=all_of(lambda node: statistics_unused(node, "native_group_norm"), static_shapes))
def native_group_norm(ctx: LoweringContext, x: Any, weight: Any, bias: Any, batch: int, channels: int, hw: int,
                      group: int, eps: float) -> tuple[Activation, None, None]:
    """``aten::native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)``."""
    return group_norm_value(ctx, ctx.value(x), int(group), weight, bias, float(eps)), None, None


@lowers(aten.group_norm.default, emits=NORM_KINDS, check=static_shapes)
def group_norm(ctx: LoweringContext, x: Any, num_groups: int, weight: Any = None, bias: Any = None,
               eps: float = 1e-5, cudnn_enabled: bool = True) -> Activation:
    """``aten::group_norm(input, num_groups, weight?, bias?, eps)``."""
    return group_norm_value(ctx, ctx.value(x), int(num_groups), weight, bias, float(eps))


@lowers(aten.instance_norm.default, emits=NORM_KINDS, check=static_shapes)
def instance_norm(ctx: LoweringContext, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                  use_input_stats: bool, momentum: float, eps: float, cudnn_enabled: bool = True) -> Activation:
    """``aten::instance_norm``: each (image, channel) normalized over its spatial dims with its own
    statistics (``use_input_stats``), or per channel with the running ones (an affine map)."""
    x = ctx.value(x)
    if x.rank < 3:
        raise XnnquantError(f"instance_norm needs (N, C, *spatial): got an input of shape {x.shape}")
    if not use_input_stats:
        from .conv import batch_norm

        return batch_norm(ctx, x, weight, bias, running_mean, running_var, momentum, eps)[0]
    return per_channel(ctx, normalized(ctx, x, list(range(2, x.rank)), float(eps)), weight, bias, "instance_norm")


@lowers(aten._native_batch_norm_legit.no_stats, emits=NORM_KINDS,
        check=all_of(lambda node: statistics_unused(node, "_native_batch_norm_legit"), static_shapes))
def batch_norm_input_statistics(ctx: LoweringContext, x: Any, weight: Any, bias: Any, training: bool,
                                momentum: float, eps: float) -> tuple[Activation, None, None]:
    """``aten::_native_batch_norm_legit.no_stats``: batch norm with the input's own statistics
    (what torch.export makes of instance norm: the input viewed as ``[1, N*C, *S]``), each
    channel (dim 1) normalized over every other dim."""
    x = ctx.value(x)
    if x.rank < 2:
        raise XnnquantError(f"batch norm needs a channel dim: got an input of shape {x.shape}")
    reduced = [0] + list(range(2, x.rank))
    return per_channel(ctx, normalized(ctx, x, reduced, float(eps)), weight, bias, "batch_norm"), None, None
