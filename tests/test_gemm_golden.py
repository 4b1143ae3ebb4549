"""pack_gemm on configurations this CPU does not select, against bytes derived by hand.

Each expected buffer below is written out element by element from the layout rules of
XNNPACK's packing routines (src/reference/packing.cc, src/microparams-init.c at
1adaa7c7), not computed by the library: tile by tile, section by section, with every
padding value spelled out.  ``le`` packs little-endian values.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.packing import kernel_configs, pack_gemm
from xnnquant.packing.gemm import packed_size


def le(fmt: str, *values: float) -> bytes:
    return struct.pack("<" + fmt, *values)


def padded64(*parts: bytes) -> bytes:
    raw = b"".join(parts)
    return raw + bytes(-len(raw) % 64)


def config(operator: str, isa: str, nr2: bool = False) -> xq.packing.gemm_configs.KernelConfig:
    return next(c for c in kernel_configs() if c.operator == operator and c.isa == isa and c.nr2 == nr2)


def qc8(codes: list[list[int]], scale: list[float]) -> xq.QuantizedTensor:
    return xq.QuantizedTensor(xq.Datatype.qcint8, np.array(codes, np.int8), np.array(scale, np.float32), channel_dim=0)


def qc4(codes: list[list[int]], scale: list[float]) -> xq.QuantizedTensor:
    return xq.QuantizedTensor(xq.Datatype.qcint4, np.array(codes, np.int8), np.array(scale, np.float32),
                              channel_dim=0)


# --- qc8w -------------------------------------------------------------------------------


def test_qc8w_partial_tile_and_k_padding() -> None:
    """nr 2, kr 4: K = 5 pads to 8, N = 3 pads to 4 (a zero row)."""
    w = qc8([[1, 2, 3, 4, 5], [-1, -2, -3, -4, -5], [10, 20, 30, 40, 50]], [0.5, 0.25, 2.0])
    got = pack_gemm(w, np.array([1, 2, 3], np.float32), nr=2, kr=4)
    expected = padded64(
        # tile 0: rows 0, 1
        le("2i", -15, 15),                           # -row sums
        le("8b", 1, 2, 3, 4, -1, -2, -3, -4),        # chunk 0: k 0..3, row 0 then row 1
        le("8b", 5, 0, 0, 0, -5, 0, 0, 0),           # chunk 1: k 4, then K padding
        le("2f", 0.5, 0.25), le("2f", 1, 2),         # scales, bias
        # tile 1: row 2, then a padding row
        le("2i", -150, 0),
        le("8b", 10, 20, 30, 40, 0, 0, 0, 0),
        le("8b", 50, 0, 0, 0, 0, 0, 0, 0),
        le("2f", 2.0, 0), le("2f", 3, 0),
    )
    assert got.tobytes() == expected
    assert got.size == packed_size("qc8w", 3, 5, nr=2, kr=4) == 128


def test_qc8w_sr2_rotates_chunks_per_row() -> None:
    """kr 2, sr 2: in each group of 4 channels, row o starts its chunks at ((c + o) % 2) * 2."""
    w = qc8([list(range(8)), list(range(10, 18))], [1.0, 1.0])
    got = pack_gemm(w, nr=2, kr=2, sr=2)
    expected = padded64(
        le("2i", -28, -108),
        le("4b", 0, 1, 12, 13),    # chunk 0: row 0 k 0,1   row 1 k 2,3
        le("4b", 2, 3, 10, 11),    # chunk 1: row 0 k 2,3   row 1 k 0,1
        le("4b", 4, 5, 16, 17),    # chunk 2: row 0 k 4,5   row 1 k 6,7
        le("4b", 6, 7, 14, 15),    # chunk 3: row 0 k 6,7   row 1 k 4,5
        le("2f", 1, 1), le("2f", 0, 0),
    )
    assert got.tobytes() == expected


def test_qc8w_amx_tile_shape() -> None:
    """The AMX branch (nr 64, kr 4; packer x64c4 avx256vnni): one row, K = 6 padded to 8.
    That packer fills the 63 padding rows with copies of row 0, row sum included."""
    w = qc8([[1, -1, 2, -2, 3, 4]], [0.125])
    got = pack_gemm(w, config=config("qd8_f32_qc8w", "avx512amx"))
    corr = le("64i", *([-7] * 64))
    chunk0 = le("4b", 1, -1, 2, -2) * 64
    chunk1 = le("4b", 3, 4, 0, 0) * 64
    expected = padded64(corr, chunk0, chunk1, le("64f", 0.125, *([0] * 63)), bytes(64 * 4))
    assert got.tobytes() == expected


def test_qc8w_unsigned_input_vnni_tile() -> None:
    """qdu8 x qc8w on AVX-512 VNNI (nr 16, kr 8; packer x16c8 avx256vnni).  The unsigned-
    input kernels get the same correction as the signed ones (-row sum: XNNPACK packs with
    input zero point 1 for both and applies the +128 at run time); this packer repeats the
    last real row (weights and correction) in the padding rows."""
    w = qc8([[-128, 127, 1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 1, 1, 1, 1, 1]], [0.5, 0.25])
    got = pack_gemm(w, np.array([9.0, 8.0], np.float32), config=config("qdu8_f32_qc8w", "avx512vnni"))
    row0_sum = -128 + 127 + 1 + 2 + 3 + 4 + 5 + 6 + 7
    expected = padded64(
        le("16i", -row0_sum, *([-9] * 15)),                            # rows 2..15 copy row 1
        le("8b", -128, 127, 1, 2, 3, 4, 5, 6) + le("8b", *([1] * 8)) * 15,   # chunk 0: k 0..7
        le("8b", 7, 0, 0, 0, 0, 0, 0, 0) + le("8b", 1, *([0] * 7)) * 15,     # chunk 1: k 8, padding
        le("16f", 0.5, 0.25, *([0] * 14)), le("16f", 9.0, 8.0, *([0] * 14)),
    )
    assert got.tobytes() == expected
    signed = pack_gemm(w, np.array([9.0, 8.0], np.float32), config=config("qd8_f32_qc8w", "avx512skx"))
    assert got[:4].tobytes() == signed[:4].tobytes()  # same correction for the real rows
    assert not signed[8:64].any()  # the reference packer leaves padding rows zero


# --- qc4w / qc4uw -----------------------------------------------------------------------


def test_qc4w_signed_nibbles_odd_k() -> None:
    """nr 2, kr 2: K = 5 -> 6 (even) -> 8 (2 kr); byte j of a chunk = k j (low) | k j+2 (high)."""
    w = qc4([[1, -1, 7, -8, 3]], [0.5])
    got = pack_gemm(w, np.array([4.0], np.float32), nr=2, kr=2)
    expected = padded64(
        le("2i", -16 * 2, 0),                  # -16 * (1 - 1 + 7 - 8 + 3)
        bytes([0x71, 0x8F, 0x00, 0x00]),       # chunk 0: (1 | 7<<4), (-1 | -8<<4); padding row
        bytes([0x03, 0x00, 0x00, 0x00]),       # chunk 1: (3 | pad 0<<4), (pad | pad)
        le("2f", 0.5, 0), le("2f", 4.0, 0),
    )
    assert got.tobytes() == expected


def test_qc4uw_unsigned_nibbles_odd_k() -> None:
    """The same weight in the madd layout: nibbles q + 8, row-sum term without the x16."""
    w = qc4([[1, -1, 7, -8, 3]], [0.5])
    got = pack_gemm(w, np.array([4.0], np.float32), nr=2, kr=2, layout="qc4uw")
    expected = padded64(
        le("2i", -2, 0),
        bytes([0xF9, 0x07, 0x00, 0x00]),       # (9 | 15<<4), (7 | 0<<4); padding row stays 0
        bytes([0x8B, 0x88, 0x00, 0x00]),       # (11 | 8<<4), (8 | 8<<4): padding codes are 8
        le("2f", 0.5, 0), le("2f", 4.0, 0),
    )
    assert got.tobytes() == expected


def test_qc4w_vnni_tile() -> None:
    """avx512vnni qdu8 x qc4w (nr 16, kr 8, signed nibbles): one chunk of 16 channels."""
    codes = [list(range(-8, 8))]
    got = pack_gemm(qc4(codes, [1.0]), config=config("qdu8_f32_qc4w", "avx512vnni"))
    first_row = bytes(((j - 8) & 0xF) | (j << 4) for j in range(8))  # k j = j-8, k j+8 = j
    expected = padded64(le("16i", 128, *([0] * 15)), first_row + bytes(15 * 8), le("16f", 1, *([0] * 15)),
                        bytes(64))
    assert got.tobytes() == expected


# --- qb4w -------------------------------------------------------------------------------


def test_qb4w_avx_branch_planes1() -> None:
    """qd8 x qb4w on AVX (nr 4, kr 8, planes 1), K = 64 in two blocks of 32, N = 3."""
    codes = np.array([[1] * 64, [-1] * 64, [k % 16 - 8 for k in range(64)]], np.int8)
    scale = np.array([[1, 2], [2, 4], [4, 8]], np.float32)  # 2^(r + b), exact in bf16
    w = xq.QuantizedTensor(xq.Datatype.qbint4, codes, scale, group_size=32)
    got = pack_gemm(w, np.array([0.5, -0.5, 1.5], np.float32), config=config("qd8_f32_qb4w", "avx"))
    row2 = bytes(((j - 8) & 0xF) | (j << 4) for j in range(8))
    chunk = bytes([0x11] * 8) + bytes([0xFF] * 8) + row2 + bytes(8)   # rows 0..2, padding row 3
    expected = padded64(
        # -sum over chunks of (chunk code sum) * scale, e.g. row 0: -(16 + 16) * 1 - (16 + 16) * 2,
        # row 1: (16 + 16) * 2 + (16 + 16) * 4, row 2: (8 + 8) * 4 + (8 + 8) * 8
        le("4f", -96.0, 192.0, 192.0, 0.0),
        chunk, chunk, le("4H", 0x3D80, 0x3E00, 0x3E80, 0),   # block 0, then bf16 scale / 16
        chunk, chunk, le("4H", 0x3E00, 0x3E80, 0x3F00, 0),   # block 1
        le("4f", 0.5, -0.5, 1.5, 0.0),
    )
    assert got.tobytes() == expected
    assert got.size == packed_size("qb4w", 3, 64, nr=4, kr=8, planes=1, group_size=32)


def test_qb4w_correction_accumulates_in_float32_chunk_by_chunk() -> None:
    """A sum whose float32 rounding depends on order: 2^24 then +1 per chunk is lost."""
    codes = np.zeros((1, 64), np.int8)
    codes[0, :16] = -8  # chunk 0 sum -128
    codes[0, 16:32] = [-1] + [0] * 15  # chunk 1 sum -1
    scale = np.array([[2.0**17, 2.0**17]], np.float32)  # chunk terms: -2^24, -2^17
    w = xq.QuantizedTensor(xq.Datatype.qbint4, codes, scale, group_size=32)
    got = pack_gemm(w, nr=1, kr=8)
    expected = np.float32(0) - np.float32(-128 * 2.0**17) - np.float32(-1 * 2.0**17)
    assert got[:4].view(np.float32)[0] == expected


def test_qb4w_unsigned_input_vnni_tile() -> None:
    """qdu8 x qb4w on AVX-512 VNNI (nr 16, kr 8, two planes), the kernel an AVX2 machine
    cannot capture: one row in a 16-row tile, K = 32 in one block, chunks of 16 values."""
    codes = np.array([[k % 16 - 8 for k in range(32)]], np.int8)
    w = xq.QuantizedTensor(xq.Datatype.qbint4, codes, np.array([[0.5]], np.float32), group_size=32)
    got = pack_gemm(w, np.array([3.0], np.float32), config=config("qdu8_f32_qb4w", "avx512vnni"))
    row0 = bytes(((j - 8) & 0xF) | (j << 4) for j in range(8))  # k j = j - 8 (low), k j + 8 = j (high)
    chunk = row0 + bytes(15 * 8)  # padding rows 1..15 are zero bytes
    expected = padded64(
        le("16f", 8.0, *([0] * 15)),   # 0 - (-8 * 0.5) - (-8 * 0.5): each chunk's codes sum to -8
        chunk, chunk,
        le("16H", 0x3D00, *([0] * 15)),  # bf16 of 0.5 / 16 = 2^-5
        le("16f", 3.0, *([0] * 15)),
    )
    assert got.tobytes() == expected and len(expected) == 448


# --- f32 --------------------------------------------------------------------------------


W3 = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.float32)


def test_f32_kr2_zero_padding() -> None:
    """The reference packer (nr 2, kr 2): K = 3 pads to 4, the padding row is 0.0."""
    got = pack_gemm(W3, np.array([10, 20, 30], np.float32), nr=2, kr=2)
    expected = padded64(
        le("2f", 10, 20), le("4f", 1, 2, 4, 5), le("4f", 3, 0, 6, 0),
        le("2f", 30, 0), le("4f", 7, 8, 0, 0), le("4f", 9, 0, 0, 0),
    )
    assert got.tobytes() == expected


def test_f32_sr4_zen_branch() -> None:
    """sr 4, kr 1 (the Zen 1 branch's shuffle): chunk c of row o reads k = (c + o) % 4."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    got = pack_gemm(w, nr=4, kr=1, sr=4)
    expected = padded64(
        le("4f", 0, 0, 0, 0),
        le("4f", 0, 5, 10, 15), le("4f", 1, 6, 11, 12), le("4f", 2, 7, 8, 13), le("4f", 3, 4, 9, 14),
    )
    assert got.tobytes() == expected


def test_f32_replicate_padding_of_the_avx_packers() -> None:
    """nr 4, N = 2, K = 5: padding rows copy row 1; the last row is 0 in columns 0..3."""
    w = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.float32)
    got = pack_gemm(w, np.array([-1, -2], np.float32), nr=4, kr=1, pad_rows="replicate")
    columns = [le("4f", w[0, k], w[1, k], w[1, k], 0) for k in range(4)] + [le("4f", 5, 10, 10, 10)]
    assert got.tobytes() == padded64(le("4f", -1, -2, 0, 0), *columns)


def test_f32_sse2_branch_replicates_every_padding_row() -> None:
    """SSE2 (nr 8, packer x8__sse2_u4): all padding rows copy the last real row."""
    w = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.float32)
    got = pack_gemm(w, config=config("f32", "sse2"))
    columns = [le("8f", w[0, k], *([w[1, k]] * 7)) for k in range(5)]
    assert got.tobytes() == padded64(bytes(8 * 4), *columns)


def test_f32_avx512_nr32_from_the_table() -> None:
    """N = 1, K = 2 < 4: both columns are remainder columns, where every padding row
    (the last one included) copies row 0."""
    got = pack_gemm(W3[:1, :2], config=config("f32", "avx512f"))
    expected = padded64(bytes(32 * 4), le("32f", *([1] * 32)), le("32f", *([2] * 32)))
    assert got.tobytes() == expected


# --- inputs that must be refused --------------------------------------------------------


def test_bad_inputs_say_what_was_wrong() -> None:
    with pytest.raises(XnnquantError, match="nr must be a positive integer: got 0"):
        pack_gemm(W3, nr=0, kr=1)
    with pytest.raises(XnnquantError, match="kr must be a power of two"):
        pack_gemm(W3, nr=4, kr=3)
    with pytest.raises(XnnquantError, match=r"bias must have shape \(N,\) = \(3,\): got \(2,\)"):
        pack_gemm(W3, np.zeros(2, np.float32), nr=4, kr=1)
    with pytest.raises(UnsupportedConfigError, match="replicate"):
        pack_gemm(W3, nr=4, kr=2, pad_rows="replicate")
    with pytest.raises(UnsupportedConfigError, match="planes=1, expected 2"):
        pack_gemm(qc4([[1, 2]], [1.0]), nr=4, kr=8, planes=1)
    with pytest.raises(XnnquantError, match="layout 'qc4uw' does not fit qcint8"):
        pack_gemm(qc8([[1, 2]], [1.0]), nr=4, kr=8, layout="qc4uw")
    not_bf16 = np.full((1, 1), 0.1, np.float32)
    w = xq.QuantizedTensor(xq.Datatype.qbint4, np.zeros((1, 32), np.int8), not_bf16, group_size=32)
    with pytest.raises(XnnquantError, match=r"qbint4 scales must hold bf16 values: got 0.100000001 at index \(0, 0\)"):
        pack_gemm(w, nr=8, kr=8)
    exact = not_bf16.astype(ml_dtypes.bfloat16).astype(np.float32)
    w16 = xq.QuantizedTensor(xq.Datatype.qbint4, np.zeros((1, 16), np.int8), exact, group_size=16)
    with pytest.raises(UnsupportedConfigError, match="multiple of 32: got group_size=16"):
        pack_gemm(w16, nr=8, kr=8)
    per_tensor = xq.QuantizedTensor(xq.Datatype.qint8, np.zeros((2, 2), np.int8), np.float32(1))
    with pytest.raises(UnsupportedConfigError, match="got qint8"):
        pack_gemm(per_tensor, nr=8, kr=8)


def test_config_table_is_consistent() -> None:
    for c in kernel_configs():
        assert c.weights in ("f32", "qc8w", "qc4w", "qc4uw", "qb4w")
        assert c.cpu_flags, c.isa
        assert c.planes == (2 if c.weights in ("qc4w", "qc4uw") else c.planes)
        args = c.pack_args()
        assert args["nr"] == c.nr and args["layout"] == c.weights
