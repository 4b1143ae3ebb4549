"""Full-integer static int8 (``xq.export(..., weights="qc8w", activations="qint8", calibration=...)``).

The lowering is the float one (every layer fp32); this package turns its graph into an
int8 one, in stages:

1. ``calibrate``: the float graph runs on the real XNNPACK over the calibration batches
   with every value a node computes exposed (``observe.Exposed``); ``ranges.ValueStats``
   keeps, per value, its exact bounds, its zeros and a sample of it, and
   ``bias_correction.InputMeans`` the sums of each filtered node's input.
2. ``rewrite.Rewrite``: cross-layer equalization of filtered pairs (optional,
   ``equalization.py``), a grid (scale, zero point) per value, shared where XNNPACK requires
   it (``grids.py``): by default the grid of
   least first-order error at the graph's outputs (``sensitivity.py``: the float graph in
   torch, ``torch_graph.py``, each element weighted by its own squared gradient), else from
   the value's histogram (``ranges.choose_range``); filters quantized per channel (codes
   nearest, or learned for the layer's output: ``rounding.py``), biases to int32; converts
   at the graph's edges and around each node that has no int8 form here or that mixed
   precision keeps fp32 (``mixed.py``: the nodes whose grids cost the outputs most, within a
   time budget), each a ``Boundary`` of the report; the result is an ``Int8Graph``
   (``int8_graph.py``).
3. ``bias_correction.correct_biases``: each bias re-quantized for the mean shift its
   quantized filter causes on the layer's float input means, which ``calibrate`` gathered
   (``bias_correction.InputMeans``).
4. ``measure``: the finished graph and the float graph on the real runtime over a few
   calibration inputs: the outputs' SQNR and each graph's run time (``Measured``, in the
   report; the export warns below ``report.ACCURACY_WARNING_DB``).

The self-check judges each int8 ATen node with its stored filter and bias, so it holds
for equalized filters as for any other; ``check.py`` also verifies that the equalized
float filters are the module's ones times their factors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import XnnquantError
from ...graph import Graph
from ...graph.rules import DATA_MOVEMENT, WEIGHTED
from ..evaluation import torch_threads
from ..exported import TensorIO
from ..options import StaticInt8
from .bias_correction import InputMeans, correct_biases
from .int8_graph import Boundary, Int8Graph
from .mixed import CostModel, cost_model
from .observe import Exposed, Measured, measure
from .ranges import ValueStats
from .rewrite import Rewrite

__all__ = ["Boundary", "Calibration", "Int8Graph", "Measured", "calibrate", "describe", "graph_batches", "measure",
           "quantize"]


def describe(graph: Graph, vid: int, sources: Sequence[tuple[str, str, str]], inputs: Sequence[TensorIO]) -> str:
    """How an error names value ``vid``: a program input by name, else the ATen node computing it."""
    if vid in graph.inputs:
        k = graph.inputs.index(vid)
        return f"input {k} ({inputs[k].name!r})" if k < len(inputs) else f"input {k}"
    for node in graph.nodes:
        if vid in node.outputs:
            h = node.debug_handle
            if 0 < h <= len(sources):
                op, name, path = sources[h - 1]
                return f"the output of {op} (node {name}, module {path or '<top level>'}; {node.kind} value {vid})"
            return f"the output of {node.kind} (value {vid})"
    return f"value {vid}"


def graph_batches(batches: Sequence[Sequence[Any]],
                  inputs: Sequence[TensorIO]) -> tuple[list[list[np.ndarray]], list[str]]:
    """The calibration batches (torch tensors in the module's order) as the graph takes them:
    float32, each input's dims in its declared dim order, and how an error names each
    (``"calibration batch 2"``); ``XnnquantError`` naming the batch and input that does not fit.

    A batch of ``m`` example inputs stacked along dim 0 (each input of shape ``(m * n, ...)``
    where the program takes ``(n, ...)``, the same ``m`` for every input: 32 images for a
    program of one) is cut into ``m`` inputs of the program's shape, in order: the program is
    calibrated on what it will be run on."""
    out, labels = [], []
    for i, batch in enumerate(batches):
        if len(batch) != len(inputs):
            raise XnnquantError(f"calibration batch {i} has {len(batch)} input(s): expected {len(inputs)}")
        arrays = []
        for j, (x, spec) in enumerate(zip(batch, inputs)):
            dtype = str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.")
            if dtype != "float32":
                raise XnnquantError(f"calibration batch {i}, input {j} ({spec.name!r}) is {dtype}: expected float32, "
                                    "as the example inputs")
            arrays.append(x.detach().numpy() if hasattr(x, "detach") else np.asarray(x))
        stacked = _stacked([a.shape for a in arrays], inputs)
        for piece in range(stacked):
            what = f"calibration batch {i}" + (f" (example {piece} of {stacked} along dim 0)" if stacked > 1 else "")
            one = []
            for j, (arr, spec) in enumerate(zip(arrays, inputs)):
                if stacked > 1:
                    n = spec.shape[0]
                    arr = arr[piece * n:(piece + 1) * n]
                spec.check(tuple(arr.shape), f"{what}, input {j}")
                one.append(np.ascontiguousarray(arr if spec.contiguous else np.transpose(arr, spec.dim_order)))
            out.append(one)
            labels.append(what)
    return out, labels


def _stacked(shapes: Sequence[tuple[int, ...]], inputs: Sequence[TensorIO]) -> int:
    """``m`` when every input of a batch is ``m >= 2`` of the program's inputs stacked along a
    static dim 0 (``graph_batches``), else 1."""
    counts = set()
    for shape, spec in zip(shapes, inputs):
        static = not spec.dynamic or all(d is None for d in spec.dynamic)
        if not static or not shape or len(shape) != len(spec.shape) or tuple(shape[1:]) != spec.shape[1:] \
                or spec.shape[0] < 1 or shape[0] % spec.shape[0]:
            return 1
        counts.add(shape[0] // spec.shape[0])
    return counts.pop() if len(counts) == 1 and min(counts) >= 2 else 1


@dataclass
class Calibration:
    """What calibration saw: ``stats`` by float value id, ``means``: per filtered node (by
    index) the per-tap means of its input over the batches (``bias_correction.InputMeans``),
    and the ``batches`` themselves (as the graph takes them: ranges by sensitivity run on some)."""

    stats: dict[int, ValueStats]
    means: dict[int, np.ndarray]
    batches: Sequence[Sequence[np.ndarray]] = ()


def calibrate(graph: Graph, batches: Sequence[Sequence[np.ndarray]], sources: Sequence[tuple[str, str, str]],
              inputs: Sequence[TensorIO], seed: int = 0, labels: Sequence[str] | None = None) -> Calibration:
    """``ValueStats`` of every float input and every value a computing node writes, by value id,
    and the input means of every filtered node (one run of the float graph per batch; an
    error names a batch by its label, ``graph_batches``)."""
    if not batches:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    filtered = [(i, n) for i, n in enumerate(graph.nodes) if n.kind in WEIGHTED]
    watched = [vid for n in graph.nodes if n.kind not in DATA_MOVEMENT for vid in n.outputs
               if not graph.value(vid).is_output]
    watched += [n.inputs[0] for _, n in filtered if not graph.value(n.inputs[0]).flags]
    watched = list(dict.fromkeys(watched))  # each value once, in order
    stats = {vid: ValueStats(describe(graph, vid, sources, inputs)) for vid in [*graph.inputs, *watched,
                                                                              *graph.outputs]}
    exposed = Exposed(graph, watched)
    rng = np.random.default_rng(seed)
    means = InputMeans(dict(filtered))
    with torch_threads(1):
        for b, batch in enumerate(batches):
            values = exposed.run(batch)
            label = labels[b] if labels is not None else f"calibration batch {b}"
            for vid, s in stats.items():
                if vid in values and values[vid].dtype == np.float32:
                    s.add(values[vid], rng, label)
            means.add(values)
    return Calibration(stats, means.means(), batches)


def estimate_for(cpu: str) -> tuple[CostModel, str]:
    """The time estimate's ratios for ``StaticInt8.cpu`` (a ``Cpu.int8_class``, or ``"this"``: this
    machine's), and the report line that says for which CPU they are, how this machine relates
    to it, and where the ratios come from."""
    from ...xnnpack.cpu import CLASS_NAMES, this_cpu

    here = this_cpu()
    chosen = here.int8_class if cpu == "this" else cpu
    costs = cost_model(chosen)
    if cpu == "this":
        whose = f"this machine's, {here.label}, as StaticInt8(cpu='this') asks"
    else:
        default = " (the default)" if cpu == StaticInt8().cpu else ""
        relation = ("is of that class" if here.int8_class == chosen else
                    f"runs {CLASS_NAMES[here.int8_class]} kernels: cpu='this' prices those")
        whose = f"StaticInt8(cpu={cpu!r}){default}; this machine, {here.label}, {relation}"
    return costs, (f"time estimate (which int8 nodes between fp32 ones stay fp32, what a budget buys) for "
                   f"{CLASS_NAMES[chosen]} kernels ({whose}): {costs.basis}")


@dataclass
class StaticResult:
    """What the static int8 stages made: the int8 graph (``int8``), the float graph it came
    from (``float_graph``) and what calibration saw of each float value (``stats``)."""

    int8: Int8Graph
    float_graph: Graph
    stats: dict[int, ValueStats]

    def value_sqnr(self, batches: Sequence[Sequence[np.ndarray]]) -> dict[int, float]:
        """SQNR (dB) of every float-graph value the int8 graph computes in int8, against the float
        graph's, over ``batches`` (as the graphs take them), both run on the real XNNPACK."""
        from ...graph import int8 as int8_math

        pairs = {fv: iv for fv, iv in self.int8.int8_of.items() if not self.float_graph.value(fv).is_constant
                 and not self.int8.graph.value(iv).is_constant}
        floats = Exposed(self.float_graph, [fv for fv in pairs if not self.float_graph.value(fv).flags])
        ints = Exposed(self.int8.graph, [iv for iv in pairs.values() if not self.int8.graph.value(iv).flags])
        factors = {e.value: e.factors for e in self.int8.equalized}
        signal = dict.fromkeys(pairs, 0.0)
        noise = dict.fromkeys(pairs, 0.0)
        for batch in batches:
            with torch_threads(1):
                f, q = floats.run(batch), ints.run(batch)
            for fv, iv in pairs.items():
                if fv in f and iv in q:
                    real = int8_math.dequantize(q[iv], *int8_math.quant(self.int8.graph.value(iv)))
                    if fv in factors:  # held divided by its equalization factors
                        real = real * factors[fv]
                    ref = f[fv].astype(np.float64)
                    signal[fv] += float(np.sum(ref * ref))
                    noise[fv] += float(np.sum((ref - real.reshape(ref.shape)) ** 2))
        return {fv: 10 * np.log10(signal[fv] / noise[fv]) if noise[fv] > 0 else np.inf for fv in pairs}


def quantize(graph: Graph, sources: Sequence[tuple[str, str, str]], rows: list[Any], filters: dict[int, Any],
             calibration: Calibration, *, ranges: str, percentile: float, method: str, bias_correction: bool,
             equalize: bool, budget: float = 0.0, rounding: str = "nearest",
             cpu: str = "avx512vnni") -> StaticResult:
    """Stages 2 and 3 of the module docstring on float graph ``graph``; with ``budget``, the graph
    is planned once to choose what mixed precision keeps in fp32 (``mixed.py``), then rewritten
    with those nodes fp32 from the start (equalization and grids planned around them).  ``cpu``:
    the ``Cpu.int8_class`` the time estimate prices (``StaticInt8.cpu``); the report says which."""
    costs, line = estimate_for(cpu)

    def rewrite(keep: dict[int, str] | None = None) -> Rewrite:
        return Rewrite(graph, sources, calibration.stats, rows, filters, ranges=ranges, percentile=percentile,
                       method=method, equalize=equalize, batches=calibration.batches, keep=keep,
                       rounding=rounding, costs=costs)

    planner = rewrite()
    lines: list[str] = []
    notes: list[str] = []
    if budget > 0:  # the choice reads the grids only: nearest codes while choosing
        planner.rounding = "nearest"
        planner.plan()
        keep, lines = planner.choose_float(budget)
        notes = [n for n in planner.result.notes if n.startswith("budget:")]  # the others recur below
        planner = rewrite(keep)
    result = planner.run()
    result.kept = lines
    result.estimate = line
    result.notes.extend(notes)
    if bias_correction:
        correct_biases(result, calibration.means)
    if calibration.batches:
        result.measured = measure(graph, result.graph, calibration.batches)
    return StaticResult(result, graph, calibration.stats)
