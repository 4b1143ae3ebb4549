"""GPTQ-style error compensation: codes that minimise a linear layer's output error.

The problem, for a weight ``w`` ``[C, K]`` and the Gram matrix ``G = X^T X`` of its
calibration inputs (``calibration``)::

    minimise  sum_r (w[r] - wq[r]) @ H @ (w[r] - wq[r])      H = G + damp * mean(diag G) * I

over ``wq = codes * scale`` with integer codes in ``[qmin, qmax]`` and one scale per group
of columns.  Rows are independent: a piece of rows per core, each processed one column at
a time (numba compiles the column loop when installed, the same float64 operations).

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

from ..compute import jit
from ..compute.blas import one_blas_thread
from ..compute.parallel import for_ranges, num_threads
from ..errors import XnnquantError
from .search import finish_scales
from .weighted_search import NARROW_RATIOS, Cost, quadratic_cost, search_scales

#: Columns per block of deferred updates.
BLOCK = 64
#: Least weight rows per piece of work (GPTQ's pass and the re-fit treat rows independently).
ROWS = 64
#: Size below which ``lower_inverse`` inverts directly.
_LEAF = 64
#: Columns from which ``lower_inverse``'s products are shared out over the cores.
_PARALLEL = 256
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
    out[half:, :half] = _product(-bottom, _product(low[half:, :half], top))
    return out


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` float64, the result's columns shared out over the cores from ``_PARALLEL``
    columns on (each column is the same product of ``a`` with one column of ``b``)."""
    if b.shape[1] < _PARALLEL:
        return a @ b
    out = np.empty((a.shape[0], b.shape[1]))

    def columns(lo: int, hi: int) -> None:
        out[:, lo:hi] = a @ b[:, lo:hi]

    for_ranges(columns, b.shape[1], _LEAF)
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

    Rows are independent (each row's errors go to the same row's later columns), so they
    are processed in pieces, one per core (``piece_rows``, ``for_ranges``); each row's
    values are the same whatever the cut (a test compares pieces of ``ROWS``, one piece,
    and one thread with two).  numpy's BLAS stays on one thread meanwhile (``compute.blas``).
    """
    c, k = w.shape
    with one_blas_thread():
        perm = column_order(np.diag(gram), group_size, settings.order)
        u, damp = inverse_cholesky(gram[np.ix_(perm, perm)], settings.damp)
        plan = _Plan(u, perm, group_size, qmin, qmax, bf16)
        if scales is None:
            plan.costs = _group_costs(plan)
        codes = np.empty((c, k))
        out = np.ones((c, k // group_size), np.float32) if scales is None else np.array(scales, np.float32)
        given = scales is not None

        step = piece_rows(c)

        def pieces(first: int, last: int) -> None:
            for lo in range(first, last, step):
                hi = min(last, lo + step)
                codes[lo:hi] = _compensate(np.asarray(w[lo:hi], np.float64), plan, out[lo:hi], given)

        for_ranges(pieces, c, step)
        if settings.refit:
            out = refit_scales(w, codes, out, dampened(gram, damp), group_size, bf16)
    return codes, out


class _Plan:
    """What every piece of rows shares: ``u`` (columns in processing order), the order,
    each processed column's group, and each group's scale-search cost (``costs``: the
    group's Schur complement at its first column, ``_group_costs``)."""

    def __init__(self, u: np.ndarray, perm: np.ndarray, group_size: int, qmin: int, qmax: int, bf16: bool) -> None:
        self.u, self.perm, self.group_size = u, perm, group_size
        self.qmin, self.qmax, self.bf16 = qmin, qmax, bf16
        self.position = np.argsort(perm)  # position[column] = when it is processed
        self.group_of = (perm // group_size).astype(np.int64)  # group of the column processed at each position
        groups = len(perm) // group_size
        #: position of each group's first processed column
        self.first = self.position.reshape(groups, group_size).min(axis=1)
        self.costs: list[Cost] = []


def _group_costs(plan: _Plan) -> list[Cost]:
    """Each group's scale-search cost ``e^T (A^T A)^-1 e``, ``A = U[j:, group columns]``
    with ``j`` the group's first processed column (module doc, **Scales**)."""
    groups = len(plan.first)
    costs: dict[int, Cost] = {}

    def some(lo: int, hi: int) -> None:
        for group in range(lo, hi):
            cols = plan.position[group * plan.group_size:(group + 1) * plan.group_size]
            costs[group] = _schur_cost(plan.u[plan.first[group]:, cols])

    for_ranges(some, groups, 1)
    return [costs[group] for group in range(groups)]


def _compensate(w: np.ndarray, plan: _Plan, scales: np.ndarray, given: bool) -> np.ndarray:
    """GPTQ's pass over rows ``w`` float64 ``[R, K]``: their codes float64 ``[R, K]``; each
    group's scale written into ``scales`` ``(R, G)`` float32 at its first column unless
    ``given`` (then read from it)."""
    u, group_of, size = plan.u, plan.group_of, plan.group_size
    k = len(plan.perm)
    rows = len(w)
    # Column j of the weight is row j of ``work`` (contiguous), in processing order.
    work = np.ascontiguousarray(w[:, plan.perm].T)
    row_scales = np.ascontiguousarray(scales.T, np.float64)  # (G, R)
    codes = np.empty((k, rows))
    err = np.empty((BLOCK, rows))
    searches = set() if given else set(plan.first.tolist())
    loops = jit.loops()
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        j = start
        while j < stop:
            if j in searches:  # the first column of a group: choose the group's scales now
                group = int(group_of[j])
                cols = plan.position[group * size:(group + 1) * size]
                current = work[cols]
                later = cols >= stop  # columns past this block still miss this block's updates
                if later.any():
                    current[later] -= u[start:j, cols[later]].T @ err[: j - start]
                found = search_scales(current.T, plan.costs[group], plan.qmin, plan.qmax, plan.bf16, NARROW_RATIOS,
                                      parallel=False)
                scales[:, group] = found
                row_scales[group] = found
            end = j + 1
            while end < stop and end not in searches:
                end += 1
            if loops is not None:
                loops.gptq_columns(work, u, row_scales, group_of, codes, err, j, end, start, stop, float(plan.qmin),
                                   float(plan.qmax))
            else:
                _columns(work, u, row_scales, group_of, codes, err, j, end, start, stop, plan.qmin, plan.qmax)
            j = end
        work[stop:] -= u[start:stop, stop:].T @ err[: stop - start]
    return codes.T[:, plan.position]


def _columns(work: np.ndarray, u: np.ndarray, row_scales: np.ndarray, group_of: np.ndarray, codes: np.ndarray,
             err: np.ndarray, first: int, last: int, start: int, stop: int, qmin: int, qmax: int) -> None:
    """Columns ``first .. last - 1`` of the block ``start .. stop - 1`` (the numpy twin of
    ``compute.loops.gptq_columns``, which says what it computes)."""
    for j in range(first, last):
        s = row_scales[group_of[j]]
        q = np.clip(np.rint(work[j] / s), qmin, qmax)
        codes[j] = q
        e = err[j - start]
        np.subtract(work[j], q * s, out=e)
        e /= u[j, j]
        work[j + 1:stop] -= np.outer(u[j, j + 1:stop], e)


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
    new ones lower its loss (rounding to bf16 can undo a tiny gain).  ``M`` is symmetric:
    its blocks ``b >= a`` are computed, the others mirrored.  Rows go in pieces, one per
    core (``piece_rows``).
    """
    out = np.empty(scales.shape, np.float32)
    step = piece_rows(len(w))

    def pieces(first: int, last: int) -> None:
        for lo in range(first, last, step):
            hi = min(last, lo + step)
            out[lo:hi] = _refit_rows(np.asarray(w[lo:hi], np.float64), codes[lo:hi], scales[lo:hi], h,
                                     group_size, bf16)

    with one_blas_thread():
        for_ranges(pieces, len(w), step)
    return out


def piece_rows(rows: int) -> int:
    """Rows per piece: one piece per thread, at least ``ROWS`` rows (fewer, larger pieces
    spend less time in Python per row)."""
    return max(ROWS, -(-rows // num_threads()))


def _refit_rows(w: np.ndarray, codes: np.ndarray, scales: np.ndarray, h: np.ndarray, group_size: int,
                bf16: bool) -> np.ndarray:
    """``refit_scales`` of rows ``w``, ``codes`` float64 ``[R, K]``, ``scales`` float32 ``(R, G)``."""
    c, k = w.shape
    n_groups = k // group_size
    v = ((w @ h) * codes).reshape(c, n_groups, group_size).sum(-1)  # (C, G)
    m = np.empty((c, n_groups, n_groups))
    for a in range(n_groups):
        lo = a * group_size
        cols = slice(lo, lo + group_size)
        m[:, a, a:] = ((codes[:, cols] @ h[cols, lo:]) * codes[:, lo:]).reshape(c, n_groups - a, group_size).sum(-1)
        m[:, a + 1:, a] = m[:, a, a + 1:]
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
