"""Writing output files so that a reader never sees half of one.

``write_atomic`` writes to a temporary file in the target's directory, flushes it to
disk, then renames it over the target.  A failure at any point (a full disk, an error
while producing the chunks, an interrupt) leaves the previous file, if any, untouched
and no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

#: What ``write_atomic`` writes: one bytes-like object, or chunks of them written in order.
Data = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]


def write_atomic(path: str | os.PathLike[str], data: Data) -> Path:
    """Write ``data`` (bytes-like, or an iterable of bytes-like chunks) to ``path`` atomically.

    The file gets the permissions ``open()`` would give it (0666 less the umask).  Chunks
    are consumed one at a time, so a generator can stream a file larger than memory; each
    is written while the next is made, so a chunk must not change once it is yielded (no
    buffer reused from one chunk to the next).  Returns ``path`` as a ``Path``.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)  # mkstemp makes 0600
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                _write_behind(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _write_behind(f: BinaryIO, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
    """Write ``chunks`` in order, each from a thread of its own while the next one is made
    (a streaming export quantizes the next weight while the last one is written: 2 s of
    writes hidden in a 1.07e9-weight export).  At most two chunks are alive at a time; an
    error from either side is raised here once no write is in flight."""
    with ThreadPoolExecutor(1, thread_name_prefix="xnnquant-write") as writer:
        pending = None
        for chunk in chunks:
            if pending is not None:
                pending.result()
            pending = writer.submit(f.write, chunk)
        if pending is not None:
            pending.result()
