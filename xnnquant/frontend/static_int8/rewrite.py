"""The float graph rewritten into a full-integer static int8 graph.

Input: the graph the lowering made with fp32 weights, every node stamped with the debug
handle of its ATen node, and what calibration saw of each value (``ranges.ValueStats``).
Output: a new graph in which every node XNNPACK computes in int8 reads and writes qint8
values (one scale and zero point per tensor, fixed here), its filter qcint8 per output
channel (``xq.quantize_per_channel``, ``method``) and its bias qcint32 with scale
``input_scale * filter_scale`` (``xq.quantize_bias``); fp32 <-> qint8 XNNConvert nodes
stand at the graph's inputs and outputs and around every node left in fp32.

Which node computes in int8 (``int8_refusal``):

==========================================  ==================================================
kinds                                       in int8 when
==========================================  ==================================================
FullyConnected, Conv2d, DepthwiseConv2d     the filter and bias are fp32 constants
Add, Subtract, Multiply                     each operand is an activation or a one-element
                                            constant (a qint8 constant of code +-127), and
                                            the scale ratios lie where XNNPACK asserts them
Clamp, Sigmoid, Tanh, Hardswish, ELU,       always (LeakyReLU: its ratios as for Add)
Gelu, LeakyReLU, GlobalAvgPooling2d
MaxPooling2d, StaticReshape, -Transpose,    no operand is a constant, sharing one scale and
-Slice, -ConstantPad, -ResizeBilinear2D,    zero point between inputs and output (XNNPACK
Copy, Concatenate2..5                       refuses any other)
anything else (AvgPooling2d, Softmax,       never: fp32 between converts, one boundary line
Div, BatchMatrixMultiply, ...)              in the report with the reason
==========================================  ==================================================

Nodes that could compute in int8 but read and feed only nodes computing in fp32 stay fp32
when the time estimate finds int8 no faster between its converts (``_keep_islands_fp32``).
An ATen node lowered to more than one computing node (``hardsigmoid``; an unfolded batch
norm) stays fp32 as a whole: the self-check judges an int8 ATen node against torch within
half an output step, which a chain of roundings inside one node does not keep.  ``silu``
(``x * sigmoid(x)``, ``_silu``) is the exception: its one more rounding, the sigmoid's, is
bounded (``check.py``), and in fp32 it left an EfficientNet's int8 program barely faster than
its fp32 one.

Cross-layer equalization (``equalize``).  Where a filtered node's output feeds nothing but
the next filtered node's input (with at most a clamp fused between, as ReLU and ReLU6
are; through adds of such values, a residual stream, and through channel-wise nodes:
global average and max pooling, a reshape or slice keeping the channels whole, a zero
padding), the output's channels are divided by factors ``s`` and the next filter's input
channels multiplied by them (``W1 / s`` on output channels, ``b1 / s``, ``W2 * s`` on
input channels): the per-tensor int8 grid of that activation then serves its small
channels as well as its large ones.  Factors (from each channel's calibrated magnitude
``a_c`` and the next filter's magnitude ``r_c`` along that input channel, clipped to
``[1/16, 16]``): a depthwise reader, whose per-channel filter takes any factor without
loss, gets ``s_c = a_c / max(a)`` (every channel spread over the whole range); a fully
connected or regular convolution reader, whose per-output-channel filter grid the
factors change, ``s_c = sqrt(a_c / r_c)`` (SmoothQuant's balance), normalized so that
the largest channel keeps its magnitude.  Only groups through a ReLU or no clamp are
equalized, where the rewrite is exact (``relu(z / s) = relu(z) / s`` for ``s > 0``).  A clamp
with an upper bound (ReLU6) does not commute with the factors: the per-tensor bound 6 would
cut channel ``c`` at ``6 s_c`` of its own units, so the group is left as it is.  (Factors held to
``a_c / 6 <= s_c <= 1``, exact up to the calibrated maxima, were tried: on held-out crops
EfficientNet-Lite0's logits fell to 9.3 dB SQNR with them, 22.6 dB without; MobileNetV2, whose
ReLU6 groups they also reached, went from 20.0 to 21.5 dB: measured 2026-12-04.)

Scales.  Values that a data-movement node links share one grid (a union-find over those
nodes); the grid's range is chosen once from all its members' statistics
(``ranges.choose_range``).  A convolution whose ``input_scale * filter_scale /
output_scale`` would reach 256 (XNNPACK refuses it) gets its output scale raised to
just below; an add, multiply or leaky ReLU whose ratios fall outside XNNPACK's asserted
ranges stays fp32 (reported).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...datatypes import Datatype
from ...errors import XnnquantError
from ...graph import Graph
from ...graph.model import Node, PerTensorQuant, Value
from ...graph.rules import DATA_MOVEMENT, INT8_RATIO_RANGES, INT8_REFUSED, WEIGHTED
from ...schemes import quantize_bias, quantize_per_channel
from ...schemes.checks import check_method
from ...tensor import QuantizedTensor
from ..report import ReportRow
from ..weights import weight_sqnr
from . import mixed, torch_graph
from .observe import Measured
from .ranges import ValueStats, choose_range, grid_range, qparams
from .rounding import layer_grams, learned_filter
from .sensitivity import Sensitivity, output_sensitivity

F32 = np.float32
BINARY = ("XNNAdd", "XNNSubtract", "XNNMultiply")
UNARY = ("XNNClamp", "XNNGelu", "XNNSigmoid", "XNNTanh", "XNNHardswish", "XNNELU", "XNNLeakyReLU",
         "XNNGlobalAvgPooling2d")
#: Node kinds computed in int8 (besides the data-movement kinds, which move codes).
COMPUTING = frozenset(WEIGHTED + BINARY + UNARY)
#: The largest bias code a filter scale is chosen for: 2^31 less room for the bias correction's shift.
BIAS_CODES = float(2**28)
#: The largest ``input_scale * filter_scale / output_scale`` XNNPACK takes is below 256.
MAX_REQUANTIZATION = 256.0
#: The most output steps an int8 layer's accumulator may reach on any input: the static int8 GEMM
#: kernels of AVX-512 and AVX-VNNI CPUs write 127 where the scaled accumulator plus the output zero
#: point falls below -2^31, the others -128 (``graph.int8.requantize_fp32``), so a layer that could
#: get there would compute differently from one CPU to another.  Half of 2^31 leaves the other half
#: to the bias correction, which ``_fit_requantization`` does not know yet (``check.check_layers``
#: verifies the finished layers).
ACCUMULATOR_STEPS = float(2**30)
#: Equalization factors are clipped to ``[1 / EQUALIZATION_LIMIT, EQUALIZATION_LIMIT]``: MobileNetV2's
#: logits SQNR (96 held-out crops) is flat from 4 to 16 (18.5 dB), lower at 32 (18.3) and 64 (18.1).
EQUALIZATION_LIMIT = 16.0


@dataclass(frozen=True)
class Boundary:
    """Where the int8 graph converts: ``what`` (a graph input or output, or an ATen node left in
    fp32) and ``why``."""

    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.what}: {self.why}"


@dataclass
class QuantizedLayer:
    """One int8 filtered node: its new node index, the float filter and bias (graph layout, after
    equalization) it came from, the stored filter, the bias value to correct
    (``bias_correction.py``), and the float graph's own bias (``float_bias``, what torch adds)."""

    node: int
    filter_id: int  # in the float graph
    weights: np.ndarray
    bias: np.ndarray  # float32 (OC,), zeros where the layer had none
    stored: QuantizedTensor
    bias_id: int  # in the int8 graph
    input_id: int  # in the int8 graph
    input_scale: float
    float_bias: np.ndarray
    source: int = -1  # the float graph's node index
    input_source: int = -1  # the float graph's input value id
    #: the bias correction's input means (``bias_correction.InputMeans``, equalized), None without it
    means: np.ndarray | None = None


@dataclass(frozen=True)
class Equalized:
    """One equalized value (module docstring): the float-graph node indices of its channel group's
    filtered producers and readers, the value, and the factors ``s`` float32 ``(C,)``."""

    producers: tuple[int, ...]
    readers: tuple[int, ...]
    value: int
    factors: np.ndarray


@dataclass
class Int8Graph:
    """What ``rewrite`` made (see the module docstring).

    ``int8_of`` / ``float_of``: float-graph value id -> the int8 graph's qint8 / fp32 value
    holding it (either may be missing).  ``int8_handles``: debug handles of the ATen nodes
    computed in int8.  ``layers``: the quantized filtered nodes.
    """

    graph: Graph
    rows: list[ReportRow]
    boundaries: list[Boundary]
    int8_of: dict[int, int] = field(default_factory=dict)
    float_of: dict[int, int] = field(default_factory=dict)
    int8_handles: set[int] = field(default_factory=set)
    layers: list[QuantizedLayer] = field(default_factory=list)
    quant: dict[int, tuple[float, int]] = field(default_factory=dict)
    #: the equalized pairs; a float value ``v`` of ``equalized`` is held as ``v / factors`` (last dim)
    equalized: list[Equalized] = field(default_factory=list)
    #: float-graph filter id -> the float filter after equalization (graph layout)
    filters: dict[int, np.ndarray] = field(default_factory=dict)
    #: the float graph it was made from
    source: Graph | None = None
    #: what ``ranges="sensitivity"`` measured (None with any other method, or when it fell back)
    sensitivity: Sensitivity | None = None
    #: how the rewrite departed from its options, and why
    notes: list[str] = field(default_factory=list)
    #: mixed precision (``StaticInt8.budget``): one line per step of nodes kept in fp32, with its measured cost
    kept: list[str] = field(default_factory=list)
    #: the finished graph against the float graph on calibration inputs (``observe.measure``)
    measured: Measured | None = None
    #: for which CPU the time estimate priced the choices, and on what basis (one report line)
    estimate: str = ""

    def primary(self, vid: int) -> int:
        """The int8 graph's value standing for float-graph value ``vid`` (its qint8 one if any)."""
        return self.int8_of.get(vid, self.float_of.get(vid, -1))


def _where(sources: Sequence[tuple[str, str, str]], handle: int) -> str:
    if not 0 < handle <= len(sources):
        return "a node of the graph"
    op, name, path = sources[handle - 1]
    return f"{op} (node {name}, module {path or '<top level>'})"


def int8_refusal(node: Node, graph: Graph) -> str | None:
    """Why ``node`` (of the float graph) has no int8 form here, or None (module docstring)."""
    kind = node.kind
    if kind in DATA_MOVEMENT:
        constants = [graph.value(i) for i in node.inputs if graph.value(i).is_constant]
        if constants:  # ViT's class token concatenated with the patches
            return (f"{kind} with a constant operand of {math.prod(constants[0].dims)} element(s) (its codes would "
                    "need the grid its inputs and output share); computed in fp32 between converts")
        return None
    if kind in INT8_REFUSED:
        return f"XNNPACK 1adaa7c7 has no qint8 {kind[3:]} (its runtime refuses it); computed in fp32 between converts"
    if kind not in COMPUTING:
        return (f"{kind} has no static int8 form here (not among XNNPACK's qint8 kinds measured bit-exact); computed "
                "in fp32 between converts")
    ins = [graph.value(i) for i in node.inputs]
    if kind in WEIGHTED:
        if any(not v.is_constant or v.datatype is not Datatype.fp32 for v in ins[1:]):
            return f"{kind} with a computed or non-fp32 filter or bias; computed in fp32 between converts"
    if kind in BINARY:
        for v in ins:
            if v.is_constant and math.prod(v.dims) != 1:
                return (f"{kind} with a constant operand of {math.prod(v.dims)} elements (one int8 scale for them "
                        "all would cost accuracy); computed in fp32 between converts")
    return None


class _Sets:
    """Union-find over value ids."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _constant_scalar(v: Value) -> float:
    return float(v.array().reshape(-1)[0])


def _scalar_qint8(c: float) -> QuantizedTensor:
    """A one-element constant as qint8: code +-127 (0 for 0), scale ``|c| / 127``, zero point 0."""
    scale = F32(abs(c) / 127.0) if c != 0 else F32(1.0)
    code = np.array([0 if c == 0 else (127 if c > 0 else -127)], np.int8)
    return QuantizedTensor(Datatype.qint8, code, scale, 0)


class Rewrite:
    """One rewrite (module docstring); ``run()`` returns the ``Int8Graph``."""

    def __init__(self, graph: Graph, sources: Sequence[tuple[str, str, str]], stats: dict[int, ValueStats],
                 rows: list[ReportRow], filters: dict[int, Any], *, ranges: str, percentile: float,
                 method: str, equalize: bool = False, batches: Sequence[Sequence[np.ndarray]] = (),
                 keep: dict[int, str] | None = None, rounding: str = "nearest",
                 costs: mixed.CostModel = mixed.DEFAULT_COSTS) -> None:
        self.src, self.sources, self.stats = graph, sources, dict(stats)
        self.costs = costs  # the time estimate's ratios (``mixed.CostModel``)
        self.rounding = rounding
        self.grams: dict[int, np.ndarray] | None = None
        self.keep = dict(keep or {})  # node index -> why mixed precision keeps it fp32
        self.batches = batches
        self.members: dict[int, list[int]] = {}  # group -> its member value ids
        self.equalize = equalize
        self.rows, self.filters = list(rows), filters
        self.ranges, self.percentile, self.method = ranges, percentile, method
        self.producer = {vid: n for n in graph.nodes for vid in n.outputs}
        self.readers: dict[int, list[int]] = {}  # value id -> the nodes (indices) reading it
        for i, n in enumerate(graph.nodes):
            for vid in n.inputs:
                self.readers.setdefault(vid, []).append(i)
        self.refusal: dict[int, str] = {}  # node index -> why it stays fp32
        self.group: dict[int, int] = {}  # float value id -> its group (of values sharing a grid)
        self.grids: dict[int, tuple[float, int]] = {}  # group -> its grid (scale, zero point)
        self.unranged: dict[int, str] = {}  # group -> why it has no grid (calibration saw only zeros)
        self.domain: dict[int, Datatype] = {}  # float value id -> what its producer computes in
        self.filter_q: dict[int, QuantizedTensor] = {}
        self.weights: dict[int, np.ndarray] = {}  # float filter id -> its values (after equalization)
        self.biases: dict[int, np.ndarray] = {}  # node index -> its float bias (after equalization)
        self.out = Graph(target=graph.target, write_scale_bf16=graph.write_scale_bf16,
                         scales_in_segment=graph.scales_in_segment)
        self.result = Int8Graph(self.out, self.rows, [])

    # ------------------------------------------------------------- planning

    def plan(self) -> None:
        src = self.src
        computing: dict[int, list[int]] = {}
        for i, n in enumerate(src.nodes):
            reason = int8_refusal(n, src)
            if reason is not None:
                self.refusal[i] = reason
            elif i in self.keep:
                self.refusal[i] = self.keep[i]
            if n.kind not in DATA_MOVEMENT:  # fp32 ones too: an int8 node among them is rounded mid-node
                computing.setdefault(n.debug_handle, []).append(i)
        silus = [nodes for nodes in computing.values() if self._silu(nodes)]
        for nodes in computing.values():
            if len(nodes) > 1 and nodes not in silus:
                kinds = ", ".join(src.nodes[i].kind for i in nodes)
                for i in nodes:
                    self.refusal.setdefault(i, f"lowered as a composition of {len(nodes)} computing nodes ({kinds}); "
                                               "an int8 ATen node is one computing node; computed in fp32 between "
                                               "converts")
        self._whole(silus)
        self._keep_islands_fp32()
        if self.equalize:
            self._equalize()
        self._grids()
        for i, n in enumerate(src.nodes):
            if i not in self.refusal and n.kind in WEIGHTED:
                self._fit_requantization(n)
        for i, n in enumerate(src.nodes):
            if i not in self.refusal:
                reason = self._ratio_refusal(n)
                if reason is not None:
                    self.refusal[i] = reason
        self._whole(silus)

    def _silu(self, nodes: list[int]) -> bool:
        """Whether ``nodes`` (one ATen node's computing nodes) are ``x * sigmoid(x)``: a sigmoid of
        ``x`` and a multiply of ``x`` by it, which compute in int8 with one more rounding than one
        node (``check.py`` bounds it)."""
        if len(nodes) != 2:
            return False
        first, second = (self.src.nodes[i] for i in nodes)
        return (first.kind == "XNNSigmoid" and second.kind == "XNNMultiply"
                and sorted(second.inputs) == sorted((first.inputs[0], first.outputs[0])))

    def _whole(self, silus: list[list[int]]) -> None:
        """A silu is computed in int8 or in fp32 as a whole (the self-check judges its ATen node in
        one or the other): one node fp32 (a budget's choice, a ratio) makes both."""
        for nodes in silus:
            why = next((self.refusal[i] for i in nodes if i in self.refusal), None)
            if why is not None:
                for i in nodes:
                    self.refusal.setdefault(i, why)

    def _keep_islands_fp32(self) -> None:
        """Keep fp32 each island of int8 nodes (nodes that could compute in int8, linked by the
        values they pass one another) that reads or feeds a node computing in fp32 and that the
        time estimate (``mixed.estimate``) finds no faster in int8 than in fp32: its inputs come
        from fp32 values and its readers are fp32 nodes or outputs, so int8 would add converts
        and rounding for nothing.  A transformer's ``scores + mask`` between its fp32 batch
        matrix product and softmax is one: in int8 its one grid had to hold the mask's -10000
        with the scores, and rounded every score to 0.  An island that only the graph's inputs
        and outputs bound (the whole program of int8 ops) stays int8, as asked."""
        src, readers = self.src, self.readers
        sets = _Sets()
        producer = {v: i for i, n in enumerate(src.nodes) for v in n.outputs}
        for j, n in enumerate(src.nodes):
            if j not in self.refusal:
                sets.find(j)
                for v in n.inputs:
                    if v in producer and producer[v] not in self.refusal:
                        sets.union(producer[v], j)
        islands: dict[int, list[int]] = {}
        for j in range(len(src.nodes)):
            if j not in self.refusal:
                islands.setdefault(sets.find(j), []).append(j)
        refused = set(self.refusal)
        base = mixed.estimate(src, refused, self.costs)
        for nodes in islands.values():
            touching = any(producer.get(v, -1) in refused for j in nodes for v in src.nodes[j].inputs) or any(
                r in refused for j in nodes for v in src.nodes[j].outputs for r in readers.get(v, []))
            computing = [j for j in nodes if src.nodes[j].kind not in DATA_MOVEMENT]
            if not touching or not computing:
                continue
            floats = mixed.estimate(src, refused | set(computing), self.costs)
            if floats <= base:
                why = (f"it reads and feeds only fp32 values and nodes: in int8 it would add converts and rounding "
                       f"and save no time (estimated {floats / base - 1:+.1%} in fp32); computed in fp32")
                for j in computing:
                    self.refusal[j] = why

    def _grids(self) -> None:
        """Every activation's grid: data-movement nodes tie values into groups, each group's range
        chosen once from its members' statistics."""
        sets = _Sets()
        pads: dict[int, float] = {}
        for n in self.src.nodes:
            if n.kind in DATA_MOVEMENT:
                for vid in n.inputs:
                    if not self.src.value(vid).is_constant:
                        sets.union(vid, n.outputs[0])
                if n.kind == "XNNStaticConstantPad" and math.isfinite(n.params.get("padding_value", 0.0)):
                    pads[n.outputs[0]] = float(n.params.get("padding_value", 0.0))
        members: dict[int, list[int]] = {}
        for v in self.src.values:
            if not v.is_constant and v.datatype is Datatype.fp32:
                members.setdefault(sets.find(v.id), []).append(v.id)
        merged: dict[int, ValueStats] = {}
        for root, vids in members.items():
            seen = [self.stats[v] for v in vids if v in self.stats]
            if seen:  # else never observed (an argmax index, a value no node reads): never quantized
                merged[root] = seen[0]
                for st in seen[1:]:
                    merged[root] = merged[root].merged(st)
        spread = {r: members[r] for r, st in merged.items() if st.bounds[1] > st.bounds[0]}  # else refused below
        histograms = self._sensitivity(spread, merged) if self.ranges == "sensitivity" else {}
        for root, stats in merged.items():
            vids = members[root]
            found = histograms[root].best_range() if root in histograms else None
            if found is not None:
                lo, hi = found
            else:
                method = "percentile" if self.ranges == "sensitivity" else self.ranges
                weights = self._channel_weights(vids[0]) if len(vids) == 1 else None
                try:
                    lo, hi = choose_range(stats, method, self.percentile, weights)
                except XnnquantError as exc:  # zero on every batch: a grid only if it is zero by construction
                    if not (stats.count and stats.bounds == (0.0, 0.0) and all(map(self._zero_by_construction, vids))):
                        self.unranged[root] = str(exc)  # raised where an int8 node needs the grid (``quant``)
                        self.group.update((vid, root) for vid in vids)
                        continue
                    lo, hi = -1.0, 1.0  # any grid holds its only value, 0, exactly (its zero point)
            for vid in vids:
                if vid in pads:
                    lo, hi = min(lo, pads[vid]), max(hi, pads[vid])
                self.group[vid] = root
            self.grids[root] = qparams(lo, hi)
        self.members = {root: members[root] for root in merged}

    def choose_float(self, budget: float) -> tuple[dict[int, str], list[str]]:
        """After ``plan``: the nodes mixed precision keeps in fp32 within ``budget`` (``mixed.choose``)
        with their reasons, and one report line per step; nothing (and a note) without a
        sensitivity measurement."""
        measured = self.result.sensitivity
        if measured is None:
            self.result.notes.append("budget: nothing kept in fp32 (the choice prices each grid by the sensitivity "
                                     "measurement, which did not run: see ranges)")
            return {}, []
        costs = {root: measured.histograms[root].cost(*grid_range(*self.grids[root])) for root in self.members
                 if root in measured.histograms}
        refused = {i for i, r in self.refusal.items() if i not in self.keep}
        steps = mixed.choose(self.src, self.members, costs, refused, budget, measured, self.costs)
        reasons: dict[int, str] = {}
        lines = []
        for step in steps:
            why = (f"kept in fp32 by budget={budget:g}: with {len(step.nodes) - 1} other node(s) it frees "
                   f"{len(step.groups)} int8 grid(s) whose error alone would leave the outputs {step.db:.1f} dB SQNR "
                   f"(first-order, {measured.inputs} calibration inputs), for {step.time:+.1%} estimated time")
            for i in step.nodes:
                reasons[i] = why
            where = sorted({_where(self.sources, self.src.nodes[i].debug_handle) for i in step.nodes})
            lines.append(f"{'; '.join(where)}: {step.db:.1f} dB alone, {step.time:+.1%} time")
        return reasons, lines

    def _sensitivity(self, groups: dict[int, list[int]], merged: dict[int, ValueStats]) -> dict[int, Any]:
        """Each group's ``sensitivity.WeightedHistogram`` (``ranges="sensitivity"``), or none with a note
        when the float graph has a node torch cannot compute here or there are no batches."""
        unsupported = torch_graph.unsupported(self.src)
        if unsupported is not None or not self.batches:
            why = f"{unsupported} has no torch form here" if unsupported else "no calibration batches were kept"
            self.result.notes.append(f"ranges: percentile instead of sensitivity ({why})")
            return {}
        factors = {e.value: e.factors for e in self.result.equalized}
        measured = output_sensitivity(self.src, self.batches, groups, {r: st.bounds for r, st in merged.items()},
                                      factors)
        self.result.sensitivity = measured
        return measured.histograms

    def _channel_weights(self, vid: int) -> np.ndarray | None:
        """float64 ``(C,)``: per channel of ``vid``, the sum of its readers' squared filter entries
        that multiply it (``ranges``' ``output_mse``); None unless every reader is a filtered node
        reading ``vid`` as its input."""
        total: np.ndarray | None = None
        for n in self.src.nodes:
            if vid not in n.inputs:
                continue
            if n.kind not in WEIGHTED or n.inputs[0] != vid or vid in n.inputs[1:]:
                return None
            w = self._weights(n.inputs[1]).astype(np.float64) ** 2
            if n.kind == "XNNFullyConnected":
                per = (w.T if n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else w).sum(axis=0)
            elif n.kind == "XNNDepthwiseConv2d":
                c = self.src.value(vid).dims[-1]
                per = w.sum(axis=(0, 1, 2)).reshape(c, -1).sum(axis=1)
            else:
                groups = int(n.params.get("groups", 1))
                oc, kh, kw, cg = w.shape
                per = w.reshape(groups, oc // groups * kh * kw, cg).sum(axis=1).reshape(groups * cg)
            total = per if total is None else total + per
        return total

    def _zero_by_construction(self, vid: int) -> bool:
        """True for a value that is 0 whatever the inputs: a product with a constant that is zero
        everywhere (ConvNeXt V2's global response norm at its initial gamma = 0, beta = 0) or with
        such a value, a sum or difference of them and of zero constants, data moved from one."""
        n = self.producer.get(vid)
        if n is None:
            return False
        zero = [(v.is_constant and not v.array().any()) or (not v.is_constant and self._zero_by_construction(v.id))
                for v in (self.src.value(i) for i in n.inputs)]
        if n.kind == "XNNMultiply":
            return any(zero)
        if n.kind in ("XNNAdd", "XNNSubtract"):
            return all(zero)
        moved = [i for i in n.inputs if not self.src.value(i).is_constant]
        return n.kind in DATA_MOVEMENT and len(moved) == 1 and self._zero_by_construction(moved[0])

    def quant(self, vid: int) -> tuple[float, int]:
        """The grid ``(scale, zero point)`` of float-graph value ``vid``; ``XnnquantError`` for a
        value calibration saw only zeros of (``choose_range``), which an int8 node reads or writes."""
        group = self.group[vid]
        if group in self.unranged:
            raise XnnquantError(self.unranged[group])
        return self.grids[group]

    def _grid(self, vid: int, node: Node) -> tuple[float, int]:
        if vid not in self.group:
            raise XnnquantError(f"static int8: {_where(self.sources, node.debug_handle)} reads value {vid}, which "
                                "calibration never observed")
        return self.quant(vid)

    # -------------------------------------------------------- equalization

    def _weights(self, wid: int) -> np.ndarray:
        if wid not in self.weights:
            self.weights[wid] = self.src.value(wid).array().astype(F32)
        return self.weights[wid]

    def _bias(self, i: int) -> np.ndarray:
        if i not in self.biases:
            n = self.src.nodes[i]
            w = self._weights(n.inputs[1])
            self.biases[i] = (self.src.value(n.inputs[2]).array().astype(F32) if len(n.inputs) > 2
                              else np.zeros(w.shape[_out_axis(n)], F32))
        return self.biases[i]

    def _equalize(self) -> None:
        """Equalize every channel group the module docstring allows."""
        src, readers = self.src, self.readers
        sets = _Sets()
        for i, n in enumerate(src.nodes):
            if (n.kind in ("XNNAdd", "XNNSubtract") or self._channelwise(n)) and i not in self.refusal:
                for vid in n.inputs:
                    sets.union(vid, n.outputs[0])
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(src.nodes):
            if i not in self.refusal and (n.kind in (*WEIGHTED, "XNNAdd", "XNNSubtract") or self._channelwise(n)):
                groups.setdefault(sets.find(n.outputs[0]), []).append(n.outputs[0])
        for values in groups.values():
            group = set(values)
            members = self._equalizable(group, readers)
            if members is None:
                continue
            producers, consumers = members
            stats = [self.stats[v] for v in sorted(group) if v in self.stats]
            factors = self._factors(stats, [src.nodes[j] for j in consumers])
            for i in producers:
                self._scale_output(i, factors)
            for j in consumers:
                self._scale_input(src.nodes[j], factors)
            for v in group:
                if v in self.stats:
                    self.stats[v] = self.stats[v].scaled(factors)
            self.result.equalized.extend(Equalized(tuple(producers), tuple(consumers), v, factors)
                                         for v in sorted(group))

    def _equalizable(self, group: set[int], readers: dict[int, list[int]]) -> tuple[list[int], list[int]] | None:
        """(filtered producers, filtered readers) of a channel group whose channels can be scaled
        together (module docstring), or None."""
        src = self.src
        producers, consumers = [], []
        for v in group:
            n = self.producer.get(v)
            i = src.nodes.index(n) if n is not None else -1
            observed = v in self.stats or (n is not None and n.kind in DATA_MOVEMENT)
            if n is None or i in self.refusal or src.value(v).is_output or not observed:
                return None
            if n.kind in WEIGHTED:
                if not self._own_filter(n, readers) or not _scale_invariant(n):
                    return None
                producers.append(i)
            elif any(u not in group for u in n.inputs) or not _scale_invariant(n):
                return None  # an add of a value outside the group, or of a constant
            for j in readers.get(v, []):
                r = src.nodes[j]
                if r.kind in WEIGHTED and r.inputs[0] == v and v not in r.inputs[1:] and self._own_filter(r, readers):
                    consumers.append(j)
                elif not ((r.kind in ("XNNAdd", "XNNSubtract") or self._channelwise(r)) and r.outputs[0] in group
                          and j not in self.refusal):
                    return None
        if not consumers or j_refused(consumers, self.refusal):
            return None
        return sorted(set(producers)), sorted(set(consumers))

    def _channelwise(self, n: Node) -> bool:
        """Whether ``n`` computes each channel (the last dim) from the same channel alone and
        commutes with a positive scaling of the channels: global average pooling, max pooling, a
        copy, a reshape or slice that keeps the last dim whole, a zero padding."""
        if n.kind in ("XNNGlobalAvgPooling2d", "XNNMaxPooling2d", "XNNCopy"):
            return True
        dims_in, dims_out = self.src.value(n.inputs[0]).dims, self.src.value(n.outputs[0]).dims
        last_kept = bool(dims_in) and bool(dims_out) and dims_in[-1] == dims_out[-1]
        if n.kind in ("XNNStaticReshape", "XNNStaticSlice"):
            return last_kept
        if n.kind == "XNNStaticConstantPad":
            return last_kept and n.params.get("padding_value", 0.0) == 0.0
        return False

    def _own_filter(self, n: Node, readers: dict[int, list[int]]) -> bool:
        return len(readers.get(n.inputs[1], [])) == 1 and not n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS

    def _factors(self, stats: list[ValueStats], consumers: list[Node]) -> np.ndarray:
        a = np.zeros(0)
        for st in stats:
            assert st.channel_lo is not None and st.channel_hi is not None
            m = np.maximum(np.abs(st.channel_lo), np.abs(st.channel_hi)).astype(np.float64)
            a = m if a.size == 0 else np.maximum(a, m)
        dense = [n for n in consumers if n.kind != "XNNDepthwiseConv2d"]
        if not dense:
            s = a / max(float(a.max()), 1e-30)
        else:
            r = np.max([_by_input_channel(n, self._weights(n.inputs[1])) for n in dense], axis=0).astype(np.float64)
            balance = np.sqrt(a / np.maximum(r, 1e-30))
            largest = float((a / np.maximum(balance, 1e-30)).max())
            s = balance * largest / max(float(a.max()), 1e-30)
        return np.clip(s, 1 / EQUALIZATION_LIMIT, EQUALIZATION_LIMIT).astype(F32)

    def _scale_output(self, i: int, factors: np.ndarray) -> None:
        n = self.src.nodes[i]
        w = self._weights(n.inputs[1])
        shape = [1] * w.ndim
        shape[_out_axis(n)] = -1
        self.weights[n.inputs[1]] = (w / factors.reshape(shape)).astype(F32)
        self.biases[i] = (self._bias(i) / factors).astype(F32)

    def _scale_input(self, n: Node, factors: np.ndarray) -> None:
        w = self._weights(n.inputs[1])
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

    # ---------------------------------------------------------- quantizing

    def _filter(self, n: Node) -> QuantizedTensor:
        wid = n.inputs[1]
        if wid not in self.filter_q:
            w = self._weights(wid)
            axis = 3 if n.kind == "XNNDepthwiseConv2d" else (1 if n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else 0)
            stored = quantize_per_channel(w, bits=8, axis=axis, method=check_method(self.method))
            floor = self._bias_floor(n)
            if np.any(np.asarray(stored.scale) < floor):  # the bias would not fit in int32 at s_x * s_w
                stored = quantize_per_channel(w, bits=8, axis=axis,
                                              scale=np.maximum(np.asarray(stored.scale), floor).astype(F32))
            gram = self._grams().get(self.src.nodes.index(n)) if self.rounding == "learned" else None
            if gram is not None:  # the scales kept, each code rounded up or down for the layer's output
                factors = {e.value: e.factors for e in self.result.equalized}.get(n.inputs[0])
                codes = learned_filter(n, w, np.asarray(stored.scale), gram, factors)
                stored = QuantizedTensor(stored.datatype, codes, stored.scale, 0, channel_dim=stored.channel_dim,
                                         meta={"rounding": "learned"})
            self.filter_q[wid] = stored
        return self.filter_q[wid]

    def _bias_floor(self, n: Node) -> np.ndarray:
        """float32 ``(OC,)``: the least filter scale per output channel at which the node's bias
        ``b`` fits its int32 codes, ``|b| / (s_x * BIAS_CODES)`` (a batch norm folded into a filter
        of near-zero weights leaves a large bias over a tiny filter scale)."""
        bias = self._bias(self.src.nodes.index(n)).astype(np.float64)
        s_x = self.quant(n.inputs[0])[0] if n.inputs[0] in self.group else None
        if s_x is None:
            return np.zeros(bias.shape, F32)
        return (np.abs(bias) / (float(F32(s_x)) * BIAS_CODES)).astype(F32)

    def _grams(self) -> dict[int, np.ndarray]:
        """The input Grams of every filtered node learned rounding can take (``rounding.layer_grams``;
        a grouped, not depthwise, convolution keeps nearest codes), computed once; none (and a
        note) when torch cannot compute the float graph here."""
        if self.grams is None:
            unsupported = torch_graph.unsupported(self.src)
            if unsupported is not None or not self.batches:
                why = f"{unsupported} has no torch form here" if unsupported else "no calibration batches were kept"
                self.result.notes.append(f"rounding: nearest instead of learned ({why})")
                self.grams = {}
            else:
                nodes = [i for i, n in enumerate(self.src.nodes) if n.kind in WEIGHTED and i not in self.refusal
                         and (n.kind != "XNNConv2d" or int(n.params.get("groups", 1)) == 1)]
                self.grams = layer_grams(self.src, self.batches, nodes)
        return self.grams

    def _fit_requantization(self, n: Node) -> None:
        """Raise the output's scale (its whole group's) so that ``s_x * s_w / s_y < 256``, and so that
        the largest accumulator any int8 input can give (``|b| + max |x - zp_x| * sum |w codes|`` per
        output channel, in input-times-filter steps) stays within ``ACCUMULATOR_STEPS`` output steps
        (``accumulator_reach``)."""
        s_x, zp_x = self._grid(n.inputs[0], n)
        stored = self._filter(n)
        accumulator = (F32(s_x) * np.asarray(stored.scale, F32)).astype(F32)
        out = n.outputs[0]
        s_y, zp_y = self._grid(out, n)
        need = float(np.max(accumulator)) / (MAX_REQUANTIZATION * (1 - 2**-10))
        reach = accumulator_reach(stored, zp_x) * accumulator + np.abs(self._bias(self.src.nodes.index(n)))
        need = max(need, float(np.max(reach, initial=0.0)) / ACCUMULATOR_STEPS)
        if s_y < need:
            self.grids[self.group[out]] = (float(F32(need)), zp_y)

    def _ratio_refusal(self, n: Node) -> str | None:
        """Why a node's scale ratios fall outside XNNPACK's asserted ranges (``rules.INT8_RATIO_RANGES``)."""
        if n.kind not in INT8_RATIO_RANGES:
            return None
        scales = [self._operand_scale(i, n) for i in n.inputs[:2]]
        s_y = F32(self._grid(n.outputs[0], n)[0])
        if n.kind in ("XNNAdd", "XNNSubtract"):
            ratios = {f"input {k} scale / output scale": float(F32(s) / s_y) for k, s in enumerate(scales)}
        elif n.kind == "XNNMultiply":
            ratios = {"input scale product / output scale": float((F32(scales[0]) * F32(scales[1])) / s_y)}
        else:  # leaky ReLU
            r = F32(scales[0]) / s_y
            ratios = {"input scale / output scale": float(r),
                      "|negative_slope| * input scale / output scale": float(r * F32(n.params["negative_slope"]))}
        lo, hi, inclusive = INT8_RATIO_RANGES[n.kind]
        for name, ratio in ratios.items():
            if not (lo <= abs(ratio) and (abs(ratio) <= hi if inclusive else abs(ratio) < hi)):
                return (f"qint8 {n.kind[3:]} needs {name} in [2^{int(np.log2(lo))}, 2^{int(np.log2(hi))}]: it would "
                        f"be {ratio:.4g} (XNNPACK asserts this range); computed in fp32 between converts")
        return None

    def _operand_scale(self, vid: int, n: Node) -> float:
        v = self.src.value(vid)
        if v.is_constant:
            return float(_scalar_qint8(_constant_scalar(v)).scale)
        return self._grid(vid, n)[0]

    # ------------------------------------------------------------- emitting

    def run(self) -> Int8Graph:
        self.plan()
        src, out, res = self.src, self.out, self.result
        for vid in src.inputs:
            v = src.value(vid)
            res.float_of[vid] = out.input(v.dims, v.datatype, v.quant)
        for vid in src.inputs:
            self.domain[vid] = Datatype.fp32
        leaning = self._int8_leaning()
        for i, n in enumerate(src.nodes):
            moved_float = n.kind in DATA_MOVEMENT and i not in leaning and not any(
                self.domain.get(v) is Datatype.qint8 for v in n.inputs)
            if i in self.refusal or moved_float:  # data movement follows its input, or its readers
                self._emit_float(n)
            else:
                self._emit_int8(n)
        for k, vid in enumerate(src.outputs):
            if vid in res.int8_of and vid not in res.float_of:
                res.boundaries.append(Boundary(f"output {k}", "qint8 -> fp32: a graph output is float32"))
            out.output(self._float(vid, self.producer[vid].debug_handle))
        handles_float = {src.nodes[i].debug_handle for i, n in enumerate(src.nodes)
                         if i in self.refusal}
        for handle in sorted(handles_float):
            reasons = sorted({self.refusal[i] for i, n in enumerate(src.nodes) if i in self.refusal
                              and n.debug_handle == handle})
            res.boundaries.append(Boundary(_where(self.sources, handle), "; ".join(reasons)))
        res.int8_handles = {n.debug_handle for i, n in enumerate(src.nodes) if i not in self.refusal
                            and n.kind not in DATA_MOVEMENT} - handles_float
        res.quant = {vid: self.quant(vid) for vid in self.group if self.group[vid] not in self.unranged}
        res.filters = dict(self.weights)
        res.source = self.src
        self._rows()
        return res

    def _int8_leaning(self) -> set[int]:
        """Data-movement nodes (by index) every reader of whose output computes in int8: they move
        int8 codes even when their input is fp32 (the convert then comes before them)."""
        readers = self.readers
        leaning: set[int] = set()
        for i in reversed(range(len(self.src.nodes))):
            n = self.src.nodes[i]
            out = n.outputs[0]
            if n.kind in DATA_MOVEMENT and not self.src.value(out).is_output and readers.get(out) and all(
                    r not in self.refusal and (self.src.nodes[r].kind not in DATA_MOVEMENT or r in leaning)
                    for r in readers[out]):
                leaning.add(i)
        return leaning

    def _input_of(self, vid: int) -> int | None:
        """The graph input ``vid`` is (through data movement), or None."""
        while vid not in self.src.inputs:
            n = self.producer.get(vid)
            if n is None or n.kind not in DATA_MOVEMENT:
                return None
            vid = n.inputs[0]
        return self.src.inputs.index(vid)

    def _int8(self, vid: int, handle: int) -> int:
        """The qint8 value of float-graph value ``vid`` (converted or quantized on first use)."""
        res = self.result
        if vid in res.int8_of:
            return res.int8_of[vid]
        v = self.src.value(vid)
        if v.is_constant:
            res.int8_of[vid] = self.out.constant(_scalar_qint8(_constant_scalar(v)))
            return res.int8_of[vid]
        scale, zero_point = self.quant(vid)
        res.int8_of[vid] = self.out.convert(self._float(vid, handle), Datatype.qint8, scale=scale,
                                            zero_point=zero_point, debug_handle=handle)
        k = self._input_of(vid)
        if k is not None:
            res.boundaries.append(Boundary(f"input {k}", f"fp32 -> qint8 (scale {scale:.6g}, zero point "
                                                         f"{zero_point}): a graph input is float32"))
        return res.int8_of[vid]

    def _float(self, vid: int, handle: int) -> int:
        """The fp32 value of float-graph value ``vid`` (a copied constant or a dequantizing convert)."""
        res = self.result
        if vid in res.float_of:
            return res.float_of[vid]
        v = self.src.value(vid)
        if v.is_constant:
            res.float_of[vid] = self.out.constant(v.array())
        else:
            res.float_of[vid] = self.out.convert(res.int8_of[vid], Datatype.fp32, debug_handle=handle)
        return res.float_of[vid]

    def _emit_float(self, n: Node) -> None:
        ins = tuple(self._float(i, n.debug_handle) for i in n.inputs)
        outs = []
        for vid in n.outputs:
            v = self.src.value(vid)
            outs.append(self.out.tensor(v.dims, v.datatype, v.quant))
            self.result.float_of[vid] = outs[-1]
            self.domain[vid] = Datatype.fp32
        self.out.nodes.append(dataclasses.replace(n, inputs=ins, outputs=tuple(outs)))

    def _emit_int8(self, n: Node) -> None:
        handle = n.debug_handle
        layer = None
        if n.kind in WEIGHTED:
            ins, layer = self._weighted_inputs(n)
        else:
            ins = tuple(self._int8(i, handle) for i in n.inputs)
        vid = n.outputs[0]
        scale, zero_point = self._grid(vid, n)
        o = self.out.tensor(self.src.value(vid).dims, Datatype.qint8, PerTensorQuant(scale, zero_point))
        self.result.int8_of[vid] = o
        self.domain[vid] = Datatype.qint8
        self.out.nodes.append(dataclasses.replace(n, inputs=ins, outputs=(o,)))
        if layer is not None:
            layer.node = len(self.out.nodes) - 1
            self.result.layers.append(layer)

    def _weighted_inputs(self, n: Node) -> tuple[tuple[int, ...], QuantizedLayer]:
        x = self._int8(n.inputs[0], n.debug_handle)
        stored = self._filter(n)
        w = self._weights(n.inputs[1])
        i = self.src.nodes.index(n)
        bias = self._bias(i)
        original = self.src.value(n.inputs[2]).array() if len(n.inputs) > 2 else np.zeros_like(bias)
        s_x = self.quant(n.inputs[0])[0]
        wid = self.out.constant(stored)
        bid = self.out.constant(quantize_bias(bias, s_x, stored.scale))
        return (x, wid, bid), QuantizedLayer(-1, n.inputs[1], w, bias, stored, bid, x, s_x, original, i, n.inputs[0])

    def _rows(self) -> None:
        """The report rows of quantized filters: scheme, bytes, SQNR; fp32 ones say why."""
        quantized = {layer.filter_id for layer in self.result.layers}
        for vid, origin in self.filters.items():
            row = self.rows[origin.row]
            if vid in quantized:
                stored = self.filter_q[vid]
                nbytes = int(stored.codes.size) + 4 * int(np.size(stored.scale))
                self.rows[origin.row] = ReportRow(row.path, tuple(int(d) for d in stored.shape), "qc8w", nbytes,
                                                  self._filter_sqnr(vid, stored), "")
            else:
                reasons = {self.refusal[i] for i, n in enumerate(self.src.nodes) if vid in n.inputs[1:]
                           and i in self.refusal}
                self.rows[origin.row] = dataclasses.replace(
                    row, fallback="static int8: its node is computed in fp32 (" + "; ".join(sorted(reasons)) + ")")


    def _filter_sqnr(self, vid: int, stored: QuantizedTensor) -> float:
        """SQNR of the stored filter against the module's (equalization undone on both sides)."""
        original = self.src.value(vid).array()
        equalized = self.weights[vid]
        if np.array_equal(original, equalized):
            return weight_sqnr(original, stored)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(equalized != 0, original / equalized, 1.0)  # the factors, broadcast
        restored = stored.dequantize().astype(np.float64) * ratio
        noise = float(np.sum((original - restored) ** 2))
        return math.inf if noise == 0 else 10 * math.log10(float(np.sum(original.astype(np.float64) ** 2)) / noise)


def accumulator_reach(stored: QuantizedTensor, zp_x: int) -> np.ndarray:
    """float64 ``(OC,)``: the largest ``|sum (x - zp_x) w|`` int8 inputs ``x`` can give each output
    channel of a filter, in codes: ``max(127 - zp_x, zp_x + 128) * sum |w codes|`` (padding reads
    ``zp_x``, adding nothing)."""
    codes = np.abs(np.asarray(stored.codes, np.float64))
    axis = stored.channel_dim or 0
    per_channel = codes.sum(axis=tuple(a for a in range(codes.ndim) if a != axis))
    return float(max(127 - zp_x, zp_x + 128)) * per_channel


def j_refused(nodes: list[int], refusal: dict[int, str]) -> bool:
    return any(j in refusal for j in nodes)


def _scale_invariant(n: Node) -> bool:
    """Whether ``n``'s output bounds commute with a positive per-channel scaling: none, or a lower
    bound of 0 and no upper one (ReLU); not a finite upper bound (ReLU6: module docstring)."""
    lo, hi = n.output_min, n.output_max
    return (lo is None or lo == 0 or lo == -math.inf) and (hi is None or hi == math.inf)


def _out_axis(n: Node) -> int:
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
