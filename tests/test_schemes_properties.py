"""Hypothesis properties of the schemes.

* |x - dequantize(quantize(x))| <= scale / 2 for every value inside the code range;
* idempotence: values already on the grid quantize back to the same codes;
* every int4 value is reachable, including -8;
* the mse search never loses to min-max, scales are positive normal floats (bf16 for
  blockwise), all-zero blocks get scale 1 and codes 0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import xnnquant as xq
from xnnquant.constants import FLT_MIN
from xnnquant.rounding import to_bf16

# Overflow or invalid values inside the search would show up as RuntimeWarnings first.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

SETTINGS = settings(max_examples=60, deadline=None)


def half_step_bound(scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """scale / 2, plus float32 rounding of x * (1 / scale) and of code * scale (a few ulps of x)."""
    return scale / 2 + np.abs(x).astype(np.float64) * 2.0**-21 + 1e-45


def finite(max_value: float = 1e6) -> st.SearchStrategy[float]:
    return st.floats(-max_value, max_value, width=32, allow_nan=False, allow_infinity=False)


def matrices(cols: st.SearchStrategy[int], max_value: float = 1e6) -> st.SearchStrategy[np.ndarray]:
    shapes = st.tuples(st.integers(1, 6), cols)
    return shapes.flatmap(lambda s: hnp.arrays(np.float32, s, elements=finite(max_value)))


def scaled_matrices(cols: st.SearchStrategy[int]) -> st.SearchStrategy[np.ndarray]:
    """Matrices times a power of ten in 1e-30 .. 1e10, so tiny and large blocks both occur."""
    return st.tuples(matrices(cols, 1.0), st.integers(-30, 10)).map(
        lambda m: (m[0] * np.float32(10.0 ** m[1])).astype(np.float32)
    )


def assert_positive_normal(scale: np.ndarray) -> None:
    assert np.all(np.isfinite(scale)) and np.all(scale >= FLT_MIN)


def assert_within_half_step(x: np.ndarray, qt: xq.QuantizedTensor, qmin: int, qmax: int) -> None:
    """Where the code is not clamped, the error is at most half a step."""
    scale = qt._broadcast(qt.scale)
    zp = qt._broadcast(np.asarray(qt.zero_point, np.float64))
    err = np.abs(x.astype(np.float64) - qt.dequantize())
    inside = (x >= (qmin - zp) * scale) & (x <= (qmax - zp) * scale)
    bound = half_step_bound(np.broadcast_to(scale, x.shape), x)
    assert np.all(err[inside] <= bound[inside])


@SETTINGS
@given(w=scaled_matrices(st.integers(1, 70)), bits=st.sampled_from([8, 4]), method=st.sampled_from(["minmax", "mse"]))
def test_per_channel_error_within_half_a_step(w: np.ndarray, bits: int, method: str) -> None:
    qmin, qmax = (-128, 127) if bits == 8 else (-8, 7)
    qt = xq.quantize_per_channel(w, bits=bits, method=method)
    assert_positive_normal(qt.scale)
    assert qt.codes.min() >= qmin and qt.codes.max() <= qmax
    assert_within_half_step(w, qt, qmin, qmax)
    if method == "minmax":  # max|w| = (qmax - qmin) / 2 * scale: nothing is clamped by more than half a step
        err = np.abs(w.astype(np.float64) - qt.dequantize())
        assert np.all(err <= half_step_bound(qt.scale[:, None], w))


@SETTINGS
@given(w=scaled_matrices(st.sampled_from([32, 64, 96])), method=st.sampled_from(["minmax", "mse"]))
def test_blockwise_error_within_half_a_step_and_bf16_scales(w: np.ndarray, method: str) -> None:
    qt = xq.quantize_blockwise(w, group_size=32, method=method)
    assert_positive_normal(qt.scale)
    np.testing.assert_array_equal(qt.scale, to_bf16(qt.scale).values)
    assert_within_half_step(w, qt, -8, 7)


@SETTINGS
@given(x=scaled_matrices(st.integers(1, 40)), dtype=st.sampled_from([xq.Datatype.qint8, xq.Datatype.quint8]),
       symmetric=st.booleans())
def test_per_tensor_error_within_half_a_step(x: np.ndarray, dtype: xq.Datatype, symmetric: bool) -> None:
    facts = xq.storage(dtype)
    qt = xq.quantize_per_tensor(x, dtype=dtype, symmetric=symmetric)
    assert_positive_normal(qt.scale)
    assert facts.code_min <= qt.zero_point <= facts.code_max
    assert_within_half_step(x, qt, facts.code_min, facts.code_max)


@SETTINGS
@given(x=matrices(st.integers(1, 40)))
def test_per_token_error_within_half_a_step(x: np.ndarray) -> None:
    span = np.maximum(x.max(axis=1), 0) - np.minimum(x.min(axis=1), 0)
    assume(np.all((span == 0) | (span >= 1e-35)))  # narrower rows are refused (see test_schemes_per_token)
    x = np.where(np.abs(x) < FLT_MIN, np.float32(0), x)  # XNNPACK reads subnormals as 0
    qt = xq.quantize_per_token(x)
    assert_positive_normal(qt.scale)
    assert_within_half_step(x, qt, -128, 127)


@SETTINGS
@given(w=scaled_matrices(st.sampled_from([32, 64])), bits=st.sampled_from([8, 4]))
def test_idempotent_on_already_quantized_values(w: np.ndarray, bits: int) -> None:
    per_channel = xq.quantize_per_channel(w, bits=bits, method="mse")
    again = xq.quantize_per_channel(per_channel.dequantize(), bits=bits, scale=per_channel.scale)
    np.testing.assert_array_equal(again.codes, per_channel.codes)
    blockwise = xq.quantize_blockwise(w, group_size=32, method="mse")
    again = xq.quantize_blockwise(blockwise.dequantize(), group_size=32, scale=blockwise.scale)
    np.testing.assert_array_equal(again.codes, blockwise.codes)
    per_tensor = xq.quantize_per_tensor(w)
    again = xq.quantize_per_tensor(per_tensor.dequantize(), scale=per_tensor.scale, zero_point=per_tensor.zero_point)
    np.testing.assert_array_equal(again.codes, per_tensor.codes)


ALL_INT4 = np.arange(-8, 8, dtype=np.int8)


@SETTINGS
@given(exponent=st.integers(-120, 100), mantissa=st.integers(0, 127), rows=st.integers(1, 4))
def test_every_int4_value_is_reachable(exponent: int, mantissa: int, rows: int) -> None:
    """Codes -8..7 times a bf16 scale c: given c, and found by the mse search from data alone."""
    c = np.float32((1 + mantissa / 128) * 2.0**exponent)
    codes = np.tile(ALL_INT4, (rows, 2))  # (rows, 32)
    x = codes.astype(np.float32) * c
    for qt in (
        xq.quantize_per_channel(x, bits=4, scale=np.full(rows, c)),
        xq.quantize_blockwise(x, group_size=32, scale=np.full((rows, 1), c)),
        xq.quantize_per_channel(x, bits=4, method="mse"),
        xq.quantize_blockwise(x, group_size=32, method="mse"),
    ):
        np.testing.assert_array_equal(qt.codes, codes)
        assert np.all(qt.scale == c)


def squared_errors(x: np.ndarray, qt: xq.QuantizedTensor, blocks: tuple[int, ...]) -> np.ndarray:
    err = (x.astype(np.float64) - qt.dequantize()) ** 2
    return err.reshape(blocks).sum(axis=-1)


@SETTINGS
@given(w=scaled_matrices(st.sampled_from([32, 64])), bits=st.sampled_from([8, 4]))
def test_mse_never_worse_than_minmax(w: np.ndarray, bits: int) -> None:
    rows, cols = w.shape
    pairs = [
        (xq.quantize_per_channel(w, bits=bits, method=m), (rows, cols)) for m in ("minmax", "mse")
    ] if bits == 8 else [
        (xq.quantize_blockwise(w, group_size=32, method=m), (rows, cols // 32, 32)) for m in ("minmax", "mse")
    ]
    minmax, mse = (squared_errors(w, qt, shape) for qt, shape in pairs)
    assert np.all(mse <= minmax * (1 + 1e-5) + 1e-300)


@SETTINGS
@given(rows=st.integers(1, 5), cols=st.sampled_from([32, 64]), which=st.integers(0, 4))
def test_all_zero_blocks_get_scale_one_and_zero_codes(rows: int, cols: int, which: int) -> None:
    w = np.zeros((rows, cols), np.float32)
    for qt in (
        xq.quantize_per_channel(w, bits=8), xq.quantize_per_channel(w, bits=4, method="mse"),
        xq.quantize_blockwise(w, 32), xq.quantize_blockwise(w, 32, method="mse"),
        xq.quantize_per_tensor(w, symmetric=bool(which % 2)),
    ):
        assert np.all(qt.scale == 1)
        np.testing.assert_array_equal(qt.dequantize(), w)


def test_tiny_values_get_the_smallest_normal_scale() -> None:
    w = np.full((2, 32), 1e-40, np.float32)  # subnormal
    for qt in (xq.quantize_per_channel(w, bits=4), xq.quantize_blockwise(w, 32, method="mse"),
               xq.quantize_per_tensor(w)):
        assert np.all(qt.scale == FLT_MIN)
        assert np.all(np.abs(qt.codes) <= 1)


def test_huge_values_never_give_nan_or_invalid_scales() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 64)) * 1e37).astype(np.float32)
    for qt in (xq.quantize_per_channel(w, bits=8, method="mse"), xq.quantize_blockwise(w, 32, method="mse"),
               xq.quantize_per_channel(w, bits=4)):
        assert_positive_normal(qt.scale)
        assert np.all(np.isfinite(qt.dequantize()))


def test_deterministic_whatever_the_call_order() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 8, 64)).astype(np.float32)
    first = [xq.quantize_blockwise(a, method="mse").to_bytes(), xq.quantize_per_channel(b, 4, method="mse").to_bytes()]
    second = [xq.quantize_per_channel(b, 4, method="mse").to_bytes(), xq.quantize_blockwise(a, method="mse").to_bytes()]
    assert first == second[::-1]


def test_a_tiny_opposite_extreme_does_not_derail_the_search() -> None:
    """A block whose positive extreme is tiny (or subnormal) next to zeros and large negatives."""
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[0, 1:17] = 1.1754944e-37, -10.0
    w[1, 0], w[1, 1] = -4.7e-41, 10.0
    for bits in (4, 8):
        minmax = xq.quantize_per_channel(w, bits=bits)
        mse = xq.quantize_per_channel(w, bits=bits, method="mse")
        assert np.all(squared_errors(w, mse, w.shape) <= squared_errors(w, minmax, w.shape))
    qt = xq.quantize_blockwise(w, 32, method="mse")
    # -10 maps to -8 (scale 1.25, exact); +10 can only map to +7: bf16(10 / 7) = 1.4296875
    assert qt.scale.tolist() == [[1.25], [1.4296875]]
