"""Special functions numpy lacks, shared by the MiniLM model and the graph interpreter."""

from __future__ import annotations

import numpy as np


def erf(x: np.ndarray) -> np.ndarray:
    """Error function, float64, absolute error at most 1.5e-7 (shape of ``x``).

    Abramowitz & Stegun 7.1.26: ``1 - (a1 t + ... + a5 t^5) exp(-x^2)`` with
    ``t = 1 / (1 + p |x|)``, odd in ``x``.  numpy has no erf and scipy is not a
    dependency; the error is below float32 resolution of the GELU it feeds.
    """
    x = np.asarray(x, dtype=np.float64)
    ax = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * ax)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-ax * ax))


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU ``x / 2 * (1 + erf(x / sqrt(2)))``; float32, shape of ``x``."""
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(np.float32)
