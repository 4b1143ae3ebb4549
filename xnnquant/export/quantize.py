"""Quantizing one weight: the one place where ``export`` turns a float weight into what it stores.

``quantize_weight(weight, scheme, method, calibration)`` is the whole contract: a float
weight in the layout the node reads (a linear's ``[out_features, in_features]``, a
convolution's ``[OC, KH, KW, IC/groups]``) in, a ``QuantizedTensor`` (or the float32 array
for ``fp32``) out.  Streaming export calls it one weight at a time.

``linear_refusal`` / ``conv_refusal`` say why a layer cannot take a scheme, from what was
measured on XNNPACK 1.4.1 (the reasons fill the report's fallback column):

* qb4w:G needs G to divide ``in_features`` (blockwise scales cover whole groups);
* qc4w with an odd ``in_features`` is computed wrongly by XNNPACK's qdint8 x qcint4
  kernels (relative errors 0.4 to 1.1, see graph/rules.py), so it is refused;
* convolutions: XNNPACK has int8 dynamic convolutions (qdint8 x qcint8, per image) but no
  4-bit ones and no dynamically quantized depthwise ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import jit
from ..errors import XnnquantError
from ..metrics import sqnr_db
from ..parallel import for_ranges
from ..schemes import quantize_blockwise, quantize_per_channel
from ..schemes.blockwise import valid_group_sizes
from ..schemes.checks import ACTIVATION_AWARE_METHODS, check_method
from ..tensor import QuantizedTensor
from .options import SchemeKind, WeightScheme


def quantize_weight(weight: Any, scheme: WeightScheme, method: str = "mse", calibration: Any = None, *,
                    axis: int = 0) -> QuantizedTensor | np.ndarray:
    """``weight`` (float, numpy or torch) stored as ``scheme`` says.

    ``axis``: the output-channel axis for the per-channel schemes (0 for linear and
    convolution filters).  ``calibration``: what an activation-aware ``method`` needs
    (passed to the scheme only when given).  Returns float32 ``weight`` for fp32.
    """
    extra: dict[str, Any] = {} if calibration is None else {"calibration": calibration}
    chosen = check_method(method)
    if scheme.kind is SchemeKind.FP32:
        return np.ascontiguousarray(np.asarray(weight, np.float32))
    if chosen in ACTIVATION_AWARE_METHODS and calibration is None:
        raise XnnquantError(
            f"method {chosen!r} has no calibration statistics for this layer: got none, expected the inputs of a "
            "torch.nn.Linear called as a module by the calibration batches (convolutions and linears computed "
            "functionally, e.g. inside nn.MultiheadAttention, are not calibrated); export such a model with "
            "method='mse'")
    if scheme.kind is SchemeKind.QB4W:
        return quantize_blockwise(weight, group_size=int(scheme.group_size or 0), method=chosen, **extra)
    bits = 8 if scheme.kind is SchemeKind.QC8W else 4
    return quantize_per_channel(weight, bits=bits, axis=axis, method=chosen, **extra)


def linear_scheme(weights: WeightScheme, fallback: tuple[WeightScheme, ...], in_features: int) -> WeightScheme | None:
    """The scheme a linear with ``in_features`` inputs gets: ``weights``, else the first
    ``fallback`` it can take, else None (it is refused); as ``Lowerer.weight_scheme`` chooses."""
    for scheme in (weights, *fallback):
        if linear_refusal(scheme, in_features) is None:
            return scheme
    return None


def is_stored_as(q: QuantizedTensor, scheme: WeightScheme, shape: tuple[int, ...]) -> bool:
    """True when ``q`` is a weight of ``shape`` quantized as ``scheme`` (per output channel)."""
    return (scheme.is_quantized and q.datatype is scheme.datatype and q.group_size == scheme.group_size
            and q.codes.shape == tuple(shape) and q.channel_dim == 0)


def weight_nbytes(q: QuantizedTensor | np.ndarray, scales_in_segment: bool = False) -> int:
    """Bytes the weight takes in the payload: its data plus its scales.  Per-channel scales
    are fp32; blockwise ones are bf16 in the constant segment (``scales_in_segment``, target
    1.4.1), or fp32 plus bf16 copies in the flatbuffer (XN01)."""
    if not isinstance(q, QuantizedTensor):
        return int(q.nbytes)
    scales = int(np.asarray(q.scale).size)
    if q.group_size is None:
        per_scale = 4
    else:
        per_scale = 2 if scales_in_segment else 6
    return q.nbytes + scales * per_scale


#: Values of a weight compared at a time by ``weight_sqnr`` (256 KiB of float32).
SQNR_PIECE = 1 << 16


def weight_sqnr(weight: np.ndarray, q: QuantizedTensor | np.ndarray) -> float:
    """SQNR of the stored weight against the float one, in dB (inf when exact).

    A quantized weight is dequantized a few output channels at a time: each piece's sums
    of squares are float32 dot products of at most ``SQNR_PIECE`` values, added up in
    float64 in the order of the pieces, so a weight of any size costs a few hundred KiB of
    temporaries a thread (the figure agrees with ``metrics.sqnr_db`` to about 1e-5 dB).
    The residuals come from one compiled pass when numba is there (``jit``), the same
    float32 values as ``w - q.dequantize()``.
    The pieces run on every core (``parallel.for_ranges``); each writes its own sums, so
    the figure does not depend on the threads.
    """
    if not isinstance(q, QuantizedTensor):
        return float("inf") if np.array_equal(q, weight) else float(sqnr_db(weight, q))
    axis = q.channel_dim or 0
    rows = q.shape[axis]
    step = max(1, SQNR_PIECE // max(1, q.codes.size // rows))
    sums = np.zeros((-(-rows // step), 2), np.float64)  # (signal, noise) of each piece

    # per-channel (axis 0) and blockwise weights of zero point 0: a compiled pass
    loops = jit.loops() if q.channel_dim == 0 and not np.any(q.zero_point) else None
    scale = np.asarray(q.scale, np.float32).reshape(rows, -1) if loops else None

    def pieces(first: int, last: int) -> None:
        for start in range(first, last, step):
            stop = min(last, start + step)
            if loops is not None:  # the same float32 residuals, in one compiled pass
                rows_w = np.ascontiguousarray(weight[start:stop], np.float32).reshape(stop - start, -1)
                rows_d = np.empty_like(rows_w)
                loops.residual(rows_w, q.codes[start:stop].reshape(stop - start, -1), scale[start:stop],  # type: ignore[index]
                               rows_d)
                w, d = rows_w.ravel(), rows_d.ravel()
            else:
                w = np.take(weight, range(start, stop), axis=axis).astype(np.float32).ravel()
                d = w - _rows(q, start, stop).dequantize().ravel()
            sums[start // step] = np.dot(w, w), np.dot(d, d)

    for_ranges(pieces, rows, step)
    signal, noise = (float(x) for x in np.add.reduce(sums, axis=0))  # pairwise, in piece order
    if noise == 0:
        return float("inf")
    with np.errstate(divide="ignore"):
        return float(10.0 * np.log10(signal / noise))


def _rows(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Output channels ``start:stop`` of a per-channel or blockwise weight."""
    axis = q.channel_dim or 0
    codes = np.take(q.codes, range(start, stop), axis=axis)
    scale = np.asarray(q.scale)[start:stop]
    return QuantizedTensor(q.datatype, codes, scale, q.zero_point, channel_dim=q.channel_dim,
                           group_size=q.group_size)


def linear_refusal(scheme: WeightScheme, in_features: int) -> str | None:
    """Why a linear with ``in_features`` inputs cannot take ``scheme`` (None: it can)."""
    if scheme.kind is SchemeKind.QB4W and in_features % int(scheme.group_size or 0):
        valid = ", ".join(map(str, valid_group_sizes(in_features))) or "none"
        return (f"group size {scheme.group_size} does not divide in_features {in_features} "
                f"(group sizes that do: {valid})")
    if scheme.kind is SchemeKind.QC4W and in_features % 2:
        return (f"qc4w with an odd in_features ({in_features}) is computed wrongly by XNNPACK's "
                "dynamically quantized int4 kernels")
    return None


def conv_refusal(scheme: WeightScheme, depthwise: bool) -> str | None:
    """Why a convolution cannot take ``scheme`` (None: it can)."""
    if not scheme.is_quantized:
        return None
    if depthwise:
        return "XNNPACK has no dynamically quantized depthwise convolution"
    if scheme.is_4bit:
        return "XNNPACK has no 4-bit convolution (its quantized convolutions take int8 filters)"
    return None
