"""pack_int4 / pack_int4_bytes / unpack_int4: golden bytes by hand, every value, ExecuTorch's serializer."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from xnnquant import XnnquantError
from xnnquant.packing import pack_int4, unpack_int4
from xnnquant.packing.int4 import pack_int4_bytes


def test_golden_even_k():
    # row 0: codes -8, 7 | 0, -1  -> nibbles 0x0, 0xF | 0x8, 0x7 -> bytes 0xF0, 0x78
    # row 1: codes  1, 2 | -3, 3  -> nibbles 0x9, 0xA | 0x5, 0xB -> bytes 0xA9, 0xB5
    codes = np.array([[-8, 7, 0, -1], [1, 2, -3, 3]], np.int8)
    assert pack_int4(codes).tobytes() == bytes([0xF0, 0x78, 0xA9, 0xB5])


def test_golden_odd_k_pads_each_row_with_a_zero_weight():
    # K = 3: the high nibble of each row's last byte is 8 (code 0), rows do not share bytes.
    # row 0: -8, 7, 5   -> 0xF0, (8 << 4) | 0xD = 0x8D
    # row 1: -1, -2, -7 -> (0x6 << 4) | 0x7 = 0x67, 0x81
    # row 2:  4, -4, 0  -> (0x4 << 4) | 0xC = 0x4C, 0x88
    codes = np.array([[-8, 7, 5], [-1, -2, -7], [4, -4, 0]], np.int8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 2) and packed.dtype == np.uint8
    assert packed.tobytes() == bytes([0xF0, 0x8D, 0x67, 0x81, 0x4C, 0x88])


def test_k_equal_one_and_higher_rank():
    assert pack_int4(np.array([[3], [-3]])).tobytes() == bytes([0x8B, 0x85])
    codes = np.arange(-8, 8).reshape(2, 2, 4)
    assert pack_int4(codes).shape == (2, 2, 2)
    assert pack_int4(codes).reshape(-1).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


@pytest.mark.parametrize("lo", range(-8, 8))
def test_every_int4_value_in_both_nibbles(lo):
    his = np.arange(-8, 8)
    codes = np.stack([np.full(16, lo), his], axis=1)  # 16 rows of (lo, hi)
    packed = pack_int4(codes)[:, 0]
    assert np.array_equal(packed & 0xF, np.full(16, lo + 8))
    assert np.array_equal(packed >> 4, his + 8)
    assert np.array_equal(unpack_int4(pack_int4(codes), 2), codes)


@given(hnp.arrays(np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9), elements=st.integers(-8, 7)))
def test_unpack_inverts_pack(codes):
    assert np.array_equal(unpack_int4(pack_int4(codes), codes.shape[-1]), codes)


@given(hnp.arrays(np.int8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=150), elements=st.integers(-8, 7)))
def test_bytes_are_those_of_the_packed_array(codes):
    """Shapes up to 150 a side: whole vectors of 64 codes and the pairs after them."""
    packed = pack_int4_bytes(codes)
    assert type(packed) is bytes
    assert packed == pack_int4(codes).tobytes()


def test_bytes_of_nothing_and_of_integral_floats():
    assert pack_int4_bytes(np.zeros((3, 0), np.int8)) == b""
    assert pack_int4_bytes(np.array([[1.0, -2.0, 3.0]])) == bytes([0x69, 0x8B])


def test_matches_executorch_serializer(tmp_path: Path):
    pytest.importorskip("executorch")
    rng = np.random.default_rng(7)
    cases = [rng.integers(-8, 8, size=shape, dtype=np.int8) for shape in [(5, 8), (7, 63), (3, 1), (16, 67)]]
    args = []
    for i, codes in enumerate(cases):
        np.save(tmp_path / f"in{i}.npy", codes)
        args += [str(tmp_path / f"in{i}.npy"), str(tmp_path / f"out{i}.npy")]
    oracle = Path(__file__).parent / "oracles" / "et_qc4w.py"
    subprocess.run([sys.executable, str(oracle), *args], check=True, timeout=300)
    for i, codes in enumerate(cases):
        expected = np.load(tmp_path / f"out{i}.npy")
        assert pack_int4(codes).tobytes() == expected.tobytes(), f"shape {codes.shape}"


@pytest.mark.parametrize(
    "codes, message",
    [
        (np.array([[0, 8]]), r"int4 codes must lie in \[-8, 7\]: got 8 at index \(0, 1\)"),
        (np.array([[-9, 0]]), r"got -9 at index \(0, 0\)"),
        (np.array([[0.0, 1.5]]), r"codes must be integers: got 1.5 at index \(0, 1\)"),
        (np.array(3), r"at least one dimension"),
        (np.array([True, False]), r"must be integers: got dtype bool"),
    ],
)
@pytest.mark.parametrize("pack", [pack_int4, pack_int4_bytes])
def test_pack_rejects_bad_codes(codes, message, pack):
    with pytest.raises(XnnquantError, match=message):
        pack(codes)


def test_integral_floats_are_accepted():
    assert pack_int4(np.array([[1.0, -2.0]])).tobytes() == bytes([0x69])


def test_unpack_rejects_mismatched_k():
    packed = pack_int4(np.zeros((2, 5), np.int8))
    with pytest.raises(XnnquantError, match=r"got 3 bytes per row for k=7, expected ceil\(k / 2\) = 4"):
        unpack_int4(packed, 7)
    with pytest.raises(XnnquantError, match="must be uint8"):
        unpack_int4(packed.astype(np.int16), 5)
    with pytest.raises(XnnquantError, match="non-negative integer"):
        unpack_int4(packed, -1)
