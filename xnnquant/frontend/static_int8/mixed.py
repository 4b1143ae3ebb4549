"""Mixed precision: the few nodes whose int8 grids cost the outputs most stay fp32, within a time budget;
and the islands of int8 nodes between fp32 ones that int8 would not make faster.

A value stops being quantized only when the node computing it and every node reading it
compute in fp32 (a reader in int8 would convert it to qint8 again).  So the unit bought is
a group of values sharing a grid (``grids.Grids.members``), and its price is its computing
producers and readers (``nodes_of``); what it buys is the group's cost at its chosen grid
(``sensitivity.WeightedHistogram.cost``: the first-order squared error of the outputs per
input, measured on calibration inputs), plus that of any other group the same fp32 nodes
free.  Greedily, the group of most cost bought per unit of estimated time is taken while
the program's estimated time stays within ``(1 + budget)`` times the all-int8 program's.

Estimated time (``estimate``), in multiply-accumulates of fp32, with the ratios of one class
of CPU (``CostModel``; ``xnnpack.cpu.Cpu.int8_class``: which static int8 GEMM kernels
XNNPACK runs there)::

    convolution, fully connected      MACs       x 1 (fp32)  or int8_mac[kind] (int8)
    any other computing or moving     elements   x f32_element or int8_element
    convert fp32 <-> qint8            elements   x convert_element

The estimate decides; it is a model, not a measurement: ``benchmarks/static_int8.py``
measures what the chosen programs take, and ``benchmarks/static_int8_ratios.py`` the ratios
on the machine that runs it.  Only the ``avx512vnni`` ratios are measured (XNNPACK's programs
on an AMD Zen 4, one thread: a network of 3x3 convolutions runs in int8 in 0.31 of its fp32
time, MobileNetV2 in 0.51, its depthwise layers being bound by memory).  The others are
derived from them, kernel by kernel, by the vector instructions per multiply-accumulate of
XNNPACK's GEMM micro-kernels (``GEMM_OPS_PER_MAC``, counted in their inner loops; loads and
broadcasts from memory not counted): an int8 ratio ``r`` measured where the int8 and fp32
kernels take ``i`` and ``f`` instructions per MAC becomes ``r * (i' / f') / (i / f)`` where
they take ``i'`` and ``f'``.  That assumes the part of the time the instructions do not
explain (memory, the kernels' edges) scales alike, and it holds only for compute-bound layers:
layers bound by memory gain more from int8's 4x smaller operands than it says.  Depthwise
convolutions and the element-wise costs keep their measured ratios on every class: the
depthwise kernels are the same ``mul32`` pattern on AVX2 and AVX-512 (int8 widened to int32,
``vpmulld`` + ``vpaddd``, against one FMA per fp32 vector) and element-wise nodes are bound
by the bytes they move (4 a float, 1 an int8 code).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...graph import Graph
from ...graph.model import Node
from ...graph.rules import DATA_MOVEMENT
from ...graph.shapes import Window
from .grids import Sets
from .sensitivity import Sensitivity

#: Vector instructions per multiply-accumulate in the inner loop of each GEMM micro-kernel the
#: executorch 1.4.1 wheel's XNNPACK (1adaa7c7) runs, ``(int8, fp32)`` per ``Cpu.int8_class``:
#:  avx512vnni  qs8 7x16c8 avx512vnni: per 16 k, 28 vpdpbusd + 14 vpxorq for 7x16x16 MACs;
#:              f32 7x32 avx512f: per k, 14 vfmadd231ps for 7x32 MACs
#:  avx512      qs8 7x16c8 avx512skx: per 8 k, 7 + 4 vpmovsxbw, 7 vbroadcasti32x4, 28 vpmaddwd,
#:              28 vpaddd for 7x16x8 MACs; f32 as avx512vnni
#:  avx2        qs8 3x8c8 avx2: per 8 k, 3 + 4 vpmovsxbw, 12 vpmaddwd, 12 vpaddd for 3x8x8 MACs;
#:              f32 6x16 fma3: per k, 12 vfmadd231ps for 6x16 MACs
#: (``sse``, older than AVX2, takes the avx2 row: XNNPACK's SSE kernels are not counted here.)
GEMM_OPS_PER_MAC: dict[str, tuple[float, float]] = {
    "avx512vnni": (42 / (7 * 16 * 16), 14 / (7 * 32)),
    "avx512": (74 / (7 * 16 * 8), 14 / (7 * 32)),
    "avx2": (31 / (3 * 8 * 8), 12 / (6 * 16)),
}
#: The int8 ratios measured (class ``avx512vnni``, module docstring).
MEASURED_INT8_MAC = {"XNNConv2d": 0.3, "XNNFullyConnected": 0.35, "XNNDepthwiseConv2d": 0.6}
MEASURED_ON = "an AMD Zen 4 (AVX-512 VNNI), one thread"


@dataclass(frozen=True)
class CostModel:
    """The estimate's ratios for one ``Cpu.int8_class`` (module docstring) and where they come from."""

    int8_class: str
    int8_mac: Mapping[str, float]
    f32_element: float = 4.0
    int8_element: float = 1.0
    convert_element: float = 4.0
    basis: str = ""


def cost_model(int8_class: str) -> CostModel:
    """The ``CostModel`` of ``int8_class`` (``"avx512vnni"``, ``"avx512"``, ``"avx2"`` or ``"sse"``)."""
    if int8_class == "avx512vnni":
        return CostModel(int8_class, dict(MEASURED_INT8_MAC), basis=f"ratios measured on {MEASURED_ON}")
    ops = GEMM_OPS_PER_MAC["avx2" if int8_class == "sse" else int8_class]
    base = GEMM_OPS_PER_MAC["avx512vnni"]
    factor = (ops[0] / ops[1]) / (base[0] / base[1])
    mac = {kind: r * factor if kind != "XNNDepthwiseConv2d" else r for kind, r in MEASURED_INT8_MAC.items()}
    return CostModel(int8_class, mac, basis=(
        f"ratios derived from those measured on {MEASURED_ON}, by the instructions per multiply-accumulate of "
        f"XNNPACK's {'AVX2' if int8_class == 'sse' else int8_class.upper().replace('512', '-512')} GEMM kernels "
        "(not measured)"))


#: The default class's model (``StaticInt8.cpu``), the measured one.
DEFAULT_COSTS = cost_model("avx512vnni")


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


def estimate(graph: Graph, floats: set[int], costs: CostModel = DEFAULT_COSTS) -> float:
    """The estimated time of ``graph`` with the nodes ``floats`` (indices) in fp32 and every other
    in int8, data movement following its input, by ``costs`` (module docstring)."""
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
                total += costs.convert_element * math.prod(graph.value(v).dims)
        work = macs(node, graph)
        if work:
            total += work * (1.0 if in_float else costs.int8_mac[node.kind])
        else:
            total += math.prod(graph.value(node.outputs[0]).dims) * (costs.f32_element if in_float
                                                                       else costs.int8_element)
        for v in node.outputs:
            domain[v] = in_float
    for v in graph.outputs:
        if not domain.get(v, True) and v in producer:
            total += costs.convert_element * math.prod(graph.value(v).dims)
    return total


def nodes_of(graph: Graph, members: Sequence[int]) -> set[int]:
    """The computing nodes (indices) that write or read any of ``members``."""
    wanted = set(members)
    return {i for i, n in enumerate(graph.nodes) if n.kind not in DATA_MOVEMENT
            and (wanted & set(n.outputs) or wanted & set(n.inputs))}


def choose(graph: Graph, groups: dict[int, list[int]], costs: dict[int, float], refused: set[int],
           budget: float, sensitivity: Sensitivity, times: CostModel = DEFAULT_COSTS) -> list[Kept]:
    """The greedy choice of the module docstring: the steps taken, in order.

    ``groups``: root -> member value ids; ``costs``: root -> the cost of its grid (per input);
    ``refused``: nodes already fp32 (no int8 form); ``times``: the estimate's ratios."""
    price = {root: nodes_of(graph, vids) - refused for root, vids in groups.items() if root in costs}
    base = estimate(graph, refused, times)
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
            time = estimate(graph, trial, times)
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


def fp32_islands(graph: Graph, refusal: Mapping[int, str], readers: Mapping[int, list[int]],
                 costs: CostModel = DEFAULT_COSTS) -> dict[int, str]:
    """The computing nodes (index -> why) of each island of int8 nodes (nodes of ``graph`` not in
    ``refusal``, linked by the values they pass one another) that reads or feeds a node computing
    in fp32 and that the time estimate (``estimate``) finds no faster in int8 than in fp32: its
    inputs come from fp32 values and its readers are fp32 nodes or outputs, so int8 would add
    converts and rounding for nothing.  A transformer's ``scores + mask`` between its fp32 batch
    matrix product and softmax is one: in int8 its one grid had to hold the mask's -10000 with
    the scores, and rounded every score to 0.  An island that only the graph's inputs and outputs
    bound (the whole program of int8 ops) stays int8, as asked.  ``readers``: value id -> the
    indices of the nodes reading it."""
    sets = Sets()
    producer = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    for j, n in enumerate(graph.nodes):
        if j not in refusal:
            sets.find(j)
            for v in n.inputs:
                if v in producer and producer[v] not in refusal:
                    sets.union(producer[v], j)
    islands: dict[int, list[int]] = {}
    for j in range(len(graph.nodes)):
        if j not in refusal:
            islands.setdefault(sets.find(j), []).append(j)
    refused = set(refusal)
    base = estimate(graph, refused, costs)
    kept: dict[int, str] = {}
    for nodes in islands.values():
        touching = any(producer.get(v, -1) in refused for j in nodes for v in graph.nodes[j].inputs) or any(
            r in refused for j in nodes for v in graph.nodes[j].outputs for r in readers.get(v, []))
        computing = [j for j in nodes if graph.nodes[j].kind not in DATA_MOVEMENT]
        if not touching or not computing:
            continue
        floats = estimate(graph, refused | set(computing), costs)
        if floats <= base:
            why = (f"it reads and feeds only fp32 values and nodes: in int8 it would add converts and rounding "
                   f"and save no time (estimated {floats / base - 1:+.1%} in fp32); computed in fp32")
            for j in computing:
                kept[j] = why
    return kept
