"""Bounds-check a flatbuffer against the schema before anything reads it.

The flatbuffers Python runtime trusts every offset it follows.  ``check_bounds`` walks the
whole buffer the way the C++ ``flatbuffers::Verifier`` does (the one ExecuTorch 1.4.1
runs before compiling), using the field table of layout.py, and raises ``PayloadError``
at the first offset, vtable, vector or string that does not lie inside the buffer, is
misaligned, or nests too deep.  It is stricter than C++ in one way only: a union whose
type tag is NONE or unknown while its value is set is refused here (C++ lets it through
and the runtime refuses it later).  After it passes, the generated accessors only read
bytes inside the buffer, and every vector length is bounded by the buffer size.  Work
is bounded too: at most ``MAX_TABLES`` table visits (shared sub-tables count each time,
as in C++, and no more than one per 4 bytes of buffer, since distinct tables cannot
overlap), nesting at most ``MAX_DEPTH`` deep.

Flatbuffer wire rules checked (all little-endian)::

    root:    u32 at 0 -> table; buffer must hold the root offset and 4 identifier bytes
    table:   i32 soffset at t -> vtable at t - soffset (2-aligned)
    vtable:  u16 vtable size (even; under 4: no fields), u16 table size (not checked),
             u16 field offsets
    field:   t + field offset, inside the buffer, naturally aligned
    offset:  u32 at p -> p + value, 4-aligned, inside the buffer
    vector:  u32 length n, then n elements (n * size bytes inside the buffer)
    string:  a [u8] vector followed by a 0 byte
"""

from __future__ import annotations

import struct

from ..errors import PayloadError
from .layout import UNIONS, fields

MAX_DEPTH = 64
MAX_TABLES = 1_000_000
_SCALAR_SIZES = {"u8": 1, "i16": 2, "u16": 2, "u32": 4, "i32": 4, "f32": 4, "u64": 8}


class _Verifier:
    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = buf
        self.size = len(buf)
        self.tables = 0
        # every table owns at least its 4-byte soffset, so a buffer without shared tables
        # (what every flatbuffers writer produces) visits at most size / 4 of them
        self.max_tables = min(MAX_TABLES, self.size // 4 + 1)

    def fail(self, what: str) -> PayloadError:
        return PayloadError(f"malformed flatbuffer ({self.size} bytes): {what}")

    def check(self, pos: int, length: int, align: int, what: str) -> None:
        if pos < 0 or length < 0 or pos + length > self.size:
            raise self.fail(f"{what} [{pos}, +{length}) lies outside the buffer")
        if pos % align:
            raise self.fail(f"{what} at {pos} is not {align}-byte aligned")

    def u32(self, pos: int, what: str) -> int:
        self.check(pos, 4, 4, what)
        return struct.unpack_from("<I", self.buf, pos)[0]

    def follow(self, pos: int, what: str) -> int:
        """Target of the u32 offset stored at ``pos``."""
        off = self.u32(pos, what)
        if off == 0 or off >= 2**31:
            raise self.fail(f"{what} at {pos} holds offset {off}, expected 1..2**31-1")
        target = pos + off
        self.check(target, 4, 4, f"{what} target")
        return target

    def vector(self, pos: int, elem_size: int, what: str) -> tuple[int, int]:
        """(start of elements, count) of the vector whose offset is at ``pos``."""
        start = self.follow(pos, what)
        n = self.u32(start, f"{what} length")
        self.check(start + 4, n * elem_size, min(elem_size, 4) or 1, f"{what} elements ({n} x {elem_size} bytes)")
        return start + 4, n

    def table(self, pos: int, name: str, depth: int) -> None:
        """Check the table of type ``name`` that starts at ``pos``, and everything below it."""
        self.tables += 1
        if depth > MAX_DEPTH or self.tables > self.max_tables:
            raise self.fail(f"nesting deeper than {MAX_DEPTH} or more than {self.max_tables} table visits")
        self.check(pos, 4, 4, f"{name} table")
        vtable = pos - struct.unpack_from("<i", self.buf, pos)[0]
        self.check(vtable, 4, 2, f"{name} vtable")
        vsize = struct.unpack_from("<H", self.buf, vtable)[0]
        if vsize % 2:
            raise self.fail(f"{name} vtable size {vsize} must be even")
        self.check(vtable, vsize, 2, f"{name} vtable")
        # The table size (tsize) is not checked, as in C++: the Python builder shares a
        # vtable between tables whose sizes differ, so only field positions are reliable.
        # a vtable shorter than 4 bytes holds no field (C++ and the Python runtime agree)
        slots = struct.unpack_from(f"<{max(0, vsize - 4) // 2}H", self.buf, vtable + 4)
        union_tags: dict[str, int] = {}
        for i, (fname, ftype) in enumerate(fields(name)):
            field_off = slots[i] if i < len(slots) else 0
            if field_off == 0:
                continue
            at = pos + field_off
            where = f"{name}.{fname}"
            if ftype in _SCALAR_SIZES:
                n = _SCALAR_SIZES[ftype]
                self.check(at, n, n, where)
                if ftype == "u8":
                    union_tags[fname] = self.buf[at]
                continue
            if ftype == "string":
                start, n = self.vector(at, 1, where)
                self.check(start + n, 1, 1, f"{where} terminator")
                if self.buf[start + n] != 0:
                    raise self.fail(f"{where} is not 0-terminated")
            elif ftype.startswith("[") and ftype[1:-1] in _SCALAR_SIZES:
                self.vector(at, _SCALAR_SIZES[ftype[1:-1]], where)
            elif ftype.startswith("["):
                start, n = self.vector(at, 4, where)
                for j in range(n):
                    self.table(self.follow(start + 4 * j, f"{where}[{j}]"), ftype[1:-1], depth + 1)
            elif ftype.startswith("union:"):
                union = ftype[6:]
                tag = union_tags.get(fname + "_type", 0)
                members = UNIONS[union]
                if tag == 0:
                    raise self.fail(f"{where} is set but its type tag is NONE")
                if tag >= len(members):
                    raise self.fail(f"{where} has unknown type tag {tag}, expected 1..{len(members) - 1}")
                self.table(self.follow(at, where), members[tag], depth + 1)  # type: ignore[arg-type]
            else:
                self.table(self.follow(at, where), ftype, depth + 1)


def check_bounds(buf: bytes | memoryview, root: str = "XNNGraph") -> None:
    """Raise ``PayloadError`` unless ``buf`` is a well-formed flatbuffer whose root is ``root``."""
    v = _Verifier(buf)
    if len(buf) < 8:
        raise v.fail("shorter than the 8 bytes of root offset and identifier")
    if len(buf) >= 2**31:
        raise v.fail("larger than the 2 GiB a flatbuffer can address")
    v.table(v.follow(0, "root offset"), root, 0)
