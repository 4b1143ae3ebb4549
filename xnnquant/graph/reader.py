"""Payload bytes -> ``Graph``: any XN00 / XN01 payload, with or without XNNHeader.

Steps: split the header (if bytes 4..7 are ``XH00``) into flatbuffer and constant
segment; check the identifier; bound-check the whole flatbuffer (bounds.py); decode it
with the flatc-generated accessors; resolve constants; validate.

Constants come from one of three places, as in ExecuTorch's runtime:

* with a header: ``constant_data[idx]`` = (offset, size) into the constant segment;
* with a header and a ``named_key`` in that entry (ExecuTorch 1.4.1): the program's
  named data, passed as ``named_data={key: bytes}``; without it the key is reported in
  ``graph.load_info.named_keys`` / ``.missing_named_keys`` and the value has no bytes;
* without a header (legacy): inline ``constant_buffer[idx].storage``.

Fields that later ExecuTorch schemas append (``named_key``, ``scale_buffer_idx``,
``num_scales``, ``dq_datatype``, ``input5_id``) and the deprecated ``constant_buffer`` are
not in our schema.fbs, so there are no generated accessors for them: they are read by
vtable slot (``layout.slot``) through the flatbuffers ``Table`` object, after the
verifier has checked those slots too.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping
from typing import Any

import flatbuffers
import numpy as np

from .. import arguments
from ..constants import XNN_INVALID_VALUE_ID
from ..datatypes import Datatype
from ..errors import PayloadError, XnnquantError
from ..rounding import bf16_bits_to_float32
from . import schema_generated as fb
from .bounds import check_bounds
from .builder import Graph
from .header import XNNHeader
from .layout import KIND_BY_TAG, UNIONS, slot
from .model import (
    LoadInfo,
    Node,
    PerChannelGroupQuant,
    PerChannelQuant,
    PerTensorQuant,
    PerTokenDynamicQuant,
    QuantParams,
    Value,
)
from .targets import Target
from .writer import _camel

IDENTIFIERS = (b"XN00", b"XN01")
_LATER_DATATYPES = {11: "qpint8", 12: "int32", 13: "pfp32", 14: "bf16"}
_N = flatbuffers.number_types


def load(source: bytes | bytearray | memoryview | str | os.PathLike[str],
         named_data: Mapping[str, bytes | bytearray | memoryview] | None = None, *, validate: bool = True) -> Graph:
    """Read a payload (bytes, or a path to a file holding one) into a ``Graph``.

    ``named_data`` maps ExecuTorch named-data keys to bytes (anything with the buffer
    protocol).  Malformed input raises ``PayloadError``; a well-formed graph that the
    runtime would refuse raises ``XnnquantError`` from validation (``validate=False``
    skips that step).

    Constants are not copied: each value's ``constant`` is a read-only ``memoryview`` of
    the bytes given, and a file is memory-mapped, so loading a multi-gigabyte payload
    reads its flatbuffer and only the pages a caller then touches (listing values reads
    no constant).  The mapping lives as long as a view of it does; a file changed in
    place under a live mapping gives undefined data (replacing it, as ``save`` does, is
    safe).
    """
    validate = arguments.flag(validate, "validate")
    named_data = checked_named_data(named_data)
    if isinstance(source, (str, os.PathLike)):
        data = map_file(source)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = memoryview(bytes(source) if isinstance(source, bytearray) else source).cast("B")
        if not data.readonly:  # a writable view would let a caller change the graph's constants
            data = memoryview(bytes(data))
    else:
        raise XnnquantError(f"load() takes payload bytes or a path: got {arguments.shown(source)}")
    try:
        graph = _Reader(data, named_data).graph()
        if validate:
            graph.validate(writing=False)
    except XnnquantError:
        raise
    except Exception as exc:  # never let corrupt bytes escape as anything but PayloadError
        raise PayloadError(f"malformed payload: {type(exc).__name__}: {exc}") from None
    return graph


def checked_named_data(named_data: Any) -> dict[str, Any] | None:
    """``named_data=`` as a dict of str keys to bytes-like blobs (None stays None)."""
    if named_data is None:
        return None
    if not isinstance(named_data, Mapping):
        raise XnnquantError(f"named_data must map str keys to bytes: got {arguments.shown(named_data)}")
    for key, blob in named_data.items():
        try:
            memoryview(blob)
            ok = isinstance(key, str)
        except TypeError:
            ok = False
        if not ok:
            raise XnnquantError(f"named_data must map str keys to bytes: got {arguments.shown(key)} -> "
                                f"{arguments.shown(blob)}")
    return dict(named_data)


def map_file(path: str | os.PathLike[str]) -> memoryview:
    """The bytes of file ``path`` as a read-only ``memoryview`` of a memory mapping."""
    path = arguments.path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except OSError as exc:
        raise XnnquantError(f"cannot read payload file {os.fspath(path)!r}: {exc}") from None


class _Reader:
    def __init__(self, data: memoryview, named_data: Mapping[str, Any] | None) -> None:
        self.named_data = named_data
        self.segment: memoryview | None = None
        if XNNHeader.has_header(data):
            h = XNNHeader.from_bytes(data)
            self.fb = bytes(data[h.flatbuffer_offset:h.flatbuffer_offset + h.flatbuffer_size])
            self.segment = data[h.constant_data_offset:h.constant_data_offset + h.constant_data_size]
        else:
            self.fb = bytes(data)
        if len(self.fb) < 8 or self.fb[4:8] not in IDENTIFIERS:
            raise PayloadError(
                f"not an XNNGraph payload: got identifier {self.fb[4:8]!r} ({len(data)} bytes), "
                f"expected {IDENTIFIERS[1]!r} or {IDENTIFIERS[0]!r} (or an XNNHeader with magic b'XH00')"
            )
        check_bounds(self.fb)
        self.root = fb.XNNGraph.GetRootAs(self.fb, 0)
        self.keys: list[str] = []
        self.missing: list[str] = []

    # --------------------------------------------------------------- helpers

    @staticmethod
    def _ext(tab: Any, table: str, name: str, flags: Any, default: int = 0) -> int:
        """A scalar field that schema.fbs does not declare, read by vtable slot."""
        o = tab.Offset(slot(table, name))
        return tab.Get(flags, tab.Pos + o) if o else default

    def _constant(self, idx: int, what: str) -> tuple[bytes | memoryview | None, str | None]:
        """(bytes, named key) of constant ``idx``; bytes None when a named key is unresolved."""
        if self.segment is None:
            return self._inline_constant(idx, what), None
        n = self.root.ConstantDataLength()
        if idx >= n:
            raise PayloadError(f"{what}: constant_buffer_idx {idx} is out of range: constant_data has {n} entries")
        entry = self.root.ConstantData(idx)
        o = entry._tab.Offset(slot("ConstantDataOffset", "named_key"))
        if o:  # presence, not content, selects the named-data path (as the runtime does)
            key = entry._tab.String(entry._tab.Pos + o).decode("utf-8")
            self.keys.append(key)
            if self.named_data is None or key not in self.named_data:
                self.missing.append(key)
                return None, key
            blob = self.named_data[key]
            try:
                return memoryview(blob).cast("B").toreadonly(), key
            except (TypeError, ValueError):
                raise XnnquantError(
                    f"named_data[{key!r}] must be bytes-like and contiguous: got {type(blob).__name__}"
                ) from None
        offset, size = entry.Offset(), entry.Size()
        if offset > len(self.segment) or size > len(self.segment) - offset:
            raise PayloadError(
                f"{what}: constant_data[{idx}] = (offset {offset}, size {size}) lies outside the "
                f"{len(self.segment)}-byte constant segment"
            )
        return self.segment[offset:offset + size], None

    def _inline_constant(self, idx: int, what: str) -> bytes:
        tab = self.root._tab
        o = tab.Offset(slot("XNNGraph", "constant_buffer"))
        n = tab.VectorLen(o) if o else 0
        if idx >= n:
            raise PayloadError(f"{what}: constant_buffer_idx {idx} is out of range: constant_buffer has {n} entries")
        buffer = fb.Buffer()
        buffer.Init(self.fb, tab.Indirect(tab.Vector(o) + 4 * idx))
        so = buffer._tab.Offset(slot("Buffer", "storage"))
        if not so:
            raise PayloadError(f"{what}: constant_buffer[{idx}] has no storage")
        start = buffer._tab.Vector(so)
        return self.fb[start:start + buffer._tab.VectorLen(so)]

    @staticmethod
    def _datatype(raw: int, what: str) -> Datatype:
        try:
            return Datatype(raw)
        except ValueError:
            later = f" ({_LATER_DATATYPES[raw]} in ExecuTorch 1.4.1's schema)" if raw in _LATER_DATATYPES else ""
            raise PayloadError(f"{what}: unknown datatype {raw}{later}, expected 0..10") from None

    # ---------------------------------------------------------------- values

    def _quant(self, qtv: Any, what: str) -> QuantParams:
        tag, table = qtv.QuantParamsType(), qtv.QuantParams()
        members = UNIONS["XNNQuantParams"]
        if table is None or not 0 < tag < len(members):
            raise PayloadError(f"{what}: quant_params missing or of unknown type tag {tag}")
        name = members[tag]
        obj = getattr(fb, str(name))()
        obj.Init(table.Bytes, table.Pos)
        if name == "PerTensorQuant":
            return PerTensorQuant(float(obj.Scale()), int(obj.ZeroPoint()))
        if name == "PerTokenDynamicQuant":
            return PerTokenDynamicQuant(int(obj.NumNonbatchDims()))
        scale = np.array(obj.ScaleAsNumpy(), np.float32) if obj.ScaleLength() else np.zeros(0, np.float32)
        buffer_idx = self._ext(obj._tab, name, "scale_buffer_idx", _N.Uint32Flags)
        num_scales = self._ext(obj._tab, name, "num_scales", _N.Uint32Flags)
        if name == "PerChannelQuant":
            if buffer_idx:
                data, _ = self._constant(buffer_idx, f"{what} scales")
                scale = np.zeros(0, np.float32) if data is None else _array(data, "<f4", f"{what} scales")
            return PerChannelQuant(scale, int(obj.ChannelDim()), buffer_idx, num_scales)
        bf16 = np.array(obj.ScaleBf16AsNumpy(), np.uint16) if obj.ScaleBf16Length() else None
        if buffer_idx:
            data, _ = self._constant(buffer_idx, f"{what} scales")
            if data is not None:
                bf16 = _array(data, "<u2", f"{what} bf16 scales")
                scale = bf16_bits_to_float32(bf16)
        return PerChannelGroupQuant(scale, int(obj.ChannelDim()), int(obj.GroupSize()), bf16, buffer_idx, num_scales)

    def _value(self, i: int) -> Value:
        what = f"value #{i}"
        xv = self.root.Xvalues(i)
        tag, table = xv.XvalueUnionType(), xv.XvalueUnion()
        members = UNIONS["XValueUnion"]
        if table is None or not 0 < tag < len(members):
            raise PayloadError(f"{what}: xvalue_union missing or of unknown type tag {tag}, expected 1 or 2")
        quant = None
        if members[tag] == "XNNQuantizedTensorValue":
            qtv = fb.XNNQuantizedTensorValue()
            qtv.Init(table.Bytes, table.Pos)
            tv = qtv.TensorValue()
            if tv is None:
                raise PayloadError(f"{what}: quantized value without tensor_value")
        else:
            qtv = None
            tv = fb.XNNTensorValue()
            tv.Init(table.Bytes, table.Pos)
        dims = tuple(int(d) for d in tv.DimsAsNumpy()) if tv.DimsLength() else ()
        if tv.NumDims() != len(dims):
            raise PayloadError(f"{what} (id {tv.IdOut()}): num_dims is {tv.NumDims()} but dims has {len(dims)} entries")
        vid = int(tv.IdOut())
        what = f"value #{i} (id {vid})"
        if qtv is not None:
            quant = self._quant(qtv, what)
        constant, key = (None, None)
        if tv.ConstantBufferIdx():
            constant, key = self._constant(int(tv.ConstantBufferIdx()), what)
        ext = int(tv.ExternalId())
        dq = self._ext(tv._tab, "XNNTensorValue", "dq_datatype", _N.Int16Flags)
        return Value(vid, self._datatype(tv.Datatype(), what), dims, None if ext == XNN_INVALID_VALUE_ID else ext,
                     int(tv.Flags()), constant, quant, key, self._datatype(dq, f"{what} dq_datatype"))

    # ----------------------------------------------------------------- nodes

    def _node(self, i: int) -> Node:
        xn = self.root.Xnodes(i)
        tag, table = xn.XnodeUnionType(), xn.XnodeUnion()
        kind = KIND_BY_TAG.get(tag)
        if kind is None or table is None:
            raise PayloadError(
                f"node #{i}: xnode_union missing or of unknown type tag {tag}, expected 1..{len(KIND_BY_TAG)}")
        obj = getattr(fb, kind.table)()
        obj.Init(table.Bytes, table.Pos)

        def scalar(name: str) -> Any:
            if name == "input5_id":
                return self._ext(obj._tab, kind.table, name, _N.Uint32Flags)
            return getattr(obj, _camel(name))()

        params: dict[str, Any] = {}
        for name, ftype in kind.param_fields:
            if ftype.startswith("["):
                n = getattr(obj, _camel(name) + "Length")()
                params[name] = tuple(int(x) for x in getattr(obj, _camel(name) + "AsNumpy")()) if n else ()
            else:
                params[name] = scalar(name)
        ids = [int(scalar(f)) for f in kind.input_fields]
        inputs = ids[:kind.n_required]
        for extra in ids[kind.n_required:]:
            if extra == XNN_INVALID_VALUE_ID:
                break
            inputs.append(extra)
        outputs = tuple(int(scalar(f)) for f in kind.output_fields)
        bounds = xn.OutputMinMax()
        lo, hi = (None, None) if bounds is None else (float(bounds.OutputMin()), float(bounds.OutputMax()))
        return Node(kind.name, tuple(inputs), outputs, params, int(scalar("flags")), int(xn.DebugHandle()), lo, hi)

    def graph(self) -> Graph:
        g = Graph()
        g.values = [self._value(i) for i in range(self.root.XvaluesLength())]
        g.nodes = [self._node(i) for i in range(self.root.XnodesLength())]
        version = self.root.Version()
        g.load_info = LoadInfo(
            identifier=self.fb[4:8].decode("ascii"),
            version="" if version is None else version.decode("utf-8"),
            num_externs=int(self.root.NumExterns()),
            inline_constants=self.segment is None,
            named_keys=tuple(self.keys),
            missing_named_keys=tuple(self.missing),
        )
        if any(n.kind not in g.target.node_kinds for n in g.nodes):
            g.target = Target.ET_1_4_1  # written again with the schema it was read with
        if self.root.XvaluesIsNone() or self.root.XnodesIsNone():
            raise PayloadError("XNNGraph has no xvalues or no xnodes vector (the runtime requires both)")
        return g


def _array(data: bytes | memoryview, dtype: str, what: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise PayloadError(f"{what}: {len(data)} bytes is not a whole number of {dtype} elements")
    return np.frombuffer(data, dtype).astype(np.dtype(dtype).newbyteorder("="))
