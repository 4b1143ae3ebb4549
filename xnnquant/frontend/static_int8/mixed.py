"""Mixed precision: the few nodes whose int8 grids cost the outputs most stay fp32, within a time budget.

A value stops being quantized only when the node computing it and every node reading it
compute in fp32 (a reader in int8 would convert it to qint8 again).  So the unit bought is
a group of values sharing a grid (``Rewrite.members``), and its price is its computing
producers and readers (``nodes_of``); what it buys is the group's cost at its chosen grid
(``sensitivity.WeightedHistogram.cost``: the first-order squared error of the outputs per
input, measured on calibration inputs), plus that of any other group the same fp32 nodes
free.  Greedily, the group of most cost bought per unit of estimated time is taken while
the program's estimated time stays within ``(1 + budget)`` times the all-int8 program's.

Estimated time (``estimate``), in multiply-accumulates of fp32 (ratios from XNNPACK's
programs on x86, one thread: a network of 3x3 convolutions runs in int8 in 0.31 of its fp32
time, MobileNetV2 in 0.51, its depthwise layers being bound by memory)::

    convolution, fully connected      MACs       x 1 (fp32)  or INT8_MAC[kind] (int8)
    any other computing or moving     elements   x F32_ELEMENT or INT8_ELEMENT
    convert fp32 <-> qint8            elements   x CONVERT_ELEMENT

The estimate decides; it is a model, not a measurement: ``benchmarks/static_int8.py``
measures what the chosen programs take.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...graph import Graph
from ...graph.model import Node
from ...graph.rules import DATA_MOVEMENT
from ...graph.shapes import Window
from .sensitivity import Sensitivity

INT8_MAC = {"XNNConv2d": 0.3, "XNNFullyConnected": 0.35, "XNNDepthwiseConv2d": 0.6}
F32_ELEMENT = 4.0
INT8_ELEMENT = 1.0
CONVERT_ELEMENT = 4.0


@dataclass(frozen=True)
class Kept:
    """One step of the choice: the float-graph nodes (indices) it made fp32, the groups of values
    it freed (by root), what their grids cost the outputs (``cost``, per input; ``db``: the
    outputs' SQNR that cost alone would leave) and the estimated time it added, as a fraction of
    the all-int8 program's (``time``)."""

    nodes: tuple[int, ...]
    groups: tuple[int, ...]
    cost: float
    db: float
    time: float


def macs(node: Node, graph: Graph) -> int:
    """Multiply-accumulates of a convolution or fully connected node, else 0."""
    out = graph.value(node.outputs[0]).dims
    if node.kind == "XNNFullyConnected":
        w = graph.value(node.inputs[1]).dims
        return math.prod(out) * (w[0] if out[-1] == w[1] else w[1])
    if node.kind in ("XNNConv2d", "XNNDepthwiseConv2d"):
        window = Window.of_conv(node.params)
        taps = window.kernel[0] * window.kernel[1]
        per_output = taps if node.kind == "XNNDepthwiseConv2d" else taps * graph.value(node.inputs[1]).dims[3]
        return math.prod(out) * per_output
    return 0


def estimate(graph: Graph, floats: set[int]) -> float:
    """The estimated time of ``graph`` with the nodes ``floats`` (indices) in fp32 and every other
    in int8, data movement following its input (module docstring)."""
    producer = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    domain: dict[int, bool] = dict.fromkeys(graph.inputs, True)  # value -> held in fp32
    total = 0.0
    converted: set[tuple[int, bool]] = set()
    for i, node in enumerate(graph.nodes):
        moving = node.kind in DATA_MOVEMENT
        in_float = domain.get(node.inputs[0], True) if moving else i in floats
        for v in node.inputs:
            if not graph.value(v).is_constant and domain.get(v, True) != in_float and (v, in_float) not in converted:
                converted.add((v, in_float))
                total += CONVERT_ELEMENT * math.prod(graph.value(v).dims)
        work = macs(node, graph)
        if work:
            total += work * (1.0 if in_float else INT8_MAC[node.kind])
        else:
            total += math.prod(graph.value(node.outputs[0]).dims) * (F32_ELEMENT if in_float else INT8_ELEMENT)
        for v in node.outputs:
            domain[v] = in_float
    for v in graph.outputs:
        if not domain.get(v, True) and v in producer:
            total += CONVERT_ELEMENT * math.prod(graph.value(v).dims)
    return total


def nodes_of(graph: Graph, members: Sequence[int]) -> set[int]:
    """The computing nodes (indices) that write or read any of ``members``."""
    wanted = set(members)
    return {i for i, n in enumerate(graph.nodes) if n.kind not in DATA_MOVEMENT
            and (wanted & set(n.outputs) or wanted & set(n.inputs))}


def choose(graph: Graph, groups: dict[int, list[int]], costs: dict[int, float], refused: set[int],
           budget: float, sensitivity: Sensitivity) -> list[Kept]:
    """The greedy choice of the module docstring: the steps taken, in order.

    ``groups``: root -> member value ids; ``costs``: root -> the cost of its grid (per input);
    ``refused``: nodes already fp32 (no int8 form)."""
    price = {root: nodes_of(graph, vids) - refused for root, vids in groups.items() if root in costs}
    base = estimate(graph, refused)
    limit = (1 + budget) * base
    floats = set(refused)
    free = {root for root, nodes in price.items() if not nodes}
    now = base
    steps: list[Kept] = []
    while True:
        best: tuple[float, int, set[int], float, set[int]] | None = None
        for root, nodes in price.items():
            if root in free:
                continue
            trial = floats | nodes
            time = estimate(graph, trial)
            if time > limit:
                continue
            freed = {r for r, ns in price.items() if r not in free and ns <= trial}
            gain = sum(costs[r] for r in freed)
            ratio = gain / max(time - now, 1e-9 * base)
            if best is None or ratio > best[0]:
                best = (ratio, root, trial, time, freed)
        if best is None or best[0] <= 0:
            return steps
        _, root, trial, time, freed = best
        gain = sum(costs[r] for r in freed)
        steps.append(Kept(tuple(sorted(trial - floats)), tuple(sorted(freed)), gain, sensitivity.db(gain),
                          (time - now) / base))
        floats, now, free = trial, time, free | freed
