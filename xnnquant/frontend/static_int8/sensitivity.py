"""How much each activation's int8 grid costs at the graph's outputs, from the float graph's gradients.

Quantizing value ``v`` changes each element ``x_e`` by ``d_e`` (rounding inside the grid,
clipping outside it); to first order the outputs move by ``J d`` (``J``: the Jacobian of
the outputs with respect to ``v``).  For a random sign vector ``u`` over the outputs,
``E_u[(u . J d)^2] = |J d|^2``, and its diagonal part is

    cost(lo, hi) = sum_e g_e^2 d_e^2,        g = J^T u  (one backward pass per probe)

with ``d_e`` the clipping error of ``x_e`` outside ``[lo, hi]`` and the rounding error's
variance ``step^2 / 12`` inside (exact zeros cost nothing).  ``g_e`` is each element's own
gradient, not a per-channel mean: an outlier that saturates a later ReLU6 has ``g_e = 0``,
so clipping it is free, as it is in the int8 program (on MobileNetV2 the late residual
stream's best ranges cut 0.1 % of its values, which tensor-MSE ranges keep).

``output_sensitivity`` runs ``torch_graph.forward`` and one backward pass per probe over
a batch of calibration inputs, and keeps per group of values sharing a grid a histogram of
the elements weighted by ``g_e^2`` (``WeightedHistogram``: per bin the sums of ``g^2``,
``g^2 x`` and ``g^2 x^2``), from which ``best_range`` finds the grid of least cost
(``ranges.MSE_GRID`` candidates per side, as ``mse``) and ``cost`` prices any grid.
Equalized values (held as ``x / s`` per channel) are binned as held, with ``g * s``.
Costs are per input, in the outputs' squared units: ``10 log10(signal / cost)`` (``signal``:
the outputs' mean squared norm per input) is the outputs' SQNR if that grid were the only
error.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...graph import Graph
from . import torch_graph
from .ranges import MSE_GRID, grid_costs

#: Histogram bins over a group's [min, max].
BINS = 1 << 12
#: Calibration inputs whose gradients are taken (evenly spread over the batches), and per torch batch.
IMAGES = 8
CHUNK = 4
#: The largest fraction of one side's nonzero elements a candidate range may clip.
MAX_CLIPPED = 0.01


@dataclass
class WeightedHistogram:
    """Elements of one group of values in ``BINS`` bins over ``[lo, hi]``, weighted by ``g^2``."""

    lo: float
    hi: float
    count: np.ndarray = field(default_factory=lambda: np.zeros(BINS))  # elements
    weight: np.ndarray = field(default_factory=lambda: np.zeros(BINS))  # sum g^2
    first: np.ndarray = field(default_factory=lambda: np.zeros(BINS))  # sum g^2 x
    second: np.ndarray = field(default_factory=lambda: np.zeros(BINS))  # sum g^2 x^2
    inputs: int = 0

    def add(self, x: np.ndarray, g2: np.ndarray) -> None:
        """Take float32 elements ``x`` with their ``g^2`` (one shape); exact zeros are skipped
        (dropped first).  The sums per bin are float64."""
        x, g2 = x.reshape(-1), g2.reshape(-1)
        nonzero = x != 0
        x, g2 = x[nonzero], g2[nonzero]  # half of a ReLU's output: dropped before the four passes below
        index = np.clip((x - np.float32(self.lo)) * np.float32(BINS / (self.hi - self.lo)), 0, BINS - 1)
        index = index.astype(np.intp)
        self.count += np.bincount(index, None, BINS)
        weighted = g2 * x
        for total, weights in ((self.weight, g2), (self.first, weighted), (self.second, weighted * x)):
            total += np.bincount(index, weights, BINS)

    def _costs(self, los: np.ndarray, his: np.ndarray) -> np.ndarray:
        """``cost(lo, hi)`` for every pair of ``los`` x ``his`` (bins at their centers)."""
        centers = self.lo + (np.arange(BINS) + 0.5) * (self.hi - self.lo) / BINS
        return grid_costs(centers, self.weight, self.first, self.second, los, his) / max(self.inputs, 1)

    def best_range(self) -> tuple[float, float] | None:
        """The candidate ``(lo, hi)`` of least cost, or None when no element moves the outputs.

        Candidates: fractions ``MSE_GRID`` of each side that clip at most ``MAX_CLIPPED`` of
        that side's nonzero elements (a first-order cost cannot see a clip so deep that it
        crosses a later saturation)."""
        if not self.weight.sum() > 0:
            return None
        centers = self.lo + (np.arange(BINS) + 0.5) * (self.hi - self.lo) / BINS
        below = np.concatenate([[0.0], np.cumsum(self.count * (centers < 0))])  # elements in bins [0, i)
        above = np.concatenate([[0.0], np.cumsum((self.count * (centers > 0))[::-1])])  # in the last i bins
        los = self.lo * MSE_GRID if self.lo < 0 else np.zeros(1)
        his = self.hi * MSE_GRID if self.hi > 0 else np.zeros(1)
        if self.lo < 0:
            clipped = below[np.searchsorted(centers, los)] / max(below[-1], 1)
            los = los[clipped <= MAX_CLIPPED]
        if self.hi > 0:
            clipped = above[BINS - np.searchsorted(centers, his, side="right")] / max(above[-1], 1)
            his = his[clipped <= MAX_CLIPPED]
        costs = self._costs(los, his)
        i, j = np.unravel_index(int(np.argmin(costs)), costs.shape)
        return float(los[i]), float(his[j])

    def cost(self, lo: float, hi: float) -> float:
        """The cost of the grid over ``[lo, hi]`` (module docstring), per input."""
        return float(self._costs(np.array([lo]), np.array([hi]))[0, 0])


@dataclass
class Sensitivity:
    """What ``output_sensitivity`` measured: ``histograms`` by group, ``signal`` the outputs' mean
    squared norm per input, ``inputs`` how many calibration inputs it saw."""

    histograms: dict[int, WeightedHistogram]
    signal: float
    inputs: int

    def db(self, cost: float) -> float:
        """``cost`` as the outputs' SQNR it alone would leave (dB)."""
        return float("inf") if cost <= 0 else float(10 * np.log10(self.signal / cost))


def spread(count: int, total: int) -> list[int]:
    """``min(count, total)`` indices spread evenly over ``range(total)``, first and last included."""
    if total <= count:
        return list(range(total))
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)}) if count > 1 else [0]


def output_sensitivity(graph: Graph, batches: Sequence[Sequence[np.ndarray]], groups: dict[int, list[int]],
                       bounds: dict[int, tuple[float, float]], factors: dict[int, np.ndarray],
                       seed: int = 0) -> Sensitivity:
    """The ``WeightedHistogram`` of every group (root -> member value ids, ``bounds`` by root)
    over ``IMAGES`` of ``batches`` (as the graph takes them), one Rademacher probe each.

    ``factors``: value id -> float32 ``(C,)`` equalization factors of the values held divided
    by them.  ``graph`` must be fully supported (``torch_graph.unsupported``)."""
    import torch

    root_of = {v: root for root, members in groups.items() for v in members}
    hists = {root: WeightedHistogram(*bounds[root]) for root in groups}
    consts = torch_graph.constants(graph)
    generator = torch.Generator().manual_seed(seed)
    chosen = [batches[i] for i in spread(IMAGES, len(batches))]
    signal, seen = 0.0, 0
    for start in range(0, len(chosen), CHUNK):
        chunk = chosen[start:start + CHUNK]
        inputs = [torch.from_numpy(np.stack([np.asarray(b[k], np.float32) for b in chunk])).requires_grad_(True)
                  for k in range(len(graph.inputs))]
        kept: dict[int, torch.Tensor] = {}
        keep = functools.partial(_retained, kept, root_of)
        env = torch_graph.forward(graph, inputs, consts, keep)
        kept.update({v: x for v, x in zip(graph.inputs, inputs) if v in root_of})
        total = inputs[0].new_zeros(())
        for vid in graph.outputs:
            out = env[vid]
            probe = torch.randint(0, 2, out.shape, generator=generator).to(out.dtype) * 2 - 1
            total = total + (out * probe).sum()
            signal += float(out.detach().double().pow(2).sum())
        total.backward()
        seen += len(chunk)
        for vid, y in kept.items():
            if y.grad is None:
                continue
            x, g = y.detach().numpy(), y.grad.numpy()
            if vid in factors:  # held as x / s: its gradient is g * s
                x, g = x / factors[vid], g * factors[vid]
            hists[root_of[vid]].add(x, g * g)
    for h in hists.values():
        h.inputs = seen
    return Sensitivity(hists, signal / max(seen, 1), seen)


def _retained(kept: dict[int, Any], wanted: dict[int, int], vid: int, y: Any) -> Any:
    """``torch_graph.forward``'s ``on_value``: keep the gradient of every ``wanted`` value."""
    if vid in wanted:
        y.retain_grad()
        kept[vid] = y
    return y
