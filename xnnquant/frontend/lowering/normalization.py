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

import numpy as np
import torch

from ...errors import XnnquantError
from . import lowers
from .context import Activation, LoweringContext, identity

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
    average = ctx.constant(np.full((1, n), 1.0 / n, np.float32))
    mean = g.fully_connected(rows, average)
    centered = g.subtract(rows, mean)
    variance = g.fully_connected(g.square(centered), average, ctx.constant(np.array([eps], np.float32)))
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
