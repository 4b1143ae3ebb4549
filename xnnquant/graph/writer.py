"""Graph -> payload bytes, through the flatc-generated builders of ``schema_generated``.

``to_bytes`` validates the graph, then writes (see header.py for the full layout)::

    XNNHeader (32 bytes) | XN01 flatbuffer | zeros to 16 | constant segment

The flatbuffer is built back to front by the flatbuffers runtime in a fixed order
(constants, values, nodes, graph), so the same graph always gives the same bytes.
The builders are those generated from ``schema.fbs`` (XN01); a graph that uses one of
the node kinds ExecuTorch 1.4.1 appended is written with those of ``schema_141.fbs``,
whose tables extend XN01's without moving a slot (a graph of XN01 kinds gives the same
bytes with either, as the vtables of both end at the last field present).
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

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import flatbuffers
import numpy as np

from ..constants import XNN_INVALID_VALUE_ID
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..rounding import to_bf16
from ..tensor import QuantizedTensor
from . import schema_141_generated, schema_generated
from .header import XNNHeader, align
from .layout import NODE_KINDS, TABLES, UNIONS
from .layout import fields as table_fields
from .model import (
    ConstantData,
    Deferred,
    Node,
    PerChannelGroupQuant,
    PerChannelQuant,
    PerTensorQuant,
    PerTokenDynamicQuant,
    QuantParams,
    Value,
)
from .segment import ConstantSegment
from .targets import Target

if TYPE_CHECKING:
    from .builder import Graph

FILE_IDENTIFIER = b"XN01"
_VECTOR_DTYPES = {"[u8]": "<u1", "[u16]": "<u2", "[u32]": "<u4", "[f32]": "<f4"}


def _camel(name: str) -> str:
    """``input1_id`` -> ``Input1Id``: the suffix flatc gives the generated adders."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _vector(b: _Builder, ftype: str, items: Any) -> int:
    return b.CreateNumpyVector(np.ascontiguousarray(items, dtype=_VECTOR_DTYPES[ftype]))


def _table_vector(b: _Builder, offsets: list[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def generated_code(graph: Graph) -> ModuleType:
    """The generated module to write ``graph`` with: XN01's unless a node needs 1.4.1's."""
    xn01 = Target.XN01.node_kinds
    return schema_generated if all(n.kind in xn01 for n in graph.nodes) else schema_141_generated


class _Builder(flatbuffers.Builder):
    """A flatbuffers builder that knows which generated module's builders to call."""

    def __init__(self, code: ModuleType, size: int = 1024) -> None:
        super().__init__(size)
        self.code = code


@functools.cache
def _table_writer(code: ModuleType, table: str) -> tuple[Callable[..., Any], tuple[tuple[str, Any, int], ...],
                                                         Callable[..., int]]:
    """(start, ((field, adder or None, slot index), ...), end) of ``table`` in ``code``:
    looked up once per table instead of once per field written."""
    fields = []
    for index, (name, ftype) in enumerate(table_fields(table)):
        adder = getattr(code, f"{table}Add{_camel(name)}", None)
        if adder is None and not ftype.startswith("["):
            continue  # a scalar this schema lacks (e.g. dq_datatype): never written
        fields.append((name, adder, index))
    return getattr(code, f"{table}Start"), tuple(fields), getattr(code, f"{table}End")


def _table(b: _Builder, table: str, values: dict[str, Any]) -> int:
    """One table of ``table`` from ``{field: value}`` (scalars, or offsets already built).

    A field the generated code has no adder for (``scale_bf16``, deprecated in 1.4.1's
    schema) is written into its slot directly, as flatc's adder would.
    """
    start, fields, end = _table_writer(getattr(b, "code", schema_generated), table)  # plain Builder: XN01
    start(b)
    for name, adder, index in fields:
        if name in values:
            if adder is not None:
                adder(b, values[name])
            else:
                b.PrependUOffsetTRelativeSlot(index, values[name], 0)
    return end(b)


def _quant_table(b: _Builder, q: QuantParams, scale_buffer: tuple[int, int] | None = None) -> tuple[int, int]:
    """(union tag, offset) of a quant-params table.

    ``scale_buffer`` = (constant_data index, number of scales): the scales live in the
    constant segment (``Graph.scales_in_segment``) and the table keeps an empty ``scale``
    vector, which the runtime dereferences even then.
    """
    if scale_buffer is not None:
        assert isinstance(q, (PerChannelQuant, PerChannelGroupQuant))  # only these have scale buffers
        table = type(q).__name__
        fields: dict[str, Any] = {"scale": _vector(b, "[f32]", ()), "channel_dim": q.channel_dim,
                  "scale_buffer_idx": scale_buffer[0], "num_scales": scale_buffer[1]}
        if isinstance(q, PerChannelGroupQuant):
            fields["group_size"] = q.group_size
        return UNIONS["XNNQuantParams"].index(table), _table(b, table, fields)
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


def _value(b: _Builder, v: Value, constant_idx: int, scale_buffer: tuple[int, int] | None = None) -> int:
    """An ``XValue`` wrapping an ``XNNTensorValue`` or ``XNNQuantizedTensorValue``."""
    quant = None if v.quant is None else _quant_table(b, v.quant, scale_buffer)
    dims = _vector(b, "[u32]", v.dims)  # always present: runtimes before 1.4.1 read it unconditionally
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


@functools.cache
def _field_types(table: str) -> dict[str, str]:
    return dict(table_fields(table))


def _node(b: _Builder, n: Node) -> int:
    """An ``XNode``: the kind's own table, its output bounds, its debug handle."""
    kind = NODE_KINDS[n.kind]
    types = _field_types(kind.table)
    fields = {name: _vector(b, types[name], value) if types[name].startswith("[") else value
              for name, value in node_fields(n).items()}
    inner = _table(b, kind.table, fields)
    node: dict[str, Any] = {"xnode_union_type": kind.tag, "xnode_union": inner, "debug_handle": n.debug_handle}
    if n.output_min is not None:
        node["output_min_max"] = _table(b, "OutputMinMax", {"output_min": n.output_min, "output_max": n.output_max})
    return _table(b, "XNode", node)


def _inline_buffers(b: _Builder, blobs: list[bytes | memoryview]) -> int:
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
        b.code.BufferStart(b)
        b.PrependUOffsetTRelativeSlot(0, storage, 0)
        tables.append(b.code.BufferEnd(b))
    return _table_vector(b, tables)


def _eager(constant: ConstantData) -> bytes | memoryview:
    """Constant data that exists already: ``Graph.constant`` defers data only with
    ``scales_in_segment``, whose graphs the segment plan writes."""
    assert not isinstance(constant, Deferred)
    return constant


def flatbuffer(graph: Graph, segment: ConstantSegment, *, inline_constants: bool = False,
               identifier: bytes = FILE_IDENTIFIER, named_prefix: str | None = None) -> bytes:
    """The flatbuffer of ``graph``; constants are added to ``segment`` on the way.

    ``named_prefix``: every ``constant_data`` entry after the reserved one names its bytes
    instead of placing them (``named_payload``): ``{offset: UINT64_MAX, size, named_key:
    named_prefix + str(index)}``, as ExecuTorch 1.4.1's own flow writes its constants.

    ``inline_constants`` writes the legacy form instead, for payloads without a header:
    every constant inline in the deprecated ``XNNGraph.constant_buffer`` (entry 0 an empty
    reserved ``Buffer``), no ``constant_data``.  ``identifier``: ``XN01`` (what we write)
    or ``XN00`` (the runtime schema's, for tests of old payloads).
    """
    plan = SegmentPlan.of(graph) if getattr(graph, "scales_in_segment", False) else None
    # schema_141_generated: the only generated code with scale_buffer_idx and named_key
    b = _Builder(schema_141_generated if plan is not None or named_prefix is not None else generated_code(graph))
    if plan is not None:
        values = [_value(b, v, plan.data_index.get(v.id, 0), plan.scale_buffer(v.id)) for v in graph.values]
        segment.entries[1:] = plan.entries[1:]
    else:
        indices = [segment.add(_eager(v.constant)) if v.constant is not None else 0 for v in graph.values]
        values = [_value(b, v, idx) for v, idx in zip(graph.values, indices)]
    nodes = [_node(b, n) for n in graph.nodes]
    if inline_constants:
        blobs = segment.blobs()
        segment.clear()  # the blobs travel inline, the segment stays empty
        constants = _inline_buffers(b, [b"", *blobs])
    elif named_prefix is not None:
        entries = [_table(b, "ConstantDataOffset", {"offset": 0, "size": 0})] + [
            _table(b, "ConstantDataOffset", {"offset": NAMED_OFFSET, "size": size,
                                             "named_key": b.CreateString(f"{named_prefix}{i}")})
            for i, (_, size) in enumerate(segment.entries[1:], 1)]
    else:
        entries = [_table(b, "ConstantDataOffset", {"offset": off, "size": size}) for off, size in segment.entries]
    root = {
        "version": b.CreateString("0" if graph.load_info is None else graph.load_info.version),
        "xnodes": _table_vector(b, nodes),
        "xvalues": _table_vector(b, values),
        "num_externs": graph.num_externs,
        "input_ids": _vector(b, "[u32]", graph.inputs),
        "output_ids": _vector(b, "[u32]", graph.outputs),
    }
    if not inline_constants:
        root["constant_data"] = _table_vector(b, entries)
    b.code.XNNGraphStart(b)
    for name, value in root.items():
        getattr(b.code, f"XNNGraphAdd{_camel(name)}")(b, value)
    if inline_constants:
        b.PrependUOffsetTRelativeSlot(TABLES["XNNGraph"].index(("constant_buffer", "[Buffer]")), constants, 0)
    b.Finish(b.code.XNNGraphEnd(b), file_identifier=identifier)
    return bytes(b.Output())


def to_bytes(graph: Graph) -> bytes:
    """Header + flatbuffer + zero padding to 16 + constant segment."""
    if getattr(graph, "scales_in_segment", False):
        return b"".join(payload_chunks(graph))
    from .rules import validate

    validate(graph)
    segment = ConstantSegment()
    fbytes = flatbuffer(graph, segment)
    constants = segment.to_bytes()
    header = XNNHeader.for_sizes(len(fbytes), len(constants))
    pad = b"\0" * (align(len(fbytes)) - len(fbytes))
    return header.to_bytes() + fbytes + pad + constants


#: ``ConstantDataOffset.offset`` of a constant found by its ``named_key`` (ExecuTorch's value).
NAMED_OFFSET = 2**64 - 1


class NamedPayload(NamedTuple):
    """A delegate's payload and its constants as the ``.pte``'s named data (``named_payload``)."""

    payload: bytes
    named: list[tuple[str, Any]]  # (key, bytes or pte.builder.Chunked), in entry order


def named_payload(graph: Graph, prefix: str) -> NamedPayload:
    """(payload, named data) of ``graph`` with its constants outside the payload.

    A ``.pte`` must hold an XNNPACK delegate's constants as named data: ExecuTorch's XNNPACK
    backend frees the delegate's bytes once the runtime is built, and XNNPACK keeps pointers
    into them for every constant it does not pack (the operand of a multiply, a PReLU's
    slope).  A program loaded from bytes in memory survives that (freeing a buffer the
    loader does not own does nothing); one loaded from a file reads freed memory (measured:
    SIGSEGV on the first call of ``x * g + b``).  Named data lives as long as the method.

    The payload is the header, the flatbuffer (every entry named ``prefix + index``, see
    ``flatbuffer``) and its padding, with an empty constant segment::

        XNNHeader (constant segment size 0) | XN01 flatbuffer | zeros to 16

    The named data is ``[(prefix + index, blob)]`` in entry order: bytes, or for a graph
    with ``scales_in_segment`` a ``pte.builder.Chunked`` made when it is written (a
    ``Deferred`` value's data, then its scales, one value in memory at a time).  In the
    ``.pte`` (``pte.writer``) each blob is a segment of its own, found by its key::

        constant_data[i] = {offset: UINT64_MAX, size: n_i, named_key: prefix + str(i)}   (i >= 1)
        Program.named_data[k] = {key: prefix + str(i), segment_index: s}
        .pte:  ... | segment: payload | segment s: blob i (n_i bytes, at a multiple of 128) | ...
    """
    from ..pte.builder import Chunked
    from .rules import validate

    validate(graph)
    segment = ConstantSegment()
    fbytes = flatbuffer(graph, segment, named_prefix=prefix)
    header = XNNHeader.for_sizes(len(fbytes), 0).to_bytes()
    payload = header + fbytes + bytes(align(len(fbytes)) - len(fbytes))
    if not getattr(graph, "scales_in_segment", False):
        return NamedPayload(payload, [(f"{prefix}{i}", blob) for i, blob in enumerate(segment.blobs(), 1)])
    made: dict[int, bytes] = {}  # value id -> its scales, made with its data
    return NamedPayload(payload, [(f"{prefix}{i}", Chunked(blob.size, _Made(blob, made)))
                                  for i, blob in enumerate(SegmentPlan.of(graph).blobs, 1)])


@dataclass
class _Made:
    """One blob of ``named_payload``, made each time it is iterated (a program may be written
    twice): a value's data, then its scales, which the data's making left in ``made`` (made
    again when the scales are read first: the writer compares a blob with the program's
    constants before writing it, ``pte.writer.SegmentLayout.of``)."""

    blob: Blob
    made: dict[int, bytes]

    def __iter__(self) -> Iterator[bytes | memoryview]:
        if self.blob.part == "data":
            data, self.made[self.blob.value.id] = _constant_parts(self.blob.value)
            yield data
        else:
            scales = self.made.pop(self.blob.value.id, None)
            yield _constant_parts(self.blob.value)[1] if scales is None else scales


# ------------------------------------------------------------ scales in the segment


class Blob(NamedTuple):
    """One entry of the constant segment: a value's ``data`` or its ``scales``."""

    value: Value
    part: str  # "data" or "scales"
    size: int


def num_scales(v: Value) -> int:
    """Scales a per-channel or blockwise constant stores (0 for any other value)."""
    if isinstance(v.constant, Deferred):
        return v.constant.num_scales
    if isinstance(v.quant, (PerChannelQuant, PerChannelGroupQuant)):
        return int(v.quant.scale.size)
    return 0


def scale_bytes(datatype: Datatype, scale: np.ndarray) -> bytes:
    """Scales as the segment holds them: bf16 bit patterns (qbint4) or float32, little-endian."""
    if datatype is Datatype.qbint4:
        return to_bf16(np.asarray(scale, np.float32).ravel()).bits.astype("<u2").tobytes()
    return np.ascontiguousarray(scale, "<f4").ravel().tobytes()


@dataclass
class SegmentPlan:
    """Where every constant goes when scales live in the constant segment.

    The segment holds, for each constant value in id order, its data, then (per-channel
    and blockwise values) its scales: bf16 bit patterns for qbint4 (as ExecuTorch 1.4.1
    stores them), float32 for the per-channel datatypes; each entry 16-aligned::

        constant_data[0]   (0, 0) reserved
        value a: data      (0, n_a)           bytes, zeros to 16
        value a: scales    (align16(n_a), s)  qbint4: u16 LE bf16 [OC][IC/G]; qc*: f32 LE [C]
        value b: data      ...

    Nothing is shared between values (identical bytes are stored twice), so every offset
    follows from dims, datatypes and group sizes alone: the flatbuffer can be written
    before any constant data exists (``Deferred``), and a graph of eager constants gives
    the same bytes as the same graph of deferred ones.
    """

    blobs: list[Blob]
    entries: list[tuple[int, int]]  # constant_data (offset, size), entry 0 reserved
    data_index: dict[int, int]  # value id -> its data's constant_data index
    scale_index: dict[int, tuple[int, int]]  # value id -> (constant_data index, number of scales)
    size: int  # of the whole segment, padding included

    @classmethod
    def of(cls, graph: Any) -> SegmentPlan:
        blobs: list[Blob] = []
        entries, data_index, scale_index, offset = [(0, 0)], {}, {}, 0
        for v in graph.values:
            if v.constant is None:
                continue
            parts = [("data", len(v.constant))]
            n = num_scales(v)
            if n:
                parts.append(("scales", n * (2 if v.datatype is Datatype.qbint4 else 4)))
            for part, size in parts:
                if part == "data":
                    data_index[v.id] = len(entries)
                else:
                    scale_index[v.id] = (len(entries), n)
                blobs.append(Blob(v, part, size))
                entries.append((offset, size))
                offset += align(size)
        return cls(blobs, entries, data_index, scale_index, offset)

    def scale_buffer(self, value_id: int) -> tuple[int, int] | None:
        return self.scale_index.get(value_id)


def _constant_parts(v: Value) -> tuple[bytes | memoryview, bytes]:
    """(data, scales) of a constant as the segment stores them, a ``Deferred`` made now."""
    data = v.constant
    if isinstance(data, Deferred):
        made = data.produce()
        if not isinstance(made, QuantizedTensor):
            return made.astype(made.dtype.newbyteorder("<")).tobytes(), b""
        scales = scale_bytes(v.datatype, made.scale) if num_scales(v) else b""
        return made.to_bytes(), scales
    assert data is not None
    q = v.quant
    scale = q.scale if isinstance(q, (PerChannelQuant, PerChannelGroupQuant)) else None
    return data, (b"" if scale is None or not scale.size else scale_bytes(v.datatype, scale))


def payload_chunks(graph: Any) -> Iterator[bytes | memoryview]:
    """The payload of a graph with ``scales_in_segment``, piece by piece (see ``SegmentPlan``).

    Header, flatbuffer and padding come first, from metadata alone; then each value's
    data and scales, a ``Deferred`` value made only when its turn comes, so writing the
    pieces to a file keeps one value in memory at a time.  ``b"".join`` of the pieces is
    ``to_bytes(graph)``.
    """
    from .rules import validate

    validate(graph)
    plan = SegmentPlan.of(graph)
    fbytes = flatbuffer(graph, ConstantSegment())
    yield XNNHeader.for_sizes(len(fbytes), plan.size).to_bytes()
    yield fbytes
    yield bytes(align(len(fbytes)) - len(fbytes))
    pending: bytes = b""
    for blob in plan.blobs:
        if blob.part == "data":
            data, pending = _constant_parts(blob.value)
            chunk: bytes | memoryview = data
        else:
            chunk, pending = pending, b""
        if len(chunk) != blob.size:
            raise XnnquantError(f"value {blob.value.id}: {blob.part} has {len(chunk)} bytes, "
                                f"expected {blob.size}")
        yield chunk
        yield bytes(align(blob.size) - blob.size)
