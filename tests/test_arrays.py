"""Input conversion: numpy and torch alike, dtypes stated, bad input named."""

import ml_dtypes
import numpy as np
import pytest

from xnnquant import XnnquantError
from xnnquant.arrays import as_float32, as_int_codes, first_not_positive_normal

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_floats_become_float32(dtype):
    t = torch.tensor([[1.5, -2.25], [0.0, 3.0]], dtype=dtype)
    out = as_float32(t)
    assert out.dtype == np.float32
    assert np.array_equal(out, t.float().numpy())


def test_numpy_bf16_and_fp16():
    x = np.array([1.5, -0.375], ml_dtypes.bfloat16)
    assert as_float32(x).tolist() == [1.5, -0.375]
    assert as_float32(x.astype(np.float16)).dtype == np.float32


def test_non_finite_is_located():
    x = np.zeros((3, 4), np.float32)
    x[2, 1] = np.nan
    x[2, 3] = np.inf
    with pytest.raises(XnnquantError, match=r"w must be finite: got nan at index \(2, 1\) \(2 non-finite"):
        as_float32(x, "w")


def test_integer_input_is_refused_for_floats():
    with pytest.raises(XnnquantError, match="must be a floating-point array: got dtype int64"):
        as_float32(np.arange(3))


def test_codes_from_torch_int8():
    assert as_int_codes(torch.tensor([-8, 7], dtype=torch.int8)).tolist() == [-8, 7]


def test_positive_normal_scales_by_the_float32_bits():
    # The thresholds are exact float32 facts: 2**-126 is the least normal, the next float
    # below it is subnormal; a float64 that rounds below it in float32 is refused too.
    tiny = float(np.finfo(np.float32).tiny)
    assert first_not_positive_normal(np.array([tiny, 1.0, 3.4e38], np.float32)) is None
    assert first_not_positive_normal(np.float32(2.0)) is None
    below = np.nextafter(np.float32(tiny), np.float32(0))
    for bad in (below, 0.0, -1.0, np.nan, np.inf):
        assert first_not_positive_normal(np.array([[1.0, 1.0], [1.0, bad]], np.float32)) == (1, 1)
    assert first_not_positive_normal(np.float32(0.0)) == ()
    assert first_not_positive_normal(np.array([tiny * 0.9999999])) == (0,)
