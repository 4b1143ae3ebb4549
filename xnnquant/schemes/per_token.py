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

XNNPACK runs its operators with denormals flushed to zero (``PTHREADPOOL_FLAG_DISABLE_DENORMALS``):
subnormal inputs count as 0 (a row of them is an all-zero row), and a subnormal scale
comes out as 0.  A row whose range ``hi - lo`` is non-zero but below ``255 * 2**-126``
(about 3e-36), or overflows float32, would get scale 0 or inf from XNNPACK, which no
kernel can use: such rows raise ``XnnquantError``.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput
from ..constants import FLT_MIN
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..rounding import quantize_values, round_half_even
from ..tensor import QuantizedTensor
from .checks import check_int, float_input
from .granularity import PerToken

QMIN, QMAX = -128, 127


def _prepare(x: ArrayInput, num_nonbatch_dims: object) -> tuple[np.ndarray, PerToken]:
    arr = float_input(x, "x", min_rank=1)
    n = check_int(num_nonbatch_dims, "num_nonbatch_dims")
    if not 0 <= n <= arr.ndim:
        raise XnnquantError(
            f"num_nonbatch_dims is out of range: got {n} for a rank-{arr.ndim} input, expected 0 to {arr.ndim}"
        )
    return arr, PerToken(n)


def _flush_denormals(rows: np.ndarray) -> np.ndarray:
    """``rows`` with subnormal values replaced by 0, as XNNPACK's denormals-are-zero mode reads them."""
    return np.where(np.abs(rows) < FLT_MIN, np.float32(0), rows)


def _multipliers(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` ``(M, K)`` float32, denormals flushed -> (multiplier ``m`` float32 ``(M,)``,
    zero point int32 ``(M,)``)."""
    lo = np.minimum(rows.min(axis=1), np.float32(0))
    hi = np.maximum(rows.max(axis=1), np.float32(0))
    with np.errstate(over="ignore", divide="ignore"):
        span = hi - lo
        mult = np.where(span == 0, np.float32(1), np.float32(255) / span).astype(np.float32)
        unusable = ~np.isfinite(span) | ~np.isfinite(mult) | (np.float32(1) / mult < FLT_MIN)
    if unusable.any():
        row = int(np.argmax(unusable))
        raise XnnquantError(
            f"x row {row} cannot be quantized per token: got min {lo[row]:.9g}, max {hi[row]:.9g}, "
            f"expected max - min to be 0 or finite and >= {255 * FLT_MIN:.3g} "
            "(else XNNPACK's scale, range / 255, is flushed to 0 or overflows)"
        )
    lo_scaled, hi_scaled = lo * mult, hi * mult
    from_min = (np.float32(QMIN) + lo_scaled) + (np.float32(QMAX) + hi_scaled) > 0
    zp = np.where(from_min, np.float32(QMIN) - lo_scaled, np.float32(QMAX) - hi_scaled)
    return mult, round_half_even(np.clip(zp, QMIN, QMAX)).astype(np.int32)


def choose_qparams(x: ArrayInput, num_nonbatch_dims: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (scale float32 ``(M,)``, zero point int32 ``(M,)``) as XNNPACK computes them.

    ``M`` is the product of the leading ``x.ndim - num_nonbatch_dims`` dims.
    """
    arr, granularity = _prepare(x, num_nonbatch_dims)
    mult, zp = _multipliers(_flush_denormals(granularity.rows(arr)))
    return (np.float32(1) / mult).astype(np.float32), zp


def quantize(x: ArrayInput, num_nonbatch_dims: int = 1) -> QuantizedTensor:
    """qdint8 ``QuantizedTensor`` of ``x``: int8 codes shaped like ``x``, scale float32 ``(M,)``,
    zero point int32 ``(M,)``, ``num_nonbatch_dims`` kept."""
    arr, granularity = _prepare(x, num_nonbatch_dims)
    rows = _flush_denormals(granularity.rows(arr))
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
