"""Human-readable summaries of payloads, for ``xnnquant inspect``."""

from __future__ import annotations

from collections import Counter
from typing import Any

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
