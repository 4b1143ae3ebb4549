"""The constant segment: every constant's bytes, 16-aligned, each distinct blob once."""

from __future__ import annotations

from dataclasses import dataclass, field

from .header import align


@dataclass
class ConstantSegment:
    """Builds the segment and the ``XNNGraph.constant_data`` table that indexes it.

    Layout (offsets relative to the segment start, which the header places 16-aligned)::

        entry 0     reserved: offset 0, size 0 (constant_buffer_idx 0 means "not constant")
        entry 1     offset 0        bytes of the first distinct blob, then zeros to 16
        entry 2     offset align16(size 1)  ...
        ...

    ``size`` is the blob's exact length; the trailing zero padding belongs to the segment
    (so its length is a multiple of 16).  Adding bytes equal to an earlier blob returns
    the earlier index, so identical constants are stored once.
    """

    entries: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # (offset, size)
    _chunks: list[bytes | memoryview] = field(default_factory=list)
    _length: int = 0
    _index: dict[bytes | memoryview, int] = field(default_factory=dict)

    def add(self, blob: bytes | memoryview) -> int:
        """Index of ``blob`` in ``entries`` (>= 1), appending it when new."""
        found = self._index.get(blob)
        if found is not None:
            return found
        index = len(self.entries)
        self.entries.append((self._length, len(blob)))
        padded = align(len(blob))
        self._chunks += [blob, b"\0" * (padded - len(blob))]
        self._length += padded
        self._index[blob] = index
        return index

    def clear(self) -> None:
        """Back to the reserved entry 0 alone."""
        self.entries[1:] = []
        self._chunks.clear()
        self._length = 0
        self._index.clear()

    def blobs(self) -> list[bytes | memoryview]:
        """The distinct blobs, in entry order (entry i + 1 holds blob i)."""
        return self._chunks[0::2]

    def to_bytes(self) -> bytes:
        """The whole segment, padding included."""
        return b"".join(self._chunks)
