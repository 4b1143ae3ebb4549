"""Orthogonal rotations for quantization: randomized Hadamard matrices of any usual width.

An orthogonal ``Q`` (``Q Q^T = I``) leaves a product unchanged when one side is rotated by
``Q`` and the other by ``Q^T`` (``x W^T = (x Q) (W Q)^T``), and a Hadamard matrix spreads
each coordinate over all of them: an outlier channel becomes many ordinary ones, which
int4 groups and per-token int8 activations keep with more levels (QuaRot, SpinQuant).

``hadamard(n)``: an ``n x n`` matrix of +-1 with ``H H^T = n I``, built as a Kronecker
product of a Paley matrix and a Sylvester one::

    n = p * 2**k      p = 1 (Sylvester alone), or a Paley order:
                      q + 1 for a prime q = 3 (mod 4)     (Paley I:  12, 20, 24, 44, 48, 60, ...)
                      2 (q + 1) for a prime q = 1 (mod 4) (Paley II: 12, 28, 36, 60, 76, ...)
    H_n = H_p (x) H_(2**k),   H_1 = [1],   H_2m = [[H_m, H_m], [H_m, -H_m]]

which covers the widths of the usual models (576 = 36 x 16, 896 = 28 x 32, 960 = 60 x 16,
1536 = 12 x 128, 2048, 3072 = 12 x 256, 4864 = 76 x 64, ...).  ``rotation(n, seed)``:
``diag(s) H_n / sqrt(n)`` with random signs ``s`` (a randomized Hadamard matrix), float64;
a width with no such construction gets a random orthogonal matrix (QR of a Gaussian one),
exact all the same.
"""

from __future__ import annotations

import functools

import numpy as np

#: Paley orders are searched up to this (the odd factor of a model's width is small).
MAX_PALEY_ORDER = 512


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[i, j] = chi(j - i)``, chi the quadratic character modulo the prime ``q``."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if a in residues else -1 for a in range(1, q)], np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley(p: int) -> np.ndarray | None:
    """A Hadamard matrix of order ``p`` by Paley's constructions, or None."""
    q = p - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: I + S, S skew-symmetric
        s = np.zeros((p, p), np.int64)
        s[0, 1:], s[1:, 0] = 1, -1
        s[1:, 1:] = _jacobsthal(q)
        return s + np.eye(p, dtype=np.int64)
    if p % 2 == 0:
        q = p // 2 - 1
        if q % 4 == 1 and _is_prime(q):  # Paley II
            c = np.zeros((q + 1, q + 1), np.int64)
            c[0, 1:], c[1:, 0] = 1, 1
            c[1:, 1:] = _jacobsthal(q)
            return (np.kron(c, np.array([[1, 1], [1, -1]])) +
                    np.kron(np.eye(q + 1, dtype=np.int64), np.array([[1, -1], [-1, -1]])))
    return None


@functools.cache
def hadamard(n: int) -> np.ndarray | None:
    """An ``n x n`` Hadamard matrix (int64, entries +-1), or None when no construction of the
    module docstring gives one.  Computed once per width."""
    if n < 1:
        return None
    odd, power = n, 1
    while odd % 2 == 0:
        odd //= 2
        power *= 2
    base = None
    p = odd
    while p <= min(n, MAX_PALEY_ORDER):
        base = np.ones((1, 1), np.int64) if p == 1 else _paley(p)
        if base is not None:
            break
        p *= 2
    if base is None:
        return None
    sylvester = np.ones((1, 1), np.int64)
    while sylvester.shape[0] * base.shape[0] < n:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    return np.kron(base, sylvester)


def rotation(n: int, seed: int = 0) -> np.ndarray:
    """A random orthogonal ``n x n`` float64 matrix: ``diag(s) H_n / sqrt(n)`` with random signs
    ``s`` (seeded), or the Q of a seeded Gaussian matrix's QR when no Hadamard matrix of
    width ``n`` is built here."""
    rng = np.random.default_rng(seed)
    h = hadamard(n)
    if h is None:
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))[None, :]
    signs = rng.choice([-1.0, 1.0], size=n)
    return signs[:, None] * h / np.sqrt(n)
