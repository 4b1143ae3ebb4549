"""Learned rounding (``StaticInt8(rounding="learned")``): each filter code rounded up or down for the
layer's output on calibration inputs, not to the nearest.

For one output channel, filter row ``w`` ``(K,)`` with scale ``s`` and the Gram matrix
``H = sum x x^T`` of the layer's input rows ``x`` (im2col windows, ``(kh, kw, c)`` with ``c``
fastest, as the filter is laid out), the layer output's squared error over the calibration
inputs is ``(w - s q)^T H (w - s q)``.  As AdaRound does, each code ``q_k`` may only be
``floor(w_k / s)`` or ``ceil(w_k / s)``; the choice is made column by column with the error fed
forward (GPTQ's order of operations, each code boxed in ``[floor, ceil]`` of the original
``w_k / s``): quantizing column ``j`` leaves ``e = w_j - s q_j``,
and the columns not yet quantized take the least-squares correction ``w_F -= e H^-1_jF /
H^-1_jj`` (rows of the upper Cholesky factor ``U`` of ``H^-1``), then are rounded within their
own box.  Rows are independent; a depthwise filter has one ``H`` per channel (its window, ``KH *
KW`` taps).  ``H`` is dampened by 1 % of its mean diagonal.

The Grams are those of the float graph's inputs (``layer_grams``: torch on ``IMAGES`` of the
calibration inputs), equalized as the layer reads them.  Every code stays within one step of
``w / s`` (the self-check holds it to that, ``check.check_layers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...graph import Graph
from ...graph.model import Node
from ...graph.shapes import Window
from ...schemes.gptq import inverse_cholesky
from . import torch_graph
from .sensitivity import IMAGES, spread

DAMP = 0.01
QMIN, QMAX = -127, 127


def _rows(node: Node, x: Any, dims: tuple[int, ...]) -> Any:
    """The input rows of filtered ``node`` from its input ``x`` ``[B, *dims]`` (torch): fully
    connected ``[L, K]``; convolution ``[L, KH * KW * C]``; depthwise ``[C, L, KH * KW]``."""
    import torch.nn.functional as F

    if node.kind == "XNNFullyConnected":
        return x.reshape(-1, x.shape[-1])
    window = Window.of_conv(node.params).with_padding_for(node.flags, dims)
    top, right, bottom, left = window.padding
    nchw = F.pad(x.reshape(-1, *dims[1:]).permute(0, 3, 1, 2), (left, right, top, bottom))
    taps = F.unfold(nchw, window.kernel, dilation=window.dilation, stride=window.stride)  # [N, C * KH * KW, L]
    n, _, length = taps.shape
    c, k = dims[3], window.kernel[0] * window.kernel[1]
    taps = taps.reshape(n, c, k, length)
    if node.kind == "XNNDepthwiseConv2d":
        return taps.permute(1, 0, 3, 2).reshape(c, n * length, k)
    return taps.permute(0, 3, 2, 1).reshape(n * length, k * c)


def layer_grams(graph: Graph, batches: Sequence[Sequence[np.ndarray]], nodes: Sequence[int]) -> dict[int, np.ndarray]:
    """float64 Gram matrices of the inputs of filtered ``nodes`` (indices): ``(K, K)``, or ``(C, K, K)``
    for a depthwise node; over ``IMAGES`` of ``batches`` (module docstring)."""
    import torch

    wanted = {i: graph.nodes[i] for i in nodes}
    by_input: dict[int, list[int]] = {}
    for i, n in wanted.items():
        by_input.setdefault(n.inputs[0], []).append(i)
    grams: dict[int, np.ndarray] = {}
    consts = torch_graph.constants(graph)
    chosen = [batches[i] for i in spread(IMAGES, len(batches))]
    with torch.no_grad():
        for start in range(0, len(chosen), 4):
            chunk = chosen[start:start + 4]
            inputs = [torch.from_numpy(np.stack([np.asarray(b[k], np.float32) for b in chunk]))
                      for k in range(len(graph.inputs))]
            env = torch_graph.forward(graph, inputs, consts)
            for vid, readers in by_input.items():
                for i in readers:
                    rows = _rows(wanted[i], env[vid], graph.value(vid).dims)
                    gram = rows.transpose(-1, -2) @ rows
                    grams[i] = grams.get(i, 0) + gram.double().numpy()
    return grams


def _inverse_factor(gram: np.ndarray) -> np.ndarray:
    """Upper triangular ``U`` with ``inverse(H) = U^T U`` for ``H`` = ``gram`` ``(K, K)``, or each of
    ``(C, K, K)``, dampened by ``DAMP`` of its mean diagonal (``gptq.inverse_cholesky``: more where
    float64 finds it not positive definite)."""
    if gram.ndim == 2:
        return inverse_cholesky(gram, DAMP)[0]
    return np.stack([inverse_cholesky(g, DAMP)[0] for g in gram])


def learned_codes(w: np.ndarray, scales: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """int8 codes of ``w`` ``[C, K]`` (float) with per-row ``scales`` ``(C,)``, each ``floor(w / s)`` or
    one more, chosen for ``gram`` ``(K, K)`` or per row ``(C, K, K)`` (module docstring).  With one
    ``gram``, columns go by decreasing input energy (``diag(H)``): the columns whose errors matter
    most are rounded while the most columns remain to absorb their errors."""
    c, k = w.shape
    order = np.argsort(-np.diag(gram), kind="stable") if gram.ndim == 2 else np.arange(k)
    gram = gram[..., order[:, None], order[None, :]]
    upper = _inverse_factor(gram)
    x = np.asarray(w, np.float64)[:, order]
    s = np.asarray(scales, np.float64)
    low = np.clip(np.floor(x / s[:, None]), QMIN, QMAX)
    high = np.clip(np.ceil(x / s[:, None]), QMIN, QMAX)
    codes = np.empty((c, k))
    for j in range(k):
        q = np.clip(np.rint(x[:, j] / s), low[:, j], high[:, j])
        codes[:, j] = q
        pivot = upper[..., j, j]
        rest = upper[..., j, j + 1:]
        error = (x[:, j] - q * s) / pivot
        x[:, j + 1:] -= error[:, None] * (rest if rest.ndim == 2 else rest[None, :])
    out = np.empty_like(codes)
    out[:, order] = codes
    return out.astype(np.int8)


def learned_filter(node: Node, w: np.ndarray, scales: np.ndarray, gram: np.ndarray,
                   factors: np.ndarray | None) -> np.ndarray:
    """int8 codes of filter ``w`` (graph layout, equalized) of ``node``, its input Gram ``gram`` taken
    on the un-equalized input and ``factors`` (the input's equalization, or None) applied."""
    if node.kind == "XNNDepthwiseConv2d":
        _, kh, kw, oc = w.shape
        per = np.repeat(gram, oc // gram.shape[0], axis=0)  # output channel o reads input o // M
        if factors is not None:
            f = np.repeat(factors.astype(np.float64), oc // factors.size)
            per = per / (f[:, None, None] ** 2)
        return learned_codes(w.reshape(kh * kw, oc).T, scales, per).T.reshape(w.shape)
    if factors is not None:
        f = factors.astype(np.float64)
        if node.kind != "XNNFullyConnected":
            f = np.tile(f, w.shape[1] * w.shape[2])  # (kh, kw, c) with c fastest
        gram = gram / np.outer(f, f)
    if node.kind == "XNNFullyConnected" and node.flags & XNN_FLAG_TRANSPOSE_WEIGHTS:
        return learned_codes(w.T, scales, gram).T
    return learned_codes(w.reshape(w.shape[0], -1), scales, gram).reshape(w.shape)
