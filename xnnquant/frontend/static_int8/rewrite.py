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

The choices of the rewrite have modules of their own: cross-layer equalization
(``equalization.py``), the grids (``grids.py``: one scale and zero point per group of values
that data movement links, each range chosen once), the islands of int8 nodes kept fp32 and
mixed precision's budget (``mixed.py``), learned rounding (``rounding.py``).  What the rewrite
gives is an ``int8_graph.Int8Graph``.  XNNPACK's own limits are kept here: a convolution whose
``input_scale * filter_scale / output_scale`` would reach 256 (XNNPACK refuses it), or whose
accumulator could reach ``ACCUMULATOR_STEPS`` output steps, gets its output scale raised
(``_fit_requantization``); an add, multiply or leaky ReLU whose ratios fall outside XNNPACK's
asserted ranges stays fp32 (reported, ``_ratio_refusal``).  (About 500 lines: planning and
emitting read the same refusals, grids and quantized filters of one ``Rewrite``.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...datatypes import Datatype
from ...graph import Graph
from ...graph.model import Node, PerTensorQuant, Value
from ...graph.rules import DATA_MOVEMENT, INT8_RATIO_RANGES, INT8_REFUSED, WEIGHTED
from ...schemes import quantize_bias, quantize_per_channel
from ...schemes.checks import check_method
from ...tensor import QuantizedTensor
from ..report import ReportRow
from ..weight_sqnr import weight_sqnr
from . import mixed, torch_graph
from .equalization import FloatFilters, equalize
from .grids import Grids, choose_grids
from .int8_graph import Boundary, Int8Graph, QuantizedLayer, where
from .ranges import ValueStats, grid_range
from .rounding import layer_grams, learned_filter

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
        self.equalize = equalize
        self.rows, self.filters = list(rows), filters
        self.ranges, self.percentile, self.method = ranges, percentile, method
        self.producer = {vid: n for n in graph.nodes for vid in n.outputs}
        self.readers: dict[int, list[int]] = {}  # value id -> the nodes (indices) reading it
        for i, n in enumerate(graph.nodes):
            for vid in n.inputs:
                self.readers.setdefault(vid, []).append(i)
        self.refusal: dict[int, str] = {}  # node index -> why it stays fp32
        self.grids = Grids(sources)  # every activation's grid, chosen by ``plan``
        self.domain: dict[int, Datatype] = {}  # float value id -> what its producer computes in
        self.filter_q: dict[int, QuantizedTensor] = {}
        self.floats = FloatFilters(graph)  # the float filters and biases, after equalization
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
            self.result.equalized.extend(equalize(src, self.refusal, self.stats, self.floats, self.producer,
                                                  self.readers))
        self.grids = choose_grids(src, self.stats, self.producer, self.floats, self.sources, ranges=self.ranges,
                                  percentile=self.percentile, batches=self.batches, equalized=self.result.equalized)
        self.result.sensitivity = self.grids.sensitivity
        self.result.notes.extend(self.grids.notes)
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
        """Keep fp32 the islands of int8 nodes between fp32 ones that the time estimate finds no
        faster in int8 (``mixed.fp32_islands``)."""
        self.refusal.update(mixed.fp32_islands(self.src, self.refusal, self.readers, self.costs))


    def choose_float(self, budget: float) -> tuple[dict[int, str], list[str]]:
        """After ``plan``: the nodes mixed precision keeps in fp32 within ``budget`` (``mixed.choose``)
        with their reasons, and one report line per step; nothing (and a note) without a
        sensitivity measurement."""
        measured = self.result.sensitivity
        if measured is None:
            self.result.notes.append("budget: nothing kept in fp32 (the choice prices each grid by the sensitivity "
                                     "measurement, which did not run: see ranges)")
            return {}, []
        costs = {root: measured.histograms[root].cost(*grid_range(*self.grids.grid_of[root]))
                 for root in self.grids.members if root in measured.histograms}
        refused = {i for i, r in self.refusal.items() if i not in self.keep}
        steps = mixed.choose(self.src, self.grids.members, costs, refused, budget, measured, self.costs)
        reasons: dict[int, str] = {}
        lines = []
        for step in steps:
            why = (f"kept in fp32 by budget={budget:g}: with {len(step.nodes) - 1} other node(s) it frees "
                   f"{len(step.groups)} int8 grid(s) whose error alone would leave the outputs {step.db:.1f} dB SQNR "
                   f"(first-order, {measured.inputs} calibration inputs), for {step.time:+.1%} estimated time")
            for i in step.nodes:
                reasons[i] = why
            names = sorted({where(self.sources, self.src.nodes[i].debug_handle) for i in step.nodes})
            lines.append(f"{'; '.join(names)}: {step.db:.1f} dB alone, {step.time:+.1%} time")
        return reasons, lines

    # ---------------------------------------------------------- quantizing

    def _filter(self, n: Node) -> QuantizedTensor:
        wid = n.inputs[1]
        if wid not in self.filter_q:
            w = self.floats.weight(wid)
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
        bias = self.floats.bias(self.src.nodes.index(n)).astype(np.float64)
        s_x = self.grids.quant(n.inputs[0])[0] if n.inputs[0] in self.grids.group_of else None
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
        s_x, zp_x = self.grids.grid(n.inputs[0], n)
        stored = self._filter(n)
        accumulator = (F32(s_x) * np.asarray(stored.scale, F32)).astype(F32)
        out = n.outputs[0]
        s_y, zp_y = self.grids.grid(out, n)
        need = float(np.max(accumulator)) / (MAX_REQUANTIZATION * (1 - 2**-10))
        reach = accumulator_reach(stored, zp_x) * accumulator + np.abs(self.floats.bias(self.src.nodes.index(n)))
        need = max(need, float(np.max(reach, initial=0.0)) / ACCUMULATOR_STEPS)
        if s_y < need:
            self.grids.grid_of[self.grids.group_of[out]] = (float(F32(need)), zp_y)

    def _ratio_refusal(self, n: Node) -> str | None:
        """Why a node's scale ratios fall outside XNNPACK's asserted ranges (``rules.INT8_RATIO_RANGES``)."""
        if n.kind not in INT8_RATIO_RANGES:
            return None
        scales = [self._operand_scale(i, n) for i in n.inputs[:2]]
        s_y = F32(self.grids.grid(n.outputs[0], n)[0])
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
        return self.grids.grid(vid, n)[0]

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
            res.boundaries.append(Boundary(where(self.sources, handle), "; ".join(reasons)))
        res.int8_handles = {n.debug_handle for i, n in enumerate(src.nodes) if i not in self.refusal
                            and n.kind not in DATA_MOVEMENT} - handles_float
        res.quant = {vid: self.grids.quant(vid) for vid in self.grids.group_of
                     if self.grids.group_of[vid] not in self.grids.unranged}
        res.filters = dict(self.floats.weights)
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
        scale, zero_point = self.grids.quant(vid)
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
        scale, zero_point = self.grids.grid(vid, n)
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
        w = self.floats.weight(n.inputs[1])
        i = self.src.nodes.index(n)
        bias = self.floats.bias(i)
        original = self.src.value(n.inputs[2]).array() if len(n.inputs) > 2 else np.zeros_like(bias)
        s_x = self.grids.quant(n.inputs[0])[0]
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
        equalized = self.floats.weights[vid]
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
