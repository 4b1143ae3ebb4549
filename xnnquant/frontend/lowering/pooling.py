"""Pooling and means: XNNMaxPooling2d, XNNAvgPooling2d, XNNGlobalAvgPooling2d, and a mean
over any dims as a fully connected node with a ``1/n`` filter.

Poolings read NHWC (``LoweringContext.in_layout``) and leave NHWC (``perm = NHWC``), like
convolutions.  Where torch and XNNPACK differ:

* ``avg_pool2d`` counts padded zeros in the divisor by default (``count_include_pad``),
  XNNPACK never does: the padding is then an explicit XNNStaticConstantPad of zeros
  before an unpadded pooling;
* ``ceil_mode`` for max pooling becomes extra bottom / right padding, which max pooling
  never selects (XNNPACK pads with -inf); average pooling with ``ceil_mode`` is refused;
* ``mean`` over H and W of a 4-D tensor is XNNGlobalAvgPooling2d (squeeze-and-excitation);
  over other dims it moves them last and multiplies by a ``[1, n]`` filter of ``1/n``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from . import lowers
from .context import NHWC, Activation, LoweringContext, pair

aten = torch.ops.aten



def _spatial(x: Activation) -> tuple[int, int]:
    if x.rank != 4:
        raise XnnquantError(f"2-D pooling needs a 4-D input (N, C, H, W): got shape {x.shape}")
    return x.shape[2], x.shape[3]


def _static_spatial(x: Activation, what: str) -> None:
    """Refuse ``what`` on dynamic H or W: it is computed from the sizes at export."""
    if x.is_dynamic(2) or x.is_dynamic(3):
        raise XnnquantError(f"{what} over dynamic H or W {x.exprs[2:]}: its padding or window is computed from the "
                            "sizes at export, which then change")


def _ceil_extra(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Bottom / right padding that gives torch's ceil_mode output size with floor division."""
    span = dilation * (kernel - 1) + 1
    out = -(-(size + 2 * pad - span) // stride) + 1
    if (out - 1) * stride >= size + pad:  # torch: the last window must start inside input or left pad
        out -= 1
    return max(0, (out - 1) * stride + span - (size + 2 * pad))


def _nchw_result(ctx: LoweringContext, vid: int) -> Activation:
    n, h, w, c = ctx.graph.value(vid).dims
    return ctx.tensor(vid, (n, c, h, w), NHWC)


@lowers(aten.max_pool2d.default, aten.max_pool2d_with_indices.default,
        emits=("XNNMaxPooling2d", "XNNStaticTranspose", "XNNStaticReshape"))
def max_pool2d(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False) -> Any:
    """``aten::max_pool2d`` (and ``_with_indices``, whose indices are refused if used)."""
    x = ctx.value(x)
    h, w = _spatial(x)
    k = pair(kernel_size)
    s, p, d = pair(stride, k), pair(padding), pair(dilation)
    if ceil_mode:
        _static_spatial(x, "max_pool2d with ceil_mode")
    extra = (_ceil_extra(h, k[0], s[0], p[0], d[0]), _ceil_extra(w, k[1], s[1], p[1], d[1])) if ceil_mode else (0, 0)
    out = ctx.graph.max_pooling_2d(ctx.in_layout(x, NHWC), kernel=k, stride=s, dilation=d,
                                   padding=(p[0], p[1] + extra[1], p[0] + extra[0], p[1]))
    result = _nchw_result(ctx, out)
    return (result, None) if ctx.node.target is aten.max_pool2d_with_indices.default else result


@lowers(aten.avg_pool2d.default, emits=("XNNAvgPooling2d", "XNNStaticConstantPad", "XNNStaticTranspose",
                                        "XNNStaticReshape"))
def avg_pool2d(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Activation:
    """``aten::avg_pool2d`` (see the module docstring for padding)."""
    x = ctx.value(x)
    _spatial(x)
    if ceil_mode or divisor_override is not None:
        raise XnnquantError(f"avg_pool2d with ceil_mode={ceil_mode}, divisor_override={divisor_override} is not "
                            "supported: expected False and None")
    k = pair(kernel_size)
    s, p = pair(stride, k), pair(padding)
    g = ctx.graph
    xin = ctx.in_layout(x, NHWC)
    pads = (p[0], p[1], p[0], p[1])
    if count_include_pad and any(p):
        xin = g.static_constant_pad(xin, (0, p[0], p[1], 0), (0, p[0], p[1], 0), 0.0)
        pads = (0, 0, 0, 0)
    return _nchw_result(ctx, g.avg_pooling_2d(xin, kernel=k, stride=s, padding=pads))


@lowers(aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default,
        emits=("XNNGlobalAvgPooling2d", "XNNAvgPooling2d", "XNNStaticTranspose", "XNNStaticReshape"))
def adaptive_avg_pool2d(ctx: LoweringContext, x: Any, output_size: Any) -> Activation:
    """To 1x1: XNNGlobalAvgPooling2d; to a size dividing the input: an average pooling."""
    x = ctx.value(x)
    h, w = _spatial(x)
    oh, ow = pair(output_size)
    if (oh, ow) == (1, 1):
        return _nchw_result(ctx, ctx.graph.global_avg_pooling_2d(ctx.in_layout(x, NHWC)))
    if (oh, ow) == (h, w) and not x.dynamic:
        return x
    _static_spatial(x, f"adaptive_avg_pool2d to {oh}x{ow}")
    if h % oh or w % ow:
        raise XnnquantError(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow}: supported when the output "
                            "divides the input (equal windows)")
    k = (h // oh, w // ow)
    return _nchw_result(ctx, ctx.graph.avg_pooling_2d(ctx.in_layout(x, NHWC), kernel=k, stride=k))


def mean_value(ctx: LoweringContext, x: Activation, dims: Any, keepdim: bool) -> Activation:
    """Mean of ``x`` over ``dims`` (see the module docstring)."""
    g = ctx.graph
    reduced = sorted({int(d) % x.rank for d in (dims if dims else range(x.rank))})
    rest = [d for d in range(x.rank) if d not in reduced]
    exprs = x.exprs
    rest_exprs = tuple(exprs[d] for d in rest)
    kept_shape = tuple(1 if d in reduced else x.shape[d] for d in range(x.rank))
    out_shape = kept_shape if keepdim else tuple(x.shape[d] for d in rest)
    if x.rank == 4 and reduced == [2, 3]:
        pooled = g.global_avg_pooling_2d(ctx.in_layout(x, NHWC))  # [N, 1, 1, C]
        if keepdim:
            return ctx.tensor(pooled, kept_shape, NHWC)
        # [N, 1, 1, C] -> [N, C]: same order
        return ctx.tensor(ctx.reshape(pooled, out_shape, rest_exprs), out_shape, sym=rest_exprs)
    if any(exprs[d] is not None for d in reduced):
        raise XnnquantError(f"mean over dynamic dims {tuple(exprs[d] for d in reduced)}: it is a fixed 1/n filter "
                            "here; only a mean over H and W of a 4-D tensor (global pooling) follows dynamic sizes")
    n = math.prod(x.shape[d] for d in reduced)
    laid = ctx.in_layout(x, tuple(rest) + tuple(reduced))
    rows = ctx.reshape(laid, tuple(x.shape[d] for d in rest) + (n,) if rest else (1, n),
                       rest_exprs + (None,) if rest else ())
    average = ctx.constant(np.full((1, n), 1.0 / n, np.float32))
    means = g.fully_connected(rows, average)
    final = out_shape if out_shape else (1,)
    kept = tuple(None if d in reduced else exprs[d] for d in range(x.rank)) if keepdim else rest_exprs
    return ctx.tensor(ctx.reshape(means, final, kept if out_shape else ()), final, sym=kept if out_shape else ())


@lowers(aten.mean.dim, emits=("XNNGlobalAvgPooling2d", "XNNFullyConnected", "XNNStaticTranspose",
                              "XNNStaticReshape"))
def mean(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Activation:
    """``aten::mean.dim(input, dim, keepdim)``."""
    if dtype is not None and dtype != torch.float32:
        raise XnnquantError(f"mean with dtype={dtype} is not supported: expected float32")
    return mean_value(ctx, ctx.value(x), dim, bool(keepdim))
