"""``load`` maps payload files instead of reading them: constants are views, never copies.

The large case is a 512 MiB constant that is a hole in a sparse file: reading it would
add 512 MiB to the process's resident memory (the pages of a mapping count once
touched), so a load that read or copied constants shows up in ``/proc/self/statm``.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.graph import Deferred, Graph, load, writer

BIG = (16384, 8192)  # float32: 512 MiB


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_constants_are_views_of_the_mapped_file(tmp_path: Path) -> None:
    g = Graph()
    x = g.input((2, 64))
    w = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    g.output(g.fully_connected(x, g.constant(w), g.constant(np.ones(32, np.float32))))
    path = g.save(tmp_path / "m.xnn")
    loaded = load(path)
    constants = [v.constant for v in loaded.values if v.constant is not None]
    assert all(isinstance(c, memoryview) and c.readonly and isinstance(c.obj, mmap.mmap) for c in constants)
    assert loaded == g  # a view compares equal to the bytes it shows
    np.testing.assert_array_equal(loaded.values[1].array(), w)
    assert load(path).to_bytes() == g.to_bytes() == path.read_bytes()


def test_listing_values_of_a_large_payload_reads_no_constant(tmp_path: Path) -> None:
    g = Graph(target="1.4.1", scales_in_segment=True)
    x = g.input((1, BIG[1]))
    big = Deferred(xq.Datatype.fp32, BIG, lambda: np.zeros(BIG, np.float32), "big")
    g.output(g.fully_connected(x, g.constant(big)))
    chunks = writer.payload_chunks(g)
    head = b"".join(bytes(next(chunks)) for _ in range(3))  # header, flatbuffer, padding
    path = tmp_path / "big.xnn"
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + writer.SegmentPlan.of(g).size)  # the constant: a hole of zeros
    before = resident_bytes()
    loaded = load(path)
    summary = [(v.id, v.datatype.name, v.dims, len(v.constant) if v.constant is not None else 0)
               for v in loaded.values]
    grown = resident_bytes() - before
    assert summary[1] == (1, "fp32", BIG, 4 * BIG[0] * BIG[1])
    assert grown < 64 << 20, f"loading grew resident memory by {grown >> 20} MiB"  # 512 MiB if read
    assert bytes(loaded.values[1].constant[-8:]) == bytes(8)  # the data is there when asked for


def test_read_pte_maps_the_program_file(tmp_path: Path) -> None:
    """A .pte read from a path: the delegate's payload and its constants are views of the mapped file."""
    pytest.importorskip("executorch")
    from xnnquant.graph import to_pte
    from xnnquant.pte import read_pte

    g = Graph()
    x = g.input((2, 64))
    g.output(g.fully_connected(x, g.constant(np.ones((32, 64), np.float32))))
    path = tmp_path / "m.pte"
    path.write_bytes(to_pte(g.to_bytes(), constants="inline"))  # the payload as written, constants in it
    (delegate,) = read_pte(path).delegates
    assert isinstance(delegate.payload, memoryview) and isinstance(delegate.payload.obj, mmap.mmap)
    weight = delegate.graph.values[1].constant
    assert isinstance(weight, memoryview) and isinstance(weight.obj, mmap.mmap)
    assert bytes(delegate.payload) == g.to_bytes()
