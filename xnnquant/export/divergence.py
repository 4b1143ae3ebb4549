"""``xq.verify``: the real XNNPACK against the reference interpreter and the float module,
and the first node where the runtime and the interpreter part ways.

Outputs.  The payload runs on the ExecuTorch 1.4.1 runtime and in the numpy interpreter
with the same inputs, and the float module (when given) runs in torch; each pair of the
three gets, per output, its SQNR (dB) and its largest absolute difference.

First diverging node.  A copy of the graph marks every value a node computes as an extra
external output (except per-token int8 values, which XNNPACK keeps internal), and runs on
the runtime: that gives every intermediate value as XNNPACK computed it.  Then every node
is evaluated by the interpreter *on the runtime's own inputs to that node*, so each node
is judged alone and an error upstream cannot make a correct node look wrong.  The first
node whose output differs from the runtime's by more than ``tolerance`` times the largest
magnitude of that output is reported, with the ATen op and module it was lowered from.
A qdint8 input, not observable, is recomputed from its producer's observed input (the
per-token quantization is bit-exact with XNNPACK's).

``tolerance`` (default 1e-4): float32 nodes differ by a few ulps (sums in another order,
XNNPACK's polynomial transcendentals are within 1e-6 relative); dynamically quantized
products by the same, as their integer parts are exact.  A wrong kernel or a wrong
lowering is off by far more.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import to_numpy
from ..constants import FLT_MIN, MAX_NUM_EXTERNS
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..graph import Graph

#: Relative tolerance of the node-by-node comparison (see the module docstring).
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Comparison:
    """One output compared between two computations."""

    output: int
    pair: str  # "runtime-interpreter", "runtime-module", "interpreter-module"
    sqnr_db: float
    max_abs_error: float


@dataclass(frozen=True)
class Divergence:
    """The first node whose runtime output differs from the interpreter's on the same inputs."""

    index: int  # position in graph.nodes
    kind: str
    value: int  # the output value compared
    relative_error: float  # max |runtime - interpreter| / max |interpreter|
    source: tuple[str, str, str] | None  # (ATen op, ATen node, module path) when known

    def __str__(self) -> str:
        origin = ""
        if self.source is not None:
            op, name, path = self.source
            origin = f", lowered from {op} (node {name}, module {path or '<top level>'})"
        return (f"node {self.index} ({self.kind}) output value {self.value}: relative error "
                f"{self.relative_error:.3g}{origin}")


@dataclass
class VerifyReport:
    """What ``verify`` found (``print`` it for a summary)."""

    comparisons: list[Comparison]
    nodes_checked: int
    tolerance: float
    first_divergence: Divergence | None
    worst_node_error: float = 0.0
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """No node diverged beyond the tolerance."""
        return self.first_divergence is None

    def __str__(self) -> str:
        lines = [f"{'output':<7}{'pair':<22}{'SQNR dB':>9}  {'max abs error':>13}"]
        for c in self.comparisons:
            sqnr = "exact" if math.isinf(c.sqnr_db) else f"{c.sqnr_db:.2f}"
            lines.append(f"{c.output:<7}{c.pair:<22}{sqnr:>9}  {c.max_abs_error:>13.3g}")
        verdict = (f"first diverging node: {self.first_divergence}" if self.first_divergence is not None else
                   f"no node diverges: {self.nodes_checked} nodes checked on the runtime's own inputs, worst relative "
                   f"error {self.worst_node_error:.3g} (tolerance {self.tolerance:g})")
        return "\n".join(lines + [verdict])


def _sqnr(reference: np.ndarray, approx: np.ndarray) -> float:
    ref = reference.astype(np.float64)
    noise = float(np.sum((approx.astype(np.float64) - ref) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _compare(name: str, a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> list[Comparison]:
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            raise XnnquantError(f"output {i}: {name} shapes differ: {x.shape} and {y.shape}")
        out.append(Comparison(i, name, _sqnr(y, x), float(np.max(np.abs(x - y), initial=0.0))))
    return out


def _graph_and_sources(subject: Any) -> tuple[Graph, list[tuple[str, str, str]]]:
    from ..graph import load
    from .exported import Exported

    if isinstance(subject, Exported):
        return subject.graph, subject.sources
    if isinstance(subject, Graph):
        return subject, []
    if isinstance(subject, (bytes, bytearray, memoryview, str)) or hasattr(subject, "__fspath__"):
        return load(subject), []
    raise XnnquantError(f"verify takes an Exported, a Graph, payload bytes or a path: got {type(subject).__name__}")


def observable(graph: Graph) -> list[int]:
    """Values a node computes that can be exposed as external outputs (not qdint8, not
    already external, not argmax-pooling indices), in node order."""
    seen = set()
    out = []
    for node in graph.nodes:
        for k, vid in enumerate(node.outputs):
            v = graph.value(vid)
            if v.flags or v.datatype is Datatype.qdint8 or vid in seen or (node.kind == "XNNArgMaxPooling2d" and k):
                continue
            seen.add(vid)
            out.append(vid)
    return out


def runtime_intermediates(graph: Graph, inputs: list[np.ndarray]) -> dict[int, np.ndarray]:
    """Every observable value as the real XNNPACK computes it: copies of ``graph`` with those
    values as extra outputs (in chunks, the runtime takes at most 4096 externals)."""
    from ..graph import run

    values = observable(graph)
    room = MAX_NUM_EXTERNS - graph.num_externs
    found: dict[int, np.ndarray] = {}
    for start in range(0, len(values), room):
        chunk = values[start:start + room]
        exposed = copy.copy(graph)  # values copied (their flags change), nodes and constants shared
        exposed.values = [copy.copy(v) for v in graph.values]
        exposed.nodes = list(graph.nodes)
        exposed.load_info = None  # a loaded graph's declared extern count no longer holds
        for vid in chunk:
            exposed.output(vid)
        results = run(exposed.to_bytes(), inputs)
        found.update(zip(chunk, results[len(graph.outputs):]))
    for vid, result in zip(graph.outputs, run(graph.to_bytes(), inputs)):
        found[vid] = result
    return found


def first_divergence(graph: Graph, inputs: list[np.ndarray], sources: list[tuple[str, str, str]],
                     tolerance: float = TOLERANCE) -> tuple[Divergence | None, int, float]:
    """(first diverging node or None, nodes checked, worst relative error) — see the module docstring."""
    from ..graph.interpreter import _external_input, constant_values, evaluate_node

    observed = runtime_intermediates(graph, inputs)
    env: dict[int, np.ndarray] = constant_values(graph)
    for i, (vid, x) in enumerate(zip(graph.inputs, inputs)):
        env[vid] = _external_input(graph.value(vid), x, i)
    computed: dict[int, np.ndarray] = {}
    worst, checked = 0.0, 0
    for position, node in enumerate(graph.nodes):
        args = [env[i] if i in env else computed[i] for i in node.inputs]
        results = evaluate_node(graph, node, args, position)
        for k, (vid, result) in enumerate(zip(node.outputs, results)):
            if vid not in observed:  # qdint8 (or indices): the interpreter's, from observed inputs
                computed[vid] = result
                continue
            got = np.asarray(observed[vid], np.float64)
            scale = max(float(np.max(np.abs(result), initial=0.0)), float(FLT_MIN))
            error = float(np.max(np.abs(got - result), initial=0.0)) / scale
            checked += k == 0
            worst = max(worst, error)
            if not error <= tolerance:  # NaN counts as diverged
                handle = node.debug_handle
                source = sources[handle - 1] if 0 < handle <= len(sources) else None
                return Divergence(position, node.kind, vid, error, source), checked, worst
            env[vid] = observed[vid].astype(np.float32)
    return None, checked, worst


def verify(subject: Any, inputs: Sequence[Any], module: Any = None, *, tolerance: float = TOLERANCE) -> VerifyReport:
    """Check ``subject`` (an ``Exported``, a ``Graph``, payload bytes or a path) on ``inputs``.

    ``inputs``: one array or tensor per graph input, in order (float32 for exported
    modules).  ``module``: the float ``torch.nn.Module`` to compare with, called as
    ``module(*inputs)``.  Returns a ``VerifyReport``: per-output SQNR and max error of
    runtime vs interpreter (and vs the module), and the first diverging node.
    """
    from ..graph import interpret, run
    from .exported import Exported

    graph, sources = _graph_and_sources(subject)
    if isinstance(inputs, (np.ndarray, str, bytes)) or not isinstance(inputs, Sequence):
        raise XnnquantError(f"verify takes a list of inputs, one per graph input: got {type(inputs).__name__}")
    given = [to_numpy(x, f"inputs[{i}]") for i, x in enumerate(inputs)]
    if len(given) != len(graph.inputs):
        raise XnnquantError(f"verify needs one input per graph input: got {len(given)}, expected {len(graph.inputs)}")
    layouts = subject if isinstance(subject, Exported) else None
    # the graph reads each input with its dims in the program's declared order (channels-last ones NHWC)
    arrays = [layouts._laid_out(x, spec, i) for i, (x, spec) in enumerate(zip(given, layouts.inputs))] \
        if layouts is not None else [np.ascontiguousarray(x) for x in given]
    payload = graph.to_bytes()
    results = {"runtime": run(payload, arrays), "interpreter": interpret(graph, arrays)}
    if layouts is not None:  # back to torch's dim order, to compare with the module
        results = {k: [r if spec.contiguous else np.transpose(r, np.argsort(spec.dim_order))
                       for r, spec in zip(v, layouts.outputs)] for k, v in results.items()}
    if module is not None:
        import torch

        with torch.no_grad():
            out = module(*[torch.from_numpy(np.ascontiguousarray(a)) for a in given])
        flat = out if isinstance(out, (tuple, list)) else (out,)
        results["module"] = [np.asarray(o.detach().numpy(), np.float32) for o in flat]
    comparisons = _compare("runtime-interpreter", results["runtime"], results["interpreter"])
    if module is not None:
        comparisons += _compare("runtime-module", results["runtime"], results["module"])
        comparisons += _compare("interpreter-module", results["interpreter"], results["module"])
    divergence, checked, worst = first_divergence(graph, arrays, sources, tolerance)
    return VerifyReport(comparisons, checked, tolerance, divergence, worst, results)
