"""xnnquant.xnnpack loader and convert_f32_qd8 against hand-derived values.

The bit-exact comparison with the library's numpy reference lives with the schemes tests;
here the expected codes are worked out by hand from XNNPACK's documented rule:
per row rmin = min(0, min), rmax = max(0, max), s = 255 / (rmax - rmin),
zero point from the side with the smaller error, code = rint(x * s) + zp, scale = 1 / s.
"""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import MissingExtraError, XnnquantError

pytestmark = pytest.mark.xnnpack


def test_library_loads_through_the_installed_package() -> None:
    from xnnquant.xnnpack import library_path, load_library

    path = library_path()
    assert path.name.startswith("_portable_lib") and path.parent.name == "pybindings"
    assert load_library() is load_library()  # cached


def test_missing_executorch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from xnnquant.xnnpack import _capi

    monkeypatch.setattr(_capi.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingExtraError, match=r"xnnquant\[xnnpack\]"):
        _capi.library_path()


def test_hand_derived_rows() -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    x = np.array(
        [
            [0.0, 0.0, 0.0, 0.0],  # all zero: scale 1, zp 127, all codes 127
            [1.0, -1.0, 0.5, 2.0],  # s = 255/3 = 85; zp = -128 + 85 = -43; 42.5 -> 42 (tie to even)
            [-3.0, -2.0, -1.0, -0.5],  # s = 85; dmax = 0 side wins: zp = 127; -42.5 -> -42
            [0.0, 255.0, 42.5, 43.5],  # s = 1; zp = -128; ties 42.5 -> 42, 43.5 -> 44
        ],
        np.float32,
    )
    qt = convert_f32_qd8(x)
    assert qt.datatype is xq.Datatype.qdint8
    assert qt.num_nonbatch_dims == 1
    np.testing.assert_array_equal(
        qt.codes,
        np.array(
            [[127, 127, 127, 127], [42, -128, -1, 127], [-128, -43, 42, 85], [-128, 127, -86, -84]],
            np.int8,
        ),
    )
    np.testing.assert_array_equal(qt.zero_point, np.array([127, -43, 127, -128], np.int32))
    expected_scale = np.array([1.0, np.float32(1) / np.float32(85), np.float32(1) / np.float32(85), 1.0], np.float32)
    np.testing.assert_array_equal(qt.scale.view(np.uint32), expected_scale.view(np.uint32))


def test_shapes_and_dtypes() -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    x = np.random.default_rng(1).standard_normal((3, 2, 37)).astype(np.float32)
    qt = convert_f32_qd8(x)
    assert qt.codes.shape == (3, 2, 37) and qt.codes.dtype == np.int8
    assert qt.scale.shape == (6,) and qt.scale.dtype == np.float32
    assert qt.zero_point.shape == (6,) and qt.zero_point.dtype == np.int32
    # every value within half a step of its dequantized code (x is inside each row's range);
    # the 1e-4 step is float32 rounding of x * s and of (code - zp) * scale: a few ulps of
    # values of at most 255 steps, 255 * 2^-23 < 1e-4 (integer codes: no CPU dependence)
    err = np.abs(qt.dequantize() - x).reshape(6, 37)
    assert np.all(err <= qt.scale[:, None] * np.float32(0.5001))
    # fp16 input is widened exactly
    half = convert_f32_qd8(x.astype(np.float16))
    direct = convert_f32_qd8(x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(half.codes, direct.codes)


def test_empty_batch() -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    qt = convert_f32_qd8(np.zeros((0, 8), np.float32))
    assert qt.codes.shape == (0, 8) and qt.scale.shape == (0,)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (np.zeros((2, 0), np.float32), r"K >= 1: got shape \(2, 0\)"),
        (np.float32(3.0), r"K >= 1: got shape \(\)"),
        (np.ones((2, 3), np.int32), "floating-point array: got dtype int32"),
        (np.array([[1.0, np.nan]], np.float32), r"finite: got nan at index \(0, 1\)"),
    ],
)
def test_bad_input(x: np.ndarray, match: str) -> None:
    from xnnquant.xnnpack import convert_f32_qd8

    with pytest.raises(XnnquantError, match=match):
        convert_f32_qd8(x)
