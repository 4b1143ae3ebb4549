"""The real XNNPACK against the reference interpreter, for any payload.

``check_payload`` runs a payload on the real XNNPACK and in the interpreter with the same
random inputs and gives each output's relative error (``xnnquant verify``).

``first_divergence`` finds the first node where the runtime and the interpreter part
ways.  A copy of the graph marks every value a node computes as an extra external output
(except per-token int8 values, which XNNPACK keeps internal), and runs on the runtime:
that gives every intermediate value as XNNPACK computed it.  Then every node is evaluated
by the interpreter *on the runtime's own inputs to that node*, so each node is judged
alone and an error upstream cannot make a correct node look wrong.  The first node whose
output differs from the runtime's by more than ``TOLERANCE`` times the largest magnitude
of that output is reported, with the ATen op and module it was lowered from when known.
A qdint8 input, not observable, is recomputed from its producer's observed input (the
per-token quantization is bit-exact with XNNPACK's).

``TOLERANCE`` (1e-4, relative to a value's largest magnitude): float32 nodes differ by a
few ulps (sums in another order; XNNPACK's polynomial transcendentals are within 1e-6
relative), dynamically quantized products by the same, as their integer parts are exact.
A wrong kernel or a wrong lowering is off by far more.  Every comparison of a node or a
program against the interpreter in xnnquant uses it.

It holds on every x86-64 CPU class alike: a class changes the order of a sum (XNNPACK's f32
GEMMs add each output's K products in order with FMA from AVX2 up, Zen 1's rotate K within
blocks of 4, SSE2's small-N kernel keeps 4 partial sums; torch's kernels block K) and whether
products are fused, never the float32 unit roundoff the error is made of: a random walk of
about ``2^-24 sqrt(K)`` of the value, 1.6e-6 at K = 2048 in every one of those orders
(``tests/test_cpu_classes_numerics.py``).  Per-token quantization and the qd8 / qdu8 kernels'
integer sums are the same on every class.  Static int8 codes are compared bit for bit: the
same on every class but where a GEMM's scaled accumulator passes ``-2^31``
(``graph.int8``), which the static int8 rewrite never lets a layer reach.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..constants import FLT_MIN, MAX_NUM_EXTERNS
from ..datatypes import Datatype, storage
from .builder import Graph

#: Relative tolerance of a node-by-node or output comparison (see the module docstring).
TOLERANCE = 1e-4

def random_inputs(graph: Graph, seed: int = 0) -> list[np.ndarray]:
    """Standard-normal fp32/fp16 inputs, uniform codes for quantized ones, in input order."""
    rng = np.random.default_rng(seed)
    out = []
    for vid in graph.inputs:
        v = graph.value(vid)
        facts = storage(v.datatype)
        dtype = np.dtype(facts.numpy_dtype)
        if not facts.quantized:
            out.append(rng.standard_normal(v.dims).astype(dtype))
        else:
            info = np.iinfo(dtype)
            out.append(rng.integers(max(info.min, -1000), min(info.max, 1000), v.dims).astype(dtype))
    return out


def relative_errors(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> list[float]:
    """Per output: max |actual - reference| / max |reference| (0 for exact, inf for shape mismatch)."""
    errors = []
    for ref, got in zip(reference, actual):
        if ref.shape != got.shape:
            errors.append(float("inf"))
            continue
        r, g = ref.astype(np.float64), got.astype(np.float64)
        scale = max(float(np.abs(r).max(initial=0.0)), 1e-30)
        errors.append(float(np.abs(g - r).max(initial=0.0)) / scale)
    return errors


def check_payload(payload: bytes, named_data: Mapping[str, bytes] | None = None, seed: int = 0, *,
           isolate: bool = False, timeout: float | None = None) -> tuple[list[float], str]:
    """Run ``payload`` on the real XNNPACK and on the numpy interpreter with the same random
    inputs; return the per-output relative errors and a report.

    ``isolate`` and ``timeout``: see ``graph.run`` (with ``isolate=True`` a payload that
    crashes the runtime raises ``RuntimeCrashError`` instead of ending the process).
    """
    from . import interpret, load, run

    graph = load(payload, named_data)
    inputs = random_inputs(graph, seed)
    real = run(payload, inputs, named_data=named_data, isolate=isolate, timeout=timeout)
    ref = interpret(graph, inputs)
    errors = relative_errors(ref, real)
    lines = [f"output {i} {tuple(r.shape)}: max relative error {e:.3g}" for i, (r, e) in enumerate(zip(ref, errors))]
    return errors, "\n".join(lines)


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
    from . import run

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
    from .interpreter import _external_input, constant_values, evaluate_node

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
            exact = storage(graph.value(vid).datatype).quantized  # int8 codes: bit-exact or wrong
            checked += k == 0
            worst = max(worst, error)
            if not (error == 0 if exact else error <= tolerance):  # NaN counts as diverged
                handle = node.debug_handle
                source = sources[handle - 1] if 0 < handle <= len(sources) else None
                return Divergence(position, node.kind, vid, error, source), checked, worst
            env[vid] = observed[vid] if exact else observed[vid].astype(np.float32)  # codes stay codes
    return None, checked, worst


