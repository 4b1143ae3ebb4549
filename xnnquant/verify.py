"""Run a payload on the real XNNPACK and on the reference interpreter with the same
inputs, and compare (``xnnquant verify``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .datatypes import storage
from .graph import Graph


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


def compare(reference: Sequence[np.ndarray], actual: Sequence[np.ndarray]) -> list[float]:
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


def verify(payload: bytes, named_data: Mapping[str, bytes] | None = None, seed: int = 0, *,
           isolate: bool = False, timeout: float | None = None) -> tuple[list[float], str]:
    """Run ``payload`` on the real XNNPACK and on the numpy interpreter with the same random
    inputs; return the per-output relative errors and a report.

    ``isolate`` and ``timeout``: see ``graph.run`` (with ``isolate=True`` a payload that
    crashes the runtime raises ``RuntimeCrashError`` instead of ending the process).
    """
    from .graph import interpret, load, run

    graph = load(payload, named_data)
    inputs = random_inputs(graph, seed)
    real = run(payload, inputs, named_data=named_data, isolate=isolate, timeout=timeout)
    ref = interpret(graph, inputs)
    errors = compare(ref, real)
    lines = [f"output {i} {tuple(r.shape)}: max relative error {e:.3g}" for i, (r, e) in enumerate(zip(ref, errors))]
    return errors, "\n".join(lines)
