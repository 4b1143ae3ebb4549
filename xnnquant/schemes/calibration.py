"""Activation statistics for activation-aware quantization: ``Calibration``.

A linear layer ``y = x @ w.T`` with weight ``w`` ``[N, K]`` sees inputs ``x`` ``(tokens, K)``.
Replacing ``w`` by ``w_q`` changes the outputs by ``x @ (w - w_q).T``, whose squared norm
over a set of inputs is, row ``n`` of the weight at a time::

    sum_tokens |x @ (w - w_q).T|**2 = sum_n (w[n] - w_q[n]) @ G @ (w[n] - w_q[n])
    G = x.T @ x                         (the Gram matrix, K x K, symmetric, PSD)

so ``G`` (with the token count, to normalise it) is all that an activation-aware method
needs to know about the inputs: accumulate it, not the activations.  ``Calibration``
does that batch by batch, summing in float64.

How other parts of the library use it (the API is stable)::

    cal = Calibration(in_features)           # one per linear layer (layers that share an
    for x in batches:                        # input may share one Calibration)
        cal.add(x)                           # x float (..., in_features), numpy or torch
        cal.add(h, mask=attention_mask)      # or: only the rows where mask (...) is True
    qt = xq.quantize_blockwise(w, 32, method="gptq", calibration=cal)

``calibration=`` of ``quantize_blockwise`` / ``quantize_per_channel`` also takes a float
array ``(tokens, in_features)`` directly; it is turned into a ``Calibration`` by
``as_calibration``.  ``Calibration(..., runtime_quantized=True)`` accumulates the inputs
as XNNPACK's dynamic path multiplies them: each row quantized per token to int8
(``quantize_per_token``, bit-exact with XNNPACK) and dequantized.

Too few tokens: ``G`` of ``T < K`` tokens has rank at most ``T``, so it says nothing about
``K - T`` directions.  The methods dampen ``G`` (add a multiple of its mean diagonal) and
work with any ``T >= 1``, but below ``MIN_TOKENS_PER_FEATURE * K`` tokens (``G`` rank
deficient) they warn (``CalibrationWarning``).  A ``Calibration`` with no tokens at all is
refused.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput, as_float32, check_finite, to_numpy
from ..compute.blas import one_blas_thread
from ..compute.parallel import for_ranges
from ..errors import XnnquantError, warn_caller
from .checks import check_int, float_input

#: Rows per float32 product (see ``Calibration.add``).
CHUNK_ROWS = 1024
#: Columns per block of the Gram matrix summed as one piece (see ``Calibration.add``).
GRAM_BLOCK = 128
#: Below ``MIN_TOKENS_PER_FEATURE * in_features`` calibration tokens the methods warn.
MIN_TOKENS_PER_FEATURE = 1.0


class CalibrationWarning(UserWarning):
    """Calibration data too small for a reliable estimate (the result may be poor)."""


class Calibration:
    """Statistics of the inputs of one linear layer, accumulated batch by batch.

    ``in_features``: the width ``K`` of the inputs (the weight's second dimension).
    ``runtime_quantized``: accumulate each row as XNNPACK's dynamic fully connected
    sees it, ``dequantize(quantize_per_token(x))``, instead of ``x``.

    Attributes: ``tokens`` (rows accumulated so far), ``gram`` (float64 ``(K, K)``,
    ``sum x^T x`` over those rows; read-only view).
    """

    def __init__(self, in_features: int, *, runtime_quantized: bool = False) -> None:
        k = check_int(in_features, "in_features")
        if k < 1:
            raise XnnquantError(f"in_features must be positive: got {k}")
        if not isinstance(runtime_quantized, bool):
            raise XnnquantError(f"runtime_quantized must be True or False: got {runtime_quantized!r}")
        self.in_features = k
        self.runtime_quantized = runtime_quantized
        self.tokens = 0
        self._gram = np.zeros((k, k), np.float64)

    @classmethod
    def from_array(cls, x: ArrayInput, *, runtime_quantized: bool = False) -> Calibration:
        """A ``Calibration`` of the rows of ``x`` float ``(..., in_features)``."""
        arr = float_input(x, "calibration", min_rank=1)
        return cls(arr.shape[-1], runtime_quantized=runtime_quantized).add(arr)

    @property
    def gram(self) -> np.ndarray:
        """``sum x^T x`` over every accumulated row: float64 ``(K, K)``, read-only."""
        view = self._gram.view()
        view.flags.writeable = False
        return view

    def add(self, x: ArrayInput, mask: ArrayInput | None = None) -> Calibration:
        """Accumulate the rows of ``x`` float ``(..., K)`` (fp32/fp16/bf16, numpy or torch).

        ``mask`` (bool, shape ``x.shape[:-1]``), when given, keeps only the rows where it
        is True (e.g. real tokens, not padding); rows it drops are not read at all.
        Returns ``self``.

        ``X^T X`` is summed in pieces: for each chunk of up to ``CHUNK_ROWS`` rows and each
        pair of column blocks ``I <= J`` (``GRAM_BLOCK`` wide), ``X[:, I]^T X[:, J]`` is
        multiplied in float32 (twice the speed of float64; relative error ~1e-6 of the
        chunk's sum, far below the dampening the methods add) and added to ``gram[I, J]``
        in float64, chunk after chunk; the blocks below the diagonal are the mirror of
        those above.  The block pairs run on every core, each adding to its own block in
        chunk order, so the sums do not depend on the number of threads.

        Non-finite rows are found by one look at the new diagonal (``sum x_k^2`` is NaN or
        inf exactly when column ``k`` met a NaN or inf, or values beyond ~1.8e19 whose
        squares overflow float32); the statistics are then left as they were and
        ``XnnquantError`` names the first bad value.
        """
        given = to_numpy(x, "calibration")
        arr: np.ndarray = as_float32(given, "calibration", finite=False).reshape(given.shape)
        if arr.ndim < 1 or arr.size == 0:
            raise XnnquantError(f"calibration is empty or a scalar: got shape {arr.shape}, expected (..., in_features) "
                                "with at least one row")
        if arr.shape[-1] != self.in_features:
            raise XnnquantError(
                f"calibration has the wrong width: got {arr.shape[-1]} features (shape {arr.shape}), "
                f"expected in_features={self.in_features}"
            )
        rows = arr.reshape(-1, self.in_features)
        keep = None
        if mask is not None:
            keep = to_numpy(mask, "mask")
            if keep.dtype != np.bool_ or keep.shape != arr.shape[:-1]:
                raise XnnquantError(
                    f"mask must be bool of shape {arr.shape[:-1]} (x.shape[:-1]): "
                    f"got {keep.dtype} of shape {keep.shape}"
                )
            rows = rows[keep.reshape(-1)]
        if self.runtime_quantized and len(rows):
            from .per_token import quantize as quantize_per_token

            if not np.isfinite(rows).all():  # the per-token scales need finite rows
                _refuse_non_finite(arr, keep)
            rows = quantize_per_token(rows).dequantize()
        if len(rows):
            gram = accumulated_gram(self._gram, rows)
            if not np.isfinite(np.diagonal(gram)).all():
                _refuse_non_finite(arr, keep)
                raise XnnquantError(
                    "calibration values are too large: some |x| > 1.8e19, whose square overflows the float32 "
                    "products; expected activations of a usable model")
            self._gram = gram
        self.tokens += len(rows)
        return self

    def __repr__(self) -> str:
        runtime = ", runtime_quantized=True" if self.runtime_quantized else ""
        return f"Calibration(in_features={self.in_features}{runtime}, tokens={self.tokens})"


def _refuse_non_finite(arr: np.ndarray, keep: np.ndarray | None) -> None:
    """Raise naming the first NaN or inf of ``arr`` among the rows ``keep`` selects (if any)."""
    check_finite(arr if keep is None else np.where(keep[..., None], arr, np.float32(0)), "calibration")


def accumulated_gram(gram: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A new float64 ``(K, K)``: ``gram + rows^T rows`` summed as ``Calibration.add`` says,
    for ``rows`` float32 ``(T, K)``."""
    k = gram.shape[0]
    starts = list(range(0, k, GRAM_BLOCK))
    pairs = [(i, j) for n, i in enumerate(starts) for j in starts[n:]]
    out = np.empty_like(gram)

    def blocks(first: int, last: int) -> None:
        for i, j in pairs[first:last]:
            rows_i, cols_j = slice(i, i + GRAM_BLOCK), slice(j, j + GRAM_BLOCK)
            total = gram[rows_i, cols_j].copy()
            for start in range(0, len(rows), CHUNK_ROWS):
                part = rows[start:start + CHUNK_ROWS]
                total += part[:, rows_i].T @ part[:, cols_j]
            out[rows_i, cols_j] = total
            if i != j:
                out[cols_j, rows_i] = total.T

    with one_blas_thread():
        for_ranges(blocks, len(pairs), 1)
    return out


def as_calibration(calibration: Calibration | ArrayInput, in_features: int) -> Calibration:
    """``calibration`` (a ``Calibration`` or a float array ``(tokens, in_features)``),
    checked against the weight's ``in_features`` and for having tokens."""
    if isinstance(calibration, Calibration):
        cal = calibration
    else:
        cal = Calibration.from_array(calibration)
    if cal.in_features != in_features:
        raise XnnquantError(
            f"calibration width does not match the weight: got {cal.in_features} features, "
            f"expected in_features={in_features}"
        )
    if cal.tokens == 0:
        raise XnnquantError("calibration has no tokens: got 0 rows, expected at least 1 (add inputs first)")
    needed = MIN_TOKENS_PER_FEATURE * in_features
    if cal.tokens < needed:
        warn_caller(f"calibration has few tokens: got {cal.tokens}, expected at least {needed:.0f} for "
                    f"in_features={in_features}; the estimate is dampened but may be no better than method='mse'",
                    CalibrationWarning)
    return cal
