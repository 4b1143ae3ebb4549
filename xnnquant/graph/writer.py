"""Graph -> payload bytes, through the flatc-generated builders of ``schema_generated``.

``to_bytes`` validates the graph, then writes (see header.py for the full layout)::

    XNNHeader (32 bytes) | XN01 flatbuffer | zeros to 16 | constant segment

The flatbuffer is built back to front by the flatbuffers runtime in a fixed order
(constants, values, nodes, graph), so the same graph always gives the same bytes.
Fields equal to their schema default are omitted, as flatc itself does.  The tables::

    XNNGraph  version "0", num_externs, input_ids / output_ids (id_out of the externals,
    │         in external-id order), constant_data (entry 0 = reserved (0, 0))
    ├─ xvalues[i]  XValue ─ XNNTensorValue (datatype, num_dims, dims always present,
    │                       constant_buffer_idx, external_id or 0xFFFFFFFF, flags, id_out = i)
    │              or XNNQuantizedTensorValue ─ tensor_value + quant_params (one of four)
    └─ xnodes[j]   XNode ─ the kind's table (ids, parameters, flags), debug_handle,
                           OutputMinMax when the node has bounds

test_graph_header.py spells out a whole minimal payload byte by byte.
"""

from __future__ import annotations

from typing import Any

import flatbuffers
import numpy as np

from ..constants import XNN_INVALID_VALUE_ID
from . import schema_generated as fb
from .header import XNNHeader, align
from .layout import NODE_KINDS, TABLES, UNIONS
from .model import (
    Node,
    PerChannelGroupQuant,
    PerChannelQuant,
    PerTensorQuant,
    PerTokenDynamicQuant,
    Value,
)
from .segment import ConstantSegment

FILE_IDENTIFIER = b"XN01"
_VECTOR_DTYPES = {"[u8]": "<u1", "[u16]": "<u2", "[u32]": "<u4", "[f32]": "<f4"}


def _camel(name: str) -> str:
    """``input1_id`` -> ``Input1Id``: the suffix flatc gives the generated adders."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _vector(b: flatbuffers.Builder, ftype: str, items: Any) -> int:
    return b.CreateNumpyVector(np.ascontiguousarray(items, dtype=_VECTOR_DTYPES[ftype]))


def _table_vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _table(b: flatbuffers.Builder, table: str, values: dict[str, Any]) -> int:
    """One table of ``table`` from ``{field: value}`` (scalars, or offsets already built)."""
    getattr(fb, f"{table}Start")(b)
    for name, _ in TABLES[table]:
        if name in values:
            getattr(fb, f"{table}Add{_camel(name)}")(b, values[name])
    return getattr(fb, f"{table}End")(b)


def _quant_table(b: flatbuffers.Builder, q: Any) -> tuple[int, int]:
    """(union tag, offset) of a quant-params table."""
    if isinstance(q, PerTensorQuant):
        fields = {"scale": q.scale, "zero_point": q.zero_point}
    elif isinstance(q, PerChannelQuant):
        fields = {"scale": _vector(b, "[f32]", q.scale), "channel_dim": q.channel_dim}
    elif isinstance(q, PerChannelGroupQuant):
        fields = {"scale": _vector(b, "[f32]", q.scale), "channel_dim": q.channel_dim, "group_size": q.group_size}
        if q.scale_bf16 is not None:
            fields["scale_bf16"] = _vector(b, "[u16]", q.scale_bf16)
    elif isinstance(q, PerTokenDynamicQuant):
        fields = {"num_nonbatch_dims": q.num_nonbatch_dims}
    else:
        raise AssertionError(f"unknown quant params {q!r}")
    table = type(q).__name__
    return UNIONS["XNNQuantParams"].index(table), _table(b, table, fields)


def _value(b: flatbuffers.Builder, v: Value, constant_idx: int) -> int:
    """An ``XValue`` wrapping an ``XNNTensorValue`` or ``XNNQuantizedTensorValue``."""
    quant = None if v.quant is None else _quant_table(b, v.quant)
    dims = _vector(b, "[u32]", v.dims)  # always present: the seed runtime reads it unconditionally
    tensor = _table(b, "XNNTensorValue", {
        "datatype": int(v.datatype), "num_dims": len(v.dims), "dims": dims,
        "constant_buffer_idx": constant_idx,
        "external_id": XNN_INVALID_VALUE_ID if v.external_id is None else v.external_id,
        "flags": v.flags, "id_out": v.id,
    })
    if quant is None:
        tag, inner = UNIONS["XValueUnion"].index("XNNTensorValue"), tensor
    else:
        tag = UNIONS["XValueUnion"].index("XNNQuantizedTensorValue")
        inner = _table(b, "XNNQuantizedTensorValue",
                       {"tensor_value": tensor, "quant_params_type": quant[0], "quant_params": quant[1]})
    return _table(b, "XValue", {"xvalue_union_type": tag, "xvalue_union": inner})


def node_fields(n: Node) -> dict[str, Any]:
    """The fields of node ``n``'s own table, by schema name (vectors as tuples).

    Inputs fill the kind's input fields in order; a missing optional input (bias, unused
    concatenation slots) is the invalid id 0xFFFFFFFF.
    """
    kind = NODE_KINDS[n.kind]
    fields: dict[str, Any] = {name: n.params[name] for name, _ in kind.param_fields if name in n.params}
    for i, name in enumerate(kind.input_fields):
        fields[name] = n.inputs[i] if i < len(n.inputs) else XNN_INVALID_VALUE_ID
    if kind.table == "_XNNCat":
        for name in ("input1_id", "input2_id", "input3_id", "input4_id"):
            fields.setdefault(name, XNN_INVALID_VALUE_ID)
    fields.update(zip(kind.output_fields, n.outputs))
    fields["flags"] = n.flags
    return fields


def _node(b: flatbuffers.Builder, n: Node) -> int:
    """An ``XNode``: the kind's own table, its output bounds, its debug handle."""
    kind = NODE_KINDS[n.kind]
    types = dict(TABLES[kind.table])
    fields = {name: _vector(b, types[name], value) if types[name].startswith("[") else value
              for name, value in node_fields(n).items()}
    inner = _table(b, kind.table, fields)
    node: dict[str, Any] = {"xnode_union_type": kind.tag, "xnode_union": inner, "debug_handle": n.debug_handle}
    if n.output_min is not None:
        node["output_min_max"] = _table(b, "OutputMinMax", {"output_min": n.output_min, "output_max": n.output_max})
    return _table(b, "XNode", node)


def _inline_buffers(b: flatbuffers.Builder, blobs: list[bytes]) -> int:
    """The deprecated ``constant_buffer`` vector: one ``Buffer`` table per blob.

    ``Buffer.storage`` (slot 0, ``[ubyte]``, 16-aligned) is deprecated in the schema, so
    the generated code has no adder for it; the slot is written directly.
    """
    tables = []
    for blob in blobs:
        b.StartVector(1, len(blob), 16)
        b.head -= len(blob)
        b.Bytes[b.head:b.head + len(blob)] = blob
        storage = b.EndVector()
        fb.BufferStart(b)
        b.PrependUOffsetTRelativeSlot(0, storage, 0)
        tables.append(fb.BufferEnd(b))
    return _table_vector(b, tables)


def flatbuffer(graph: Any, segment: ConstantSegment, *, inline_constants: bool = False,
               identifier: bytes = FILE_IDENTIFIER) -> bytes:
    """The flatbuffer of ``graph``; constants are added to ``segment`` on the way.

    ``inline_constants`` writes the legacy form instead, for payloads without a header:
    every constant inline in the deprecated ``XNNGraph.constant_buffer`` (entry 0 an empty
    reserved ``Buffer``), no ``constant_data``.  ``identifier``: ``XN01`` (what we write)
    or ``XN00`` (the runtime schema's, for tests of old payloads).
    """
    b = flatbuffers.Builder(1024)
    indices = [segment.add(v.constant) if v.constant is not None else 0 for v in graph.values]
    values = [_value(b, v, idx) for v, idx in zip(graph.values, indices)]
    nodes = [_node(b, n) for n in graph.nodes]
    if inline_constants:
        blobs = segment.blobs()
        segment.clear()  # the blobs travel inline, the segment stays empty
        constants = _inline_buffers(b, [b""] + blobs)
    else:
        entries = [_table(b, "ConstantDataOffset", {"offset": off, "size": size}) for off, size in segment.entries]
    root = {
        "version": b.CreateString(graph.version),
        "xnodes": _table_vector(b, nodes),
        "xvalues": _table_vector(b, values),
        "num_externs": graph.num_externs,
        "input_ids": _vector(b, "[u32]", graph.inputs),
        "output_ids": _vector(b, "[u32]", graph.outputs),
    }
    if not inline_constants:
        root["constant_data"] = _table_vector(b, entries)
    fb.XNNGraphStart(b)
    for name, value in root.items():
        getattr(fb, f"XNNGraphAdd{_camel(name)}")(b, value)
    if inline_constants:
        b.PrependUOffsetTRelativeSlot(TABLES["XNNGraph"].index(("constant_buffer", "[Buffer]")), constants, 0)
    b.Finish(fb.XNNGraphEnd(b), file_identifier=identifier)
    return bytes(b.Output())


def to_bytes(graph: Any) -> bytes:
    """Header + flatbuffer + zero padding to 16 + constant segment."""
    from .rules import validate

    validate(graph)
    segment = ConstantSegment()
    fbytes = flatbuffer(graph, segment)
    constants = segment.to_bytes()
    header = XNNHeader.for_sizes(len(fbytes), len(constants))
    pad = b"\0" * (align(len(fbytes)) - len(fbytes))
    return header.to_bytes() + fbytes + pad + constants
