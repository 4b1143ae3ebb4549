"""Resizing: bilinear (plain and antialiased), nearest, and separable linear maps.

The 1.4.1 schema has one resize node, XNNStaticResizeBilinear2D (NHWC); there is no
nearest resize.  Every other resize is composed, exactly:

* **nearest** (``upsample_nearest2d``, ``_upsample_nearest_exact2d``): each output row
  (column) is a copy of one input row (column), so it is data movement, per axis.  Which
  source each output reads is asked of torch itself, by resizing an image that holds
  each pixel's flat index (``_sources``).  An axis scaled up by a whole factor ``s``
  repeats every element ``s`` times (a concatenation of ``s`` copies along a new unit
  dim, then a reshape); one that takes every ``s``-th element is a strided slice; any
  other is a concatenation of slices (``gathered``)::

      [.., H, ..] -reshape-> [.., H, 1, ..] -concat s copies-> [.., H, s, ..] -reshape-> [.., H*s, ..]

* **bilinear with scale factors that do not give whole sizes**, and **antialiased
  bilinear** where it differs from bilinear (downscaling, or ``align_corners=True``): a
  separable linear map ``Y = A_h X A_w^T`` whose matrices are torch's own weights, read
  by resizing one-hot images (``_weights``), applied by two fully connected nodes.  The
  result differs from torch's only by the order of the float32 sums of at most a few
  (bilinear) to ``2 * in / out + 2`` (antialiased) terms.  Antialiased upscaling with
  ``align_corners=False`` is bilinear itself (same weights): the resize node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from . import all_of, lowers, static_shapes
from .context import NHWC, Activation, LoweringContext
from .shape import GATHER_KINDS, gathered

aten = torch.ops.aten
#: Largest side an antialiased resize takes: its per-axis filter matrices are side x side floats.
ANTIALIASED_MAX_SIDE = 2**12

SEPARABLE_KINDS = ("XNNFullyConnected", "XNNStaticTranspose", "XNNStaticReshape")


def _spatial(x: Activation, op: str) -> tuple[int, int]:
    if x.rank != 4:
        raise XnnquantError(f"{op} needs a 4-D input (N, C, H, W): got shape {x.shape}")
    return x.shape[2], x.shape[3]


# ------------------------------------------------------------------ separable


def separable(ctx: LoweringContext, x: Activation, a_h: np.ndarray, a_w: np.ndarray) -> Activation:
    """``y[n, c] = a_h @ x[n, c] @ a_w.T`` for ``x [N, C, H, W]``, ``a_h [OH, H]``, ``a_w [OW, W]``:
    a fully connected node over W, a transpose, one over H; the result is laid out
    ``[N, C, OW, OH]`` (``perm (0, 1, 3, 2)``)::

        [N, C, H, W] -FC a_w-> [N, C, H, OW] -transpose-> [N, C, OW, H] -FC a_h-> [N, C, OW, OH]
    """
    g = ctx.graph
    n, c, _, _ = x.shape
    oh, ow = a_h.shape[0], a_w.shape[0]
    rows = g.fully_connected(ctx.canonical(x), ctx.constant(a_w.astype(np.float32)))
    cols = g.fully_connected(g.static_transpose(rows, (0, 1, 3, 2)), ctx.constant(a_h.astype(np.float32)))
    return ctx.tensor(cols, (n, c, oh, ow), (0, 1, 3, 2))


def _weights(probe: Callable[[torch.Tensor], torch.Tensor], size: int, axis: int) -> np.ndarray:
    """The ``[out, size]`` matrix of a separable resize along ``axis`` (2: H, 3: W): ``probe``
    applied to a batch of ``size`` one-hot images of length ``size`` along that axis and 2
    along the other (which the probe keeps at 2, an identity map), read back.  In float64:
    the weights are torch's exact ones, rounded once to float32 when placed in the graph
    (torch's float32 kernels compute them with a few roundings of their own).  (Images of
    width 1 are avoided: torch's antialiased kernel computes them differently.)"""
    eye = torch.eye(size, dtype=torch.float64)
    if axis == 2:
        images = eye.reshape(size, 1, size, 1).expand(size, 1, size, 2)
    else:
        images = eye.reshape(size, 1, 1, size).expand(size, 1, 2, size)
    with torch.no_grad():
        out = probe(images.contiguous())
    lines = out[:, 0, :, 0] if axis == 2 else out[:, 0, 0, :]
    return lines.T.contiguous().numpy().astype(np.float64)


# --------------------------------------------------------------------- nearest


def _sources(ctx: LoweringContext, h: int, w: int, args: Sequence[Any]) -> tuple[list[int], list[int]]:
    """The source row of each output row and the source column of each output column of the
    node being lowered, from torch: its op applied to an image holding each pixel's flat index."""
    if h * w >= 2**24:
        raise XnnquantError(f"a nearest resize of a {h}x{w} image is not supported: expected fewer than 2^24 pixels")
    index = torch.arange(h * w, dtype=torch.float32).reshape(1, 1, h, w)
    with torch.no_grad():
        flat = ctx.node.target(index, *args).reshape(-1, ctx.node.meta["val"].shape[-1]).to(torch.int64)
    return (flat[:, 0] // w).tolist(), (flat[0, :] % w).tolist()


def _nearest_check(node: Any) -> str | None:
    shape = getattr(node.args[0], "meta", {}).get("val")
    if shape is not None and len(shape.shape) != 4:
        return f"{node.target} needs a 4-D input (N, C, H, W): got shape {tuple(shape.shape)}"
    return None


@lowers(aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.vec,
        aten._upsample_nearest_exact2d.default, emits=GATHER_KINDS, check=all_of(_nearest_check, static_shapes))
def upsample_nearest2d(ctx: LoweringContext, x: Any, *args: Any) -> Activation:
    """Nearest resize (module docstring): rows, then columns, in ``x``'s own layout."""
    x = ctx.value(x)
    h, w = _spatial(x, "nearest upsampling")
    rows, cols = _sources(ctx, h, w, args)
    return gathered(ctx, gathered(ctx, x, 2, rows), 3, cols)


# -------------------------------------------------------------------- bilinear


def _output_size(h: int, w: int, output_size: Any, factors: Any, op: str) -> tuple[int, int] | None:
    """The output size, or None when scale factors do not give whole sizes (torch then maps
    coordinates by the factors, not by the size ratio)."""
    if output_size:
        oh, ow = (int(d) for d in output_size)
        return oh, ow
    if not factors or any(f is None for f in factors):
        raise XnnquantError(f"{op} needs output_size or scale factors")
    fh, fw = (float(f) for f in factors)
    if (h * fh) % 1 or (w * fw) % 1:
        return None
    return int(h * fh), int(w * fw)


def _linear_resize(ctx: LoweringContext, x: Activation, args: Sequence[Any]) -> Activation:
    """The node's resize as a separable linear map with torch's own weights (``separable``)."""
    if x.dynamic:
        raise XnnquantError(f"a resize by a separable map of a value with dynamic dims {x.sym}: its matrices and "
                            "transposes are laid out at the sizes seen at export; expected static shapes")
    target = ctx.node.target
    h, w = x.shape[2], x.shape[3]
    oh, ow = ctx.node.meta["val"].shape[-2:]
    if target in (aten.upsample_bilinear2d.vec, aten._upsample_bilinear2d_aa.vec):
        _, align, factors = args
        if factors:  # torch maps coordinates by the factors: probe with them (and no size)
            fh, fw = (float(f) for f in factors)
            by_h = lambda t: target(t, None, align, [fh, 1.0])  # noqa: E731
            by_w = lambda t: target(t, None, align, [1.0, fw])  # noqa: E731
        else:
            by_h = lambda t: target(t, [int(oh), 2], align, None)  # noqa: E731
            by_w = lambda t: target(t, [2, int(ow)], align, None)  # noqa: E731
    else:  # .default: (output_size, align_corners, scales_h, scales_w)
        _, align, *scales = args
        fh, fw = (list(scales) + [None, None])[:2]
        by_h = lambda t: target(t, [int(oh), 2], align, fh, None)  # noqa: E731
        by_w = lambda t: target(t, [2, int(ow)], align, None, fw)  # noqa: E731
    return separable(ctx, x, _weights(by_h, h, 2), _weights(by_w, w, 3))


@lowers(aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default,
        emits=("XNNStaticResizeBilinear2D",) + SEPARABLE_KINDS)
def upsample_bilinear2d(ctx: LoweringContext, x: Any, output_size: Any, align_corners: bool,
                        *scales: Any) -> Activation:
    """Bilinear resize: XNNStaticResizeBilinear2D (NHWC) to ``output_size`` or to whole
    ``size * scale`` sizes (torch's coordinate map then is XNNPACK's, by the size ratio);
    a separable linear map otherwise."""
    x = ctx.value(x)
    h, w = _spatial(x, "bilinear upsampling")
    if x.is_dynamic(2) or x.is_dynamic(3):
        raise XnnquantError(f"bilinear upsampling of dynamic H or W {x.exprs[2:]}: XNNPACK resizes to the fixed size "
                            "computed at export")
    factors = scales[0] if len(scales) == 1 else scales
    size = _output_size(h, w, output_size, factors, "upsample_bilinear2d")
    if size is None:
        return _linear_resize(ctx, x, (output_size, align_corners, *scales))
    oh, ow = size
    out = ctx.graph.static_resize_bilinear_2d(ctx.in_layout(x, NHWC), oh, ow, align_corners=bool(align_corners))
    return ctx.tensor(out, (x.shape[0], x.shape[1], oh, ow), NHWC)


@lowers(aten._upsample_bilinear2d_aa.vec, aten._upsample_bilinear2d_aa.default,
        emits=("XNNStaticResizeBilinear2D",) + SEPARABLE_KINDS, check=static_shapes)
def upsample_bilinear2d_aa(ctx: LoweringContext, x: Any, output_size: Any, align_corners: bool,
                           *scales: Any) -> Activation:
    """Antialiased bilinear resize (module docstring)."""
    x = ctx.value(x)
    h, w = _spatial(x, "antialiased bilinear upsampling")
    oh, ow = (int(d) for d in ctx.node.meta["val"].shape[-2:])
    factors = scales[0] if len(scales) == 1 else scales
    whole = _output_size(h, w, output_size, factors, "_upsample_bilinear2d_aa") is not None
    if not align_corners and whole and oh >= h and ow >= w:
        out = ctx.graph.static_resize_bilinear_2d(ctx.in_layout(x, NHWC), oh, ow, align_corners=False)
        return ctx.tensor(out, (x.shape[0], x.shape[1], oh, ow), NHWC)
    if max(h, w) > ANTIALIASED_MAX_SIDE or math.prod((oh, ow)) > 2**24:
        raise XnnquantError(f"an antialiased resize from {h}x{w} to {oh}x{ow} is not supported: expected at most "
                            f"{ANTIALIASED_MAX_SIDE} per side")
    return _linear_resize(ctx, x, (output_size, align_corners, *scales))
