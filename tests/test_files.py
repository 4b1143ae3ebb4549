"""files.write_atomic: whole files or none, from bytes or from chunks."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from xnnquant.errors import OutputFileError, XnnquantError
from xnnquant.files import write_atomic


def test_bytes_and_chunks(tmp_path: Path) -> None:
    path = write_atomic(tmp_path / "a.bin", b"\x00\x01")
    assert path == tmp_path / "a.bin" and path.read_bytes() == b"\x00\x01"
    write_atomic(str(path), (bytes([i]) * 3 for i in range(4)))  # a generator, consumed once
    assert path.read_bytes() == b"\x00\x00\x00\x01\x01\x01\x02\x02\x02\x03\x03\x03"
    write_atomic(path, [memoryview(b"ab"), bytearray(b"c")])
    assert path.read_bytes() == b"abc" and list(tmp_path.iterdir()) == [path]


def test_mode_is_what_open_gives(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        path = write_atomic(tmp_path / "m.bin", b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_failing_producer_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.pte"
    path.write_bytes(b"old")

    def chunks() -> Iterator[bytes]:
        yield b"new, first half"
        raise RuntimeError("the exporter failed half way")

    with pytest.raises(RuntimeError, match="half way"):
        write_atomic(path, chunks())
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]


def test_a_missing_directory_is_an_os_error_naming_the_path_given(tmp_path: Path) -> None:
    """An ``OutputFileError`` (an ``XnnquantError`` and an ``OSError``) names the path given and the
    system's reason, never the hidden temporary file the bytes go to first."""
    target = tmp_path / "no" / "such" / "dir.bin"
    with pytest.raises(OutputFileError) as info:
        write_atomic(target, b"x")
    assert isinstance(info.value, OSError) and isinstance(info.value, XnnquantError)
    assert str(info.value) == (f"cannot write {str(target)!r}: No such file or directory (its directory "
                               f"{str(target.parent)!r} does not exist)")
    with pytest.raises(OutputFileError, match=rf"^cannot write {re.escape(repr(str(tmp_path)))}: Is a directory$"):
        write_atomic(tmp_path, b"x")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OutputFileError, match=r"is not a directory\)$"):
        write_atomic(tmp_path / "file" / "x.pte", b"x")
    for bad in (None, 3, b"x.pte", ""):
        with pytest.raises(XnnquantError, match=r"^path must be a file path \(a non-empty str or os.PathLike\): got "):
            write_atomic(bad, b"x")  # type: ignore[arg-type]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_failing_write_stops_the_producer_and_leaves_the_old_file(tmp_path: Path) -> None:
    """Chunks are written from a thread while the next is made: its error comes back here,
    and no chunk after it is asked for (a failed write must not go on quantizing a model)."""
    path = tmp_path / "out.pte"
    path.write_bytes(b"old")
    made = []

    def chunks() -> Iterator[object]:
        for i in range(10):
            made.append(i)
            yield "not bytes" if i == 2 else b"x" * 1000

    with pytest.raises(TypeError):
        write_atomic(path, chunks())  # type: ignore[arg-type]
    assert made == [0, 1, 2, 3]  # the chunk after the bad one is made while it is written
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]
