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
``gptq``).  Candidates are computed as in ``search`` (float32, then bf16).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..compute.parallel import for_ranges
from .search import COARSE_RATIOS, FINE_FACTORS, coarse_candidates, finish_scales

#: Narrower stage-1 ratios for GPTQ, whose error compensation follows the choice: on the
#: 36 MiniLM linears (qb4w g32, held-out layer outputs) 28.845 dB against 28.836 dB with
#: ``COARSE_RATIOS``, at 15 candidates instead of 36 (for ``act_mse`` alone the narrow set
#: loses 0.06 dB).
NARROW_RATIOS = np.concatenate([[1.0], np.arange(0.6, 1.21, 0.05)]).astype(np.float32)
#: Rows per range when the search is spread over the cores.
_ROWS_PER_TASK = 64
#: ``cost(e)``: errors float32 ``(R, N, g)`` of R candidates for N blocks -> costs ``(R, N)``.
Cost = Callable[[np.ndarray], np.ndarray]


def diagonal_cost(d: np.ndarray) -> Cost:
    """``sum_b d[b] * e**2`` for weights ``d`` ``(g,)`` shared by every block."""
    d32 = np.asarray(d, np.float32)
    return lambda e: (e * e) @ d32


def quadratic_cost(m: np.ndarray) -> Cost:
    """``e^T M e`` for one symmetric positive definite ``M`` float64 ``(g, g)``.

    Computed as ``|e @ T|**2`` with ``M = T T^T`` (Cholesky), one matrix product for all
    candidates and blocks.
    """
    t = np.linalg.cholesky(m).astype(np.float32)

    def cost(e: np.ndarray) -> np.ndarray:
        y = e.reshape(-1, e.shape[-1]) @ t
        return np.einsum("ij,ij->i", y, y).reshape(e.shape[:-1])

    return cost


def _errors(x: np.ndarray, scales: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """``x - s * clip(rint(x / s))`` for candidates ``scales`` ``(R, N)``: float32 ``(R, N, g)``."""
    s = scales[..., None]
    e = x[None] / s
    np.rint(e, out=e)
    np.clip(e, qmin, qmax, out=e)
    e *= s
    np.subtract(x[None], e, out=e)
    return e


def search_scales(x: np.ndarray, cost: Cost, qmin: int, qmax: int, bf16: bool,
                  ratios: np.ndarray = COARSE_RATIOS, parallel: bool = True) -> np.ndarray:
    """Least-cost scale of each block of ``x`` ``(N, g)`` -> float32 ``(N,)``.

    Candidates (as ``search.mse_scales``): ``ratios`` of the min-max scale (1.0 first) and
    the no-clipping scale, then the best one times ``FINE_FACTORS``.  Ties keep the earlier
    candidate.  All-zero blocks get 1.0.  Errors and costs are float32 (they only rank
    candidates; the codes themselves are computed by the caller); blocks are searched in
    ranges of rows on every core (``parallel``), each on its own, so the result does not
    depend on the number of threads.  ``parallel=False`` searches in the calling thread
    (for a caller that spreads its own work over the cores).
    """
    x32 = np.ascontiguousarray(x, np.float32)
    out = np.empty(len(x32), np.float32)

    def search_rows(start: int, stop: int) -> None:
        out[start:stop] = _search(x32[start:stop], cost, qmin, qmax, bf16, ratios)

    if parallel:
        for_ranges(search_rows, len(x32), _ROWS_PER_TASK)
    else:
        for lo in range(0, len(x32), _ROWS_PER_TASK):
            search_rows(lo, min(len(x32), lo + _ROWS_PER_TASK))
    return out


def _search(x: np.ndarray, cost: Cost, qmin: int, qmax: int, bf16: bool, ratios: np.ndarray) -> np.ndarray:
    cols = np.arange(len(x))
    raw, all_zero, _, _ = coarse_candidates(x, qmin, qmax, ratios)
    cand = finish_scales(raw, all_zero[None], bf16)
    best = cost(_errors(x, cand, qmin, qmax)).argmin(axis=0)
    kept = cand[best, cols]
    fine = np.concatenate([kept[None], finish_scales(FINE_FACTORS[:, None] * kept[None], all_zero[None], bf16)])
    best = cost(_errors(x, fine, qmin, qmax)).argmin(axis=0)
    return fine[best, cols]
