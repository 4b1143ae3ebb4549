"""The extended header ``eh00`` that a ``.pte`` carries inside its flatbuffer, at bytes 8..40.

::

    offset  size  content
    ------  ----  ---------------------------------------------------------------
         0     4  u32 LE   offset of the Program table (the flatbuffer's root offset)
         4     4  "ET12"   the flatbuffer's file identifier
         8     4  "eh00"   extended header magic
        12     4  u32 LE   header length = 32
        16     8  u64 LE   program size: bytes [0, program size) are the flatbuffer
                           with this header inside it
        24     8  u64 LE   segment base offset: where segment offsets count from
                           (a multiple of 128), 0 without segments
        32     8  u64 LE   segment data size: from the segment base to the end of the
                           last segment
        40     .  the rest of the flatbuffer

The header is inserted into a finished flatbuffer after its first 8 bytes, and its root
offset grown by 32: every offset inside a flatbuffer is relative to where it is stored,
so only the root offset (counted from byte 0) moves, and 32 keeps every alignment the
schema asks for (at most 16).  A reader that finds no ``eh00`` at byte 8 treats the whole
file as the flatbuffer, without segments.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import XnnquantError

MAGIC = b"eh00"
#: Bytes of the header as written: magic, length, three u64.
LENGTH = 32
#: The shortest header a reader accepts (without the segment data size).
MINIMUM_LENGTH = 24
#: Where the header starts: after the root offset and the file identifier.
OFFSET = 8
_LAYOUT = struct.Struct("<4sIQQQ")
assert _LAYOUT.size == LENGTH


@dataclass(frozen=True)
class ExtendedHeader:
    """Program size, segment base offset and segment data size of a ``.pte``, in bytes."""

    program_size: int
    segment_base_offset: int
    segment_data_size: int

    def to_bytes(self) -> bytes:
        return _LAYOUT.pack(MAGIC, LENGTH, self.program_size, self.segment_base_offset, self.segment_data_size)

    @classmethod
    def read(cls, data: bytes | memoryview) -> ExtendedHeader | None:
        """The header of the program ``data`` (its first 40 bytes suffice), or None when
        bytes 8..12 are not ``eh00`` or its length is below 24."""
        if len(data) < OFFSET + MINIMUM_LENGTH or bytes(data[OFFSET:OFFSET + 4]) != MAGIC:
            return None
        (length,) = struct.unpack_from("<I", data, OFFSET + 4)
        if length < MINIMUM_LENGTH:
            return None
        program_size, base = struct.unpack_from("<QQ", data, OFFSET + 8)
        size = struct.unpack_from("<Q", data, OFFSET + 24)[0] if length > MINIMUM_LENGTH and len(data) >= 40 else 0
        return cls(program_size, base, size)


def insert(flatbuffer: bytes, header: ExtendedHeader) -> bytes:
    """``flatbuffer`` (a finished ``ET12`` flatbuffer) with ``header`` at bytes 8..40."""
    if len(flatbuffer) < OFFSET or flatbuffer[4:8] != b"ET12":
        raise XnnquantError(f"not an ET12 flatbuffer: got identifier {flatbuffer[4:8]!r}")
    (root,) = struct.unpack_from("<I", flatbuffer, 0)
    return struct.pack("<I", root + LENGTH) + flatbuffer[4:OFFSET] + header.to_bytes() + flatbuffer[OFFSET:]
