"""Human-readable summaries of payloads, for ``xnnquant inspect``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from ..graph import Graph
from ..graph.model import PerChannelGroupQuant, PerChannelQuant, PerTensorQuant, PerTokenDynamicQuant, Value


def _quant(value: Value) -> str:
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


# ---------------------------------------------------------------------- records (--json) and .pte files


def scale_bytes(value: Any) -> int:
    """Bytes the value's scales take where the payload keeps them: bf16 (2 each) or fp32
    (4 each) in named data when ``scale_buffer_idx`` is set (ExecuTorch 1.4.1), else the
    inline fp32 list plus the inline bf16 list when present."""
    q = value.quant
    if isinstance(q, PerChannelGroupQuant):
        if q.scale_buffer_idx:
            return 2 * q.num_scales
        return 4 * q.scale.size + (2 * q.scale_bf16.size if q.scale_bf16 is not None else 0)
    if isinstance(q, PerChannelQuant):
        return 4 * (q.num_scales if q.scale_buffer_idx else q.scale.size)
    return 0


def _quant_record(value: Any) -> dict[str, Any] | None:
    q = value.quant
    if q is None:
        return None
    record: dict[str, Any] = {"kind": type(q).__name__}
    if isinstance(q, PerTensorQuant):
        record.update(scale=q.scale, zero_point=q.zero_point)
    elif isinstance(q, PerTokenDynamicQuant):
        record.update(num_nonbatch_dims=q.num_nonbatch_dims)
    else:
        named = bool(q.scale_buffer_idx)
        bf16 = isinstance(q, PerChannelGroupQuant) and (named or q.scale_bf16 is not None)
        record.update(channel_dim=q.channel_dim, num_scales=int(q.num_scales if named else q.scale.size),
                      scale_dtype="bf16" if bf16 else "fp32", scales_in_named_data=named)
        if isinstance(q, PerChannelGroupQuant):
            record.update(group_size=q.group_size)
    return record


def _finite(x: float | None) -> float | str | None:
    """A float for JSON: infinities as the strings "inf" / "-inf"."""
    if x is None or np.isfinite(x):
        return x
    return "inf" if x > 0 else "-inf"


def graph_record(graph: Graph) -> dict[str, Any]:
    """The values, nodes and bytes by datatype of a graph, as JSON-ready data.

    Each value: ``id``, ``datatype``, ``shape``, ``external_id`` and ``role`` (``"input"``,
    ``"output"`` or None), ``bytes`` (constant data, 0 for activations), ``scale_bytes``,
    ``named_key`` and ``quant`` (kind, channel dim, group size, number and dtype of
    scales; None when not quantized).
    """
    values = []
    for v in graph.values:
        role = "input" if v.is_input else "output" if v.is_output else None
        values.append({
            "id": v.id, "datatype": v.datatype.name, "shape": [int(d) for d in v.dims],
            "external_id": v.external_id, "role": role,
            "bytes": len(v.constant) if v.constant is not None else 0, "scale_bytes": scale_bytes(v),
            "named_key": v.named_key, "quant": _quant_record(v),
        })
    nodes = [{"kind": n.kind, "inputs": list(n.inputs), "outputs": list(n.outputs), "flags": n.flags,
              "output_min": _finite(n.output_min), "output_max": _finite(n.output_max)} for n in graph.nodes]
    return {"values": values, "nodes": nodes, "bytes_by_datatype": bytes_by_datatype([values])}


def bytes_by_datatype(value_lists: list[list[dict[str, Any]]]) -> dict[str, dict[str, int]]:
    """Datatype -> number of constants, their data bytes and scale bytes (constants only),
    largest first."""
    totals: dict[str, dict[str, int]] = {}
    for values in value_lists:
        for v in values:
            if v["bytes"] or v["scale_bytes"]:
                t = totals.setdefault(v["datatype"], {"constants": 0, "bytes": 0, "scale_bytes": 0})
                t["constants"] += 1
                t["bytes"] += v["bytes"]
                t["scale_bytes"] += v["scale_bytes"]
    return dict(sorted(totals.items(), key=lambda kv: -(kv[1]["bytes"] + kv[1]["scale_bytes"])))


def describe_bytes(totals: dict[str, dict[str, int]]) -> str:
    """One line: ``qbint4 3 constants 8,192 B + 1,024 B scales; fp32 ...``."""
    if not totals:
        return "no constants"
    parts = []
    for name, t in totals.items():
        scales = f" + {t['scale_bytes']:,} B scales" if t["scale_bytes"] else ""
        parts.append(f"{name} {t['constants']} constant{'s' * (t['constants'] != 1)} {t['bytes']:,} B{scales}")
    return "; ".join(parts)


def program_record(program: Any, name: str = "") -> dict[str, Any]:
    """A ``read_pte`` result as JSON-ready data: the file, its methods, each XNNPACK
    delegate (``graph_record`` plus method, index, location, payload and named-data bytes),
    the delegates of other backends, and bytes by datatype over all delegates."""
    delegates = []
    for d in program.delegates:
        record = {"name": d.name, "method": d.method, "index": d.index, "location": d.location,
                  "payload_bytes": len(d.payload), "named_data_bytes": sum(len(b) for b in d.named_data.values())}
        record.update(graph_record(d.graph))
        delegates.append(record)
    return {
        "file": name, "bytes": len(program.data), "methods": list(program.methods), "delegates": delegates,
        "other_delegates": [{"method": m, "index": i, "backend": b} for m, i, b in program.other_delegates],
        "named_data": {"blobs": len(program.named_data), "bytes": sum(len(b) for b in program.named_data.values()),
                       "origins": sorted(set(program.named_data_origin.values()))},
        "bytes_by_datatype": bytes_by_datatype([d["values"] for d in delegates]),
    }


def describe_program(program: Any, name: str = "") -> str:
    """``describe`` for every XNNPACK delegate of a ``read_pte`` result, with the program's
    methods and bytes by datatype per delegate and in total."""
    record = program_record(program, name)
    named = record["named_data"]
    lines = [f"program {name or '(bytes)'}: {record['bytes']:,} bytes, methods {', '.join(record['methods'])}; "
             f"{len(record['delegates'])} XNNPACK delegate(s); named data {named['blobs']} blobs, "
             f"{named['bytes']:,} bytes (from {', '.join(named['origins']) or 'nowhere'})"]
    for other in record["other_delegates"]:
        lines.append(f"other delegate {other['method']}/{other['index']}: {other['backend']} (not read)")
    for d, delegate in zip(record["delegates"], program.delegates):
        lines.append("")
        lines.append(f"delegate {d['name']} ({d['location']}, payload {d['payload_bytes']:,} bytes, "
                     f"{len(delegate.named_data)} named blobs {d['named_data_bytes']:,} bytes)")
        lines.extend("  " + line for line in describe(delegate.graph).splitlines())
        lines.append("  bytes by datatype: " + describe_bytes(d["bytes_by_datatype"]))
    lines.append("")
    lines.append("bytes by datatype, all delegates: " + describe_bytes(record["bytes_by_datatype"]))
    return "\n".join(lines)
