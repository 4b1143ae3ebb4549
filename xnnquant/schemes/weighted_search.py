"""Scale search under a weighted error: what an error costs at the layer's output.

``search_scales(x, cost, ...)`` chooses one scale per block of ``x`` ``(N, g)`` float64
among candidates, for the least ``cost(e)``, ``e = x - s * clip(rint(x / s), qmin, qmax)``.
It is ``search.mse_scales`` (same two stages of candidates, each made a positive normal
float and rounded to bf16 when the runtime reads bf16 before it is scored) with the plain
squared error replaced by a cost that knows the inputs:

* ``diagonal_cost(d)``: ``sum_b d_b e_b**2``, ``d`` the inputs' energy per column
  (``diag(X^T X)``): errors in columns that meet large activations cost more;
* ``quadratic_cost(m)``: ``e^T M e`` for a symmetric positive definite ``M`` ``(g, g)``
  shared by every block: the exact output error ``|X e|**2`` when ``M = X^T X`` restricted
  to the block's columns (correlated inputs included).

``act_mse`` (``activation_aware``) uses the quadratic cost with each group's diagonal block
of ``X^T X``; GPTQ uses it with the Schur complement its error compensation leaves (see
``gptq``).  Arithmetic is float64: the search compares costs that may differ in the
7th digit, and candidates are computed as in ``search`` (float32, then bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .search import COARSE_RATIOS, FINE_FACTORS, finish_scales, half_range

#: ``cost(e)``: errors ``(R, N, g)`` of R candidates for N blocks -> costs ``(R, N)``.
Cost = Callable[[np.ndarray], np.ndarray]


def diagonal_cost(d: np.ndarray) -> Cost:
    """``sum_b d[..., b] * e**2``; ``d`` float64 ``(g,)`` or ``(N, g)``."""
    return lambda e: np.einsum("rnb,rnb,...nb->rn", e, e, np.broadcast_to(d, e.shape[1:]))


def quadratic_cost(m: np.ndarray) -> Cost:
    """``e^T M e`` for one symmetric positive definite ``M`` float64 ``(g, g)``.

    Computed as ``|e @ T|**2`` with ``M = T T^T`` (Cholesky), one matrix product for all
    candidates and blocks.
    """
    t = np.linalg.cholesky(m)

    def cost(e: np.ndarray) -> np.ndarray:
        y = e.reshape(-1, e.shape[-1]) @ t
        return np.einsum("ij,ij->i", y, y).reshape(e.shape[:-1])

    return cost


def _errors(x: np.ndarray, scales: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """``x - s * clip(rint(x / s))`` for candidates ``scales`` ``(R, N)``: float64 ``(R, N, g)``."""
    s = scales[..., None]
    return x[None] - np.clip(np.rint(x[None] / s), qmin, qmax) * s


def search_scales(x: np.ndarray, cost: Cost, qmin: int, qmax: int, bf16: bool) -> np.ndarray:
    """Least-cost scale of each block of ``x`` ``(N, g)`` float64 -> float32 ``(N,)``.

    Candidates (as ``search.mse_scales``): ratios ``COARSE_RATIOS`` of the min-max scale
    and the no-clipping scale, then the best one times ``FINE_FACTORS``.  The min-max
    scale is the first candidate and ties keep the earlier one.  All-zero blocks get 1.0.
    """
    cols = np.arange(len(x))
    maxpos = np.maximum(x.max(axis=-1), 0)
    maxneg = np.maximum(-x.min(axis=-1), 0)
    base = np.maximum(maxpos, maxneg) / float(half_range(qmin, qmax))
    all_zero = base == 0
    no_clip = np.maximum(maxpos / qmax, maxneg / -qmin)
    raw = np.concatenate([COARSE_RATIOS[:, None] * base[None], no_clip[None]])
    cand = finish_scales(raw.astype(np.float32), all_zero[None], bf16).astype(np.float64)
    best = cost(_errors(x, cand, qmin, qmax)).argmin(axis=0)
    kept = cand[best, cols]
    fine_raw = FINE_FACTORS[:, None] * kept[None].astype(np.float32)
    fine = np.concatenate([kept[None], finish_scales(fine_raw, all_zero[None], bf16).astype(np.float64)])
    best = cost(_errors(x, fine, qmin, qmax)).argmin(axis=0)
    return fine[best, cols].astype(np.float32)
