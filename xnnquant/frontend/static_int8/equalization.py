"""Cross-layer equalization of the static int8 rewrite (``StaticInt8(equalize=True)``, the default).

Where a filtered node's output feeds nothing but the next filtered node's input (with at
most a clamp fused between, as ReLU and ReLU6 are; through adds of such values, a residual
stream, and through channel-wise nodes: global average and max pooling, a reshape or slice
keeping the channels whole, a zero padding), the output's channels are divided by factors
``s`` and the next filter's input channels multiplied by them (``W1 / s`` on output channels,
``b1 / s``, ``W2 * s`` on input channels): the per-tensor int8 grid of that activation then
serves its small channels as well as its large ones.  Factors (from each channel's calibrated
magnitude ``a_c`` and the next filter's magnitude ``r_c`` along that input channel, clipped
to ``[1/16, 16]``): a depthwise reader, whose per-channel filter takes any factor without
loss, gets ``s_c = a_c / max(a)`` (every channel spread over the whole range); a fully
connected or regular convolution reader, whose per-output-channel filter grid the factors
change, ``s_c = sqrt(a_c / r_c)`` (SmoothQuant's balance), normalized so that the largest
channel keeps its magnitude.  Only groups through a ReLU or no clamp are equalized, where the
rewrite is exact (``relu(z / s) = relu(z) / s`` for ``s > 0``).  A clamp with an upper bound
(ReLU6) does not commute with the factors: the per-tensor bound 6 would cut channel ``c`` at
``6 s_c`` of its own units, so the group is left as it is.  (Factors held to
``a_c / 6 <= s_c <= 1``, exact up to the calibrated maxima, were tried: on held-out crops
EfficientNet-Lite0's logits fell to 9.3 dB SQNR with them, 22.6 dB without; MobileNetV2, whose
ReLU6 groups they also reached, went from 20.0 to 21.5 dB: measured 2026-12-04.)

Takes the float graph, the nodes that stay fp32 (never equalized), what calibration saw of
each value and the graph's float filters (``FloatFilters``); scales the filters and the
statistics in place and gives the ``Equalized`` values (``equalize``).
"""

from __future__ import annotations

import math

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...graph import Graph
from ...graph.model import Node
from ...graph.rules import DATA_MOVEMENT, WEIGHTED
from .grids import Sets
from .int8_graph import Equalized
from .ranges import ValueStats

F32 = np.float32
#: Equalization factors are clipped to ``[1 / EQUALIZATION_LIMIT, EQUALIZATION_LIMIT]``: MobileNetV2's
#: logits SQNR (96 held-out crops) is flat from 4 to 16 (18.5 dB), lower at 32 (18.3) and 64 (18.1).
EQUALIZATION_LIMIT = 16.0


class FloatFilters:
    """The float filters and biases of a graph's filtered nodes as the rewrite quantizes them:
    the graph's own, float32 in graph layout, read on first use, then scaled by equalization
    (``scale_output``, ``scale_input``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.weights: dict[int, np.ndarray] = {}  # float filter id -> its values (after equalization)
        self.biases: dict[int, np.ndarray] = {}  # node index -> its float bias (after equalization)

    def weight(self, wid: int) -> np.ndarray:
        """The filter of value id ``wid``."""
        if wid not in self.weights:
            self.weights[wid] = self.graph.value(wid).array().astype(F32)
        return self.weights[wid]

    def bias(self, i: int) -> np.ndarray:
        """float32 ``(OC,)``: the bias of node ``i`` (zeros where it has none)."""
        if i not in self.biases:
            n = self.graph.nodes[i]
            w = self.weight(n.inputs[1])
            self.biases[i] = (self.graph.value(n.inputs[2]).array().astype(F32) if len(n.inputs) > 2
                              else np.zeros(w.shape[out_axis(n)], F32))
        return self.biases[i]

    def scale_output(self, i: int, factors: np.ndarray) -> None:
        """Node ``i``'s output channels divided by ``factors``: its filter's and its bias."""
        n = self.graph.nodes[i]
        w = self.weight(n.inputs[1])
        shape = [1] * w.ndim
        shape[out_axis(n)] = -1
        self.weights[n.inputs[1]] = (w / factors.reshape(shape)).astype(F32)
        self.biases[i] = (self.bias(i) / factors).astype(F32)

    def scale_input(self, n: Node, factors: np.ndarray) -> None:
        """Node ``n``'s filter's input channels multiplied by ``factors``."""
        w = self.weight(n.inputs[1])
        if n.kind == "XNNFullyConnected":
            scaled = w * factors[None, :]
        elif n.kind == "XNNDepthwiseConv2d":
            scaled = w * np.repeat(factors, w.shape[3] // factors.size)[None, None, None, :]
        else:
            groups = int(n.params.get("groups", 1))
            oc, kh, kw, cg = w.shape
            scaled = (w.reshape(groups, oc // groups, kh, kw, cg)
                      * factors.reshape(groups, 1, 1, 1, cg)).reshape(w.shape)
        self.weights[n.inputs[1]] = scaled.astype(F32)


def equalize(graph: Graph, refusal: dict[int, str], stats: dict[int, ValueStats], filters: FloatFilters,
             producer: dict[int, Node], readers: dict[int, list[int]]) -> list[Equalized]:
    """Equalize every channel group the module docstring allows, among the nodes not in
    ``refusal`` (node index -> why it stays fp32): ``filters`` and ``stats`` (by value id) are
    scaled in place; returns the equalized values.  ``producer``: value id -> the node writing
    it; ``readers``: value id -> the indices of the nodes reading it."""
    sets = Sets()
    for i, n in enumerate(graph.nodes):
        if (n.kind in ("XNNAdd", "XNNSubtract") or channelwise(graph, n)) and i not in refusal:
            for vid in n.inputs:
                sets.union(vid, n.outputs[0])
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(graph.nodes):
        if i not in refusal and (n.kind in (*WEIGHTED, "XNNAdd", "XNNSubtract") or channelwise(graph, n)):
            groups.setdefault(sets.find(n.outputs[0]), []).append(n.outputs[0])
    equalized: list[Equalized] = []
    for values in groups.values():
        group = set(values)
        members = _equalizable(graph, group, refusal, stats, producer, readers)
        if members is None:
            continue
        producers, consumers = members
        seen = [stats[v] for v in sorted(group) if v in stats]
        factors = _factors(seen, [graph.nodes[j] for j in consumers], filters)
        for i in producers:
            filters.scale_output(i, factors)
        for j in consumers:
            filters.scale_input(graph.nodes[j], factors)
        for v in group:
            if v in stats:
                stats[v] = stats[v].scaled(factors)
        equalized.extend(Equalized(tuple(producers), tuple(consumers), v, factors) for v in sorted(group))
    return equalized


def _equalizable(graph: Graph, group: set[int], refusal: dict[int, str], stats: dict[int, ValueStats],
                 producer: dict[int, Node], readers: dict[int, list[int]]) -> tuple[list[int], list[int]] | None:
    """(filtered producers, filtered readers) of a channel group whose channels can be scaled
    together (module docstring), or None."""
    producers, consumers = [], []
    for v in group:
        n = producer.get(v)
        i = graph.nodes.index(n) if n is not None else -1
        observed = v in stats or (n is not None and n.kind in DATA_MOVEMENT)
        if n is None or i in refusal or graph.value(v).is_output or not observed:
            return None
        if n.kind in WEIGHTED:
            if not _own_filter(n, readers) or not scale_invariant(n):
                return None
            producers.append(i)
        elif any(u not in group for u in n.inputs) or not scale_invariant(n):
            return None  # an add of a value outside the group, or of a constant
        for j in readers.get(v, []):
            r = graph.nodes[j]
            if r.kind in WEIGHTED and r.inputs[0] == v and v not in r.inputs[1:] and _own_filter(r, readers):
                consumers.append(j)
            elif not ((r.kind in ("XNNAdd", "XNNSubtract") or channelwise(graph, r)) and r.outputs[0] in group
                      and j not in refusal):
                return None
    if not consumers or any(j in refusal for j in consumers):
        return None
    return sorted(set(producers)), sorted(set(consumers))


def channelwise(graph: Graph, n: Node) -> bool:
    """Whether ``n`` computes each channel (the last dim) from the same channel alone and
    commutes with a positive scaling of the channels: global average pooling, max pooling, a
    copy, a reshape or slice that keeps the last dim whole, a zero padding."""
    if n.kind in ("XNNGlobalAvgPooling2d", "XNNMaxPooling2d", "XNNCopy"):
        return True
    dims_in, dims_out = graph.value(n.inputs[0]).dims, graph.value(n.outputs[0]).dims
    last_kept = bool(dims_in) and bool(dims_out) and dims_in[-1] == dims_out[-1]
    if n.kind in ("XNNStaticReshape", "XNNStaticSlice"):
        return last_kept
    if n.kind == "XNNStaticConstantPad":
        return last_kept and n.params.get("padding_value", 0.0) == 0.0
    return False


def _own_filter(n: Node, readers: dict[int, list[int]]) -> bool:
    return len(readers.get(n.inputs[1], [])) == 1 and not n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS


def _factors(stats: list[ValueStats], consumers: list[Node], filters: FloatFilters) -> np.ndarray:
    a = np.zeros(0)
    for st in stats:
        assert st.channel_lo is not None and st.channel_hi is not None
        m = np.maximum(np.abs(st.channel_lo), np.abs(st.channel_hi)).astype(np.float64)
        a = m if a.size == 0 else np.maximum(a, m)
    dense = [n for n in consumers if n.kind != "XNNDepthwiseConv2d"]
    if not dense:
        s = a / max(float(a.max()), 1e-30)
    else:
        r = np.max([_by_input_channel(n, filters.weight(n.inputs[1])) for n in dense], axis=0).astype(np.float64)
        balance = np.sqrt(a / np.maximum(r, 1e-30))
        largest = float((a / np.maximum(balance, 1e-30)).max())
        s = balance * largest / max(float(a.max()), 1e-30)
    return np.clip(s, 1 / EQUALIZATION_LIMIT, EQUALIZATION_LIMIT).astype(F32)


def scale_invariant(n: Node) -> bool:
    """Whether ``n``'s output bounds commute with a positive per-channel scaling: none, or a lower
    bound of 0 and no upper one (ReLU); not a finite upper bound (ReLU6: module docstring)."""
    lo, hi = n.output_min, n.output_max
    return (lo is None or lo == 0 or lo == -math.inf) and (hi is None or hi == math.inf)


def out_axis(n: Node) -> int:
    """The output-channel axis of a filtered node's filter (graph layout)."""
    if n.kind == "XNNDepthwiseConv2d":
        return 3
    return 1 if n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else 0


def _by_input_channel(n: Node, w: np.ndarray) -> np.ndarray:
    """``max |w|`` per input channel of a fully connected or regular convolution's filter ``(C,)``."""
    if n.kind == "XNNFullyConnected":
        return np.abs(w).max(axis=0)
    groups = int(n.params.get("groups", 1))
    oc, kh, kw, cg = w.shape
    return np.abs(w.reshape(groups, oc // groups, kh * kw, cg)).max(axis=(1, 2)).reshape(groups * cg)
