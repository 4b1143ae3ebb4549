"""Activation ranges of static int8, from what calibration saw of each value.

``ValueStats`` keeps, per graph value, the exact minimum and maximum over every
calibration element (overall and per channel, the last dim of the graph's layout), the
count of exact zeros, and a sample of the values with their channels (every element of
a small value, ``SAMPLES`` random ones per batch of a larger one) from which the
histogram of ``choose_range`` is made.  ``scaled`` gives the statistics of the value with
its channels divided by per-channel factors (cross-layer equalization).  A range always contains 0, so that zero (ReLU
outputs, padding) is one exact code, and its int8 grid is::

    scale = (hi - lo) / 255 (float32)        zero_point = clip(round(-128 - lo / scale), -128, 127)
    real value of code q = (q - zero_point) * scale

Methods (``StaticInt8.ranges``):

===============  ==================================================================
``minmax``       ``[min, max]`` over every calibration element
``percentile``   the ``p``-th percentile of the positive values and of the magnitudes
                 of the negative ones (``p = 99.99`` by default)
``mse``          the ``[lo, hi]`` of least expected squared error on the histogram:
                 clipped values cost their distance to the bound squared, the others
                 ``step^2 / 12`` (uniform rounding; exact zeros cost nothing), over a
                 grid of bounds from 2 % to 100 % of each side (``MSE_GRID`` points)
``output_mse``   the same search with each sampled value weighted by how much its
                 channel moves what the value's readers compute (``channel_weights``:
                 for filtered readers, the sum of the squared filter entries that
                 multiply that channel, so the objective is the first-order squared
                 error of the readers' outputs); plain ``mse`` where a reader is not a
                 filtered node
===============  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...constants import FLT_MIN
from ...errors import XnnquantError

#: Elements sampled per calibration batch from a value larger than this (all of a smaller one).
SAMPLES = 8192
#: Histogram bins over a value's [min, max].
BINS = 1 << 12
#: Candidate bounds per side of ``mse``: fractions of the observed bound, from 2 % to 100 %.
MSE_GRID = np.geomspace(0.02, 1.0, 96)
QMIN, QMAX = -128, 127


@dataclass
class ValueStats:
    """What calibration saw of one value (see the module docstring); ``name`` says what it is.

    ``channel_lo`` / ``channel_hi``: float32 ``(C,)`` bounds per channel (the last dim);
    ``samples`` / ``channels``: per batch, float32 sampled values and int32 their channels."""

    name: str
    lo: float = np.inf
    hi: float = -np.inf
    count: int = 0
    zeros: int = 0
    samples: list[np.ndarray] = field(default_factory=list)
    channels: list[np.ndarray] = field(default_factory=list)
    channel_lo: np.ndarray | None = None
    channel_hi: np.ndarray | None = None

    def add(self, x: np.ndarray, rng: np.random.Generator, batch: str | None = None) -> None:
        """Take one batch's values of this value (any shape, float32, channels last);
        ``XnnquantError`` naming the ``batch`` (default: by its count) when one is NaN or
        infinite."""
        arr = np.asarray(x, np.float32)
        flat = arr.reshape(-1)
        if flat.size == 0:
            return
        rows = flat.reshape(-1, arr.shape[-1] if arr.ndim else 1)
        lows, highs = rows.min(axis=0), rows.max(axis=0)
        if not (np.all(np.isfinite(lows)) and np.all(np.isfinite(highs))):
            bad = int(np.flatnonzero(~np.isfinite(flat))[0])
            raise XnnquantError(f"calibration: {self.name} is not finite on "
                                f"{batch or f'calibration batch {len(self.samples)}'} (value {flat[bad]} at flat "
                                f"index {bad}): static int8 needs finite activations to choose their ranges")
        self.channel_lo = lows if self.channel_lo is None else np.minimum(self.channel_lo, lows)
        self.channel_hi = highs if self.channel_hi is None else np.maximum(self.channel_hi, highs)
        self.lo, self.hi = min(self.lo, float(lows.min())), max(self.hi, float(highs.max()))
        self.count += flat.size
        self.zeros += int(np.count_nonzero(flat == 0))
        picked = np.arange(flat.size) if flat.size <= SAMPLES else rng.integers(0, flat.size, SAMPLES)
        self.samples.append(flat[picked])
        self.channels.append((picked % rows.shape[1]).astype(np.int32))

    def merged(self, other: ValueStats) -> ValueStats:
        """The statistics of both values' elements together (a concatenation's output; the
        per-channel bounds are dropped)."""
        return ValueStats(f"{self.name} and {other.name}", min(self.lo, other.lo), max(self.hi, other.hi),
                          self.count + other.count, self.zeros + other.zeros, self.samples + other.samples,
                          self.channels + other.channels)

    def scaled(self, factors: np.ndarray) -> ValueStats:
        """The statistics of this value with channel ``c`` divided by ``factors[c]`` (> 0)."""
        assert self.channel_lo is not None and self.channel_hi is not None
        lows, highs = self.channel_lo / factors, self.channel_hi / factors
        return ValueStats(self.name, float(lows.min()), float(highs.max()), self.count, self.zeros,
                          [s / factors[c] for s, c in zip(self.samples, self.channels)], list(self.channels),
                          lows.astype(np.float32), highs.astype(np.float32))

    @property
    def bounds(self) -> tuple[float, float]:
        """``[min(lo, 0), max(hi, 0)]``: what the range must hold at most."""
        return min(self.lo, 0.0), max(self.hi, 0.0)


def choose_range(stats: ValueStats, method: str, percentile: float = 99.99,
                 channel_weights: np.ndarray | None = None) -> tuple[float, float]:
    """``(lo, hi)`` with ``lo <= 0 <= hi`` and ``hi > lo`` for ``stats`` by ``method``
    (``channel_weights``: float ``(C,)`` for ``output_mse``, None for uniform).

    ``XnnquantError`` when calibration never reached the value or saw only zeros (a
    constant activation has no range to spread 256 codes over).
    """
    if stats.count == 0:
        raise XnnquantError(f"calibration: {stats.name} was never computed on the calibration batches")
    lo, hi = stats.bounds
    if not hi > lo:
        raise XnnquantError(f"calibration: {stats.name} is 0 on every calibration input (a constant activation): its "
                            "int8 range would be empty; calibrate with inputs that exercise it, or remove it")
    if method == "minmax":
        return lo, hi
    values = np.concatenate(stats.samples)
    if method == "percentile":
        neg, pos = -values[values < 0], values[values > 0]
        return (-float(np.percentile(neg, percentile)) if neg.size else 0.0,
                float(np.percentile(pos, percentile)) if pos.size else 0.0) if (neg.size or pos.size) else (lo, hi)
    if method == "mse" or (method == "output_mse" and channel_weights is None):
        return _mse_range(values, lo, hi)
    if method == "output_mse":
        assert channel_weights is not None
        return _mse_range(values, lo, hi, np.asarray(channel_weights, np.float64)[np.concatenate(stats.channels)])
    raise XnnquantError(f"unknown range method {method!r}")


def _mse_range(values: np.ndarray, lo: float, hi: float, weights: np.ndarray | None = None) -> tuple[float, float]:
    """The grid bounds of least expected squared error (module docstring), float64 sums;
    ``weights``: one per value (None: all 1).  Exact zeros cost nothing at any bounds."""
    keep = values != 0
    nonzero = values[keep].astype(np.float64)
    if nonzero.size == 0:
        return lo, hi
    counts, edges = np.histogram(nonzero, BINS, (lo, hi), weights=None if weights is None else weights[keep])
    centers = (edges[:-1] + edges[1:]) / 2
    n = counts.astype(np.float64)
    los = lo * MSE_GRID if lo < 0 else np.zeros(1)
    his = hi * MSE_GRID if hi > 0 else np.zeros(1)
    error = grid_costs(centers, n, n * centers, n * centers**2, los, his)
    i, j = np.unravel_index(int(np.argmin(error)), error.shape)
    return float(los[i]), float(his[j])


def grid_costs(centers: np.ndarray, w0: np.ndarray, w1: np.ndarray, w2: np.ndarray, los: np.ndarray,
               his: np.ndarray) -> np.ndarray:
    """The squared error of the int8 grid over ``[a, b]`` for every ``a`` of ``los`` and ``b`` of
    ``his`` (float64 ``(len(los), len(his))``, inf where ``b <= a``), from a histogram: per bin
    (at ``centers``, ascending) the sums of weights ``w0``, of weight times value ``w1`` and of
    weight times value squared ``w2``.  A bin below ``a`` costs its values' squared distance to
    ``a`` (clipped), above ``b`` to ``b``; a bin inside costs the rounding's ``step^2 / 12``
    per unit of weight, ``step = (b - a) / 255``."""
    s0, s1, s2 = (np.concatenate([[0.0], np.cumsum(w)]) for w in (w0, w1, w2))
    a, b = np.meshgrid(los, his, indexing="ij")
    ia = np.searchsorted(centers, a)  # bins [0, ia) lie below a
    ib = np.searchsorted(centers, b, side="right")  # bins [ib, BINS) lie above b
    below = s2[ia] - 2 * a * s1[ia] + a * a * s0[ia]
    above = (s2[-1] - s2[ib]) - 2 * b * (s1[-1] - s1[ib]) + b * b * (s0[-1] - s0[ib])
    step = (b - a) / (QMAX - QMIN)
    error = below + above + (s0[ib] - s0[ia]) * step * step / 12
    error[~(b > a)] = np.inf
    return np.asarray(error)


def qparams(lo: float, hi: float) -> tuple[float, int]:
    """``(scale, zero_point)`` of the int8 grid over ``[lo, hi]`` (module docstring); float32 scale."""
    if not (lo <= 0 <= hi and hi > lo):
        raise XnnquantError(f"an int8 range must hold 0 and be non-empty: got [{lo}, {hi}]")
    scale = np.float32((hi - lo) / (QMAX - QMIN))
    if not scale >= FLT_MIN:
        raise XnnquantError(f"the int8 range [{lo:.3g}, {hi:.3g}] is too narrow for a float32 scale")
    zero_point = int(np.clip(np.rint(QMIN - lo / float(scale)), QMIN, QMAX))
    return float(scale), zero_point


def grid_range(scale: float, zero_point: int) -> tuple[float, float]:
    """The real values of codes -128 and 127 on the grid ``(scale, zero_point)``."""
    return (QMIN - zero_point) * scale, (QMAX - zero_point) * scale
