"""Bias correction: each int8 layer's bias absorbs the mean shift its quantized filter causes.

A layer computes ``y = W x + b``; stored, ``W`` becomes ``Wq`` and the layer computes
``Wq x + b``, whose mean over the calibration inputs differs from the float layer's by
``(W - Wq) E[x]`` per output channel: small per weight, but summed over a channel's
taps it is a systematic shift that every following layer inherits.  Here ``E[x]`` is
taken where the int8 graph feeds the layer (the real XNNPACK's codes on the calibration
batches, dequantized), per tap of the window::

    conv2d     W [OC, KH, KW, Cg], groups G:    delta[o] = sum_ijc (W - Wq)[o, i, j, c] m[i, j, g(o) * Cg + c]
    depthwise  W [1, KH, KW, OC], multiplier M: delta[o] = sum_ij (W - Wq)[0, i, j, o] m[i, j, o // M]
    fully      W [N, K]:                        delta    = (W - Wq) m
    connected

``m[i, j, c]`` is the mean over images and output positions of input channel ``c`` at tap
``(i, j)`` of the window (zero where the window reads padding, as XNNPACK reads the zero
point there), ``m[k]`` the mean of input feature ``k`` over rows.  The bias is then
quantized again from ``b + delta`` (float64 sums).  The correction leaves every other
value of the graph (scales, zero points, filters) as it is.  The int8 graph's own input
means would differ from the float ones only by what upstream quantization shifts, a
second-order change of ``delta``; the float ones cost no second pass over the batches.
"""

from __future__ import annotations

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...graph.model import Node
from ...graph.shapes import Window
from ...schemes import quantize_bias
from .rewrite import Int8Graph, QuantizedLayer


def tap_means(node: Node, x: np.ndarray) -> np.ndarray:
    """float64 ``[KH, KW, C]`` (convolutions) or ``[K]`` (fully connected): the sum over the images
    of ``x`` (float, NHWC or ``[..., K]``) of the per-tap input means of filtered node ``node``
    (module docstring)."""
    x = np.asarray(x, np.float64)
    if node.kind == "XNNFullyConnected":
        rows = x.reshape(-1, x.shape[-1])
        return rows.mean(axis=0) * (x.shape[0] if x.ndim > 2 else 1)
    window = Window.of_conv(node.params).with_padding_for(node.flags, x.shape)
    top, right, bottom, left = window.padding
    oh, ow = window.output_hw(node.kind, x.shape)
    padded = np.pad(x.sum(axis=0), ((top, bottom), (left, right), (0, 0)))  # images summed: the means are linear
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    means = np.empty((kh, kw, x.shape[3]))
    for i in range(kh):
        for j in range(kw):  # tap (i, j) reads padded rows i*dh + oy*sh, columns j*dw + ox*sw
            tap = padded[i * dh: i * dh + (oh - 1) * sh + 1: sh, j * dw: j * dw + (ow - 1) * sw + 1: sw]
            means[i, j] = tap.sum(axis=(0, 1)) / (oh * ow)
    return means


def _delta(layer: QuantizedLayer, kind: str, flags: int, means: np.ndarray, groups: int) -> np.ndarray:
    """float64 ``(OC,)``: the mean shift ``(W - Wq) m`` of one layer (module docstring)."""
    error = layer.weights.astype(np.float64) - layer.stored.dequantize().astype(np.float64)
    if kind == "XNNFullyConnected":
        return (error.T if flags & XNN_FLAG_TRANSPOSE_WEIGHTS else error) @ means
    if kind == "XNNDepthwiseConv2d":
        oc, c = error.shape[3], means.shape[2]
        return np.einsum("ijo,ijo->o", error[0], np.repeat(means, oc // c, axis=2))
    oc, kh, kw, cg = error.shape
    per_group = np.einsum("oijc,ijgc->og", error, means.reshape(kh, kw, groups, cg))
    return per_group[np.arange(oc), np.arange(oc) // (oc // groups)]


def correct_biases(graph: Int8Graph, means: dict[int, np.ndarray]) -> None:
    """Re-quantize every int8 layer's bias of ``graph`` from ``b + delta`` (module docstring);
    ``means``: float-graph node index -> the float input's per-tap means (``tap_means``, averaged
    over the calibration batches), before equalization."""
    g = graph.graph
    factors = {e.value: e.factors for e in graph.equalized}
    for layer in graph.layers:
        node = g.nodes[layer.node]
        if layer.source not in means:
            continue
        m = means[layer.source]
        if layer.input_source in factors:  # the layer reads its input divided by these
            m = m / factors[layer.input_source].astype(np.float64)
        layer.means = m
        g.value(layer.bias_id).constant = quantize_bias(corrected_bias(layer, node), layer.input_scale,
                                                        layer.stored.scale).to_bytes()


def corrected_bias(layer: QuantizedLayer, node: Node) -> np.ndarray:
    """float32 ``(OC,)``: the layer's float bias plus its mean shift ``delta`` (module docstring;
    the float bias when ``layer.means`` is None)."""
    if layer.means is None:
        return layer.bias
    delta = _delta(layer, node.kind, node.flags, layer.means, int(node.params.get("groups", 1)))
    return (layer.bias.astype(np.float64) + delta).astype(np.float32)
