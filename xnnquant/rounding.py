"""Rounding, in one place.

* ``round_half_even``: the rounding of every quantizer here, as in XNNPACK
  (``lrintf`` under the default rounding mode) and ``torch.round``.
* ``to_bf16``: float32 -> bfloat16 with round-to-nearest-even, through ml_dtypes.
* ``check_bf16_exact``: refuse scales that are not exactly bf16 values.
* ``runtime_bf16``: the ExecuTorch 1.4.1 runtime's own fp32 -> bf16 conversion of
  blockwise scales (multiply, then truncate), which differs from round-to-nearest-even.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from .arrays import as_float32
from .constants import RUNTIME_BF16_FACTOR
from .errors import UnsupportedConfigError


def round_half_even(x: np.ndarray) -> np.ndarray:
    """Round to the nearest integer, ties to even; dtype kept (float)."""
    return np.rint(x)


def quantize_values(x: np.ndarray, inv_scale: np.ndarray, zero_point: np.ndarray | int,
                    qmin: int, qmax: int, dtype: str) -> np.ndarray:
    """``clamp(round_half_even(x * inv_scale) + zero_point, qmin, qmax)`` as ``dtype``.

    The product is rounded before the zero point is added (XNNPACK's and PyTorch's order);
    all arithmetic is float32, as on the device.
    """
    q = round_half_even(np.float32(1) * x * inv_scale) + zero_point
    return np.clip(q, qmin, qmax).astype(dtype)


class Bf16(NamedTuple):
    """A bf16 array as its uint16 bit patterns and as the float32 values they denote."""

    bits: np.ndarray  # uint16, same shape
    values: np.ndarray  # float32, same shape, exactly representable in bf16


def to_bf16(x: np.ndarray) -> Bf16:
    """float32 -> bf16, round to nearest, ties to even (NaN stays NaN)."""
    b = np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return Bf16(bits=b.view(np.uint16), values=b.astype(np.float32))


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 values (exact)."""
    return np.asarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def check_bf16_exact(scale: np.ndarray, name: str = "scale") -> Bf16:
    """``scale`` (float32, any shape) as bf16, refusing values that are not exactly bf16.

    XNNPACK reads blockwise (qbint4) scales as bf16, so codes must be computed against
    bf16-exact scales; rounding them here would silently change what the codes mean.
    Raises ``UnsupportedConfigError`` naming the first inexact value and its index.
    """
    arr = np.asarray(scale, np.float32)
    bf = to_bf16(arr)
    inexact = bf.values.view(np.uint32) != arr.view(np.uint32)
    if inexact.any():
        where = tuple(int(i) for i in np.argwhere(inexact)[0])
        raise UnsupportedConfigError(
            f"{name} must hold bf16 values: got {arr[where]:.9g} at index {where}, expected exactly bf16 values "
            f"({int(inexact.sum())} of {arr.size} are not; XNNPACK reads blockwise scales as bf16): round them "
            "with xnnquant.rounding.to_bf16 before computing the codes"
        )
    return bf


def runtime_bf16(x: np.ndarray) -> Bf16:
    """fp32 -> bf16 as the ExecuTorch 1.4.1 runtime converts blockwise scales.

    ``x``: float array, any shape.  Returns the bf16 bit patterns (uint16) and their
    float32 values, same shape.

    When a qbint4 tensor's scales arrive as fp32, that runtime does not round them to
    nearest-even: it multiplies each by ``RUNTIME_BF16_FACTOR`` in float32 and keeps the
    upper half of the product's bit pattern::

        bits32 = float32(x * 1.00389105f).view(uint32)
        bf16   = bits32 >> 16          (sign, 8 exponent bits, top 7 mantissa bits)

    The product adds ``m * 2**-8`` of the value (``m`` in [1, 2) the significand), that
    is between 0.5 and 1 bf16 step, so truncation rounds *up* whenever the dropped bits
    are worth more than ``1 - m / 2`` of a step: like round-half-up for significands
    near 1, close to round-up (ceil) for significands near 2.  On uniformly spread
    values about a quarter come out one bf16 step above round-to-nearest-even, never
    below.  A value that is already a bf16 number comes back unchanged, since the
    product stays below the next bf16 step.
    """
    x32 = as_float32(x, "x", finite=False)
    with np.errstate(over="ignore", invalid="ignore"):
        product = (x32 * RUNTIME_BF16_FACTOR).astype(np.float32)
    bits = (product.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return Bf16(bits=bits, values=bf16_bits_to_float32(bits))
