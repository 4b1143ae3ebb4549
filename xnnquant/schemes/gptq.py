"""GPTQ-style error compensation: codes that minimise a linear layer's output error.

The problem, for a weight ``w`` ``[C, K]`` and the Gram matrix ``G = X^T X`` of its
calibration inputs (``calibration``)::

    minimise  sum_r (w[r] - wq[r]) @ H @ (w[r] - wq[r])      H = G + damp * mean(diag G) * I

over ``wq = codes * scale`` with integer codes in ``[qmin, qmax]`` and one scale per group
of columns.  Rows are independent; all rows are processed together, one column at a time.

**Column by column.**  Quantizing column ``j`` alone (rounding to its group's scale)
leaves an error ``delta = w[:, j] - wq[:, j]``.  With ``j`` fixed, the best change of the
columns ``F`` not yet quantized is the least-squares correction
``w[:, F] -= delta / Hinv_jj * Hinv_jF`` with ``Hinv = inverse(H restricted to {j} + F)``,
and it costs ``delta**2 / Hinv_jj`` per row.  Writing ``inverse(H) = U^T U`` with ``U`` upper
triangular (columns in processing order), row ``j`` of ``U`` holds exactly those numbers
for every ``j`` at once: ``Hinv_jF / sqrt(Hinv_jj) = U[j, F]`` and ``Hinv_jj = U[j, j]**2``.
So, with ``e = delta / U[j, j]``::

    w[:, F] -= e[:, None] * U[j, F]            loss += sum(e**2)

``U`` comes from one Cholesky factorisation of ``H`` (``inverse_cholesky``).  Updates to
columns beyond the current block of ``BLOCK`` columns are deferred and applied at the end of
the block as one matrix product (``e_block @ U[block, after]``): the same sums, grouped.

**Order.**  Columns may be processed in any order (``H``, ``U`` and ``w`` permuted alike,
the codes permuted back): a column's group, hence its scale, does not depend on when it
is quantized, so the qbint4 format (contiguous groups, no permutation of the inputs)
carries any order.  ``order="act"`` takes columns by decreasing ``H_jj`` (input energy):
the columns whose errors matter most are quantized while the most columns remain to
absorb their errors.

**Scales.**  A group's scale must be known when its first column is quantized; by
default it is chosen then (``scales=None``), from the current (already error-updated)
values of the group's columns ``x`` ``[C, g]``, searching candidate scales for the least::

    e^T S e,   S = (A^T A)^-1,   A = U[j:, group columns],   e = x - s * round(x / s)

``S`` is ``H`` reduced to the group's columns with every later column free to compensate
(the Schur complement): ``e^T S e`` is the loss this group's rounding leaves after the best
possible continuous correction of everything not yet quantized.  Given ``scales`` are
used for every group instead.  A final least-squares re-fit (``refit_scales``) then
rescales each row's groups, codes fixed.

**Measured** (``benchmarks/activation_aware.py``; all-MiniLM-L6-v2, 36 linears, qb4w g32,
calibrated on 7,622 tokens, held-out layer-output SQNR; ``mse`` gives 23.51 dB): the
defaults give 28.84 dB.  Alternatives: natural column order 28.59; no re-fit 28.71;
act_mse scales fixed up front 28.48; at first use, weighting the search by ``diag(H)`` or
by ``1 / U_jj**2`` instead of ``S`` (natural order, no re-fit): 28.24 and 28.40 against
28.47; dampening 0.001 / 0.003 / 0.03 / 0.1:
28.81 / 28.83 / 28.83 / 28.64; a second and third pass of GPTQ on the re-fitted scales
(each re-fitted again): 28.88 and 28.89, at two and three times the cost, not done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..errors import XnnquantError
from .search import finish_scales
from .weighted_search import NARROW_RATIOS, Cost, quadratic_cost, search_scales

#: Columns per block of deferred updates.
BLOCK = 64
#: Size below which ``lower_inverse`` inverts directly.
_LEAF = 64
#: Dampening retries: each multiplies the dampening by 10 when Cholesky fails.
DAMP_RETRIES = 4


@dataclass(frozen=True)
class GptqSettings:
    """How ``gptq`` runs (the defaults are the measured best, see the module doc).
    ``damp``: added to ``diag(G)`` as a fraction of its mean; ``order``: "natural"
    (column 0 first) or "act" (decreasing input energy); ``refit``: least-squares re-fit
    of the scales after the pass (kept per row only where it lowers the loss)."""

    damp: float = 0.01
    order: Literal["natural", "act"] = "act"
    refit: bool = True


def dampened(gram: np.ndarray, damp: float) -> np.ndarray:
    """``gram + damp * mean(diag(gram)) * I`` (float64 ``(K, K)``); an all-zero ``gram``
    (inputs always zero) becomes ``damp * I``, so the loss is plain weight error."""
    mean = float(np.mean(np.diag(gram)))
    h = np.array(gram, np.float64)
    h[np.diag_indices_from(h)] += damp * (mean if mean > 0 else 1.0)
    return h


def inverse_cholesky(gram: np.ndarray, damp: float) -> tuple[np.ndarray, float]:
    """Upper triangular ``U`` with ``U^T U = inverse(dampened(gram, damp))``, and the
    dampening used: when Cholesky fails (``gram`` not positive definite even dampened,
    e.g. rounding on a near-singular matrix), ``damp`` is raised tenfold, up to
    ``DAMP_RETRIES`` times, then ``XnnquantError``.  Never a ``LinAlgError``."""
    k = gram.shape[0]
    flip = np.arange(k)[::-1]
    for attempt in range(DAMP_RETRIES + 1):
        used = damp * 10.0**attempt if damp > 0 else 1e-6 * 10.0**attempt
        try:
            # With P the reversal of the columns, P H P = L L^T (lower L) gives H = R R^T
            # with R = P L P upper, hence inverse(H) = R^-T R^-1 and U = R^-1 = P L^-1 P.
            low = np.linalg.cholesky(dampened(gram, used)[np.ix_(flip, flip)])
            upper = lower_inverse(low)[np.ix_(flip, flip)]
        except np.linalg.LinAlgError:
            continue
        if np.all(np.isfinite(upper)):
            return upper, used
    raise XnnquantError(
        f"calibration statistics are not usable: the Gram matrix ({k} x {k}) is not positive definite even "
        f"with dampening {damp * 10.0**DAMP_RETRIES:g} x mean(diag); expected finite activations of the "
        "layer's input"
    )


def lower_inverse(low: np.ndarray) -> np.ndarray:
    """Inverse of a lower triangular ``low`` ``(n, n)`` float64, lower triangular.

    By halves: ``inverse([[A, 0], [B, C]]) = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``, about
    ``2 n^3 / 3`` flops in matrix products (a general inverse takes ``2 n^3``).
    """
    n = len(low)
    if n <= _LEAF:
        return np.tril(np.linalg.inv(low))
    half = n // 2
    top, bottom = lower_inverse(low[:half, :half]), lower_inverse(low[half:, half:])
    out = np.zeros_like(low)
    out[:half, :half] = top
    out[half:, half:] = bottom
    out[half:, :half] = -bottom @ (low[half:, :half] @ top)
    return out


def column_order(energy: np.ndarray, group_size: int, order: str) -> np.ndarray:
    """Processing order of the ``K`` columns: ``(K,)`` int64 permutation.

    "natural": ``0, 1, ..., K - 1``; "act": by decreasing ``energy`` (``diag(H)``), ties by
    index.
    """
    if order == "act":
        return np.argsort(-energy, kind="stable")
    return np.arange(len(energy))


def gptq(w: np.ndarray, gram: np.ndarray, group_size: int, qmin: int, qmax: int, bf16: bool,
         settings: GptqSettings = GptqSettings(), scales: np.ndarray | None = None,
         ) -> tuple[np.ndarray, np.ndarray]:
    """Error-compensated codes of ``w`` ``[C, K]`` and their scales (see the module doc).

    ``gram``: float64 ``(K, K)``, ``X^T X`` of the calibration inputs.  ``group_size``: the
    columns that share a scale (``K`` for per-channel).  ``scales`` (float32
    ``(C, K // group_size)``), when given, are used for every group instead of choosing
    each at its first use.

    Returns codes float64 ``[C, K]`` (integers in ``[qmin, qmax]``) and scales float32
    ``(C, K // group_size)`` (positive normal; bf16 values when ``bf16``).
    """
    c, k = w.shape
    n_groups = k // group_size
    perm = column_order(np.diag(gram), group_size, settings.order)
    u, damp = inverse_cholesky(gram[np.ix_(perm, perm)], settings.damp)
    h = dampened(gram, damp)
    position = np.argsort(perm)  # position[column] = when it is processed
    group_of = perm // group_size  # group of the column processed at each position
    # Column j of the weight is row j of ``work`` (contiguous), in processing order.
    work = np.array(w, np.float64)[:, perm].T.copy()
    chosen = np.full(n_groups, scales is not None)
    scales = np.ones((c, n_groups), np.float32) if scales is None else scales.copy()
    row_scales = scales.T.astype(np.float64)  # (G, C)
    codes = np.empty((k, c))
    err = np.empty((BLOCK, c))
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        for j in range(start, stop):
            group = group_of[j]
            if not chosen[group]:
                cols = position[group * group_size:(group + 1) * group_size]
                current = work[cols]
                later = cols >= stop  # columns past this block still miss this block's updates
                if later.any():
                    current[later] -= u[start:j, cols[later]].T @ err[: j - start]
                found = search_scales(current.T, _schur_cost(u[j:, cols]), qmin, qmax, bf16, NARROW_RATIOS)
                scales[:, group] = found
                row_scales[group] = found
                chosen[group] = True
            s = row_scales[group]
            q = np.clip(np.rint(work[j] / s), qmin, qmax)
            codes[j] = q
            e = err[j - start]
            np.subtract(work[j], q * s, out=e)
            e /= u[j, j]
            work[j + 1:stop] -= np.outer(u[j, j + 1:stop], e)
        work[stop:] -= u[start:stop, stop:].T @ err[: stop - start]
    codes = codes.T[:, position]
    if settings.refit:
        scales = refit_scales(np.asarray(w, np.float64), codes, scales, h, group_size, bf16)
    return codes, scales


def _schur_cost(a: np.ndarray) -> Cost:
    """``e^T (A^T A)^-1 e`` for ``a`` ``(rows, g)`` of full column rank."""
    return quadratic_cost(np.linalg.inv(a.T @ a))


def refit_scales(w: np.ndarray, codes: np.ndarray, scales: np.ndarray, h: np.ndarray, group_size: int,
                 bf16: bool) -> np.ndarray:
    """Each row's group scales re-fitted by least squares, codes fixed.

    Per row, ``wq = sum_a s_a q_a`` (``q_a`` the codes of group ``a``, zero elsewhere), so
    the loss ``(w - wq)^T h (w - wq) = s^T M s - 2 s^T v + w^T h w`` is quadratic in ``s``,
    with ``M_ab = q_a^T h q_b``, ``v_a = q_a^T h w``: its minimum solves ``M s = v``.  The
    solution is made positive normal (bf16 if asked); a row keeps its old scales unless the
    new ones lower its loss (rounding to bf16 can undo a tiny gain).
    """
    c, k = w.shape
    n_groups = k // group_size
    v = ((w @ h) * codes).reshape(c, n_groups, group_size).sum(-1)  # (C, G)
    m = np.empty((c, n_groups, n_groups))
    for a in range(n_groups):
        cols = slice(a * group_size, (a + 1) * group_size)
        m[:, a, :] = ((codes[:, cols] @ h[cols, :]) * codes).reshape(c, n_groups, group_size).sum(-1)
    old = scales.astype(np.float64)
    # A tiny ridge towards the old scales keeps groups whose codes are all zero (M_aa = 0)
    # where they are, and every system solvable (a row of zero codes keeps its scales).
    size = np.trace(m, axis1=1, axis2=2) / n_groups
    ridge = 1e-12 * np.where(size > 0, size, 1.0)
    eye = np.eye(n_groups)[None] * ridge[:, None, None]
    fitted = np.linalg.solve(m + eye, (v + ridge[:, None] * old)[..., None])[..., 0]
    usable = np.isfinite(fitted) & (fitted > 0)
    new = finish_scales(np.where(usable, fitted, old).astype(np.float32), np.zeros(fitted.shape, bool), bf16)

    def loss(s: np.ndarray) -> np.ndarray:  # without the constant w^T h w
        return np.einsum("ca,cab,cb->c", s, m, s) - 2 * np.einsum("ca,ca->c", s, v)

    better = loss(new.astype(np.float64)) < loss(old)
    return np.where(better[:, None], new, scales).astype(np.float32)
