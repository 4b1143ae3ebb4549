"""GPTQ against a slow, obviously correct version of the same math.

The reference below is written from the least-squares argument alone: column by column,
float64, no Cholesky factor, no blocking, no deferred updates.  At each step it inverts
``H`` restricted to the columns not yet quantized (``F``, the current column first), and
applies the optimal correction of those columns for the current column's rounding error,
``w[:, F'] -= delta / Hinv[0, 0] * Hinv[0, F']``.  A group's scale is chosen when its first
column comes up, for the least ``e^T S e`` with ``S`` the Schur complement of ``H`` on the
group's columns given the others in ``F`` (``S = inverse(Hinv[group, group])``).

The library computes the same numbers through one Cholesky factorisation (rows of
``U``, ``U^T U = inverse(H)``) with updates grouped per block, so its floats differ in the
last bits.  Codes are compared for exact equality: a difference needs a value within
~1e-12 of a rounding boundary (x / s exactly at k + 1/2) or two candidate scales whose
costs tie to ~1e-12, which random data does not produce.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from xnnquant.schemes import gptq
from xnnquant.schemes.weighted_search import NARROW_RATIOS, quadratic_cost, search_scales

QMIN, QMAX = -8, 7


def slow_gptq(w: np.ndarray, h: np.ndarray, group_size: int, order: np.ndarray, bf16: bool,
              scales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    c, k = w.shape
    work = w.astype(np.float64).copy()
    codes = np.zeros((c, k))
    chosen = scales is not None
    scale = np.ones((c, k // group_size), np.float32) if scales is None else scales.copy()
    done = np.zeros(k // group_size, bool) | chosen
    remaining = list(order)
    for j in order:
        hinv = np.linalg.inv(h[np.ix_(remaining, remaining)])
        group = j // group_size
        if not done[group]:
            cols = [col for col in remaining if col // group_size == group]
            idx = [remaining.index(col) for col in cols]
            schur = np.linalg.inv(hinv[np.ix_(idx, idx)])
            found = search_scales(work[:, cols], quadratic_cost(schur), QMIN, QMAX, bf16, NARROW_RATIOS)
            scale[:, group] = found
            done[group] = True
        s = scale[:, group].astype(np.float64)
        q = np.clip(np.rint(work[:, j] / s), QMIN, QMAX)
        codes[:, j] = q
        delta = work[:, j] - q * s
        rest = remaining[1:]
        work[:, rest] -= np.outer(delta / hinv[0, 0], hinv[0, 1:])
        remaining = rest
    return codes, scale


def _problem(seed: int, c: int, k: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(c, k)) * rng.uniform(0.5, 2, size=(c, 1))
    x = rng.normal(size=(tokens, k)) @ rng.normal(size=(k, k)) * 0.3 + rng.normal(size=(tokens, k)) * rng.uniform(0.1, 3, k)
    return w.astype(np.float32), x.T @ x


@pytest.mark.parametrize("order", ["natural", "act"])
@pytest.mark.parametrize("c, k, g, bf16", [(6, 64, 32, True), (5, 96, 32, True), (4, 160, 160, False), (3, 256, 64, True)])
def test_gptq_matches_slow_reference(order: str, c: int, k: int, g: int, bf16: bool) -> None:
    """k = 96, 160 and 256 span more than one block of deferred updates (BLOCK = 64)."""
    w, gram = _problem(k + c, c, k, 3 * k)
    settings = gptq.GptqSettings(damp=0.01, order=order, refit=False)  # type: ignore[arg-type]
    codes, scales = gptq.gptq(w, gram, g, QMIN, QMAX, bf16, settings)
    h = gptq.dampened(gram, 0.01)
    ref_codes, ref_scales = slow_gptq(w, h, g, gptq.column_order(np.diag(h), g, order), bf16)
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(codes, ref_codes)
    assert codes.min() >= QMIN and codes.max() <= QMAX


def test_gptq_with_given_scales_matches_slow_reference() -> None:
    w, gram = _problem(7, 5, 192, 400)
    given = np.full((5, 6), 0.25, np.float32)
    settings = gptq.GptqSettings(damp=0.05, order="act", refit=False)
    codes, scales = gptq.gptq(w, gram, 32, QMIN, QMAX, True, settings, given)
    h = gptq.dampened(gram, 0.05)
    ref_codes, _ = slow_gptq(w, h, 32, gptq.column_order(np.diag(h), 32, "act"), True, given)
    np.testing.assert_array_equal(codes, ref_codes)
    np.testing.assert_array_equal(scales, given)


def test_refit_scales_is_the_least_squares_optimum() -> None:
    """Per row, against numpy's least squares on ``sqrt(H)``-weighted columns ``A``,
    ``A[:, a]`` = the row's codes in group ``a`` (zero elsewhere)."""
    w, gram = _problem(11, 4, 128, 300)
    h = gptq.dampened(gram, 0.01)
    codes, scales = gptq.gptq(w, gram, 32, QMIN, QMAX, False, gptq.GptqSettings(refit=False))
    fitted = gptq.refit_scales(w.astype(np.float64), codes, scales, h, 32, bf16=False)
    root = np.linalg.cholesky(h).T  # h = root^T root
    for r in range(4):
        a = np.zeros((128, 4))
        for group in range(4):
            a[group * 32:(group + 1) * 32, group] = codes[r, group * 32:(group + 1) * 32]
        best = np.linalg.lstsq(root @ a, root @ w[r].astype(np.float64), rcond=None)[0]
        # float32 scales; the library's 1e-12 ridge moves the optimum by ~1e-12 relative
        np.testing.assert_allclose(fitted[r], best.astype(np.float32), rtol=2e-7)
    def loss(s: np.ndarray) -> np.ndarray:
        e = w.astype(np.float64) - codes * np.repeat(s.astype(np.float64), 32, axis=1)
        return np.einsum("ck,kl,cl->c", e, h, e)

    assert np.all(loss(fitted) <= loss(scales)) and loss(fitted).sum() < loss(scales).sum()


def test_lower_inverse() -> None:
    rng = np.random.default_rng(5)
    for n in (1, 7, 64, 65, 200):
        low = np.tril(rng.normal(size=(n, n))) + 4 * np.eye(n)
        inverse = gptq.lower_inverse(low)
        assert np.array_equal(inverse, np.tril(inverse))
        # float64 rounding times the condition number (up to ~1e3 here)
        np.testing.assert_allclose(inverse @ low, np.eye(n), atol=1e-15 * np.linalg.cond(low) * n)


def test_inverse_cholesky_factors_the_inverse() -> None:
    _, gram = _problem(3, 1, 48, 30)  # 30 tokens < 48 features: singular until dampened
    upper, damp = gptq.inverse_cholesky(gram, 0.01)
    assert damp == 0.01
    assert np.array_equal(upper, np.triu(upper))
    inverse = np.linalg.inv(gptq.dampened(gram, 0.01))
    np.testing.assert_allclose(upper.T @ upper, inverse, rtol=1e-9, atol=1e-12 * np.abs(inverse).max())


def test_rows_in_pieces_compiled_columns_and_threads_change_no_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ and the re-fit treat each row on its own: cutting the rows into pieces of
    ``ROWS`` (64: 200 rows in 4 pieces, the last one short), one piece, one thread or two,
    the compiled column loop (``compute.loops``) or the numpy one, and numpy's BLAS on one
    thread or its own, all give the same codes and scales bit for bit."""
    from xnnquant.compute import blas, jit

    w, gram = _problem(13, 200, 160, 500)

    def run() -> tuple[np.ndarray, np.ndarray]:
        return gptq.gptq(w, gram, 32, QMIN, QMAX, True, gptq.GptqSettings())

    with monkeypatch.context() as patch:
        patch.setattr(gptq, "piece_rows", lambda rows: gptq.ROWS)
        codes, scales = run()
    variants: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
        "one piece": lambda patch: patch.setattr(gptq, "piece_rows", lambda rows: rows),
        "one piece a thread": lambda patch: None,
        "one thread": lambda patch: patch.setenv("XNNQUANT_NUM_THREADS", "1"),
        "numpy columns": lambda patch: patch.setenv("XNNQUANT_JIT", "0"),
        "BLAS threads": lambda patch: patch.setattr(blas, "_threadpools", lambda: None),
    }
    for name, change in variants.items():
        with monkeypatch.context() as patch:
            change(patch)
            again, again_scales = run()
        np.testing.assert_array_equal(again, codes, err_msg=name)
        np.testing.assert_array_equal(again_scales, scales, err_msg=name)
    assert jit.loops() is None or hasattr(jit.loops(), "gptq_columns")
