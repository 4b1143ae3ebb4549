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
value of the graph (scales, zero points, filters) as it is, so it needs one pass of the
int8 graph over the calibration batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...graph import int8
from ...graph.shapes import Window, windows
from ...schemes import quantize_bias
from .observe import Exposed
from .rewrite import Int8Graph, QuantizedLayer


def _tap_means(layer: QuantizedLayer, graph: Int8Graph, codes: np.ndarray) -> np.ndarray:
    """float64 ``[KH, KW, C]`` (convolutions) or ``[K]`` (fully connected) input means of one batch."""
    node = graph.graph.nodes[layer.node]
    x = int8.dequantize(codes, *int8.quant(graph.graph.value(layer.input_id))).astype(np.float64)
    if node.kind == "XNNFullyConnected":
        return x.reshape(-1, x.shape[-1]).mean(axis=0)
    window = Window.of_conv(node.params).with_padding_for(node.flags, x.shape)
    return windows(x, window, 0.0, node.kind).mean(axis=(0, 1, 2))


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


def correct_biases(graph: Int8Graph, batches: Sequence[Sequence[np.ndarray]]) -> None:
    """Re-quantize every int8 layer's bias of ``graph`` from ``b + delta`` (module docstring);
    ``batches``: the calibration inputs as the graph takes them."""
    if not graph.layers:
        return
    g = graph.graph
    exposed = Exposed(g, sorted({layer.input_id for layer in graph.layers
                                 if not g.value(layer.input_id).is_input}))
    sums: list[np.ndarray] = []
    for b, batch in enumerate(batches):
        values = exposed.run(batch)
        for k, layer in enumerate(graph.layers):
            m = _tap_means(layer, graph, values[layer.input_id])
            if b == 0:
                sums.append(m)
            else:
                sums[k] += m
    for k, layer in enumerate(graph.layers):
        node = g.nodes[layer.node]
        means = sums[k] / len(batches)
        delta = _delta(layer, node.kind, node.flags, means, int(node.params.get("groups", 1)))
        corrected = (layer.bias.astype(np.float64) + delta).astype(np.float32)
        g.value(layer.bias_id).constant = quantize_bias(corrected, layer.input_scale, layer.stored.scale).to_bytes()
