"""quantize_per_token against the real XNNPACK's f32 -> qd8 convert operator, bit for bit.

The oracle is ``xnnquant.xnnpack.convert_f32_qd8`` (XNNPACK 1adaa7c7 in executorch
1.4.1, through ctypes).  Codes, zero points and the float32 bits of the scales must all
be equal on every row.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import xnnquant as xq
from xnnquant.schemes import per_token

pytestmark = pytest.mark.xnnpack

ROW_LENGTHS = (1, 2, 5, 16, 33, 64, 255, 384)


def _rows_of_every_kind(rng: np.random.Generator, k: int) -> dict[str, np.ndarray]:
    """Float32 ``(n, k)`` row sets, by kind; scales span about 1e-6 .. 1e6."""
    n = 48
    magnitude = (10.0 ** rng.uniform(-4, 8, (n, 1))).astype(np.float32)  # range / 255 from ~1e-6 to ~1e6
    normal = rng.standard_normal((n, k)).astype(np.float32) * magnitude
    heavy = (rng.standard_t(1.5, (n, k)) * magnitude).astype(np.float32)
    constant = np.repeat((rng.standard_normal((n, 1)) * magnitude).astype(np.float32), k, axis=1)
    # exact .5 ties in x * m: lo = -a / 256 * 2**e and hi = (255 - a) / 256 * 2**e give
    # m = 2**(8 - e) exactly and zero point a - 128 (odd or even); the values
    # (j + 1/2) / 256 * 2**e with j in [-a, 254 - a] then land exactly on ties.
    e = np.exp2(rng.integers(-20, 20, (n, 1))).astype(np.float32)
    a = rng.integers(1, 255, (n, 1))
    j = rng.integers(-a, 255 - a, (n, k)).astype(np.float32)
    ties = ((j + np.float32(0.5)) / np.float32(256)) * e
    ties[:, 0] = (-a[:, 0] / np.float32(256)).astype(np.float32) * e[:, 0]
    if k > 1:
        ties[:, 1] = ((255 - a[:, 0]) / np.float32(256)).astype(np.float32) * e[:, 0]
    # ties in the zero point: m = 2 (range 127.5), lo * m = -(odd) / 2
    zp_ties = np.zeros((n, k), np.float32)
    lo = -(rng.integers(0, 120, n) * 2 + 1).astype(np.float32) / 4  # -0.25, -0.75, ...: lo*m = -0.5, -1.5, ...
    zp_ties[:, 0] = lo
    if k > 1:
        zp_ties[:, 1] = lo + np.float32(127.5)
        zp_ties[:, 2:] = rng.uniform(lo[:, None], lo[:, None] + 127.5, (n, k - 2)).astype(np.float32)
    return {
        "normal": normal,
        "heavy-tailed": heavy,
        "all-positive": np.abs(normal),
        "all-negative": -np.abs(heavy),
        "constant": constant,
        "zero": np.zeros((4, k), np.float32),
        "exact .5 ties": ties,
        "zero-point ties": zp_ties,
    }


def _assert_bit_exact(x: np.ndarray, what: str) -> int:
    from xnnquant.xnnpack import convert_f32_qd8

    ours = xq.quantize_per_token(x)
    ref = convert_f32_qd8(x)
    scale_bits = ours.scale.view(np.uint32), ref.scale.view(np.uint32)
    bad_rows = (
        (ours.codes != ref.codes).reshape(len(x), -1).any(axis=1)
        | (np.asarray(ours.zero_point) != np.asarray(ref.zero_point))
        | (scale_bits[0] != scale_bits[1])
    )
    assert not bad_rows.any(), (
        f"{what}: {int(bad_rows.sum())} of {len(x)} rows differ from XNNPACK, first row "
        f"{int(np.argmax(bad_rows))}: ours zp/scale {np.asarray(ours.zero_point)[bad_rows][0]}/"
        f"{ours.scale[bad_rows][0]!r}, XNNPACK {np.asarray(ref.zero_point)[bad_rows][0]}/{ref.scale[bad_rows][0]!r}"
    )
    return len(x)


def test_bit_exact_with_xnnpack_on_thousands_of_mixed_rows() -> None:
    rng = np.random.default_rng(20261130)
    checked = 0
    scales: list[np.ndarray] = []
    for k in ROW_LENGTHS:
        kinds = _rows_of_every_kind(rng, k)
        mixed = rng.permutation(np.concatenate(list(kinds.values())))
        checked += _assert_bit_exact(mixed, f"K={k}")
        scales.append(xq.quantize_per_token(mixed).scale)
    every = np.concatenate(scales)
    assert checked >= 2000
    assert every.min() < 1e-6 and every.max() > 1e6  # the scale range asked for is covered


def test_ties_really_are_ties() -> None:
    """The tie rows hit x * m = j + 1/2 exactly, and the zero-point rows a .5 zero point."""
    rng = np.random.default_rng(1)
    kinds = _rows_of_every_kind(rng, 16)
    ties = kinds["exact .5 ties"]
    mult = np.float32(1) / xq.quantize_per_token(ties).scale
    products = ties * mult[:, None]
    assert np.mean(products[:, 2:] - np.floor(products[:, 2:]) == 0.5) > 0.9
    zp_rows = kinds["zero-point ties"]
    lo = np.minimum(zp_rows.min(axis=1), 0)
    raw_zp = np.float32(-128) - lo * np.float32(2)
    assert np.all(raw_zp - np.floor(raw_zp) == 0.5)


def test_textbook_formula_differs_on_some_rows() -> None:
    """Why the exact algorithm matters.  The textbook scale (hi - lo) / 255 has other float32
    bits than XNNPACK's 1 / (255 / (hi - lo)) on about a quarter of these rows; the textbook
    codes rint(x / scale + zp) differ on far fewer (measured: 3 rows in 20,000)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2000, 64)) * 10.0 ** rng.uniform(-3, 3, (2000, 1))).astype(np.float32)
    qt = xq.quantize_per_token(x)
    lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    textbook_scale = (hi - lo) / np.float32(255)
    assert np.mean(textbook_scale != qt.scale) > 0.1


@pytest.mark.parametrize("shape, nonbatch", [((3, 4, 5), 1), ((3, 4, 5), 2), ((2, 3, 4, 5), 3), ((7,), 1)])
def test_batch_dims_match_xnnpack_rows(shape: tuple[int, ...], nonbatch: int) -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    ours = xq.quantize_per_token(x, num_nonbatch_dims=nonbatch)
    row_len = int(np.prod(shape[len(shape) - nonbatch :]))
    ref = convert_f32_qd8(x.reshape(-1, row_len))
    assert ours.codes.shape == shape and ours.num_nonbatch_dims == nonbatch
    np.testing.assert_array_equal(ours.codes.reshape(-1, row_len), ref.codes)
    np.testing.assert_array_equal(ours.scale.view(np.uint32), ref.scale.view(np.uint32))
    np.testing.assert_array_equal(ours.zero_point, ref.zero_point)


def test_half_precision_inputs_are_widened_exactly() -> None:
    import torch

    rng = np.random.default_rng(4)
    x32 = rng.standard_normal((64, 40)).astype(np.float32)
    for low in (x32.astype(np.float16), x32.astype(ml_dtypes.bfloat16)):
        widened = low.astype(np.float32)
        expected = xq.quantize_per_token(widened)
        for arg in (low, torch.from_numpy(widened).to(torch.bfloat16 if low.dtype != np.float16 else torch.float16)):
            got = xq.quantize_per_token(arg)
            np.testing.assert_array_equal(got.codes, expected.codes)
            np.testing.assert_array_equal(got.scale, expected.scale)


def test_all_zero_row_matches_the_documented_values() -> None:
    """Hand-derived: an all-zero row gets scale 1, zero point 127 and codes 127."""
    qt = xq.quantize_per_token(np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(qt.scale, [1, 1])
    np.testing.assert_array_equal(qt.zero_point, [127, 127])
    np.testing.assert_array_equal(qt.codes, np.full((2, 3), 127))
    scale, zp = per_token.choose_qparams(np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(scale, qt.scale)
    np.testing.assert_array_equal(zp, qt.zero_point)


def test_hand_derived_row() -> None:
    """x = [-1, 0, 3]: lo = -1, hi = 3, m = 255 / 4 = 63.75; (-128 - 63.75) + (127 + 191.25)
    = 126.5 > 0, so zp = -128 + 63.75 = -64.25 -> -64; codes rint([-63.75, 0, 191.25]) - 64."""
    qt = xq.quantize_per_token(np.array([[-1.0, 0.0, 3.0]], np.float32))
    assert qt.zero_point.tolist() == [-64]
    assert qt.codes.tolist() == [[-128, -64, 127]]
    assert qt.scale[0] == np.float32(1) / np.float32(63.75)


def test_denormals_are_flushed_like_xnnpack() -> None:
    """XNNPACK runs with denormals flushed to zero: subnormal values count as 0."""
    from xnnquant.xnnpack import convert_f32_qd8

    tiny = np.finfo(np.float32).tiny
    x = np.array(
        [
            [1e-39, -1e-39, 0.0, 5e-40],  # all subnormal: an all-zero row
            [1e-35, 1.1e-38, -1e-38, 0.0],  # normal range, subnormal members
            [3.1e-36, 0.0, tiny, -tiny],  # just above the least usable range
            [1.0, 1e-39, -2.0, 0.5],
        ],
        np.float32,
    )
    ours, ref = xq.quantize_per_token(x), convert_f32_qd8(x)
    np.testing.assert_array_equal(ours.codes, ref.codes)
    np.testing.assert_array_equal(ours.scale.view(np.uint32), ref.scale.view(np.uint32))
    np.testing.assert_array_equal(ours.zero_point, ref.zero_point)


@pytest.mark.parametrize("row", [[8e-37, 0.0], [-1e-37, 1e-37], [3e38, -3e38]])
def test_rows_xnnpack_cannot_scale_are_refused(row: list[float]) -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    x = np.array([[1.0, 2.0], row], np.float32)
    ref_scale = convert_f32_qd8(x).scale[1]
    assert ref_scale == 0 or np.isinf(ref_scale)  # what XNNPACK itself reports for such a row
    with pytest.raises(xq.XnnquantError, match=r"x row 1 cannot be quantized per token: got min"):
        xq.quantize_per_token(x)


@settings(max_examples=150, deadline=None)
@given(
    x=st.tuples(st.integers(1, 8), st.integers(1, 70)).flatmap(
        lambda shape: hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False, allow_infinity=False))
    )
)
def test_any_rows_match_xnnpack_or_are_refused_where_xnnpack_gives_no_usable_scale(x: np.ndarray) -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    ref = convert_f32_qd8(x)
    try:
        ours = xq.quantize_per_token(x)
    except xq.XnnquantError:
        assert np.any((ref.scale == 0) | np.isinf(ref.scale))
        return
    np.testing.assert_array_equal(ours.codes, ref.codes)
    np.testing.assert_array_equal(ours.scale.view(np.uint32), ref.scale.view(np.uint32))
    np.testing.assert_array_equal(ours.zero_point, ref.zero_point)
