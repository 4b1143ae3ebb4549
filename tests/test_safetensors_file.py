"""SafetensorsFile: tensors as the safetensors package writes them, offsets for read-ahead,
and refused files named down to the tensor where the header tells."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq
from xnnquant.files.safetensors import SafetensorsFile, TensorInfo, _data_offsets

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((37, 5000)).astype(np.float32),  # spans several pages
        "b.bias": rng.standard_normal(3).astype(np.float16),
        "c": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
        "ids": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_every_tensor_reads_as_written_and_the_offsets_hold_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    given = tensors()
    safetensors_numpy.save_file(given, str(path), metadata={"format": "np"})
    f = SafetensorsFile(path)
    data = path.read_bytes()
    offsets = _data_offsets(path)
    assert set(f.tensors) == set(given) == set(offsets)
    for name, array in given.items():
        got = f.read(name)
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name
        begin, end = offsets[name]
        assert data[begin:end] == array.tobytes(), name
        f.warm(name, chunk=4096)  # "a.weight" takes 181 chunks, "empty" none
        assert f.nbytes(name) == end - begin
    assert f.info("c") == TensorInfo("c", "BF16", (2, 3))
    assert not f.read("a.weight").flags.writeable  # a view of the mapped file, read-only


def good_file(path: Path) -> tuple[Path, dict, int]:
    safetensors_numpy.save_file({"x": np.zeros((2, 2), np.float32), "y": np.ones(3, np.float32)}, str(path))
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return path, json.loads(data[8:8 + n]), 8 + n


def with_header(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def test_refused_files_name_the_tensor_that_does_not_fit(tmp_path: Path) -> None:
    path, header, start = good_file(tmp_path / "good.safetensors")
    data = path.read_bytes()[start:]
    last = max(header, key=lambda k: header[k]["data_offsets"][1] if k != "__metadata__" else -1)
    first = min(header, key=lambda k: header[k]["data_offsets"][0] if k != "__metadata__" else 1 << 60)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-4])
    end = header[last]["data_offsets"][1]
    with pytest.raises(xq.XnnquantError) as info:
        SafetensorsFile(truncated)
    assert str(info.value) == (f"{truncated}: not a valid safetensors file (Error while deserializing header: "
                               f"incomplete metadata, file not fully covered): tensor {last!r}: its data ends at "
                               f"byte {end} of the data section, which has only {end - 4} bytes (the file is "
                               f"truncated)")
    header[first]["data_offsets"][1] += 4  # overlaps the next tensor
    overlap = with_header(tmp_path / "overlap.safetensors", header, data)
    with pytest.raises(xq.XnnquantError, match=rf"overlap.safetensors: not a valid safetensors file \(.*\): "
                                               rf"tensor '{first}' ends at byte 20, tensor '{last}' begins at "
                                               r"byte 16 of the data section \(an overlap\)"):
        SafetensorsFile(overlap)


@pytest.mark.parametrize(("content", "message"), [
    (b"\x05\0\0", r"not a valid safetensors file \(Error while deserializing header: header too small\)$"),
    ((1000).to_bytes(8, "little") + b"{}", r"not a valid safetensors file \(.*\)$"),
    ((4).to_bytes(8, "little") + b"\xff\xfe{}", r"not a valid safetensors file \(.*\)$"),
    ((8).to_bytes(8, "little") + b'{"w": 1}', r"not a valid safetensors file \(.*\)$"),
])
def test_not_safetensors(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(xq.XnnquantError, match=message):
        SafetensorsFile(path)


def test_missing_file_and_tensor_are_named(tmp_path: Path) -> None:
    with pytest.raises(xq.XnnquantError, match=r"cannot open safetensors file .*nothing.safetensors"):
        SafetensorsFile(tmp_path / "nothing.safetensors")
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file({"x": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(xq.XnnquantError, match=r"no tensor 'y' in the file \(1 tensors: x"):
        SafetensorsFile(path).read("y")


def test_a_file_cut_short_after_it_was_opened_is_refused_not_mapped(tmp_path: Path) -> None:
    """A page mapped past the end of the file would stop the process with SIGBUS: the read
    checks the size first and names the tensor."""
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(tensors(), str(path))
    f = SafetensorsFile(path)
    size = path.stat().st_size
    with open(path, "r+b") as cut:
        cut.truncate(size - 100)
    spans = {n: span for n, span in _data_offsets(path).items() if span[1] > span[0]}  # not "empty"
    name = max(spans, key=lambda n: spans[n][1])
    last = spans[name]
    with pytest.raises(xq.XnnquantError, match=rf"tensor {name!r} cannot be read: the file has {size - 100} bytes "
                                               rf"now, the tensor ends at byte {last[1]}"):
        f.read(name)
    f.warm(name)  # the reader thread's warm stops at the end, without error
