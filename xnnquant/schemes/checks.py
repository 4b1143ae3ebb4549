"""Input checks and scale rules shared by the schemes.

Every check raises ``XnnquantError`` saying what was wrong, what was given and what was
expected.  Two scale rules hold in every scheme (XNNPACK rejects any scale that is not a
positive normal float32):

* a block whose values are all zero gets scale 1.0 (as XNNPACK's own per-token
  quantization does), and codes 0;
* a non-zero scale below the smallest normal float32 (``2**-126``, about 1.18e-38) is
  clamped up to it, so every value of such a tiny block quantizes to 0 or +-1.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np

from ..arguments import shown, spelling
from ..arrays import ArrayInput, as_float32, first_not_positive_normal, float_array, is_int, to_numpy
from ..constants import FLT_MIN, XNN_MAX_TENSOR_DIMS
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..rounding import check_bf16_exact
from ..tensor import check_zero_point

Method = Literal["minmax", "mse", "range", "act_mse", "gptq"]
METHODS: tuple[str, ...] = ("minmax", "mse", "range", "act_mse", "gptq")
#: Methods that choose codes and scales from calibration activations (``activation_aware``,
#: in the order of its table).
ACTIVATION_AWARE_METHODS: tuple[str, ...] = ("act_mse", "gptq")


def float_input(x: ArrayInput, name: str, min_rank: int, max_rank: int = XNN_MAX_TENSOR_DIMS) -> np.ndarray:
    """``x`` as a finite, non-empty float32 array of rank in ``[min_rank, max_rank]``.

    fp32, fp16 and bf16 (numpy, ml_dtypes or torch) are accepted and widened exactly.
    """
    given = to_numpy(x, name)
    arr = as_float32(given, name).reshape(given.shape)  # as_float32 widens 0-d arrays to (1,)
    return _check_shape(arr, name, min_rank, max_rank)


def float_source(x: ArrayInput, name: str, min_rank: int, max_rank: int = XNN_MAX_TENSOR_DIMS) -> np.ndarray:
    """``x`` as a non-empty, C-contiguous array of its own float dtype, for the kernels.

    The same checks as ``float_input`` except finiteness, which the kernels check as they
    read the values (``kernels`` raises ``float_input``'s error); nothing is widened here.
    """
    arr = np.asarray(float_array(x, name), order="C")  # keeps rank 0, unlike ascontiguousarray
    return _check_shape(arr, name, min_rank, max_rank)


def _check_shape(arr: np.ndarray, name: str, min_rank: int, max_rank: int) -> np.ndarray:
    if not min_rank <= arr.ndim <= max_rank:
        expected = f"{min_rank}" if min_rank == max_rank else f"{min_rank} to {max_rank}"
        raise XnnquantError(
            f"{name} has the wrong rank: got shape {arr.shape} (rank {arr.ndim}), expected rank {expected}"
        )
    if arr.size == 0:
        raise XnnquantError(f"{name} is empty: got shape {arr.shape}, expected at least one element")
    return arr


def normalize_axis(axis: object, ndim: int, name: str = "axis") -> int:
    """``axis`` in ``[-ndim, ndim)`` as a non-negative int."""
    if not is_int(axis):
        raise XnnquantError(f"{name} must be an integer: got {axis!r}")
    if not -ndim <= axis < ndim:
        raise XnnquantError(
            f"{name} is out of range: got {axis} for a rank-{ndim} tensor, expected {-ndim} to {ndim - 1}"
        )
    return int(axis) % ndim


def check_method(method: object) -> Method:
    """``method`` as one of ``METHODS`` (case and surrounding spaces ignored, as every option)."""
    text = spelling(method)
    if text not in METHODS:
        given = repr(method) if isinstance(method, str) else shown(method)
        raise XnnquantError(f"unknown method: got {given}, expected one of {', '.join(map(repr, METHODS))}")
    return cast(Method, text)


def check_calibration_use(method: str, calibration: object, scale: object) -> None:
    """Calibration goes with the activation-aware methods, and only with them."""
    needs = method in ACTIVATION_AWARE_METHODS
    if needs and calibration is None:
        raise XnnquantError(
            f"method {method!r} needs calibration activations: got calibration=None, expected a float array "
            "(tokens, in_features) or an xnnquant.Calibration"
        )
    if not needs and calibration is not None:
        raise XnnquantError(
            f"method {method!r} does not use calibration: got a calibration, expected calibration=None "
            f"(activation-aware methods: {', '.join(map(repr, ACTIVATION_AWARE_METHODS))})"
        )
    if needs and scale is not None:
        raise XnnquantError(
            f"method {method!r} chooses its own scales: got scale= and calibration=, expected one of them"
        )


def check_int(value: object, name: str) -> int:
    if not is_int(value):
        raise XnnquantError(f"{name} must be an integer: got {value!r}")
    return int(value)


def positive_normal(scale: np.ndarray, all_zero: np.ndarray) -> np.ndarray:
    """float32 ``scale`` with the two rules above applied (``all_zero`` marks zero blocks)."""
    out = np.maximum(np.asarray(scale, np.float32), FLT_MIN)
    return np.where(all_zero, np.float32(1), out).astype(np.float32)


def reciprocal(scale: np.ndarray) -> np.ndarray:
    """``1 / scale`` in float32: every quantizer here multiplies by it (as torchao does)."""
    return (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)


def user_scale(scale: ArrayInput, name: str = "scale") -> np.ndarray:
    """A caller-given scale as a float32 array, each value a positive normal float."""
    if isinstance(scale, (bool, np.bool_, str, bytes)):
        raise XnnquantError(f"{name} must be a number or an array of numbers: got {scale!r}")
    try:
        arr = np.asarray(scale, dtype=np.float64)
    except (TypeError, ValueError):
        raise XnnquantError(f"{name} must be a number or an array of numbers: got {scale!r}") from None
    as32 = arr.astype(np.float32)
    where = first_not_positive_normal(as32)
    if where is not None:
        raise XnnquantError(
            f"{name} must be a positive normal float32 (XNNPACK rejects others): got {arr[where]}"
            f"{f' at index {where}' if where else ''}, expected a finite value >= {FLT_MIN:.9g}"
        )
    return as32


def user_scales(scale: ArrayInput, shape: tuple[int, ...], bf16: bool = False) -> np.ndarray:
    """Caller-given scales of the expected ``shape``, positive normal (and bf16-exact if asked)."""
    arr = user_scale(scale)
    if arr.shape != shape:
        raise XnnquantError(f"scale has the wrong shape: got {arr.shape}, expected {shape}")
    if bf16:
        check_bf16_exact(arr)
    return arr


def user_zero_point(zero_point: object, datatype: Datatype) -> int:
    """A caller-given per-tensor zero point as an int, in range for ``datatype``."""
    value = zero_point.item() if isinstance(zero_point, np.ndarray) and zero_point.size == 1 else zero_point
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    zp = check_int(value, "zero_point")
    check_zero_point(datatype, zp)
    return zp
