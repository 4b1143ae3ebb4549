"""Hand-derived golden values: small inputs whose codes and scales are worked out by hand.

The inputs are chosen so every float32 step is exact (scales that are powers of two or
exact quotients), so each expected value below follows from the docstring's arithmetic.
"""

from __future__ import annotations

import numpy as np

import xnnquant as xq
from xnnquant.schemes import blockwise


def test_per_channel_int4_minmax_and_its_bytes() -> None:
    """max|w| = 15 -> scale 15 / 7.5 = 2; w / 2 = -7.5 -> -8 (ties to even), 7, 2.5 -> 2,
    -1.5 -> -2, 0.5 -> 0, 3.5 -> 4.  Storage adds 8: nibbles 0, 15, 10, 6, 8, 12, low
    nibble first: bytes 0xF0, 0x6A, 0xC8."""
    w = np.array([[-15.0, 14.0, 5.0, -3.0, 1.0, 7.0]], np.float32)
    qt = xq.quantize_per_channel(w, bits=4)
    assert qt.datatype is xq.Datatype.qcint4 and qt.zero_point == 0 and qt.channel_dim == 0
    assert qt.scale.tolist() == [2.0]
    assert qt.codes.tolist() == [[-8, 7, 2, -2, 0, 4]]
    assert qt.to_bytes() == bytes([0xF0, 0x6A, 0xC8])


def test_per_channel_int8_positive_extreme_saturates() -> None:
    """max|w| = 127.5 -> scale 1: 127.5 -> 128 (to even) -> clamped to 127; -127.5 -> -128;
    2.5 -> 2; -0.5 -> 0.  Little-endian int8 bytes."""
    qt = xq.quantize_per_channel(np.array([[127.5, -127.5, 2.5, -0.5]], np.float32), bits=8)
    assert qt.datatype is xq.Datatype.qcint8
    assert qt.scale.tolist() == [1.0]
    assert qt.codes.tolist() == [[127, -128, 2, 0]]
    assert qt.to_bytes() == bytes([0x7F, 0x80, 0x02, 0x00])


def test_blockwise_scale_rounds_to_bf16_ties_to_even_before_the_codes() -> None:
    """Group 0: max / 7.5 = 1 + 2**-8, halfway between bf16 1.0 and 1.0078125 -> 1.0 (even).
    Group 1: max / 7.5 = 1 + 3 * 2**-8, halfway between 1.0078125 (odd) and 1.015625 -> 1.015625.
    Codes use the rounded scales: 7.5293 / 1.0 -> 8 -> clamped 7; -3 -> -3;
    -7.5879 / 1.015625 = -7.471 -> -7; 2.031250 / 1.015625 = 2."""
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[0, 1] = 7.5 * (1 + 2**-8), -3.0
    w[1, 0], w[1, 1] = -7.5 * (1 + 3 * 2**-8), 2.03125
    qt = xq.quantize_blockwise(w, group_size=32)
    assert qt.datatype is xq.Datatype.qbint4 and qt.group_size == 32
    assert qt.scale.tolist() == [[1.0], [1.015625]]
    assert qt.codes[:, :2].tolist() == [[7, -3], [-7, 2]]
    assert not qt.codes[:, 2:].any()


def test_blockwise_float32_scales_and_their_codes_for_experiments() -> None:
    """The same two groups with the scales kept in float32 (bf16=False): 1 + 2**-8 and
    1 + 3 * 2**-8 exactly; their codes: 7.5293 / 1.0039 = 7.5 -> 8 (even) -> clamped 7,
    -3 / 1.0039 = -2.99 -> -3; -7.5879 / 1.0117 = -7.5 -> -8 (even); 2.03125 / 1.0117 =
    2.0077 -> 2.  With bf16 scales quantize_codes gives quantize's codes."""
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[0, 1] = 7.5 * (1 + 2**-8), -3.0
    w[1, 0], w[1, 1] = -7.5 * (1 + 3 * 2**-8), 2.03125
    s32 = blockwise.choose_qparams(w, 32, "minmax", bf16=False)
    assert s32.dtype == np.float32 and s32.tolist() == [[1 + 2**-8], [1 + 3 * 2**-8]]
    assert blockwise.quantize_codes(w, s32, 32)[:, :2].tolist() == [[7, -3], [-8, 2]]
    qt = xq.quantize_blockwise(w, group_size=32)
    np.testing.assert_array_equal(blockwise.quantize_codes(w, qt.scale, 32), qt.codes)
    np.testing.assert_array_equal(blockwise.choose_qparams(w, 32), qt.scale)


def test_per_tensor_asymmetric_qint8_and_quint8() -> None:
    """lo = -51, hi = 204: scale = 255 / 255 = 1; qint8 zp = -128 - (-51) = -77;
    codes rint(x) - 77: -128, -77, 25.5 -> 26 -> -51, 24.5 -> 24 -> -53, 127.
    quint8: zp = 0 + 51 = 51; codes 0, 51, 77, 75, 255."""
    x = np.array([-51.0, 0.0, 25.5, 24.5, 204.0], np.float32)
    q8 = xq.quantize_per_tensor(x)
    assert (q8.datatype, float(q8.scale), q8.zero_point) == (xq.Datatype.qint8, 1.0, -77)
    assert q8.codes.tolist() == [-128, -77, -51, -53, 127]
    u8 = xq.quantize_per_tensor(x, dtype=xq.Datatype.quint8)
    assert (u8.datatype, float(u8.scale), u8.zero_point) == (xq.Datatype.quint8, 1.0, 51)
    assert u8.codes.tolist() == [0, 51, 77, 75, 255]
    assert u8.to_bytes() == bytes([0, 51, 77, 75, 255])


def test_per_tensor_given_parameters_are_used_as_given() -> None:
    qt = xq.quantize_per_tensor(np.array([1.0, -1.0, 0.25], np.float32), scale=0.5, zero_point=3)
    assert float(qt.scale) == 0.5 and qt.zero_point == 3
    assert qt.codes.tolist() == [5, 1, 3]  # 2 + 3, -2 + 3, rint(0.5) = 0 + 3


def test_bias_rounds_half_even_and_saturates() -> None:
    """scale 1 * 1 = 1: 1e10 -> 2**31 - 1, -1e10 -> -2**31, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2."""
    qt = xq.quantize_bias(np.array([1e10, -1e10, 0.5, 1.5, 2.5, -2.5], np.float32), 1.0, 1.0)
    assert qt.datatype is xq.Datatype.qint32 and qt.scale.shape == ()
    assert qt.codes.tolist() == [2**31 - 1, -(2**31), 0, 2, 2, -2]
    assert qt.to_bytes()[:8] == bytes([0xFF, 0xFF, 0xFF, 0x7F, 0x00, 0x00, 0x00, 0x80])


def test_bias_per_channel() -> None:
    """scales 0.5 * [2, 0.25] = [1, 0.125]: 3 / 1 = 3, 3 / 0.125 = 24."""
    qt = xq.quantize_bias(np.array([3.0, 3.0], np.float32), 0.5, np.array([2.0, 0.25], np.float32))
    assert qt.datatype is xq.Datatype.qcint32 and qt.channel_dim == 0
    assert qt.scale.tolist() == [1.0, 0.125]
    assert qt.codes.tolist() == [3, 24]


def test_mse_finds_the_exact_grid() -> None:
    """w = k / 4 for k = -8..7: min-max takes 2 / 7.5; the search finds 0.25 = max(-w) / 8,
    where every value is exact (zero error)."""
    w = (np.arange(-8, 8, dtype=np.float32) / 4)[None]
    minmax = xq.quantize_per_channel(w, bits=4)
    assert minmax.scale.tolist() == [np.float32(2) / np.float32(7.5)]
    mse = xq.quantize_per_channel(w, bits=4, method="mse")
    assert mse.scale.tolist() == [0.25]
    assert mse.codes.tolist() == [list(range(-8, 8))]
    np.testing.assert_array_equal(mse.dequantize(), w)


def test_valid_group_sizes() -> None:
    assert blockwise.valid_group_sizes(384) == [32, 64, 96, 128, 192, 384]
    assert blockwise.valid_group_sizes(40) == []
    qt = xq.quantize_blockwise(np.ones((3, 96), np.float32), group_size=96)  # group = K is allowed
    assert qt.scale.shape == (3, 1)


def test_bias_takes_the_weight_scales_of_a_quantized_weight() -> None:
    """weight scales max|row| / 127.5 = [1, 2]; input scale 0.5 -> bias scales [0.5, 1]."""
    weight = xq.quantize_per_channel(np.array([[127.5, 0.0], [0.0, -255.0]], np.float32), bits=8)
    assert weight.scale.tolist() == [1.0, 2.0]
    qt = xq.quantize_bias(np.array([1.25, -3.5], np.float32), 0.5, weight)
    assert qt.scale.tolist() == [0.5, 1.0]
    assert qt.codes.tolist() == [2, -4]  # 2.5 -> 2, -3.5 -> -4 (ties to even)
