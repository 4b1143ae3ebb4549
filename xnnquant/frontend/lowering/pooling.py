"""Pooling and means: XNNMaxPooling2d, XNNAvgPooling2d, XNNGlobalAvgPooling2d, and a mean
over any dims as a fully connected node with a ``1/n`` filter.

Poolings read NHWC (``LoweringContext.in_layout``) and leave NHWC (``perm = NHWC``), like
convolutions.  Where torch and XNNPACK differ:

* ``ceil_mode`` adds bottom / right padding that gives torch's output size with floor
  division (torch: the last window must start inside the input or its left padding).
  Max pooling never selects padding (XNNPACK pads with -inf).
* The divisor of ``avg_pool2d``.  torch divides each window's sum by, for a window
  ``[h0, h0 + k)`` in padded coordinates (likewise W)::

      count_include_pad:   (min(h0 + k, H + pad) - h0) * ...   padding cells counted, cells
                                                                past the padding (ceil_mode) not
      otherwise:           (min(h0 + k, H) - max(h0, 0)) * ...  input cells only
      divisor_override d:  d

  XNNPACK's average pooling divides by the number of input cells in the window, never
  counting its padding.  So: without ``count_include_pad``, the pooling's own padding
  (plus the ceil extra) gives torch's divisor; with it, the torch padding is an explicit
  XNNStaticConstantPad of zeros (now counted) and only the ceil extra is the pooling's
  padding (not counted); with ``divisor_override``, a depthwise convolution with a
  ``1/d`` filter sums the window (zero padding adds nothing).
* ``mean`` over H and W of a 4-D tensor is XNNGlobalAvgPooling2d (squeeze-and-excitation);
  over other dims it moves them last and multiplies by a ``[1, n]`` filter of ``1/n``.
* ``adaptive_avg_pool2d`` to a size that does not divide the input has windows of
  different sizes: a separable linear map (two fully connected nodes).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from . import lowers, reads_later_outputs
from .context import NHWC, Activation, LoweringContext, pair
from .reduction import not_scalar, row_sums

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


def max_pool_check(node: Any) -> str | None:
    """``max_pool2d_with_indices`` whose indices are read is refused, and so is ceil mode over
    a dynamic H or W (as the lowering would refuse it; said here, before lowering, so that
    ``aten.max_pool2d``, which has no portable kernel, is decomposed into
    ``max_pool2d_with_indices``, which has one)."""
    ceil_mode = node.args[5] if len(node.args) > 5 else node.kwargs.get("ceil_mode", False)
    shape = tuple(getattr(node.args[0].meta.get("val"), "shape", ()))
    if ceil_mode and any(not isinstance(d, int) for d in shape[2:4]):
        return (f"max_pool2d with ceil_mode over dynamic H or W {shape[2:4]}: its padding or window is computed "
                "from the sizes at export, which then change")
    if node.target is aten.max_pool2d_with_indices.default and reads_later_outputs(node):
        return ("the indices of max_pool2d_with_indices are used: XNNPACK's max pooling gives the values only (its "
                "argmax pooling gives window-relative indices, and only for non-overlapping windows); a mixed program "
                "runs this op outside XNNPACK")
    return None


@lowers(aten.max_pool2d.default, aten.max_pool2d_with_indices.default,
        emits=("XNNMaxPooling2d", "XNNStaticTranspose", "XNNStaticReshape"), check=max_pool_check)
def max_pool2d(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False) -> Any:
    """``aten::max_pool2d`` (and ``_with_indices``, whose indices are refused if used)."""
    x = ctx.value(x)
    h, w = _spatial(x)
    k = pair(kernel_size)
    s, p, d = pair(stride, k), pair(padding), pair(dilation)
    # ceil_mode over a dynamic H or W never gets here: max_pool_check refuses it
    extra = (_ceil_extra(h, k[0], s[0], p[0], d[0]), _ceil_extra(w, k[1], s[1], p[1], d[1])) if ceil_mode else (0, 0)
    out = ctx.graph.max_pooling_2d(ctx.in_layout(x, NHWC), kernel=k, stride=s, dilation=d,
                                   padding=(p[0], p[1] + extra[1], p[0] + extra[0], p[1]))
    result = _nchw_result(ctx, out)
    return (result, None) if ctx.node.target is aten.max_pool2d_with_indices.default else result


@lowers(aten.avg_pool2d.default, emits=("XNNAvgPooling2d", "XNNDepthwiseConv2d", "XNNStaticConstantPad",
                                        "XNNStaticTranspose", "XNNStaticReshape"))
def avg_pool2d(ctx: LoweringContext, x: Any, kernel_size: Any, stride: Any = (), padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Activation:
    """``aten::avg_pool2d`` (see the module docstring for the divisors)."""
    x = ctx.value(x)
    h, w = _spatial(x)
    k = pair(kernel_size)
    s, p = pair(stride, k), pair(padding)
    if ceil_mode:
        _static_spatial(x, "avg_pool2d with ceil_mode")
    e = (_ceil_extra(h, k[0], s[0], p[0], 1), _ceil_extra(w, k[1], s[1], p[1], 1)) if ceil_mode else (0, 0)
    g = ctx.graph
    xin = ctx.in_layout(x, NHWC)
    if divisor_override:
        channels = x.shape[1]
        ones = ctx.constant(np.full((1, k[0], k[1], channels), 1.0 / float(divisor_override), np.float32))
        out = g.depthwise_conv2d(xin, ones, None, padding=(p[0], p[1] + e[1], p[0] + e[0], p[1]), stride=s)
        return _nchw_result(ctx, out)
    pads = (p[0], p[1] + e[1], p[0] + e[0], p[1])
    if count_include_pad and any(p):
        xin = g.static_constant_pad(xin, (0, p[0], p[1], 0), (0, p[0], p[1], 0), 0.0)
        pads = (0, e[1], e[0], 0)
    return _nchw_result(ctx, g.avg_pooling_2d(xin, kernel=k, stride=s, padding=pads))


def adaptive_windows(size: int, out: int) -> np.ndarray:
    """torch's adaptive average pooling of ``size`` to ``out`` as an ``[out, size]`` matrix: row i
    averages ``[floor(i * size / out), ceil((i + 1) * size / out))``."""
    a = np.zeros((out, size))
    for i in range(out):
        lo, hi = (i * size) // out, -(-((i + 1) * size) // out)
        a[i, lo:hi] = 1.0 / (hi - lo)
    return a


@lowers(aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default,
        emits=("XNNGlobalAvgPooling2d", "XNNAvgPooling2d", "XNNFullyConnected", "XNNStaticTranspose",
               "XNNStaticReshape"))
def adaptive_avg_pool2d(ctx: LoweringContext, x: Any, output_size: Any) -> Activation:
    """To 1x1: XNNGlobalAvgPooling2d; to a size dividing the input: an average pooling; else
    a separable linear map (``resize.separable``) with torch's windows (``adaptive_windows``)."""
    x = ctx.value(x)
    h, w = _spatial(x)
    oh, ow = pair(output_size)
    if (oh, ow) == (1, 1):
        return _nchw_result(ctx, ctx.graph.global_avg_pooling_2d(ctx.in_layout(x, NHWC)))
    if (oh, ow) == (h, w) and not x.dynamic:
        return x
    _static_spatial(x, f"adaptive_avg_pool2d to {oh}x{ow}")
    if h % oh or w % ow:
        from .resize import separable

        if x.dynamic:
            raise XnnquantError(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow} of a value with dynamic dims {x.sym}: "
                                "windows of different sizes are a separable map laid out at the sizes seen at export")
        return separable(ctx, x, adaptive_windows(h, oh), adaptive_windows(w, ow))
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
    means = row_sums(ctx, rows, n, 1.0 / n)
    final = out_shape if out_shape else (1,)
    kept = tuple(None if d in reduced else exprs[d] for d in range(x.rank)) if keepdim else rest_exprs
    return ctx.tensor(ctx.reshape(means, final, kept if out_shape else ()), final, sym=kept if out_shape else ())


@lowers(aten.mean.dim, emits=("XNNGlobalAvgPooling2d", "XNNFullyConnected", "XNNStaticTranspose",
                              "XNNStaticReshape"), check=not_scalar)
def mean(ctx: LoweringContext, x: Any, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Activation:
    """``aten::mean.dim(input, dim, keepdim)``."""
    if dtype is not None and dtype != torch.float32:
        raise XnnquantError(f"mean with dtype={dtype} is not supported: expected float32")
    return mean_value(ctx, ctx.value(x), dim, bool(keepdim))
