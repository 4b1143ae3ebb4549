"""Measurements for accuracy experiments: SQNR, storage cost, scale conversions.

* ``sqnr_db``: signal-to-quantization-noise ratio of an approximation, in decibels.
* ``bits_per_weight``: what a ``QuantizedTensor`` costs in storage, scales included.
* ``relative_error``: element-wise ``(approx - reference) / |reference|``.
* ``runtime_bf16``: the fp32 -> bf16 scale conversion of the ExecuTorch 1.4.1 runtime
  (multiply, then truncate), to compare with round-to-nearest-even.

Every reduction accumulates in float64, so the figures do not depend on summation order
at float32 precision.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np

from .arrays import as_float32
from .datatypes import ScaleKind, ZeroPoint, storage
from .errors import XnnquantError
from .rounding import Bf16, bf16_bits_to_float32
from .tensor import QuantizedTensor

#: The factor the ExecuTorch 1.4.1 runtime multiplies fp32 scales by before it keeps
#: their upper 16 bits; just below 1 + 2**-8.
RUNTIME_BF16_FACTOR = np.float32(1.00389105)


def _pair(reference: Any, approx: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both inputs as float64 arrays of one shape (each checked as a float array first)."""
    ref = as_float32(reference, "reference").astype(np.float64)
    app = as_float32(approx, "approx").astype(np.float64)
    if ref.shape != app.shape:
        raise XnnquantError(
            f"reference and approx must have the same shape: got {ref.shape} and {app.shape}"
        )
    return ref, app


@overload
def sqnr_db(reference: Any, approx: Any, axis: None = None) -> float: ...
@overload
def sqnr_db(reference: Any, approx: Any, axis: int | tuple[int, ...]) -> np.ndarray: ...
def sqnr_db(reference: Any, approx: Any, axis: int | tuple[int, ...] | None = None) -> float | np.ndarray:
    """``10 * log10(sum(reference**2) / sum((reference - approx)**2))``.

    ``reference`` and ``approx``: float arrays of one shape (numpy or torch, fp32, fp16 or
    bf16).  With ``axis=None`` the sums run over everything and a float is returned;
    otherwise over ``axis`` and a float64 array of the remaining shape is returned.
    An exact approximation gives ``inf``; a zero reference with a non-zero error gives
    ``-inf``; a zero reference matched exactly gives ``nan`` (0/0: no signal, no noise).
    """
    ref, app = _pair(reference, approx)
    signal = np.sum(ref * ref, axis=axis)
    noise = np.sum((ref - app) ** 2, axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 10.0 * np.log10(signal / noise)
    return float(out) if np.ndim(out) == 0 else out


def relative_error(reference: Any, approx: Any) -> np.ndarray:
    """``(approx - reference) / |reference|`` element-wise, float64, the shape of the inputs.

    Where ``reference`` is zero the result is ``nan`` (or ``0`` when ``approx`` is zero too).
    """
    ref, app = _pair(reference, approx)
    diff = app - ref
    with np.errstate(divide="ignore", invalid="ignore"):
        out = diff / np.abs(ref)
    return np.where(diff == 0, 0.0, out)


def bits_per_weight(qt: QuantizedTensor) -> float:
    """Storage bits per element of ``qt``: codes plus scales plus stored zero points.

    ============  ======================================  =========================
    datatype      codes                                   parameters
    ============  ======================================  =========================
    8/32-bit      ``bits`` per element                    per-tensor: fp32 scale and
                                                          int32 zero point; per-channel:
                                                          one fp32 scale per channel
    qcint4        ``ceil(K / 2)`` bytes per row           one fp32 scale per channel
    qbint4        ``ceil(K / 2)`` bytes per row           one bf16 scale per group
    qdint8        8 per element                           one fp32 scale and one int32
                                                          zero point per row (run time)
    ============  ======================================  =========================

    4-bit rows are padded to whole bytes, as ``QuantizedTensor.to_bytes`` writes them, so
    an odd K costs a little more than 4 bits.  Zero points fixed by the datatype (0, or
    8 for 4-bit) cost nothing.
    """
    facts = storage(qt.datatype)
    shape = qt.shape
    numel = int(np.prod(shape, dtype=np.int64))
    if numel == 0:
        raise XnnquantError(f"bits_per_weight needs a non-empty tensor: got shape {shape}")
    if facts.bits == 4:
        rows = numel // shape[-1]
        code_bits = rows * ((shape[-1] + 1) // 2) * 8
    else:
        code_bits = numel * facts.bits
    scale_bits = {
        ScaleKind.TENSOR: 32,
        ScaleKind.CHANNEL: 32,
        ScaleKind.GROUP_BF16: 16,
        ScaleKind.RUNTIME: 32,
    }[facts.scale] * int(qt.scale.size)
    zero_point_bits = {ZeroPoint.FREE: 32, ZeroPoint.RUNTIME: 32}.get(facts.zero_point, 0)
    zero_point_bits *= int(qt.scale.size)
    return (code_bits + scale_bits + zero_point_bits) / numel


def runtime_bf16(x: Any) -> Bf16:
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
