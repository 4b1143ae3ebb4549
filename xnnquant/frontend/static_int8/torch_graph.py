"""A float XNNGraph computed by torch, with autograd: what the static int8 stages differentiate.

``forward(graph, inputs, constants)`` computes every value of ``graph`` (fp32 nodes only)
with torch operations, with one extra leading axis for a batch of ``B`` graph inputs:
value ``v`` of dims ``D`` is a tensor ``[B, *D]``, so ``B`` calibration inputs of a graph
made for one run as one torch batch.  Layouts are the graph's (NHWC activations, OHWI
filters, depthwise ``[1, KH, KW, OC]``); a convolution runs as torch's NCHW one between
two permutes::

    x [B, N, H, W, C] -> [B * N, C, H, W] -> conv2d -> [B * N, OC, OH, OW] -> [B, N, OH, OW, OC]

``output_min`` / ``output_max`` clamp where the 1.4.1 runtime applies them
(``interpreter.CLAMPED_KINDS``), as the numpy interpreter does.  ``unsupported(graph)``
names the first node kind without a torch form here (then nothing is differentiated and
the callers fall back, saying so).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...constants import (
    XNN_FLAG_ALIGN_CORNERS,
    XNN_FLAG_TENSORFLOW_LEGACY_MODE,
    XNN_FLAG_TRANSPOSE_B,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
)
from ...graph import Graph
from ...graph.interpreter import CLAMPED_KINDS, bilinear_taps
from ...graph.model import Node
from ...graph.rules import DATA_MOVEMENT
from ...graph.shapes import Window

Op = Callable[[Node, list[Any], Graph], Any]


def _conv(node: Node, args: list[Any], graph: Graph) -> Any:
    import torch.nn.functional as F

    x, w, *bias = args
    dims = graph.value(node.inputs[0]).dims
    window = Window.of_conv(node.params).with_padding_for(node.flags, dims)
    top, right, bottom, left = window.padding
    b, n = x.shape[:2]
    nchw = F.pad(x.reshape(b * n, *dims[1:]).permute(0, 3, 1, 2), (left, right, top, bottom))
    if node.kind == "XNNDepthwiseConv2d":  # [1, KH, KW, OC] -> [OC, 1, KH, KW]
        filters, groups = w.permute(3, 0, 1, 2), dims[3]
    else:  # OHWI -> OIHW
        filters, groups = w.permute(0, 3, 1, 2), node.params["groups"]
    y = F.conv2d(nchw, filters, bias[0] if bias else None, window.stride, 0, window.dilation, groups)
    return y.permute(0, 2, 3, 1).reshape(b, n, *y.shape[2:], y.shape[1])


def _conv_transpose(node: Node, args: list[Any], graph: Graph) -> Any:
    """Filter ``[OC, KH, KW, IC/g]``: torch's transposed convolution with no padding, ``adjustment``
    rows and columns of zeros added at the bottom and right, then the padding cut off each side."""
    import torch.nn.functional as F

    x, w, *bias = args
    dims = graph.value(node.inputs[0]).dims
    p = node.params
    window = Window.of_conv(p)
    top, right, bottom, left = window.padding
    groups = p["groups"]
    oc, kh, kw, icg = w.shape
    b, n = x.shape[:2]
    nchw = x.reshape(b * n, *dims[1:]).permute(0, 3, 1, 2)
    filters = w.reshape(groups, oc // groups, kh, kw, icg).permute(0, 4, 1, 2, 3).reshape(groups * icg, oc // groups,
                                                                                         kh, kw)
    y = F.conv_transpose2d(nchw, filters, None, window.stride, 0, 0, groups, window.dilation)
    y = F.pad(y, (0, p.get("adjustment_width", 0), 0, p.get("adjustment_height", 0)))
    y = y[:, :, top:y.shape[2] - bottom, left:y.shape[3] - right]
    if bias:
        y = y + bias[0][:, None, None]
    return y.permute(0, 2, 3, 1).reshape(b, n, *y.shape[2:], y.shape[1])


def _resize(node: Node, args: list[Any], graph: Graph) -> Any:
    """Bilinear resize of ``[B, N, H, W, C]``, at the positions and weights XNNPACK computes
    (``interpreter.bilinear_taps``)."""
    import torch

    x = args[0]
    align, legacy = bool(node.flags & XNN_FLAG_ALIGN_CORNERS), bool(node.flags & XNN_FLAG_TENSORFLOW_LEGACY_MODE)
    top, bottom, fy = bilinear_taps(x.shape[2], node.params["new_height"], align, legacy)
    left, right, fx = bilinear_taps(x.shape[3], node.params["new_width"], align, legacy)
    wy = torch.from_numpy(fy).to(x.dtype)[:, None, None]
    wx = torch.from_numpy(fx).to(x.dtype)[:, None]
    top, bottom, left, right = (torch.from_numpy(i) for i in (top, bottom, left, right))
    rows = [x[:, :, i] for i in (top, bottom)]
    upper, lower = (r[:, :, :, left] * (1 - wx) + r[:, :, :, right] * wx for r in rows)
    return upper * (1 - wy) + lower * wy


def _batch_matrix_multiply(node: Node, args: list[Any], graph: Graph) -> Any:
    a, b = args
    return a @ (b.transpose(-1, -2) if node.flags & XNN_FLAG_TRANSPOSE_B else b)


def _pool(node: Node, args: list[Any], graph: Graph) -> Any:
    import torch.nn.functional as F

    x = args[0]
    dims = graph.value(node.inputs[0]).dims
    stored = Window.of_pool(node.params)
    window = stored.with_padding_for(node.flags, dims)
    top, right, bottom, left = window.padding
    b, n = x.shape[:2]
    nchw = x.reshape(b * n, *dims[1:]).permute(0, 3, 1, 2)
    if node.kind == "XNNMaxPooling2d":
        padded = F.pad(nchw, (left, right, top, bottom), value=-float("inf"))
        y = F.max_pool2d(padded, window.kernel, window.stride, 0, window.dilation)
    else:  # the mean of the pixels inside the input: padding not counted
        total = F.avg_pool2d(F.pad(nchw, (left, right, top, bottom)), window.kernel, window.stride, 0,
                             divisor_override=1)
        ones = F.pad(nchw.new_ones((1, 1, *nchw.shape[2:])), (left, right, top, bottom))
        y = total / F.avg_pool2d(ones, window.kernel, window.stride, 0, divisor_override=1)
    return y.permute(0, 2, 3, 1).reshape(b, n, *y.shape[2:], y.shape[1])


def _fully_connected(node: Node, args: list[Any], graph: Graph) -> Any:
    x, w, *bias = args
    y = x @ (w if node.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else w.T)
    return y + bias[0] if bias else y


def _slice(node: Node, args: list[Any], graph: Graph) -> Any:
    index = [slice(None)] + [slice(o, o + s) for o, s in zip(node.params["offsets"],
                                                            graph.value(node.outputs[0]).dims)]
    return args[0][tuple(index)]


def _pad(node: Node, args: list[Any], graph: Graph) -> Any:
    import torch.nn.functional as F

    widths: list[int] = []
    for before, after in reversed(list(zip(node.params["pre_paddings"], node.params["post_paddings"]))):
        widths += [before, after]  # torch's order: the last dim first
    return F.pad(args[0], widths, value=node.params["padding_value"])


def _unary(fn: Callable[[Any, Node], Any]) -> Op:
    return lambda node, args, graph: fn(args[0], node)


def _ops() -> dict[str, Op]:
    import torch
    import torch.nn.functional as F

    return {
        "XNNFullyConnected": _fully_connected,
        "XNNConv2d": _conv,
        "XNNDepthwiseConv2d": _conv,
        "XNNConvTranspose2d": _conv_transpose,
        "XNNBatchMatrixMultiply": _batch_matrix_multiply,
        "XNNStaticResizeBilinear2D": _resize,
        "XNNPReLU": lambda n, a, g: torch.where(a[0] > 0, a[0], a[0] * a[1]),
        "XNNMaxPooling2d": _pool,
        "XNNAvgPooling2d": _pool,
        "XNNGlobalAvgPooling2d": lambda n, a, g: a[0].mean(dim=(2, 3), keepdim=True),
        "XNNAdd": lambda n, a, g: a[0] + a[1],
        "XNNSubtract": lambda n, a, g: a[0] - a[1],
        "XNNMultiply": lambda n, a, g: a[0] * a[1],
        "XNNDiv": lambda n, a, g: a[0] / a[1],
        "XNNMinimum": lambda n, a, g: torch.minimum(a[0], a[1]),
        "XNNMaximum": lambda n, a, g: torch.maximum(a[0], a[1]),
        "XNNClamp": _unary(lambda x, n: x),
        "XNNCopy": _unary(lambda x, n: x),
        "XNNHardswish": _unary(lambda x, n: F.hardswish(x)),
        "XNNSigmoid": _unary(lambda x, n: torch.sigmoid(x)),
        "XNNTanh": _unary(lambda x, n: torch.tanh(x)),
        "XNNELU": _unary(lambda x, n: F.elu(x, n.params["alpha"])),
        "XNNLeakyReLU": _unary(lambda x, n: F.leaky_relu(x, n.params["negative_slope"])),
        "XNNGelu": _unary(lambda x, n: F.gelu(x)),
        "XNNSoftmax": _unary(lambda x, n: torch.softmax(x, -1)),
        "XNNAbs": _unary(lambda x, n: x.abs()),
        "XNNNegate": _unary(lambda x, n: -x),
        "XNNSquare": _unary(lambda x, n: x * x),
        "XNNSquareRoot": _unary(lambda x, n: torch.sqrt(x)),
        "XNNReciprocalSquareRoot": _unary(lambda x, n: torch.rsqrt(x)),
        "XNNExp": _unary(lambda x, n: torch.exp(x)),
        "XNNLog": _unary(lambda x, n: torch.log(x)),
        "XNNSin": _unary(lambda x, n: torch.sin(x)),
        "XNNCos": _unary(lambda x, n: torch.cos(x)),
        "XNNFloor": _unary(lambda x, n: torch.floor(x)),
        "XNNCeiling": _unary(lambda x, n: torch.ceil(x)),
        "XNNStaticReshape": lambda n, a, g: a[0].reshape(a[0].shape[0], *g.value(n.outputs[0]).dims),
        "XNNStaticTranspose": lambda n, a, g: a[0].permute(0, *(p + 1 for p in n.params["perm"])),
        "XNNStaticSlice": _slice,
        "XNNStaticConstantPad": _pad,
        **{f"XNNConcatenate{k}": (lambda n, a, g: torch.cat(a, dim=n.params["axis"] + 1)) for k in range(2, 6)},
    }


def unsupported(graph: Graph) -> str | None:
    """The first node kind of ``graph`` that ``forward`` cannot compute (or that is not fp32), or None."""
    from ...datatypes import Datatype

    ops = _ops()
    for node in graph.nodes:
        if node.kind not in ops:
            return node.kind
        if any(graph.value(v).datatype is not Datatype.fp32 for v in (*node.inputs, *node.outputs)):
            return f"{node.kind} on a non-fp32 value"
    return None


def constants(graph: Graph) -> dict[int, Any]:
    """Every fp32 constant of ``graph`` as a torch tensor, by value id."""
    import torch

    return {v.id: torch.from_numpy(np.ascontiguousarray(v.array(), np.float32)) for v in graph.values
            if v.is_constant}


def forward(graph: Graph, inputs: Sequence[Any], consts: dict[int, Any],
            on_value: Callable[[int, Any], Any] | None = None) -> dict[int, Any]:
    """Every value ``graph`` computes, by id, as float32 torch tensors ``[B, *dims]``.

    ``inputs``: one float32 tensor ``[B, *dims]`` per graph input; ``consts``: ``constants(graph)``.
    ``on_value(vid, tensor)``, when given, sees each computed value and returns the tensor that
    the graph's readers get (the same, or one that taps it)."""
    ops = _ops()
    env: dict[int, Any] = dict(zip(graph.inputs, inputs))
    batch = inputs[0].shape[0] if len(inputs) else 1
    for node in graph.nodes:
        if node.kind in DATA_MOVEMENT:  # a constant moved (ViT's class token concatenated): one per input
            args = [env[v] if v in env else consts[v].expand(batch, *consts[v].shape) for v in node.inputs]
        else:  # filters, biases, and operands that broadcast over the leading axis as they are
            args = [env[v] if v in env else consts[v] for v in node.inputs]
        y = ops[node.kind](node, args, graph)
        if node.kind in CLAMPED_KINDS and node.output_min is not None:
            y = y.clamp(node.output_min, node.output_max)
        dims = graph.value(node.outputs[0]).dims
        if tuple(y.shape[1:]) != tuple(dims):
            y = y.reshape(y.shape[0], *dims)  # fully connected and global pooling: the stored dims
        env[node.outputs[0]] = y if on_value is None else on_value(node.outputs[0], y)
    return env
