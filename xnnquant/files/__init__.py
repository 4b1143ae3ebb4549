"""Writing output files so that a reader never sees half of one.

``write_atomic`` writes to a temporary file in the target's directory, flushes it to
disk, then renames it over the target.  A failure at any point (a full disk, an error
while producing the chunks, an interrupt) leaves the previous file, if any, untouched
and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from .. import arguments
from ..errors import OutputFileError, XnnquantError

#: What ``write_atomic`` writes: one bytes-like object, or chunks of them written in order.
Data = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


def write_atomic(path: str | os.PathLike[str], data: Data) -> Path:
    """Write ``data`` (bytes-like, or an iterable of bytes-like chunks) to ``path`` atomically.

    The file gets the permissions ``open()`` would give it (0666 less the umask).  Chunks
    are consumed one at a time, so a generator can stream a file larger than memory; each
    is written while the next is made, so a chunk must not change once it is yielded (no
    buffer reused from one chunk to the next).  Returns ``path`` as a ``Path``.

    A path that is not one raises ``XnnquantError``; a failure of the file system
    (a missing directory, no permission, a full disk) raises ``OutputFileError`` naming
    ``path`` and the system's reason, never the temporary file.  Errors of the chunks'
    producer pass through unchanged.
    """
    path = arguments.path(path)
    with _writing(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            with _writing(path):
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)  # mkstemp makes 0600
                if isinstance(data, (bytes, bytearray, memoryview)):
                    f.write(data)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                _write_behind(f, data, path)
            with _writing(path):
                f.flush()
                os.fsync(f.fileno())
        with _writing(path):
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """An ``OSError`` of the block as ``OutputFileError`` naming ``path`` (not the temporary file)."""
    try:
        yield
    except OSError as exc:
        if isinstance(exc, XnnquantError):
            raise
        raise OutputFileError(f"cannot write {os.fspath(path)!r}: {exc.strerror or str(exc) or type(exc).__name__}"
                              f"{_hint(path)}") from None


def _hint(path: Path) -> str:
    """Why the folder of ``path`` cannot take it, when that is plain to see."""
    folder = path.parent
    if not folder.exists():
        return f" (its directory {os.fspath(folder)!r} does not exist)"
    if not folder.is_dir():
        return f" ({os.fspath(folder)!r} is not a directory)"
    return ""


def _write_behind(f: BinaryIO, chunks: Iterable[bytes | bytearray | memoryview], path: Path) -> None:
    """Write ``chunks`` in order, each from a thread of its own while the next one is made
    (a streaming export quantizes the next weight while the last one is written).  At most
    two chunks are alive at a time; an
    error from either side is raised here once no write is in flight (a write's as
    ``OutputFileError``, see ``_writing``)."""
    with ThreadPoolExecutor(1, thread_name_prefix="xnnquant-write") as writer:
        pending = None
        for chunk in chunks:
            if pending is not None:
                with _writing(path):
                    pending.result()
            pending = writer.submit(f.write, chunk)
        if pending is not None:
            with _writing(path):
                pending.result()
