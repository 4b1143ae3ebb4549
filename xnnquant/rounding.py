"""Rounding, in one place.

* ``round_half_even``: the rounding of every quantizer here, as in XNNPACK
  (``lrintf`` under the default rounding mode) and ``torch.round``.
* ``to_bf16``: float32 -> bfloat16 with round-to-nearest-even, through ml_dtypes.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np


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
