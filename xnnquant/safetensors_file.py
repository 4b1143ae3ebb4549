"""A safetensors file read one tensor at a time, each memory-mapped only while it is used.

For exporting models larger than memory: ``SafetensorsFile(path)`` reads and checks the
header only; ``with f.tensor(name) as array:`` maps that tensor's bytes (a read-only numpy
view, no copy), and unmaps them at the end of the block, so the process never holds more
than the tensor in use: the pages of a mapping count in its resident memory for as long
as they stay mapped.

The format (safetensors' specification)::

    bytes 0..7     n, little-endian u64: the header's length
    bytes 8..8+n   JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
                          "__metadata__": {str: str} (optional)}
    then           the data; a tensor's bytes are data[begin:end], row-major, little-endian

The ``safetensors`` package reads such files, but it maps the whole file and has no way to
give a tensor's byte range, which per-tensor mapping needs; so the header is read here.
Every defect of the header, or a file shorter than its header says, is an
``XnnquantError`` naming the file and, where it concerns one, the tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .errors import XnnquantError

#: safetensors dtype names -> numpy dtypes (little-endian).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
#: A header longer than this is refused (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: dtype, shape, and its bytes' range within the file."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # file offset of the first byte
    nbytes: int


class SafetensorsFile:
    """The tensors of one safetensors file (see the module docstring); close it, or use ``with``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open until close()
        except OSError as exc:
            raise XnnquantError(f"cannot open safetensors file {os.fspath(path)!r}: {exc}") from None
        try:
            self.tensors = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _fail(self, message: str) -> XnnquantError:
        return XnnquantError(f"{self.path}: {message}")

    def _read_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise self._fail(f"not a safetensors file: {size} bytes, expected at least 8 (the header length)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise self._fail(f"not a safetensors file, or truncated: the header length field says {n} bytes, "
                             f"the file holds {size - 8} after it")
        try:
            header = json.loads(self._file.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(f"corrupt safetensors header: not UTF-8 JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._fail(f"corrupt safetensors header: expected a JSON object, got {type(header).__name__}")
        data_start, data_size = 8 + n, size - 8 - n
        tensors = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = self._entry(name, entry, data_start, data_size)
        return tensors

    def _entry(self, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
        def bad(what: str) -> XnnquantError:
            return self._fail(f"tensor {name!r}: {what}")

        if not isinstance(entry, dict):
            raise bad(f"header entry must be an object: got {entry!r}")
        dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise bad(f"unknown dtype {entry.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad(f"shape must be a list of non-negative integers: got {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise bad(f"data_offsets must be [begin, end] with 0 <= begin <= end: got {offsets!r}")
        begin, end = offsets
        expected = dtype.itemsize * math.prod(shape)
        if end - begin != expected:
            raise bad(f"holds {end - begin} bytes, but {entry['dtype']} {tuple(shape)} needs {expected}")
        if end > data_size:
            raise bad(f"its data ends at byte {end} of the data section, which has only {data_size} bytes "
                      "(the file is truncated)")
        return TensorInfo(name, dtype, tuple(shape), data_start + begin, expected)

    def info(self, name: str) -> TensorInfo:
        """The tensor ``name``; a missing one is an error listing a few that exist."""
        if name not in self.tensors:
            near = ", ".join(sorted(self.tensors)[:5])
            raise self._fail(f"no tensor {name!r} in the file ({len(self.tensors)} tensors: {near}, ...)")
        return self.tensors[name]

    @contextlib.contextmanager
    def tensor(self, name: str) -> Iterator[np.ndarray]:
        """``with f.tensor(name) as a:``: the tensor as a read-only array mapped from the file.

        The mapping (and its pages' share of resident memory) ends with the block; an array
        kept beyond it keeps the mapping alive until it is freed.
        """
        info = self.info(name)
        if info.nbytes == 0:
            empty = np.zeros(info.shape, info.dtype)
            empty.flags.writeable = False
            yield empty
            return
        page = mmap.ALLOCATIONGRANULARITY
        start = info.start - info.start % page
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)  # read ahead: the whole tensor is used
        array: np.ndarray | None = None
        mapped = mmap.mmap(self._file.fileno(), info.start + info.nbytes - start, flags=flags,
                           prot=mmap.PROT_READ, offset=start)
        try:
            array = np.frombuffer(mapped, info.dtype, math.prod(info.shape), info.start - start)
            array.flags.writeable = False  # the pages are mapped read-only: a write would crash
            yield array.reshape(info.shape)
        finally:
            array = None
            if hasattr(mapped, "madvise"):
                mapped.madvise(mmap.MADV_DONTNEED)  # drop the pages even if a view outlives the block
            with contextlib.suppress(BufferError):  # a view still exists: freed with it
                mapped.close()

    def prefetch(self, name: str) -> None:
        """Ask the kernel to start reading tensor ``name`` into its page cache now (no wait,
        nothing mapped), so that reading it later overlaps with other work."""
        info = self.info(name)
        if info.nbytes and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._file.fileno(), info.start, info.nbytes, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
