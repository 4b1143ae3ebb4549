"""Bad input raises XnnquantError saying what was wrong, what was given and what was expected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import xnnquant as xq

W = np.ones((4, 64), np.float32)


def with_value(index: tuple[int, int], value: float) -> np.ndarray:
    w = W.copy()
    w[index] = value
    return w


CASES: list[tuple[str, Callable[[], Any], str]] = [
    # NaN / Inf, and where
    ("nan per-channel", lambda: xq.quantize_per_channel(with_value((2, 5), np.nan)), r"w must be finite: got nan at index \(2, 5\)"),
    ("inf blockwise", lambda: xq.quantize_blockwise(with_value((1, 3), np.inf)), r"w must be finite: got inf at index \(1, 3\)"),
    ("-inf per-tensor", lambda: xq.quantize_per_tensor(with_value((0, 0), -np.inf)), r"x must be finite: got -inf at index \(0, 0\)"),
    ("nan per-token", lambda: xq.quantize_per_token(with_value((3, 63), np.nan)), r"x must be finite: got nan at index \(3, 63\)"),
    ("nan bias", lambda: xq.quantize_bias(np.array([1.0, np.nan], np.float32), 0.1, 0.1), r"b must be finite: got nan at index \(1,\)"),
    # empty tensors
    ("empty per-channel", lambda: xq.quantize_per_channel(np.zeros((0, 8), np.float32)), r"w is empty: got shape \(0, 8\)"),
    ("empty blockwise", lambda: xq.quantize_blockwise(np.zeros((4, 0), np.float32)), r"w is empty|group_size"),
    ("empty per-tensor", lambda: xq.quantize_per_tensor(np.zeros((0,), np.float32)), r"x is empty: got shape \(0,\)"),
    ("empty per-token", lambda: xq.quantize_per_token(np.zeros((3, 0), np.float32)), r"x is empty: got shape \(3, 0\)"),
    ("empty bias", lambda: xq.quantize_bias(np.zeros(0, np.float32), 0.1, 0.1), r"b is empty"),
    # wrong rank
    ("rank 1 blockwise", lambda: xq.quantize_blockwise(np.ones(64, np.float32)), r"w has the wrong rank: got shape \(64,\) \(rank 1\), expected rank 2"),
    ("rank 3 blockwise", lambda: xq.quantize_blockwise(np.ones((2, 2, 64), np.float32)), r"expected rank 2"),
    ("scalar per-channel", lambda: xq.quantize_per_channel(np.float32(1.0)), r"w has the wrong rank: got shape \(\) \(rank 0\), expected rank 1 to 6"),
    ("rank 7 per-channel", lambda: xq.quantize_per_channel(np.ones((1,) * 7, np.float32)), r"expected rank 1 to 6"),
    ("scalar per-token", lambda: xq.quantize_per_token(np.float32(1.0)), r"x has the wrong rank"),
    ("2-D bias", lambda: xq.quantize_bias(np.ones((2, 2), np.float32), 0.1, 0.1), r"b has the wrong rank: got shape \(2, 2\) \(rank 2\), expected rank 1"),
    # axis out of range
    ("axis 2", lambda: xq.quantize_per_channel(W, axis=2), r"axis is out of range: got 2 for a rank-2 tensor, expected -2 to 1"),
    ("axis -3", lambda: xq.quantize_per_channel(W, axis=-3), r"axis is out of range: got -3"),
    ("axis float", lambda: xq.quantize_per_channel(W, axis=0.0), r"axis must be an integer: got 0.0"),
    ("num_nonbatch_dims 3", lambda: xq.quantize_per_token(W, num_nonbatch_dims=3), r"num_nonbatch_dims is out of range: got 3 for a rank-2 input, expected 0 to 2"),
    # unsupported bits, method, datatype
    ("bits 2", lambda: xq.quantize_per_channel(W, bits=2), r"unsupported bits for per-channel quantization: got 2, expected 8 or 4"),
    ("bits True", lambda: xq.quantize_per_channel(W, bits=True), r"got True, expected 8 or 4"),
    ("method", lambda: xq.quantize_blockwise(W, method="percentile"), r"unknown method: got 'percentile', expected one of 'minmax', 'mse'"),
    ("per-tensor dtype", lambda: xq.quantize_per_tensor(W, dtype=xq.Datatype.qcint8), r"unsupported per-tensor datatype: got <Datatype.qcint8: 6>, expected Datatype.qint8 or Datatype.quint8"),
    # group sizes
    ("group 48", lambda: xq.quantize_blockwise(np.ones((2, 96), np.float32), 48), r"group_size must be a multiple of 32 that divides in_features: got group_size=48, in_features=96 \(valid: 32, 96\)"),
    ("group 64 of 96", lambda: xq.quantize_blockwise(np.ones((2, 96), np.float32), 64), r"got group_size=64, in_features=96 \(valid: 32, 96\)"),
    ("group 16", lambda: xq.quantize_blockwise(W, 16), r"got group_size=16, in_features=64 \(valid: 32, 64\)"),
    ("group of K=40", lambda: xq.quantize_blockwise(np.ones((2, 40), np.float32), 40), r"valid: none: in_features must be a multiple of 32"),
    # zero points and scales given by the caller
    ("zp 128 qint8", lambda: xq.quantize_per_tensor(W, scale=0.1, zero_point=128), r"zero_point is out of range for qint8: got 128, expected -128 to 127"),
    ("zp -1 quint8", lambda: xq.quantize_per_tensor(W, xq.Datatype.quint8, scale=0.1, zero_point=-1), r"zero_point is out of range for quint8: got -1, expected 0 to 255"),
    ("zp 1.5", lambda: xq.quantize_per_tensor(W, scale=0.1, zero_point=1.5), r"zero_point must be an integer: got 1.5"),
    ("scale only", lambda: xq.quantize_per_tensor(W, scale=0.1), r"give both scale and zero_point or neither"),
    ("scale 0", lambda: xq.quantize_per_tensor(W, scale=0.0, zero_point=0), r"scale must be a positive normal float32 \(XNNPACK rejects others\): got 0.0"),
    ("scale -1", lambda: xq.quantize_per_tensor(W, scale=-1.0, zero_point=0), r"got -1.0"),
    ("scale subnormal", lambda: xq.quantize_per_tensor(W, scale=1e-40, zero_point=0), r"positive normal float32"),
    ("scale nan", lambda: xq.quantize_per_tensor(W, scale=float("nan"), zero_point=0), r"got nan"),
    ("channel scale -1", lambda: xq.quantize_per_channel(W, scale=np.array([1, 1, -1, 1.0])), r"got -1.0 at index \(2,\)"),
    ("channel scale shape", lambda: xq.quantize_per_channel(W, scale=np.ones(3)), r"scale has the wrong shape: got \(3,\), expected \(4,\)"),
    ("block scale not bf16", lambda: xq.quantize_blockwise(W, 32, scale=np.full((4, 2), 0.1)), r"scale must hold bf16 values: got 0.100000001 at index \(0, 0\)"),
    ("bias input scale 0", lambda: xq.quantize_bias(np.ones(4, np.float32), 0.0, 0.1), r"input_scale must be a positive normal float32"),
    ("bias weight scale shape", lambda: xq.quantize_bias(np.ones(4, np.float32), 0.1, np.ones(3)), r"weight_scale must be one number or one per output channel: got shape \(3,\), expected \(\) or \(4,\)"),
    ("bias scale underflow", lambda: xq.quantize_bias(np.ones(2, np.float32), 1e-20, np.array([1.0, 1e-20])), r"bias scale input_scale \* weight_scale must be a positive normal float32: got 9.9999\d*e-41 \(channel 1\)"),
    # inputs that are not float arrays
    ("int input", lambda: xq.quantize_per_channel(np.ones((2, 2), np.int32)), r"w must be a floating-point array: got dtype int32"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_with_what_got_expected(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(xq.XnnquantError, match=message):
        call()


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        xq.quantize_blockwise(W, 48)
