"""QuantizedTensor: dequantize broadcasting by granularity, bytes, and shape checks."""

import numpy as np
import pytest

import xnnquant as xq
from xnnquant import Datatype, QuantizedTensor


def test_per_channel_dequantize_along_channel_dim():
    codes = np.array([[1, -2, 3], [4, 5, -6]], np.int8)
    qt = QuantizedTensor(Datatype.qcint8, codes, np.array([0.5, 2.0, 0.25], np.float32), channel_dim=1)
    assert qt.dequantize().tolist() == [[0.5, -4.0, 0.75], [2.0, 10.0, -1.5]]


def test_blockwise_dequantize_repeats_each_scale_over_its_group():
    codes = np.tile(np.arange(-8, 8, dtype=np.int8), (2, 4))  # (2, 64)
    scale = np.array([[1.0, 0.5], [2.0, 0.25]], np.float32)
    qt = QuantizedTensor(Datatype.qbint4, codes, scale, group_size=32)
    out = qt.dequantize()
    assert out[1, 33] == codes[1, 33] * 0.25 and out[0, 5] == codes[0, 5] * 1.0
    assert len(qt.to_bytes()) == 2 * 32


def test_per_tensor_asymmetric():
    qt = QuantizedTensor(Datatype.quint8, np.array([0, 128, 255], np.uint8), np.float32(0.5), zero_point=128)
    assert qt.dequantize().tolist() == [-64.0, 0.0, 63.5]
    assert qt.to_bytes() == bytes([0, 128, 255])


def test_int32_bytes_are_little_endian():
    qt = QuantizedTensor(Datatype.qcint32, np.array([1, -2], np.int32), np.array([1.0, 1.0], np.float32), channel_dim=0)
    assert qt.to_bytes() == bytes([1, 0, 0, 0, 0xFE, 0xFF, 0xFF, 0xFF])


def test_qdint8_is_never_constant():
    qt = QuantizedTensor(Datatype.qdint8, np.zeros((2, 3), np.int8), np.ones(2, np.float32),
                         zero_point=np.zeros(2, np.int32), num_nonbatch_dims=1)
    assert qt.dequantize().shape == (2, 3)
    with pytest.raises(xq.XnnquantError, match="never constant data"):
        qt.to_bytes()


@pytest.mark.parametrize("kwargs, message", [
    (dict(datatype=Datatype.qcint8, codes=np.zeros((2, 3), np.int8), scale=np.ones(3), channel_dim=0),
     r"scale has the wrong shape: got \(3,\), expected \(2,\)"),
    (dict(datatype=Datatype.qcint8, codes=np.zeros((2, 3), np.int16), scale=np.ones(2), channel_dim=0),
     "codes must be int8: got dtype int16"),
    (dict(datatype=Datatype.fp32, codes=np.zeros(2, np.float32), scale=np.ones(())),
     "needs a quantized datatype: got fp32"),
    (dict(datatype=Datatype.qbint4, codes=np.zeros((2, 48), np.int8), scale=np.ones((2, 1)), group_size=32),
     "group_size must divide K: got group_size=32, K=48"),
])
def test_inconsistent_fields_are_refused(kwargs, message):
    with pytest.raises(xq.XnnquantError, match=message):
        QuantizedTensor(**kwargs)


_4BIT_ZP = r": got 8, expected 0 \(signed codes in \[-8, 7\]; storage adds 8 to each nibble\)"


@pytest.mark.parametrize("kwargs, message", [
    # 4-bit codes are signed with zero point 0; 8 is the runtime's zero point of the stored nibbles
    (dict(datatype=Datatype.qcint4, codes=np.zeros((2, 4), np.int8), scale=np.ones(2), channel_dim=0, zero_point=8),
     "zero_point is out of range for qcint4" + _4BIT_ZP),
    (dict(datatype=Datatype.qbint4, codes=np.zeros((2, 32), np.int8), scale=np.ones((2, 1)), group_size=32,
          zero_point=8), "zero_point is out of range for qbint4" + _4BIT_ZP),
    (dict(datatype=Datatype.qcint8, codes=np.zeros((3, 4), np.int8), scale=np.ones(3), channel_dim=0,
          zero_point=np.array([0, 0, -1])), r"zero_point is out of range for qcint8: got -1 at index \(2,\), expected 0$"),
    (dict(datatype=Datatype.qint32, codes=np.zeros(3, np.int32), scale=np.float32(1), zero_point=1),
     "zero_point is out of range for qint32: got 1, expected 0$"),
    (dict(datatype=Datatype.qint8, codes=np.zeros(3, np.int8), scale=np.float32(1), zero_point=128),
     "zero_point is out of range for qint8: got 128, expected -128 to 127"),
    (dict(datatype=Datatype.quint8, codes=np.zeros(3, np.uint8), scale=np.float32(1), zero_point=-1),
     "zero_point is out of range for quint8: got -1, expected 0 to 255"),
    (dict(datatype=Datatype.qdint8, codes=np.zeros((2, 3), np.int8), scale=np.ones(2),
          zero_point=np.array([0, 300])), r"zero_point is out of range for qdint8: got 300 at index \(1,\), expected -128 to 127"),
    (dict(datatype=Datatype.qdint8, codes=np.zeros((2, 3), np.int8), scale=np.ones(2), zero_point=np.zeros(3)),
     r"qdint8 zero_point has the wrong shape: got \(3,\), expected \(\) or the scale's \(2,\)"),
    (dict(datatype=Datatype.qint8, codes=np.zeros(3, np.int8), scale=np.float32(1), zero_point=0.5),
     "zero_point must be integers: got 0.5"),
])
def test_zero_point_follows_the_datatype(kwargs, message):
    with pytest.raises(xq.XnnquantError, match=message):
        QuantizedTensor(**kwargs)


def test_zero_points_every_type_accepts():
    """Every value of each type's range is accepted (a test that each check can also pass)."""
    for zp in range(-128, 128):
        QuantizedTensor(Datatype.qint8, np.zeros(1, np.int8), np.float32(1), zero_point=zp)
    for zp in range(256):
        QuantizedTensor(Datatype.quint8, np.zeros(1, np.uint8), np.float32(1), zero_point=np.uint8(zp))
    QuantizedTensor(Datatype.qdint8, np.zeros((256, 1), np.int8), np.ones(256),
                    zero_point=np.arange(-128, 128, dtype=np.int32))
    QuantizedTensor(Datatype.qcint4, np.zeros((2, 4), np.int8), np.ones(2), channel_dim=0, zero_point=np.zeros(2))


@pytest.mark.parametrize(("make", "shape", "expected"), [
    (lambda w: xq.quantize_blockwise(w, 32), (6, 64), 6 * 32),         # two nibbles a byte
    (lambda w: xq.quantize_per_channel(w, 4), (5, 7), 5 * 4),          # odd K: a padding nibble a row
    (lambda w: xq.quantize_per_channel(w, 4, axis=3), (1, 3, 3, 5), 9 * 3),
    (lambda w: xq.quantize_per_channel(w, 8), (5, 7), 35),
    (lambda w: xq.quantize_per_tensor(w, Datatype.quint8), (3, 4), 12),
    (lambda w: xq.quantize_bias(w[0], np.float32(0.01), np.float32(0.02)), (2, 9), 9 * 4),  # int32
])
def test_nbytes_counts_the_bytes_without_packing(make, shape, expected):
    """``nbytes``, hand-counted from the layouts ``to_bytes`` documents, and the bytes agree."""
    q = make(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    assert q.nbytes == expected == len(q.to_bytes())
