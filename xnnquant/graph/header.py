"""The 32-byte XNNHeader that wraps an XN01 flatbuffer and its constant segment.

A payload is laid out as::

    offset  size  content
    ------  ----  ---------------------------------------------------------------
         0     4  00 00 00 00   (where a bare flatbuffer keeps its root offset)
         4     4  "XH00"        magic (where a bare flatbuffer keeps its identifier)
         8     2  u16 LE        header length = 30
        10     4  u32 LE        flatbuffer offset = 32
        14     4  u32 LE        flatbuffer size (unpadded)
        18     4  u32 LE        constant segment offset = 32 + align16(flatbuffer size)
        22     8  u64 LE        constant segment size
        30     2  00 00         padding to 32
        32     n  flatbuffer (identifier "XN01" at 32 + 4)
      32+n     p  00 ...        padding to a multiple of 16
    const_off  s  constant segment (every entry 16-aligned, zero padded)

A buffer whose bytes 4..7 are not ``XH00`` is a bare flatbuffer (legacy payloads keep
constants inline in ``XNNGraph.constant_buffer``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..constants import CONSTANT_TENSOR_ALIGNMENT
from ..errors import PayloadError

MAGIC = b"XH00"
HEADER_LENGTH = 30
_LAYOUT = struct.Struct("<4s4sHIIIQ")  # placeholder, magic, length, fb off, fb size, const off, const size
assert _LAYOUT.size == HEADER_LENGTH


def align(n: int, alignment: int = CONSTANT_TENSOR_ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class XNNHeader:
    """Offsets and sizes of the two regions of a payload (all in bytes from its start)."""

    flatbuffer_offset: int
    flatbuffer_size: int
    constant_data_offset: int
    constant_data_size: int

    # byte offsets of the fields inside the header
    MAGIC_OFFSET = 4
    LENGTH_OFFSET = 8
    FLATBUFFER_OFFSET_OFFSET = 10
    FLATBUFFER_SIZE_OFFSET = 14
    CONSTANT_DATA_OFFSET_OFFSET = 18
    CONSTANT_DATA_SIZE_OFFSET = 22

    @classmethod
    def for_sizes(cls, flatbuffer_size: int, constant_data_size: int) -> XNNHeader:
        """The header of a payload with a flatbuffer and a segment of these sizes."""
        fb_offset = align(HEADER_LENGTH)
        return cls(fb_offset, flatbuffer_size, fb_offset + align(flatbuffer_size), constant_data_size)

    def to_bytes(self) -> bytes:
        """The header as 32 bytes: 30 of fields (see the module docstring), 2 of padding."""
        packed = _LAYOUT.pack(
            b"\0\0\0\0", MAGIC, HEADER_LENGTH, self.flatbuffer_offset, self.flatbuffer_size,
            self.constant_data_offset, self.constant_data_size,
        )
        return packed + b"\0" * (align(HEADER_LENGTH) - HEADER_LENGTH)

    @staticmethod
    def has_header(data: bytes | memoryview) -> bool:
        """Whether ``data`` starts with an XNNHeader (the runtime's detection rule)."""
        return len(data) >= HEADER_LENGTH and bytes(data[4:8]) == MAGIC

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> XNNHeader:
        """Parse the header at the start of ``data`` and check it against ``len(data)``."""
        if not cls.has_header(data):
            raise PayloadError(
                f"no XNNHeader: got {len(data)} bytes starting {bytes(data[:8])!r}, "
                f"expected at least {HEADER_LENGTH} bytes with magic {MAGIC!r} at offset 4"
            )
        _, _, _length, fb_off, fb_size, const_off, const_size = _LAYOUT.unpack_from(data, 0)
        header = cls(fb_off, fb_size, const_off, const_size)
        problem = header.problem(len(data))
        if problem:
            raise PayloadError(f"corrupt XNNHeader: {problem}")
        return header

    def problem(self, total_size: int) -> str | None:
        """Why this header does not fit a payload of ``total_size`` bytes, or None.

        The same checks as ExecuTorch 1.4.1's runtime: a flatbuffer of at least 8 bytes,
        both regions inside the payload, the constant segment after the flatbuffer.
        """
        if self.flatbuffer_size < 8:
            return f"flatbuffer_size must be at least 8: got {self.flatbuffer_size}"
        if self.flatbuffer_offset + self.flatbuffer_size > total_size:
            return (
                f"flatbuffer region [{self.flatbuffer_offset}, +{self.flatbuffer_size}) "
                f"extends past the end of the {total_size}-byte payload"
            )
        if self.constant_data_offset + self.constant_data_size > total_size:
            return (
                f"constant region [{self.constant_data_offset}, +{self.constant_data_size}) "
                f"extends past the end of the {total_size}-byte payload"
            )
        if self.constant_data_offset < self.flatbuffer_offset + self.flatbuffer_size:
            return (
                f"constant region must start after the flatbuffer: got constant_data_offset="
                f"{self.constant_data_offset}, flatbuffer ends at {self.flatbuffer_offset + self.flatbuffer_size}"
            )
        return None

    def is_valid(self, total_size: int) -> bool:
        """Whether this header fits a payload of ``total_size`` bytes."""
        return self.problem(total_size) is None
