"""A safetensors file read one tensor at a time, for exports of models larger than memory.

The ``safetensors`` package checks the file: ``safe_open`` checks the whole header when
the file is opened (dtypes, shapes, offsets that tile the data section exactly, nothing
truncated), then closes it.  ``read`` maps one tensor's bytes (``mmap``) and views them as
an array: no copy, the page cache's pages are the array, and they leave the process's
resident memory when the array goes, so peak memory is one tensor's bytes, not the file's
(one ``safe_open`` kept for all reads maps the whole file; ``get_tensor`` copies: docs/benchmarks.md,
"Performance").  A file cut
short after it was checked is refused before mapping (a mapped page past the end would
stop the process with SIGBUS), and so is a file changed in any way since it was opened:
its identity (device, inode, size, modification time) is kept at opening and compared
before each read, so an export never writes a mix of two files.

safetensors does not say where a tensor's bytes lie in the file, and ``read`` and
``warm`` need that; ``_data_offsets`` takes them from the header that ``safe_open`` has
already checked::

    bytes 0..7     n, little-endian u64
    bytes 8..8+n   JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}
    then           the data section: a tensor's bytes are data[begin:end]

safetensors' errors name no tensor; when a file is refused, the tensor whose bytes do not
fit (past the end of a truncated file, or overlapping or leaving a gap before the next) is
named from the same header where it can be read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import XnnquantError, missing_extra

#: safetensors dtypes read by mapping the file, as numpy dtypes (little-endian, as the
#: format stores them); the others are read through ``safetensors``.
_MAPPED: dict[str, Any] = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16, "I64": "<i8",
                           "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, dtype as safetensors spells it (``"F32"``), shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def _safetensors() -> Any:
    try:
        import safetensors
    except ImportError:  # pragma: no cover - the models extra is missing
        raise missing_extra("models", "safetensors", "reading a safetensors file") from None
    return safetensors


class SafetensorsFile:
    """The tensors of one safetensors file; nothing stays open between reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        safetensors = _safetensors()
        try:
            with safetensors.safe_open(self.path, framework="numpy") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 - not a dict
                self.tensors = {name: TensorInfo(name, part.get_dtype(), tuple(part.get_shape()))
                                for name, part in slices.items()}
            self._identity = _identity(os.stat(self.path))
        except OSError as exc:
            raise XnnquantError(f"cannot open safetensors file {os.fspath(path)!r}: {exc}") from None
        except safetensors.SafetensorError as exc:
            raise XnnquantError(f"{self.path}: not a valid safetensors file ({exc}){_misfit(self.path)}") from None
        self._offsets: dict[str, tuple[int, int]] | None = None

    def _check_unchanged(self, stat: os.stat_result, name: str) -> None:
        """Refuse to read ``name`` from a file that is no longer the one opened."""
        now = _identity(stat)
        if now != self._identity:
            raise XnnquantError(
                f"{self.path}: tensor {name!r} cannot be read: the file changed since it was opened (size "
                f"{self._identity[2]} -> {now[2]} bytes, modified at {self._identity[3]} -> {now[3]} ns); "
                "export again from the file as it is now")

    def info(self, name: str) -> TensorInfo:
        """The tensor ``name``; a missing one is an error listing a few that exist."""
        if name not in self.tensors:
            raise _no_tensor(self.path, name, self.tensors, "file")
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``: a read-only array mapping its bytes in the file, for the dtypes
        numpy spells (``_MAPPED``), else read into an array of its own.  Either way the file
        is closed again; the mapping ends with the array."""
        info = self.info(name)
        dtype = _MAPPED.get(info.dtype)
        if dtype is not None:
            return self._mapped(info, np.dtype(dtype))
        safetensors = _safetensors()
        try:
            self._check_unchanged(os.stat(self.path), name)
            with safetensors.safe_open(self.path, framework="numpy") as f:
                return np.asarray(f.get_tensor(name))
        except (OSError, safetensors.SafetensorError) as exc:  # changed since it was opened
            raise XnnquantError(f"{self.path}: tensor {name!r} cannot be read: {exc}") from None

    def _mapped(self, info: TensorInfo, dtype: np.dtype) -> np.ndarray:
        """``info``'s bytes mapped read-only (``mmap``), viewed as ``dtype`` in its shape."""
        begin, end = self._span(info.name)
        count = math.prod(info.shape)
        if count == 0:
            return np.zeros(info.shape, dtype)
        try:
            with open(self.path, "rb") as f:
                stat = os.fstat(f.fileno())
                size = stat.st_size
                if size < end:  # a page past the end would kill the process (SIGBUS), not raise
                    raise XnnquantError(f"{self.path}: tensor {info.name!r} cannot be read: the file has "
                                        f"{size} bytes now, the tensor ends at byte {end} (it changed since "
                                        "it was opened)")
                self._check_unchanged(stat, info.name)
                start = begin - begin % mmap.ALLOCATIONGRANULARITY
                mapped = mmap.mmap(f.fileno(), end - start, offset=start, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise XnnquantError(f"{self.path}: tensor {info.name!r} cannot be read: {exc}") from None
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)  # read ahead on the first touch, drop behind
        return np.frombuffer(mapped, dtype, count, begin - start).reshape(info.shape)

    def warm(self, name: str, chunk: int = 16 << 20) -> None:
        """Read tensor ``name``'s bytes into the page cache and wait for them (``chunk``
        bytes at a time into one scratch buffer): for a thread that reads ahead, so the
        disk works while the caller quantizes (faster than ``posix_fadvise(WILLNEED)``
        hints on a cold file: docs/benchmarks.md, "Performance")."""
        begin, end = self._span(self.info(name).name)
        scratch = memoryview(bytearray(min(chunk, max(end - begin, 1))))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(begin)
            while begin < end:
                got = f.readinto(scratch[: min(len(scratch), end - begin)])
                if not got:
                    return
                begin += got

    def nbytes(self, name: str) -> int:
        """Bytes tensor ``name`` takes in the file."""
        self.info(name)
        begin, end = self._span(name)
        return end - begin

    def _span(self, name: str) -> tuple[int, int]:
        """File offsets ``(begin, end)`` of tensor ``name``'s bytes."""
        if self._offsets is None:
            self._offsets = _data_offsets(self.path)
        return self._offsets[name]


class ShardedSafetensors:
    """A checkpoint saved in several safetensors files, as Hugging Face saves models larger
    than a few GB, read through its index (``model.safetensors.index.json``), which names
    the file of each tensor::

        {"metadata": {...}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                           "lm_head.weight": "model-00002-of-00002.safetensors", ...}}

    The files sit beside the index.  Each is opened and checked as one ``SafetensorsFile``;
    a tensor the index maps to a file that lacks it is refused at opening.  The reads of
    ``SafetensorsFile`` go to the tensor's file; ``tensors`` lists them file by file, each
    file's in its own order.
    """

    def __init__(self, index: str | os.PathLike[str]) -> None:
        self.path = Path(index)
        try:
            with open(self.path, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise XnnquantError(f"cannot read the checkpoint index {os.fspath(index)!r}: {exc}; expected JSON with a "
                                "'weight_map' of tensor name -> safetensors file") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            got = "an empty one" if weight_map == {} else type(weight_map).__name__ if not isinstance(
                weight_map, dict) else "names that are not strings"
            raise XnnquantError(f"{self.path}: expected a 'weight_map' of tensor name -> safetensors file name, "
                                f"got {got}")
        self.shards = {file: SafetensorsFile(self.path.parent / file) for file in sorted(set(weight_map.values()))}
        self._shard_of: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for file, shard in self.shards.items():
            for name in shard.tensors:
                if weight_map.get(name) == file:
                    self._shard_of[name] = shard
                    self.tensors[name] = shard.tensors[name]
        for name, file in weight_map.items():
            if name not in self.tensors:
                raise XnnquantError(f"{self.path}: tensor {name!r} is mapped to {file!r}, which does not hold it")

    def _shard(self, name: str) -> SafetensorsFile:
        if name not in self._shard_of:
            raise _no_tensor(self.path, name, self.tensors, "checkpoint")
        return self._shard_of[name]

    def info(self, name: str) -> TensorInfo:
        return self._shard(name).info(name)

    def read(self, name: str) -> np.ndarray:
        return self._shard(name).read(name)

    def warm(self, name: str, chunk: int = 16 << 20) -> None:
        self._shard(name).warm(name, chunk)

    def nbytes(self, name: str) -> int:
        return self._shard(name).nbytes(name)


def _no_tensor(path: Path, name: str, tensors: dict[str, TensorInfo], what: str) -> XnnquantError:
    """The error for a tensor ``name`` that the ``what`` at ``path`` lacks, listing a few it has."""
    near = ", ".join(sorted(tensors)[:5])
    return XnnquantError(f"{path}: no tensor {name!r} in the {what} ({len(tensors)} tensors: {near}, ...)")


def open_checkpoint(path: str | os.PathLike[str]) -> SafetensorsFile | ShardedSafetensors:
    """The checkpoint at ``path``: one safetensors file, or the index of a sharded one
    (a ``.json`` file, ``ShardedSafetensors``)."""
    if os.fspath(path).endswith(".json"):
        return ShardedSafetensors(path)
    return SafetensorsFile(path)


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size, mtime (ns)."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header and the file offset where the data section starts."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """File offsets ``(begin, end)`` of every tensor's bytes (of a file safetensors accepted)."""
    header, start = _header(path)
    return {name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def _misfit(path: Path) -> str:
    """``": tensor 'x' ..."`` naming the tensor whose bytes do not fit the data section, when
    the header can be read and one is found; else ``""``."""
    try:
        header, start = _header(path)
        spans = sorted((int(entry["data_offsets"][0]), int(entry["data_offsets"][1]), str(name))
                       for name, entry in header.items() if name != "__metadata__")
    except Exception:  # the header itself is what safetensors refused: nothing more to say
        return ""
    size = os.path.getsize(path) - start
    position, previous = 0, None
    for begin, end, name in spans:
        if begin != position:
            where = f"tensor {previous!r} ends at byte {position}, " if previous else ""
            return (f": {where}tensor {name!r} begins at byte {begin} of the data section "
                    f"({'a gap' if begin > position else 'an overlap'})")
        if end > size:
            return (f": tensor {name!r}: its data ends at byte {end} of the data section, which has only "
                    f"{size} bytes (the file is truncated)")
        position, previous = end, name
    return ""
