"""Convolutions (regular, grouped, depthwise, transposed) and batch normalization.

Layouts.  XNNPACK convolves NHWC activations with OHWI filters; torch holds NCHW
activations and OIHW filters.  The input goes to NHWC through ``LoweringContext.in_layout`` (a
transpose only where the producer was not NHWC already) and the output stays NHWC
(``perm = NHWC``).  Filters are rearranged once, as constants::

    regular / grouped  torch [OC, IC/g, KH, KW] --(0, 2, 3, 1)--> [OC, KH, KW, IC/g]
    depthwise          torch [OC, 1, KH, KW]    --(1, 2, 3, 0)--> [1, KH, KW, OC]
    transposed         torch [IC, OC/g, KH, KW] --per group (1, 2, 3, 0)--> [OC, KH, KW, IC/g]

A 1-D convolution (3-D input) is a 2-D one of height 1 (``_one_d``): a unit dim inserted in
the input, the filter, the stride, padding and dilation, and dropped from the result.

torch's symmetric ``padding=(ph, pw)`` is XNNPACK's (top, right, bottom, left) =
(ph, pw, ph, pw).  A 1x1 convolution (stride 1, no padding, one group) is lowered as a
fully connected layer over each pixel's channels (``_pointwise``).

Weights.  What XNNPACK 1.4.1 computes (measured, tests/test_graph_conv_dynamic.py):
``qc8w`` gives a regular or grouped convolution a qcint8 filter and an input converted
to qdint8 *per image* (``num_nonbatch_dims=3``; per pixel is computed wrongly).  There is
no 4-bit convolution and no dynamically quantized depthwise or transposed convolution:
those layers are refused under a quantized scheme unless ``fallback=`` fits them.  1x1
convolutions, being fully connected layers, take every scheme (input quantized per pixel).

Batch norm.  An eval-mode batch norm after a convolution is folded into it by the
``batch_norm`` pass; the ones left are a multiply-add with per-channel constants here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from ..weights import Layer, LayerKind
from . import lowers
from .context import NHWC, Activation, LoweringContext, pair

aten = torch.ops.aten

CONV_OPS = (aten.convolution.default, aten.conv2d.default)
BATCH_NORM = aten._native_batch_norm_legit_no_training.default
CONV_KINDS = ("XNNConv2d", "XNNDepthwiseConv2d", "XNNConvTranspose2d", "XNNFullyConnected", "XNNConvert",
              "XNNStaticTranspose",
              "XNNStaticReshape")


def _batch_norm_affine(ctx: LoweringContext, weight: Any, bias: Any, mean: Any, var: Any, eps: float,
                       channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (scale, shift) in float64: ``y = x * scale + shift``."""
    def arr(x: Any, default: float) -> np.ndarray:
        if x is None:
            return np.full(channels, default)
        if isinstance(x, Activation):
            raise XnnquantError("batch norm with computed statistics or affine parameters is not supported")
        return ctx.constant_array(x, "batch norm parameter").astype(np.float64).reshape(channels)

    scale = arr(weight, 1.0) / np.sqrt(arr(var, 1.0) + float(eps))
    return scale, arr(bias, 0.0) - arr(mean, 0.0) * scale


@lowers(aten.conv2d.default, emits=CONV_KINDS)
def conv2d(ctx: LoweringContext, x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Activation:
    """``aten::conv2d(input, weight, bias?, stride, padding, dilation, groups)``."""
    if isinstance(padding, str):
        raise XnnquantError(f"conv2d padding={padding!r} is not supported here: expected explicit padding")
    return convolution(ctx, x, weight, bias, stride, padding, dilation, False, (0, 0), groups)


@lowers(aten.convolution.default, emits=CONV_KINDS)
def convolution(ctx: LoweringContext, x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                transposed: bool, output_padding: Any, groups: int) -> Activation:
    """``aten::convolution``: 2-D (4-D input) or 1-D (3-D input, see ``_one_d``), constant filter."""
    x = ctx.value(x)
    if x.rank not in (3, 4):
        raise XnnquantError(f"only 1-D and 2-D convolutions are supported: got an input of shape {x.shape}")
    if isinstance(weight, Activation) or (bias is not None and isinstance(bias, Activation)):
        raise XnnquantError("convolution with a computed filter or bias is not supported: expected constants")
    w = ctx.constant_array(weight, "convolution weight")
    b = None if bias is None else ctx.constant_array(bias, "convolution bias")
    if x.rank == 3:
        return _one_d(ctx, x, weight, w, b, stride, padding, dilation, bool(transposed), output_padding, int(groups))
    return _two_d(ctx, x, weight, w, b, pair(stride), pair(padding), pair(dilation), bool(transposed),
                  pair(output_padding), int(groups))


def _one_d(ctx: LoweringContext, x: Activation, weight: Any, w: np.ndarray, b: np.ndarray | None, stride: Any,
           padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int) -> Activation:
    """A 1-D convolution as a 2-D one of height 1: a unit dim inserted before the length
    (``shape.with_unit_dim``: an NLC value becomes NHWC by a reshape alone) and in the filter::

        x [N, C, L] -> [N, C, 1, L]      w [OC, IC/g, K] -> [OC, IC/g, 1, K]
        stride s, padding p, dilation d, output_padding o -> (1, s), (0, p), (1, d), (0, o)
        y [N, OC, 1, L'] -> [N, OC, L']  (laid out NLC, as the 2-D result is NHWC)
    """
    from .shape import with_unit_dim, without_unit_dim

    def one(v: Any) -> int:
        return int(v[0]) if isinstance(v, (list, tuple)) else int(v)

    out = _two_d(ctx, with_unit_dim(ctx, x, 2), weight, w.reshape(w.shape[0], w.shape[1], 1, w.shape[2]), b,
                 (1, one(stride)), (0, one(padding)), (1, one(dilation)), transposed, (0, one(output_padding)),
                 groups, reference=((0, 2, 1), 2))
    traced = ctx.program.shape(ctx.node.meta["val"], "the convolution's result")  # its dynamic dims
    return without_unit_dim(ctx, out, 2, tuple(size.expr for size in traced))


def _two_d(ctx: LoweringContext, x: Activation, weight: Any, w: np.ndarray, b: np.ndarray | None,
           stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int], transposed: bool,
           output_padding: tuple[int, int], groups: int,
           reference: tuple[tuple[int, ...], int] = (NHWC, 3)) -> Activation:
    """The 2-D convolution of NCHW ``x`` by the ``[OC, IC/g, KH, KW]`` filter ``w`` (the values of
    the torch argument ``weight``).  ``reference``: the ATen node's input layout and non-batch
    dims as the graph quantizes it per image (for the self-check's reference)."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    g = ctx.graph
    path = ctx.weight_path(weight)
    if transposed:
        return _transposed(ctx, x, weight, w, b, path, (sh, sw), (ph, pw), (dh, dw), output_padding, groups)
    oc, channels = w.shape[0], x.shape[1]
    if w.shape[2:] == (1, 1) and (sh, sw, ph, pw, groups) == (1, 1, 0, 0, 1):
        return _pointwise(ctx, x, weight, w, b, path, reference[0])
    depthwise = groups == channels and channels > 1 and w.shape[1] == 1
    layer = Layer(LayerKind.DEPTHWISE if depthwise else LayerKind.CONV)
    if depthwise:  # [OC, 1, KH, KW] -> [1, KH, KW, OC]
        wid, scheme = ctx.weight(weight, layer, path=path, values=w, layout=lambda a: a.transpose(1, 2, 3, 0), axis=3)
    else:  # [OC, IC/g, KH, KW] -> [OC, KH, KW, IC/g]
        wid, scheme = ctx.weight(weight, layer, path=path, values=w, layout=lambda a: a.transpose(0, 2, 3, 1))
    bid = None if b is None else ctx.constant(b, key=b)
    xin = ctx.in_layout(x, NHWC)
    if scheme.is_quantized:
        xin = ctx.dynamic(xin, num_nonbatch_dims=3)
        ctx.note_quantized(weight, input_layout=reference[0], nonbatch_dims=reference[1])
    if depthwise:
        out = g.depthwise_conv2d(xin, wid, bid, padding=(ph, pw, ph, pw), stride=(sh, sw), dilation=(dh, dw))
    else:
        out = g.conv2d(xin, wid, bid, padding=(ph, pw, ph, pw), stride=(sh, sw), dilation=(dh, dw), groups=groups)
    n, oh, ow, _ = g.value(out).dims
    return ctx.tensor(out, (n, oc, oh, ow), NHWC)


def _pointwise(ctx: LoweringContext, x: Activation, weight: Any, w: np.ndarray, b: np.ndarray | None,
               path: str, input_layout: tuple[int, ...] = NHWC) -> Activation:
    """A 1x1 convolution (stride 1, no padding, one group) is a fully connected layer over the
    channels of each pixel of the NHWC value, so it takes every scheme a linear takes, its
    input quantized per pixel::

        x NHWC [N, H, W, C] --XNNFullyConnected(w [OC, C])--> [N, H, W, OC]
    """
    from .linear import dense

    flat = w.reshape(w.shape[0], w.shape[1])
    nhwc = ctx.relaid(x, NHWC)
    as_rows = Activation(nhwc.id, nhwc.dims, (0, 1, 2, 3))  # the NHWC value read as [N, H, W, C] rows
    out = dense(ctx, as_rows, weight, b, values=flat, path=path, input_layout=input_layout)
    n, h, wd, oc = out.shape
    return ctx.tensor(out.id, (n, oc, h, wd), NHWC)


def _transposed(ctx: LoweringContext, x: Activation, weight: Any, w: np.ndarray, b: np.ndarray | None, path: str,
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                output_padding: tuple[int, int], groups: int) -> Activation:
    """Transposed convolution (XNNConvTranspose2d, target 1.4.1), fp32 filter only."""
    g = ctx.graph
    if "XNNConvTranspose2d" not in g.target.node_kinds:
        raise XnnquantError("transposed convolution needs target '1.4.1' (XNNConvTranspose2d)")
    ic, ocg, kh, kw = w.shape

    def layout(a: np.ndarray) -> np.ndarray:  # [IC, OC/g, KH, KW] -> [OC, KH, KW, IC/g]
        grouped = a.reshape(groups, ic // groups, ocg, kh, kw).transpose(0, 2, 3, 4, 1)
        return grouped.reshape(groups * ocg, kh, kw, ic // groups)

    wid, _ = ctx.weight(weight, Layer(LayerKind.TRANSPOSED), path=path, values=w, layout=layout)
    bid = None if b is None else ctx.constant(b)
    out = g.conv_transpose2d(ctx.in_layout(x, NHWC), wid, bid, padding=(padding[0], padding[1]) * 2,
                             stride=stride, dilation=dilation, groups=groups, adjustment=output_padding)
    n, oh, ow, oc = g.value(out).dims
    return ctx.tensor(out, (n, oc, oh, ow), NHWC)


def _not_training(node: Any) -> str | None:
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    return "batch norm in training mode is not supported: export the module in eval mode" if training else None


@lowers(aten.batch_norm.default, emits=("XNNMultiply", "XNNAdd"), check=_not_training)
def batch_norm_eval(ctx: LoweringContext, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                    training: bool, momentum: float, eps: float, cudnn_enabled: bool = True) -> Activation:
    """``aten::batch_norm`` with ``training=False`` (torch.export's op before decomposition)."""
    return batch_norm(ctx, x, weight, bias, running_mean, running_var, momentum, eps)[0]


@lowers(BATCH_NORM, emits=("XNNMultiply", "XNNAdd"))
def batch_norm(ctx: LoweringContext, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
               momentum: float, eps: float) -> tuple[Activation, None, None]:
    """Eval-mode batch norm: folded into the convolution before it, else ``x * scale + shift``
    per channel (dim 1)."""
    x = ctx.value(x)
    if x.rank < 2:
        raise XnnquantError(f"batch norm needs a channel dim: got an input of shape {x.shape}")
    channels = x.shape[1]
    scale, shift = _batch_norm_affine(ctx, weight, bias, running_mean, running_var, eps, channels)
    per_channel = (channels,) + (1,) * (x.rank - 2)
    g = ctx.graph
    scaled = g.multiply(x.id, ctx.constant_like(scale.astype(np.float32).reshape(per_channel), x))
    return ctx.tensor(g.add(scaled, ctx.constant_like(shift.astype(np.float32).reshape(per_channel), x)),
                      x.shape, x.perm), None, None
