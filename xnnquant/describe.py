"""Human-readable summaries of payloads, for ``xnnquant inspect`` and ``xnnquant verify``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .graph import Graph
from .graph.model import PerChannelGroupQuant, PerChannelQuant, PerTensorQuant, PerTokenDynamicQuant


def _quant(value: Any) -> str:
    q = value.quant
    if isinstance(q, PerTensorQuant):
        return f"scale {q.scale:.6g}, zero point {q.zero_point}"
    if isinstance(q, PerChannelQuant):
        return f"{q.scale.size} scales on dim {q.channel_dim}"
    if isinstance(q, PerChannelGroupQuant):
        bf16 = "+bf16" if q.scale_bf16 is not None else ""
        return f"{q.scale.size}{bf16} scales, group {q.group_size}"
    if isinstance(q, PerTokenDynamicQuant):
        return f"per token, {q.num_nonbatch_dims} non-batch dim(s)"
    return ""


def describe(graph: Graph) -> str:
    """Values (with external ids, constants and quantization) and nodes, one line each."""
    lines = [f"{len(graph.values)} values, {len(graph.nodes)} nodes, {graph.num_externs} externals"]
    counts = Counter(node.kind for node in graph.nodes)
    lines.append("node kinds: " + ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())))
    lines.append("values:")
    for v in graph.values:
        role = "input" if v.is_input else "output" if v.is_output else ""
        where = f"external {v.external_id} {role}" if v.external_id is not None else ""
        data = (f"{len(v.constant)} bytes" if v.constant is not None
                else f"named {v.named_key[:16]}..." if v.named_key else "")
        parts = [p for p in (where, data, _quant(v)) if p]
        lines.append(f"  %{v.id:<4} {v.datatype.name:<7} {list(v.dims)!s:<16} " + "; ".join(parts))
    lines.append("nodes:")
    for i, n in enumerate(graph.nodes):
        ins = ", ".join(f"%{x}" for x in n.inputs)
        outs = ", ".join(f"%{x}" for x in n.outputs)
        clamp = ""
        if n.output_min is not None or n.output_max is not None:
            clamp = f"  clamp [{n.output_min}, {n.output_max}]"
        lines.append(f"  {i:<4} {outs} = {n.kind}({ins}){clamp}")
    return "\n".join(lines)


def random_inputs(graph: Graph, seed: int = 0) -> list[np.ndarray]:
    """Standard-normal fp32/fp16 inputs, uniform codes for quantized ones, in input order."""
    rng = np.random.default_rng(seed)
    out = []
    for vid in graph.inputs:
        v = graph.value(vid)
        dtype = np.dtype(v.datatype.name.replace("fp", "float")) if v.datatype.name.startswith("fp") else None
        if dtype is not None:
            out.append(rng.standard_normal(v.dims).astype(dtype))
        else:
            info = np.iinfo({"qint8": np.int8, "quint8": np.uint8, "qint32": np.int32}[v.datatype.name])
            out.append(rng.integers(max(info.min, -1000), min(info.max, 1000), v.dims).astype(info.dtype))
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


def verify(payload: bytes, named_data: Mapping[str, bytes] | None = None, seed: int = 0) -> tuple[list[float], str]:
    """Run ``payload`` on the real XNNPACK and on the numpy interpreter with the same random
    inputs; return the per-output relative errors and a report."""
    from .graph import interpret, load, run

    graph = load(payload, named_data)
    inputs = random_inputs(graph, seed)
    real = run(payload, inputs, named_data=named_data)
    ref = interpret(graph, inputs)
    errors = compare(ref, real)
    lines = [f"output {i} {tuple(r.shape)}: max relative error {e:.3g}" for i, (r, e) in enumerate(zip(ref, errors))]
    return errors, "\n".join(lines)
