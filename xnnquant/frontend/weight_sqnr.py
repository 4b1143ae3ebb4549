"""The SQNR of a stored weight against the float one, for the report's column, in pieces.

``weight_sqnr`` gives one figure; ``sqnr_rows``, ``sqnr_sums`` and ``sqnr_of`` give it from
pieces of rows, so a streaming export (``streaming.py``) that quantizes a few rows at a
time reports the figure the whole weight would give.
"""

from __future__ import annotations

import numpy as np

from ..compute import jit
from ..compute.parallel import for_ranges
from ..metrics import sqnr_db
from ..tensor import QuantizedTensor

#: Values of a weight compared at a time by ``weight_sqnr`` (256 KiB of float32).
SQNR_PIECE = 1 << 16


def weight_sqnr(weight: np.ndarray, q: QuantizedTensor | np.ndarray) -> float:
    """SQNR of the stored weight against the float one, in dB (inf when exact).

    A quantized weight is dequantized a few output channels at a time: each piece's sums
    of squares are float32 dot products of at most ``SQNR_PIECE`` values, added up in
    float64 in the order of the pieces, so a weight of any size costs a few hundred KiB of
    temporaries a thread (the figure agrees with ``metrics.sqnr_db`` to about 1e-5 dB).
    The residuals come from one compiled pass when numba is there (``jit``), the same
    float32 values as ``w - q.dequantize()``.  The pieces run on every core
    (``parallel.for_ranges``); each writes its own sums, so the figure does not depend on
    the threads.
    """
    if not isinstance(q, QuantizedTensor):
        return float("inf") if np.array_equal(q, weight) else float(sqnr_db(weight, q))
    return sqnr_of(sqnr_sums(weight, q))


def sqnr_rows(width: int) -> int:
    """Output channels of ``width`` values each that one of ``weight_sqnr``'s pieces takes."""
    return max(1, SQNR_PIECE // max(1, width))


def sqnr_sums(weight: np.ndarray, q: QuantizedTensor) -> np.ndarray:
    """The (signal, noise) sums of squares of ``weight_sqnr``'s pieces, float64 ``(pieces, 2)``
    in row order: the sums of rows ``a:b`` of a weight whose ``a`` is a multiple of
    ``sqnr_rows`` are the rows of its sums from ``a // sqnr_rows``."""
    axis = q.channel_dim or 0
    rows = q.shape[axis]
    step = sqnr_rows(q.codes.size // rows)
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
    return sums


def sqnr_of(sums: np.ndarray) -> float:
    """``weight_sqnr``'s figure from its pieces' sums (``sqnr_sums``)."""
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
