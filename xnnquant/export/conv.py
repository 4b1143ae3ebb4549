"""Convolutions (regular, grouped, depthwise, transposed) and batch normalization.

Layouts.  XNNPACK convolves NHWC activations with OHWI filters; torch holds NCHW
activations and OIHW filters.  The input goes to NHWC through ``Lowerer.in_layout`` (a
transpose only where the producer was not NHWC already) and the output stays NHWC
(``perm = NHWC``).  Filters are rearranged once, as constants::

    regular / grouped  torch [OC, IC/g, KH, KW] --(0, 2, 3, 1)--> [OC, KH, KW, IC/g]
    depthwise          torch [OC, 1, KH, KW]    --(1, 2, 3, 0)--> [1, KH, KW, OC]
    transposed         torch [IC, OC/g, KH, KW] --per group (1, 2, 3, 0)--> [OC, KH, KW, IC/g]

torch's symmetric ``padding=(ph, pw)`` is XNNPACK's (top, right, bottom, left) =
(ph, pw, ph, pw).  A 1x1 convolution (stride 1, no padding, one group) is lowered as a
fully connected layer over each pixel's channels (``_pointwise``).

Weights.  What XNNPACK 1.4.1 computes (measured, tests/test_graph_conv_dynamic.py):
``qc8w`` gives a regular or grouped convolution a qcint8 filter and an input converted
to qdint8 *per image* (``num_nonbatch_dims=3``; per pixel is computed wrongly).  There is
no 4-bit convolution and no dynamically quantized depthwise or transposed convolution:
those layers are refused under a quantized scheme unless ``fallback=`` fits them.  1x1
convolutions, being fully connected layers, take every scheme (input quantized per pixel).

Batch norm.  An eval-mode batch norm right after a convolution (its only user) is folded
into the convolution's filter and bias before quantization:
``w' = w * s``, ``b' = (b - mean) * s + beta`` with ``s = gamma / sqrt(var + eps)``,
computed in float64.  Elsewhere it is a multiply-add with per-channel constants.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import XnnquantError
from .lowering import NHWC, Lowerer, Tensor, pair
from .options import WeightScheme
from .quantize import conv_refusal
from .registry import lowers

aten = torch.ops.aten

CONV_OPS = (aten.convolution.default, aten.conv2d.default)
BATCH_NORM = aten._native_batch_norm_legit_no_training.default
CONV_KINDS = ("XNNConv2d", "XNNDepthwiseConv2d", "XNNConvTranspose2d", "XNNFullyConnected", "XNNConvert",
              "XNNStaticTranspose",
              "XNNStaticReshape")


def plan_batch_norm_folding(ctx: Lowerer, graph: Any) -> None:
    """Find each batch norm whose input is a convolution used by nothing else."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is BATCH_NORM:
            source = node.args[0]
            if getattr(source, "target", None) in CONV_OPS and len(source.users) == 1:
                ctx.folded_batch_norms[source] = node


def _batch_norm_affine(ctx: Lowerer, weight: Any, bias: Any, mean: Any, var: Any, eps: float,
                       channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (scale, shift) in float64: ``y = x * scale + shift``."""
    def arr(x: Any, default: float) -> np.ndarray:
        if x is None:
            return np.full(channels, default)
        if isinstance(x, Tensor):
            raise XnnquantError("batch norm with computed statistics or affine parameters is not supported")
        return ctx.constant_array(x, "batch norm parameter").astype(np.float64).reshape(channels)

    scale = arr(weight, 1.0) / np.sqrt(arr(var, 1.0) + float(eps))
    return scale, arr(bias, 0.0) - arr(mean, 0.0) * scale



@lowers(aten.conv2d.default, emits=CONV_KINDS)
def conv2d(ctx: Lowerer, x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """``aten::conv2d(input, weight, bias?, stride, padding, dilation, groups)``."""
    if isinstance(padding, str):
        raise XnnquantError(f"conv2d padding={padding!r} is not supported here: expected explicit padding")
    return convolution(ctx, x, weight, bias, stride, padding, dilation, False, (0, 0), groups)


@lowers(aten.convolution.default, emits=CONV_KINDS)
def convolution(ctx: Lowerer, x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any,
                transposed: bool, output_padding: Any, groups: int) -> Tensor:
    """``aten::convolution``: 2-D only (4-D input), constant filter."""
    x = ctx.value(x)
    if x.rank != 4:
        raise XnnquantError(f"only 2-D convolutions are supported: got an input of shape {x.shape}")
    if isinstance(weight, Tensor) or (bias is not None and isinstance(bias, Tensor)):
        raise XnnquantError("convolution with a computed filter or bias is not supported: expected constants")
    w = ctx.constant_array(weight, "convolution weight").astype(np.float64)
    b = None if bias is None else ctx.constant_array(bias, "convolution bias").astype(np.float64)
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    g = ctx.graph
    path = ctx.weight_path(weight)
    groups = int(groups)
    # output channels: [OC, IC/g, KH, KW] filters hold them on axis 0; transposed ones,
    # [IC, OC/g, KH, KW], on axis 1 of each group
    oc = w.shape[1] * groups if transposed else w.shape[0]
    batch_norm = ctx.folded_batch_norms.get(ctx.node)
    if batch_norm is not None:
        _, bn_w, bn_b, mean, var, _momentum, eps = batch_norm.args
        scale, shift = _batch_norm_affine(ctx, ctx.env[bn_w] if bn_w is not None else None,
                                          ctx.env[bn_b] if bn_b is not None else None, ctx.env[mean],
                                          ctx.env[var], eps, oc)
        if transposed:
            ic, ocg = w.shape[:2]
            w = (w.reshape(groups, ic // groups, ocg, *w.shape[2:])
                 * scale.reshape(groups, 1, ocg, 1, 1)).reshape(w.shape)
        else:
            w = w * scale[:, None, None, None]
        b = (np.zeros(oc) if b is None else b) * scale + shift
    if transposed:
        return _transposed(ctx, x, w, b, path, (sh, sw), (ph, pw), (dh, dw), pair(output_padding), groups)
    channels = x.shape[1]
    if w.shape[2:] == (1, 1) and (sh, sw, ph, pw, groups) == (1, 1, 0, 0, 1):
        return _pointwise(ctx, x, w, b, path)
    depthwise = groups == channels and channels > 1 and w.shape[1] == 1

    def refusal(scheme: WeightScheme) -> str | None:
        return conv_refusal(scheme, depthwise)

    scheme, note = ctx.weight_scheme(path, refusal)
    if depthwise:
        wid = ctx.quantized_weight(w.astype(np.float32), path, scheme, note, layout=lambda a: a.transpose(1, 2, 3, 0),
                                   axis=3)
    else:
        wid = ctx.quantized_weight(w.astype(np.float32), path, scheme, note, layout=lambda a: a.transpose(0, 2, 3, 1))
    bid = None if b is None else ctx.constant(b.astype(np.float32))
    xin = ctx.in_layout(x, NHWC)
    if scheme.is_quantized:
        xin = ctx.dynamic(xin, num_nonbatch_dims=3)
    if depthwise:
        out = g.depthwise_conv2d(xin, wid, bid, padding=(ph, pw, ph, pw), stride=(sh, sw), dilation=(dh, dw))
    else:
        out = g.conv2d(xin, wid, bid, padding=(ph, pw, ph, pw), stride=(sh, sw), dilation=(dh, dw),
                       groups=groups)
    n, oh, ow, _ = g.value(out).dims
    return ctx.tensor(out, (n, oc, oh, ow), NHWC)


def _pointwise(ctx: Lowerer, x: Tensor, w: np.ndarray, b: np.ndarray | None, path: str) -> Tensor:
    """A 1x1 convolution (stride 1, no padding, one group) is a fully connected layer over the
    channels of each pixel of the NHWC value, so it takes every scheme a linear takes, its
    input quantized per pixel::

        x NHWC [N, H, W, C] --XNNFullyConnected(w [OC, C])--> [N, H, W, OC]
    """
    from .linear import dense

    flat = w.reshape(w.shape[0], w.shape[1]).astype(np.float32)
    ctx.origins[id(flat)] = path + ".weight"
    nhwc = ctx.relaid(x, NHWC)
    as_rows = Tensor(nhwc.id, nhwc.dims, (0, 1, 2, 3))  # the NHWC value read as [N, H, W, C] rows
    out = dense(ctx, as_rows, flat, None if b is None else b.astype(np.float32))
    n, h, wd, oc = out.shape
    return ctx.tensor(out.id, (n, oc, h, wd), NHWC)


def _transposed(ctx: Lowerer, x: Tensor, w: np.ndarray, b: np.ndarray | None, path: str,
                stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                output_padding: tuple[int, int], groups: int) -> Tensor:
    """Transposed convolution (XNNConvTranspose2d, target 1.4.1), fp32 filter only."""
    g = ctx.graph
    if "XNNConvTranspose2d" not in g.target.node_kinds:
        raise XnnquantError("transposed convolution needs target '1.4.1' (XNNConvTranspose2d)")

    def refusal(scheme: WeightScheme) -> str | None:
        return "XNNPACK's quantized transposed convolution was not measured correct" if scheme.is_quantized else None

    scheme, note = ctx.weight_scheme(path, refusal)
    ic, ocg, kh, kw = w.shape

    def layout(a: np.ndarray) -> np.ndarray:  # [IC, OC/g, KH, KW] -> [OC, KH, KW, IC/g]
        grouped = a.reshape(groups, ic // groups, ocg, kh, kw).transpose(0, 2, 3, 4, 1)
        return grouped.reshape(groups * ocg, kh, kw, ic // groups)

    wid = ctx.quantized_weight(w.astype(np.float32), path, scheme, note, layout=layout)
    bid = None if b is None else ctx.constant(b.astype(np.float32))
    out = g.conv_transpose2d(ctx.in_layout(x, NHWC), wid, bid, padding=(padding[0], padding[1]) * 2,
                             stride=stride, dilation=dilation, groups=groups, adjustment=output_padding)
    n, oh, ow, oc = g.value(out).dims
    return ctx.tensor(out, (n, oc, oh, ow), NHWC)


@lowers(BATCH_NORM, emits=("XNNMultiply", "XNNAdd"))
def batch_norm(ctx: Lowerer, x: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
               momentum: float, eps: float) -> tuple[Tensor, None, None]:
    """Eval-mode batch norm: folded into the convolution before it, else ``x * scale + shift``
    per channel (dim 1)."""
    x = ctx.value(x)
    if ctx.node in ctx.folded_batch_norms.values():
        return x, None, None
    if x.rank < 2:
        raise XnnquantError(f"batch norm needs a channel dim: got an input of shape {x.shape}")
    channels = x.shape[1]
    scale, shift = _batch_norm_affine(ctx, weight, bias, running_mean, running_var, eps, channels)
    per_channel = (channels,) + (1,) * (x.rank - 2)
    g = ctx.graph
    scaled = g.multiply(x.id, ctx.constant_like(scale.astype(np.float32).reshape(per_channel), x))
    return ctx.tensor(g.add(scaled, ctx.constant_like(shift.astype(np.float32).reshape(per_channel), x)),
                      x.shape, x.perm), None, None
