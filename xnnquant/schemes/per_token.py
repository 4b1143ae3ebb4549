"""Per-token dynamic quantization (qdint8), bit for bit as XNNPACK computes it at run time.

XNNPACK quantizes each row of a dynamically quantized input when the graph runs; this
module reproduces that conversion (``f32 -> qd8``) exactly, so a reference computation
sees the very codes, zero points and scales the kernels see.  Per row ``r``, all in
float32 arithmetic::

    lo = min(0, min(r))           hi = max(0, max(r))
    m  = 255 / (hi - lo)          (m = 1 when hi == lo, e.g. an all-zero row)
    zp = -128 - lo*m   if (-128 + lo*m) + (127 + hi*m) > 0   else   127 - hi*m
    zp = round_half_even(clamp(zp, -128, 127))
    q  = saturate_int8(round_half_even(x * m) + zp)          (product rounded first)
    scale = 1 / m                                             (not (hi - lo) / 255)

The textbook ``rint(x / ((hi - lo) / 255) + zp)`` disagrees on several percent of rows.
fp16 and bf16 inputs are widened to float32 first (XNNPACK's fp32 path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..datatypes import Datatype
from ..errors import XnnquantError
from ..rounding import quantize_values, round_half_even
from ..tensor import QuantizedTensor
from .checks import check_int, float_input
from .granularity import PerToken

QMIN, QMAX = -128, 127


def _prepare(x: Any, num_nonbatch_dims: Any) -> tuple[np.ndarray, PerToken]:
    arr = float_input(x, "x", min_rank=1)
    n = check_int(num_nonbatch_dims, "num_nonbatch_dims")
    if not 0 <= n <= arr.ndim:
        raise XnnquantError(f"num_nonbatch_dims is out of range: got {n} for a rank-{arr.ndim} input, expected 0 to {arr.ndim}")
    return arr, PerToken(n)


def _multipliers(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` ``(M, K)`` float32 -> (multiplier ``m`` float32 ``(M,)``, zero point int32 ``(M,)``)."""
    lo = np.minimum(rows.min(axis=1), np.float32(0))
    hi = np.maximum(rows.max(axis=1), np.float32(0))
    with np.errstate(over="ignore"):
        span = hi - lo
    if not np.isfinite(span).all():
        row = int(np.argmax(~np.isfinite(span)))
        raise XnnquantError(
            f"x row {row} has a range that overflows float32: got min {lo[row]}, max {hi[row]}, "
            "expected max - min to be finite"
        )
    with np.errstate(divide="ignore"):
        mult = np.where(span == 0, np.float32(1), np.float32(255) / span).astype(np.float32)
    lo_scaled, hi_scaled = lo * mult, hi * mult
    from_min = (np.float32(QMIN) + lo_scaled) + (np.float32(QMAX) + hi_scaled) > 0
    zp = np.where(from_min, np.float32(QMIN) - lo_scaled, np.float32(QMAX) - hi_scaled)
    return mult, round_half_even(np.clip(zp, QMIN, QMAX)).astype(np.int32)


def choose_qparams(x: Any, num_nonbatch_dims: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (scale float32 ``(M,)``, zero point int32 ``(M,)``) as XNNPACK computes them.

    ``M`` is the product of the leading ``x.ndim - num_nonbatch_dims`` dims.
    """
    arr, granularity = _prepare(x, num_nonbatch_dims)
    mult, zp = _multipliers(granularity.rows(arr))
    return (np.float32(1) / mult).astype(np.float32), zp


def quantize(x: Any, num_nonbatch_dims: int = 1) -> QuantizedTensor:
    """qdint8 ``QuantizedTensor`` of ``x``: int8 codes shaped like ``x``, scale float32 ``(M,)``,
    zero point int32 ``(M,)``, ``num_nonbatch_dims`` kept."""
    arr, granularity = _prepare(x, num_nonbatch_dims)
    rows = granularity.rows(arr)
    mult, zp = _multipliers(rows)
    codes = quantize_values(rows, mult[:, None], zp[:, None], QMIN, QMAX, "int8")
    return QuantizedTensor(
        Datatype.qdint8, codes.reshape(arr.shape), (np.float32(1) / mult).astype(np.float32), zp,
        num_nonbatch_dims=granularity.num_nonbatch_dims,
    )


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``(codes - zero_point[row]) * scale[row]`` as float32, in the logical shape."""
    if qt.datatype is not Datatype.qdint8:
        raise XnnquantError(f"not a per-token tensor: got {qt.datatype.name}, expected qdint8")
    return qt.dequantize()
