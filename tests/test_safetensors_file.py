"""SafetensorsFile against the safetensors package (the oracle for the format), and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq
from xnnquant.safetensors_file import SafetensorsFile

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


def test_every_tensor_reads_as_the_safetensors_package_writes_it(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    given = tensors()
    safetensors_numpy.save_file(given, str(path), metadata={"format": "np"})
    with SafetensorsFile(path) as f:
        assert set(f.tensors) == set(given)
        for name, array in given.items():
            with f.tensor(name) as got:
                assert got.dtype == array.dtype and got.shape == array.shape, name
                assert got.tobytes() == array.tobytes(), name
                assert not got.flags.writeable


def header_file(path: Path, header: object, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(("header", "data", "message"), [
    ({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, b"\0" * 12,
     "tensor 'w': its data ends at byte 16 of the data section, which has only 12 bytes (the file is truncated)"),
    ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, b"\0" * 16,
     "tensor 'w': holds 16 bytes, but F32 (2, 3) needs 24"),
    ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, b"\0",
     "tensor 'w': unknown dtype 'Q4', expected one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4,
     "tensor 'w': shape must be a list of non-negative integers: got [-1]"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4,
     "tensor 'w': data_offsets must be [begin, end] with 0 <= begin <= end: got [4, 0]"),
    ([1, 2], b"", "corrupt safetensors header: expected a JSON object, got list"),
])
def test_defects_name_the_file_and_tensor(tmp_path: Path, header: object, data: bytes, message: str) -> None:
    path = header_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(xq.XnnquantError) as info:
        SafetensorsFile(path)
    assert str(info.value) == f"{path}: {message}"


def test_truncated_header_and_tiny_files(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x05\0\0")
    with pytest.raises(xq.XnnquantError, match=r"not a safetensors file: 3 bytes, expected at least 8"):
        SafetensorsFile(path)
    path.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(xq.XnnquantError, match=r"the header length field says 1000 bytes, the file holds 2"):
        SafetensorsFile(path)
    path.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{}")
    with pytest.raises(xq.XnnquantError, match=r"corrupt safetensors header: not UTF-8 JSON"):
        SafetensorsFile(path)
    with pytest.raises(xq.XnnquantError, match=r"cannot open safetensors file .*nothing.safetensors"):
        SafetensorsFile(tmp_path / "nothing.safetensors")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_numpy.save_file({"x": np.zeros(2, np.float32)}, str(path))
    with SafetensorsFile(path) as f, pytest.raises(xq.XnnquantError, match=r"no tensor 'y' in the file \(1 tensors: x"):
        f.info("y")
