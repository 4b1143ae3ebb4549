"""ExecuTorch programs (``.pte``) and data files (``.ptd``): every XNNPACK delegate as a ``Graph``.

``read_pte(path_or_bytes, data_files=())`` returns a ``PteProgram``: the program's method
names, and for each XNNPACK delegate its method, its payload bytes, the ``Graph`` that
``xnnquant.graph.load`` reads from them, and the named-data blobs (constants and scales)
the payload refers to by key.

Where the bytes are (ExecuTorch 1.4.1; every integer little-endian)::

    .pte  [0, 4)    u32 offset of the Program table (flatbuffer root)
          [4, 8)    b"ET12"  file identifier of ExecuTorch's program.fbs
          [8, 40)   extended header: b"eh00", u32 header length (32), u64 program_size,
                    u64 segment_base_offset, u64 segment_data_size
          [0, program_size)                   the Program flatbuffer
          [segment_base_offset, ...)          segments; Program.segments[i] = (offset, size)
                                              relative to segment_base_offset
    a delegate's payload: ExecutionPlan.delegates[j].processed = (location, index)
          location INLINE  (0): Program.backend_delegate_data[index].data, inside the flatbuffer
          location SEGMENT (1): Program.segments[index]
    named data (the XNNPACK delegate's constants and scales, key = sha256 hex of the bytes,
    "scale_" + sha256 for scales): Program.named_data[i] = (key, segment_index)

    .ptd  [4, 8)    b"FT01"  identifier of ExecuTorch's flat_tensor.fbs
          [8, 48)   header: b"FH01", u32 header length (40), u64 flatbuffer_offset,
                    u64 flatbuffer_size, u64 segment_base_offset, u64 segment_data_size
          FlatTensor.named_data[i] = (key, segment_index, layout) ->
          FlatTensor.segments[segment_index] = (offset, size) relative to segment_base_offset

ExecuTorch writes the named data into a ``.ptd`` when constants are tagged for an external
file (``executorch.exir.passes.external_constants_pass.delegate_external_constants_pass_unlifted``
on the unlifted module, after ``torchao.utils.unwrap_tensor_subclass`` for torchao
weights); ``ExecutorchProgramManager.write_tensor_data_to_file`` then writes ``<tag>.ptd``.
Pass those files as ``data_files``.

What comes from elsewhere: the program flatbuffer is read with the accessors flatc
generated from xnnquant's own ``program.fbs`` (``program_generated``) and the extended
header with ``header.py``, so reading a ``.pte`` imports neither torch nor executorch.
``.ptd`` files are read with ExecuTorch's ``executorch.extension.flat_tensor.serialize
.serialize`` (``FlatTensorHeader`` and ``_deserialize_to_flat_tensor``: ExecuTorch's
flat_tensor.fbs, decoded by its pinned flatc in a subprocess; imported on first use).

What is ours: the walk from the program to each delegate, the bounds checks (every
offset, size and vector length is checked against the file before it is followed, so the
generated accessors, which trust what they read, never run past the data), and turning
any failure into ``ProgramError``.  A truncated file, a file without an XNNPACK delegate
or a malformed delegate is a ``ProgramError`` (an ``XnnquantError``), never another
exception.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import arguments
from ..constants import XNNPACK_BACKEND_ID
from ..errors import PayloadError, ProgramError, XnnquantError, missing_extra
from . import program_generated as fb
from .header import ExtendedHeader

#: File identifier of ExecuTorch's program.fbs (bytes 4..7 of every ``.pte``).
PTE_IDENTIFIER = b"ET12"
#: File identifier of ExecuTorch's flat_tensor.fbs (bytes 4..7 of every ``.ptd``).
PTD_IDENTIFIER = b"FT01"

Source = bytes | bytearray | memoryview | str | os.PathLike
#: Bytes read from a program or data file: a view of the mapped file when read from a path.
Blob = bytes | memoryview


@dataclass(frozen=True, eq=False)
class Delegate:
    """One XNNPACK delegate of a program.

    ``method`` and ``index``: the method it belongs to and its position in that method's
    delegate table (what the program's ``DelegateCall`` instructions name).  ``location``:
    ``"inline"`` (bytes inside the Program flatbuffer) or ``"segment"``.  ``payload``: the
    XNNGraph payload (XNNHeader + XN01 flatbuffer + constant segment).  ``graph``: the
    payload read with ``xnnquant.graph.load`` and the named data below.  ``named_data``:
    key -> bytes of every blob the payload names, in the payload's order.
    """

    method: str
    index: int
    location: str
    payload: Blob = field(repr=False)
    graph: Any = field(repr=False)
    named_data: dict[str, Blob] = field(repr=False)

    @property
    def name(self) -> str:
        """``"<method>/<index>"``, e.g. ``"forward/0"``."""
        return f"{self.method}/{self.index}"


@dataclass(frozen=True, eq=False)
class PteProgram:
    """What ``read_pte`` found in a program.

    ``methods``: method names in the program's order.  ``delegates``: its XNNPACK
    delegates, by method then index.  ``other_delegates``: ``(method, index, backend id)``
    of delegates of other backends (not read).  ``named_data``: every named blob of the
    program and its data files, key -> bytes; ``named_data_origin``: key -> ``"program"`` or
    the data file it came from.  ``data``: the ``.pte`` bytes; ``data_files``: the bytes of
    each data file given.  ``operators``: every ``name.overload`` its methods call kernels of
    (``"aten::embedding.out"``; the name alone for an empty overload), in the program's order.
    """

    methods: tuple[str, ...]
    delegates: tuple[Delegate, ...]
    other_delegates: tuple[tuple[str, int, str], ...]
    named_data: dict[str, Blob] = field(repr=False)
    named_data_origin: dict[str, str] = field(repr=False)
    data: Blob = field(repr=False)
    data_files: tuple[Blob, ...] = field(repr=False, default=())
    operators: tuple[str, ...] = ()

    def method_delegates(self, method: str) -> tuple[Delegate, ...]:
        """The XNNPACK delegates of ``method``, by index."""
        if method not in self.methods:
            raise XnnquantError(f"no method {method!r} in the program: it has {', '.join(self.methods)}")
        return tuple(d for d in self.delegates if d.method == method)


def is_pte(source: Source) -> bool:
    """Whether ``source`` (bytes or a path) starts like an ExecuTorch program: bytes 4..7 are
    ``b"ET12"``.  Reads 8 bytes of a file; imports nothing."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[4:8]) == PTE_IDENTIFIER
    if not isinstance(source, (str, os.PathLike)):  # an int would open that file descriptor
        return False
    try:
        with open(source, "rb") as f:
            return f.read(8)[4:8] == PTE_IDENTIFIER
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False


def _read(source: Source, what: str) -> tuple[Blob, str]:
    """(bytes, name for messages) of a path or a bytes-like object.

    A file is memory-mapped (``graph.reader.map_file``), and delegates and named data are
    views of it: reading a multi-GB program reads its flatbuffer and the pages a caller
    then touches, not the whole file.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), f"the {what} bytes"
    if isinstance(source, (str, os.PathLike)):
        from ..graph.reader import map_file

        try:
            return map_file(source), repr(os.fspath(source))
        except XnnquantError as exc:
            raise ProgramError(f"cannot read {what} file {os.fspath(source)!r}: {exc}") from None
    raise XnnquantError(f"a {what} must be given as bytes or a path: got {arguments.shown(source)}")


def _sources(given: Source | Iterable[Source]) -> list[Source]:
    """``data_files=``: one source (bytes or a path) or a list or tuple of them, as a list."""
    if isinstance(given, (bytes, bytearray, memoryview, str, os.PathLike)):
        return [given]
    if isinstance(given, (list, tuple)):
        for i, item in enumerate(given):
            if not isinstance(item, (bytes, bytearray, memoryview, str, os.PathLike)):
                raise XnnquantError(f"data_files[{i}] must be the bytes or the path of a .ptd file: got "
                                    f"{arguments.shown(item)}")
        return list(given)
    raise XnnquantError(f"data_files must be the bytes or the path of a .ptd file, or a list of them: got "
                        f"{arguments.shown(given)}")


class _Bounds:
    """Checks that what the file claims fits in the file, with one message shape."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name

    def count(self, n: int, what: str, elem: int = 4) -> int:
        if n < 0 or n * elem > self.size:
            raise ProgramError(f"{self.name}: {what} claims {n} entries, more than its {self.size} bytes can hold")
        return n

    def span(self, start: int, size: int, what: str) -> tuple[int, int]:
        if start < 0 or size < 0 or start + size > self.size:
            raise ProgramError(
                f"{self.name} is truncated or corrupt: {what} spans bytes [{start}, {start + size}), "
                f"the file has {self.size}"
            )
        return start, start + size


def _text(raw: bytes | None, what: str) -> str:
    if raw is None:
        raise ProgramError(f"{what} is missing")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ProgramError(f"{what} is not UTF-8: got {bytes(raw)[:32]!r}") from None


# Exceptions the flatbuffers accessors raise when they follow garbage offsets.
_DECODE_ERRORS = (struct.error, IndexError, TypeError, ValueError, OverflowError, RecursionError,
                  AttributeError, UnicodeDecodeError)


def read_ptd(source: Source) -> dict[str, Blob]:
    """The named blobs of an ExecuTorch data file (``.ptd``): key -> bytes.

    Raises ``ProgramError`` for anything that is not a well-formed FlatTensor file.
    """
    return _ptd_blobs(*_read(source, ".ptd"))


def _ptd_blobs(data: Blob, name: str) -> dict[str, Blob]:
    if len(data) < 48 or data[4:8] != PTD_IDENTIFIER:
        raise ProgramError(
            f"{name} is not an ExecuTorch data file: got identifier {bytes(data[4:8])!r} ({len(data)} bytes), "
            f"expected {PTD_IDENTIFIER!r} and a 48-byte header"
        )
    try:
        from executorch.extension.flat_tensor.serialize.serialize import (
            FlatTensorHeader,
            _deserialize_to_flat_tensor,
        )
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "reading ExecuTorch data files (.ptd)") from None
    bounds = _Bounds(len(data), name)
    header = FlatTensorHeader.from_bytes(data[8:])
    if not header.is_valid():
        raise ProgramError(f"{name}: the FlatTensor header is invalid: got magic {header.magic!r}, "
                           f"length {header.length}, expected b'FH01' and at least {header.EXPECTED_LENGTH}")
    _, fb_end = bounds.span(header.flatbuffer_offset, header.flatbuffer_size, "the FlatTensor flatbuffer")
    base, _ = bounds.span(header.segment_base_offset, header.segment_data_size, "the segment data")
    try:
        flat = _deserialize_to_flat_tensor(data[:fb_end])
    except Exception as exc:  # flatc failed (exit status) or its JSON did not fit the schema
        raise ProgramError(f"{name}: ExecuTorch's flatc could not decode the FlatTensor table: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from None
    blobs: dict[str, Blob] = {}
    for entry in flat.named_data:
        where = f"named data {entry.key!r}"
        if not 0 <= entry.segment_index < len(flat.segments):
            raise ProgramError(f"{name}: {where} names segment {entry.segment_index}, "
                               f"the file has {len(flat.segments)}")
        seg = flat.segments[entry.segment_index]
        start, end = bounds.span(base + seg.offset, seg.size, f"{where} (segment {entry.segment_index})")
        blobs[entry.key] = data[start:end]
    return blobs


def read_pte(source: Source, data_files: Source | Iterable[Source] = (), *,
             validate: bool = True, need_delegate: bool = True) -> PteProgram:
    """Every XNNPACK delegate of an ExecuTorch program, read into a ``Graph``.

    ``source``: the ``.pte`` (bytes or a path).  ``data_files``: the ``.ptd`` files holding
    named data the program keeps outside (one path or bytes, or several); their blobs join
    the program's own.  ``validate``: passed to ``xnnquant.graph.load`` (``False`` reads
    payloads the runtime would refuse).  ``need_delegate=False`` reads a program without
    XNNPACK delegates too (one that runs on ExecuTorch's portable kernels only).

    Raises ``ProgramError`` when the file is not a ``.pte``, is truncated or corrupt, has
    no XNNPACK delegate (unless ``need_delegate=False``), or a delegate's payload is malformed or names constants found
    neither in the program nor in ``data_files``.
    """
    validate = arguments.flag(validate, "validate")
    files = _sources(data_files)
    data, name = _read(source, ".pte")
    if len(data) < 8 or data[4:8] != PTE_IDENTIFIER:
        identifier = bytes(data[4:8])
        hint = (" (an XNNGraph payload: read it with xnnquant.graph.load)"
                if identifier in (b"XN00", b"XN01", b"XH00") else "")
        raise ProgramError(
            f"{name} is not an ExecuTorch program: got identifier {identifier!r}{hint} "
            f"({len(data)} bytes), expected {PTE_IDENTIFIER!r}"
        )
    program = _Walk(data, name)
    named = dict(program.named_data)
    origin = dict.fromkeys(named, "program")
    file_bytes = []
    for file in files:
        where = "data file bytes" if isinstance(file, (bytes, bytearray, memoryview)) else os.fspath(file)
        file_data, file_name = _read(file, ".ptd")
        file_bytes.append(file_data)
        for key, blob in _ptd_blobs(file_data, file_name).items():
            if key in named and named[key] != blob:
                raise ProgramError(f"named data {key!r} differs between {origin[key]} and {where}")
            named.setdefault(key, blob)
            origin.setdefault(key, where)
    beside = _beside(source) if isinstance(source, (str, os.PathLike)) else ""
    delegates = tuple(_delegate(found, named, validate, name, files, beside) for found in program.xnnpack)
    if not delegates and need_delegate:
        listed = "; ".join(f"{m}: {len([d for d in program.others if d[0] == m])} other delegate(s)"
                           for m in program.methods)
        raise ProgramError(
            f"{name} has no XNNPACK delegate ({listed or 'no methods'}): expected at least one "
            f"delegate with backend id {XNNPACK_BACKEND_ID!r} (lower with ExecuTorch's XnnpackPartitioner)"
        )
    return PteProgram(tuple(program.methods), delegates, tuple(program.others), named, origin, data,
                      tuple(file_bytes), tuple(program.operators))


@dataclass
class _Found:
    method: str
    index: int
    location: str
    payload: Blob


class _Walk:
    """The methods, delegates and named data of a program, every offset checked."""

    def __init__(self, data: Blob, name: str) -> None:
        self.data, self.name = data, name
        self.bounds = _Bounds(len(data), name)
        self.methods: list[str] = []
        self.xnnpack: list[_Found] = []
        self.others: list[tuple[str, int, str]] = []
        self.named_data: dict[str, Blob] = {}
        self.operators: list[str] = []
        try:
            self._walk()
        except (ProgramError, MemoryError):
            raise
        except _DECODE_ERRORS as exc:
            raise ProgramError(f"{name}: the Program flatbuffer is corrupt ({type(exc).__name__}: {exc})") from None

    def _walk(self) -> None:
        data, bounds = self.data, self.bounds
        header = ExtendedHeader.read(data)
        program_size, self.segment_base = len(data), None
        if header is not None:
            bounds.span(0, header.program_size, "the Program flatbuffer (from the extended header)")
            bounds.span(header.segment_base_offset, header.segment_data_size, "the segment data")
            program_size, self.segment_base = header.program_size, header.segment_base_offset
        flatbuffer = data[:program_size]
        self.fb_bounds = _Bounds(len(flatbuffer), self.name)
        bounds.count(struct.unpack_from("<I", flatbuffer, 0)[0], "the root offset", 1)
        root = fb.Program.GetRootAs(flatbuffer, 0)
        self.segments = [(s.Offset(), s.Size()) for s in
                         (root.Segments(i) for i in range(self.fb_bounds.count(root.SegmentsLength(), "segments")))]
        for i in range(self.fb_bounds.count(root.NamedDataLength(), "named_data")):
            entry = root.NamedData(i)
            key = _text(entry.Key(), f"{self.name}: named_data[{i}].key")
            self.named_data[key] = self._segment(entry.SegmentIndex(), f"named data {key!r}")
        inline_count = self.fb_bounds.count(root.BackendDelegateDataLength(), "backend_delegate_data")
        for p in range(self.fb_bounds.count(root.ExecutionPlanLength(), "execution_plan")):
            plan = root.ExecutionPlan(p)
            method = _text(plan.Name(), f"{self.name}: execution_plan[{p}].name")
            self.methods.append(method)
            for k in range(self.fb_bounds.count(plan.OperatorsLength(), f"method {method!r} operators")):
                operator = plan.Operators(k)
                op_name = _text(operator.Name(), f"{self.name}: method {method!r} operator {k} name")
                overload = "" if operator.Overload() is None else _text(operator.Overload(), "an overload")
                named_op = f"{op_name}.{overload}" if overload else op_name
                if named_op not in self.operators:
                    self.operators.append(named_op)
            for j in range(self.fb_bounds.count(plan.DelegatesLength(), f"method {method!r} delegates")):
                delegate = plan.Delegates(j)
                where = f"method {method!r} delegate {j}"
                backend = _text(delegate.Id(), f"{self.name}: {where} id")
                if backend != XNNPACK_BACKEND_ID:
                    self.others.append((method, j, backend))
                    continue
                ref = delegate.Processed()
                if ref is None:
                    raise ProgramError(f"{self.name}: {where} has no processed data reference")
                location, index = ref.Location(), ref.Index()
                if location == fb.DataLocation.INLINE:
                    if index >= inline_count:
                        raise ProgramError(f"{self.name}: {where} names inline data {index}, "
                                           f"the program has {inline_count}")
                    payload = root.BackendDelegateData(index).DataAsNumpy()
                    payload = b"" if isinstance(payload, int) else payload.tobytes()
                    self.xnnpack.append(_Found(method, j, "inline", payload))
                elif location == fb.DataLocation.SEGMENT:
                    self.xnnpack.append(_Found(method, j, "segment", self._segment(index, where)))
                else:
                    raise ProgramError(f"{self.name}: {where} has data location {location}, "
                                       "expected 0 (inline) or 1 (segment)")

    def _segment(self, index: int, what: str) -> Blob:
        if self.segment_base is None:
            raise ProgramError(f"{self.name}: {what} lives in segment {index}, but the file has no "
                               "extended header, so no segments")
        if not 0 <= index < len(self.segments):
            raise ProgramError(f"{self.name}: {what} names segment {index}, the program has {len(self.segments)}")
        offset, size = self.segments[index]
        start, end = self.bounds.span(self.segment_base + offset, size, f"{what} (segment {index})")
        return self.data[start:end]


def _delegate(found: _Found, named: Mapping[str, Blob], validate: bool, name: str,
              files: list[Source], beside: str) -> Delegate:
    from ..graph import load

    where = f"{name}: method {found.method!r} delegate {found.index}"
    if not found.payload:
        raise ProgramError(f"{where} has an empty XNNPACK payload")
    try:
        graph = load(found.payload, named_data=named, validate=validate)
    except PayloadError as exc:
        raise ProgramError(f"{where}: malformed XNNPACK payload: {exc}") from None
    except XnnquantError as exc:
        raise ProgramError(f"{where}: the XNNPACK payload fails validation: {exc}") from None
    info = graph.load_info
    assert info is not None  # a graph that load() read
    if info.missing_named_keys:
        keys = info.missing_named_keys
        given = f"{len(files)} given" if files else "none given"
        raise ProgramError(
            f"{where} names {len(keys)} constant(s) that are neither in the program nor in its data "
            f"files ({given}; first key {keys[0]!r}): pass the .ptd file(s) ExecuTorch wrote beside "
            f"the .pte as data_files (xnnquant CLI: --data){beside}"
        )
    return Delegate(found.method, found.index, found.location, found.payload, graph,
                    {key: named[key] for key in dict.fromkeys(info.named_keys)})


def _beside(path: str | os.PathLike) -> str:
    """``" (beside it: a.ptd, b.ptd)"``: the data files in the folder of the .pte at ``path``."""
    try:
        found = sorted(p.name for p in Path(path).parent.glob("*.ptd"))
    except (OSError, ValueError):
        return ""
    return f" (beside it: {', '.join(found)})" if found else ""
