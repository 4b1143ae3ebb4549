"""Measurements for accuracy experiments: SQNR, storage cost, scale conversions.

* ``sqnr_db``: signal-to-quantization-noise ratio of an approximation, in decibels.
* ``bits_per_weight``: what a ``QuantizedTensor`` costs in storage, scales included.
* ``relative_error``: element-wise ``(approx - reference) / |reference|``.
* ``runtime_bf16``: the fp32 -> bf16 scale conversion of the ExecuTorch 1.4.1 runtime
  (multiply, then truncate), to compare with round-to-nearest-even (defined in
  ``rounding``, with the library's other roundings).

Every reduction accumulates in float64, so the figures do not depend on summation order
at float32 precision.
"""

from __future__ import annotations

from typing import overload

import numpy as np

from .arrays import ArrayInput, as_float32
from .datatypes import ScaleKind, ZeroPoint, storage
from .errors import XnnquantError
from .rounding import runtime_bf16
from .tensor import QuantizedTensor


def _pair(reference: ArrayInput, approx: ArrayInput) -> tuple[np.ndarray, np.ndarray]:
    """Both inputs as float64 arrays of one shape (each checked as a float array first)."""
    ref = as_float32(reference, "reference").astype(np.float64)
    app = as_float32(approx, "approx").astype(np.float64)
    if ref.shape != app.shape:
        raise XnnquantError(
            f"reference and approx must have the same shape: got {ref.shape} and {app.shape}"
        )
    return ref, app


@overload
def sqnr_db(reference: ArrayInput, approx: ArrayInput, axis: None = None) -> float: ...
@overload
def sqnr_db(reference: ArrayInput, approx: ArrayInput, axis: int | tuple[int, ...]) -> np.ndarray: ...
def sqnr_db(reference: ArrayInput, approx: ArrayInput, axis: int | tuple[int, ...] | None = None) -> float | np.ndarray:
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


def relative_error(reference: ArrayInput, approx: ArrayInput) -> np.ndarray:
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


__all__ = ["bits_per_weight", "relative_error", "runtime_bf16", "sqnr_db"]
