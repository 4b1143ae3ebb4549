"""Full-integer static int8 (``xq.export(..., weights="qc8w", activations="qint8", calibration=...)``).

The lowering is the float one (every layer fp32); this package turns its graph into an
int8 one, in stages:

1. ``calibrate``: the float graph runs on the real XNNPACK over the calibration batches
   with every value a node computes exposed (``observe.Exposed``); ``ranges.ValueStats``
   keeps, per value, its exact bounds, its zeros and a sample of it.
2. ``rewrite.rewrite``: a grid (scale, zero point) per value from its range
   (``ranges.choose_range``), shared where XNNPACK requires it; filters quantized per
   channel, biases to int32; converts at the graph's edges and around each node that
   has no int8 form here, each a ``Boundary`` of the report.
3. ``bias_correction.correct_biases``: one pass of the int8 graph over the calibration
   batches re-quantizes each bias for the mean shift its quantized filter causes.

Cross-layer equalization happens before all this, on the ATen graph
(``passes/cross_layer.py``), so that the exported program itself (and so the self-check's
first comparison) holds the equalized filters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import XnnquantError
from ...graph import Graph
from ...graph.rules import DATA_MOVEMENT
from ..exported import TensorIO
from .bias_correction import correct_biases
from .observe import Exposed
from .ranges import ValueStats
from .rewrite import Boundary, Int8Graph, rewrite

__all__ = ["Boundary", "Int8Graph", "calibrate", "describe", "graph_batches", "quantize"]


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


def graph_batches(batches: Sequence[Sequence[Any]], inputs: Sequence[TensorIO]) -> list[list[np.ndarray]]:
    """The calibration batches (torch tensors in the module's order) as the graph takes them:
    float32, each input's dims in its declared dim order; ``XnnquantError`` naming the batch and
    input that does not fit."""
    out = []
    for i, batch in enumerate(batches):
        if len(batch) != len(inputs):
            raise XnnquantError(f"calibration batch {i} has {len(batch)} input(s): expected {len(inputs)}")
        arrays = []
        for j, (x, spec) in enumerate(zip(batch, inputs)):
            what = f"calibration batch {i}, input {j}"
            dtype = str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.")
            if dtype != "float32":
                raise XnnquantError(f"{what} ({spec.name!r}) is {dtype}: expected float32, as the example inputs")
            arr = x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)
            spec.check(tuple(arr.shape), what)
            arrays.append(np.ascontiguousarray(arr if spec.contiguous else np.transpose(arr, spec.dim_order)))
        out.append(arrays)
    return out


def calibrate(graph: Graph, batches: Sequence[Sequence[np.ndarray]], sources: Sequence[tuple[str, str, str]],
              inputs: Sequence[TensorIO], seed: int = 0) -> dict[int, ValueStats]:
    """``ValueStats`` of every float input and every value a computing node writes, by value id."""
    watched = [vid for n in graph.nodes if n.kind not in DATA_MOVEMENT for vid in n.outputs
               if not graph.value(vid).is_output]
    stats = {vid: ValueStats(describe(graph, vid, sources, inputs)) for vid in [*graph.inputs, *watched,
                                                                              *graph.outputs]}
    exposed = Exposed(graph, watched)
    rng = np.random.default_rng(seed)
    for batch in batches:
        values = exposed.run(batch)
        for vid, s in stats.items():
            if vid in values and values[vid].dtype == np.float32:
                s.add(values[vid], rng)
    return stats


@dataclass
class StaticResult:
    """The int8 graph and how long its stages took (seconds)."""

    int8: Int8Graph
    stats: dict[int, ValueStats]


def quantize(graph: Graph, sources: Sequence[tuple[str, str, str]], rows: list[Any], filters: dict[int, Any],
             inputs: Sequence[TensorIO], batches: Sequence[Sequence[np.ndarray]], *, ranges: str,
             percentile: float, method: str, bias_correction: bool,
             stats: dict[int, ValueStats] | None = None) -> StaticResult:
    """Stages 1 to 3 of the module docstring on float graph ``graph``."""
    if stats is None:
        stats = calibrate(graph, batches, sources, inputs)
    result = rewrite(graph, sources, stats, rows, filters, ranges=ranges, percentile=percentile, method=method)
    if bias_correction:
        correct_biases(result, batches)
    return StaticResult(result, stats)
