"""The grids of the static int8 rewrite: one scale and zero point per group of activations.

Values that a data-movement node links share one grid (a union-find over those nodes,
``Sets``): XNNPACK's qint8 data movement moves codes, so its inputs and output must be on
one grid.  The grid's range is chosen once from all its members' statistics: by default the
range of least first-order error at the graph's outputs (``ranges="sensitivity"``:
``sensitivity.py``), else from the values' histogram (``ranges.choose_range``), a lone value
read only by filtered nodes weighted by their filters (``channel_weights``).  A zero padding
value widens its output's range to hold it.  A group calibration saw only zeros of has no
grid (``Grids.unranged``): an error where an int8 node reads or writes it, unless its values
are zero whatever the inputs (``zero_by_construction``).

Takes the float graph, what calibration saw of each value (equalized: ``equalization.py``)
and the options; gives the ``Grids``.  The rewrite then raises a filtered node's output scale
where XNNPACK needs it (``rewrite.Rewrite._fit_requantization``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...datatypes import Datatype
from ...errors import XnnquantError
from ...graph import Graph
from ...graph.model import Node
from ...graph.rules import DATA_MOVEMENT, WEIGHTED
from . import torch_graph
from .int8_graph import Equalized, where
from .ranges import ValueStats, choose_range, qparams
from .sensitivity import Sensitivity, output_sensitivity

if TYPE_CHECKING:
    from .equalization import FloatFilters


class Sets:
    """Union-find over value ids (or node indices)."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass
class Grids:
    """Every activation's grid (module docstring).

    ``group_of``: float value id -> its group (of values sharing a grid); ``grid_of``: group ->
    its grid ``(scale, zero point)``; ``unranged``: group -> why it has none; ``members``: group
    -> its value ids, for the groups calibration observed; ``sensitivity``: what
    ``ranges="sensitivity"`` measured (None with any other method, or when it fell back, which
    ``notes`` then says); ``sources``: what each debug handle stands for, to name a node.
    """

    sources: Sequence[tuple[str, str, str]]
    group_of: dict[int, int] = field(default_factory=dict)
    grid_of: dict[int, tuple[float, int]] = field(default_factory=dict)
    unranged: dict[int, str] = field(default_factory=dict)
    members: dict[int, list[int]] = field(default_factory=dict)
    sensitivity: Sensitivity | None = None
    notes: list[str] = field(default_factory=list)

    def quant(self, vid: int) -> tuple[float, int]:
        """The grid ``(scale, zero point)`` of float-graph value ``vid``; ``XnnquantError`` for a
        value calibration saw only zeros of (``choose_range``), which an int8 node reads or writes."""
        group = self.group_of[vid]
        if group in self.unranged:
            raise XnnquantError(self.unranged[group])
        return self.grid_of[group]

    def grid(self, vid: int, node: Node) -> tuple[float, int]:
        """``quant(vid)`` for value ``vid`` that ``node`` reads or writes; an error naming the node
        for a value calibration never observed."""
        if vid not in self.group_of:
            raise XnnquantError(f"static int8: {where(self.sources, node.debug_handle)} reads value {vid}, which "
                                "calibration never observed")
        return self.quant(vid)


def choose_grids(graph: Graph, stats: dict[int, ValueStats], producer: dict[int, Node], filters: FloatFilters,
                 sources: Sequence[tuple[str, str, str]], *, ranges: str, percentile: float,
                 batches: Sequence[Sequence[np.ndarray]], equalized: list[Equalized]) -> Grids:
    """Every activation's grid (module docstring): data-movement nodes tie values into groups, each
    group's range chosen once from its members' statistics (``stats``, by value id)."""
    found = Grids(sources)
    sets = Sets()
    pads: dict[int, float] = {}
    for n in graph.nodes:
        if n.kind in DATA_MOVEMENT:
            for vid in n.inputs:
                if not graph.value(vid).is_constant:
                    sets.union(vid, n.outputs[0])
            if n.kind == "XNNStaticConstantPad" and math.isfinite(n.params.get("padding_value", 0.0)):
                pads[n.outputs[0]] = float(n.params.get("padding_value", 0.0))
    members: dict[int, list[int]] = {}
    for v in graph.values:
        if not v.is_constant and v.datatype is Datatype.fp32:
            members.setdefault(sets.find(v.id), []).append(v.id)
    merged: dict[int, ValueStats] = {}
    for root, vids in members.items():
        seen = [stats[v] for v in vids if v in stats]
        if seen:  # else never observed (an argmax index, a value no node reads): never quantized
            merged[root] = seen[0]
            for st in seen[1:]:
                merged[root] = merged[root].merged(st)
    spread = {r: members[r] for r, st in merged.items() if st.bounds[1] > st.bounds[0]}  # else refused below
    histograms = _sensitivity(found, graph, batches, spread, merged, equalized) if ranges == "sensitivity" else {}
    for root, group_stats in merged.items():
        vids = members[root]
        best = histograms[root].best_range() if root in histograms else None
        if best is not None:
            lo, hi = best
        else:
            method = "percentile" if ranges == "sensitivity" else ranges
            weights = channel_weights(graph, filters, vids[0]) if len(vids) == 1 else None
            try:
                lo, hi = choose_range(group_stats, method, percentile, weights)
            except XnnquantError as exc:  # zero on every batch: a grid only if it is zero by construction
                if not (group_stats.count and group_stats.bounds == (0.0, 0.0)
                        and all(zero_by_construction(graph, producer, vid) for vid in vids)):
                    found.unranged[root] = str(exc)  # raised where an int8 node needs the grid (``quant``)
                    found.group_of.update((vid, root) for vid in vids)
                    continue
                lo, hi = -1.0, 1.0  # any grid holds its only value, 0, exactly (its zero point)
        for vid in vids:
            if vid in pads:
                lo, hi = min(lo, pads[vid]), max(hi, pads[vid])
            found.group_of[vid] = root
        found.grid_of[root] = qparams(lo, hi)
    found.members = {root: members[root] for root in merged}
    return found


def _sensitivity(found: Grids, graph: Graph, batches: Sequence[Sequence[np.ndarray]], groups: dict[int, list[int]],
                 merged: dict[int, ValueStats], equalized: list[Equalized]) -> dict[int, Any]:
    """Each group's ``sensitivity.WeightedHistogram`` (``ranges="sensitivity"``, kept in
    ``found.sensitivity``), or none with a note when the float graph has a node torch cannot
    compute here or there are no batches."""
    unsupported = torch_graph.unsupported(graph)
    if unsupported is not None or not batches:
        why = f"{unsupported} has no torch form here" if unsupported else "no calibration batches were kept"
        found.notes.append(f"ranges: percentile instead of sensitivity ({why})")
        return {}
    factors = {e.value: e.factors for e in equalized}
    measured = output_sensitivity(graph, batches, groups, {r: st.bounds for r, st in merged.items()}, factors)
    found.sensitivity = measured
    return measured.histograms


def channel_weights(graph: Graph, filters: FloatFilters, vid: int) -> np.ndarray | None:
    """float64 ``(C,)``: per channel of ``vid``, the sum of its readers' squared filter entries
    that multiply it (``ranges``' ``output_mse``); None unless every reader is a filtered node
    reading ``vid`` as its input."""
    total: np.ndarray | None = None
    for n in graph.nodes:
        if vid not in n.inputs:
            continue
        if n.kind not in WEIGHTED or n.inputs[0] != vid or vid in n.inputs[1:]:
            return None
        w = filters.weight(n.inputs[1]).astype(np.float64) ** 2
        if n.kind == "XNNFullyConnected":
            per = (w.T if n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else w).sum(axis=0)
        elif n.kind == "XNNDepthwiseConv2d":
            c = graph.value(vid).dims[-1]
            per = w.sum(axis=(0, 1, 2)).reshape(c, -1).sum(axis=1)
        else:
            groups = int(n.params.get("groups", 1))
            oc, kh, kw, cg = w.shape
            per = w.reshape(groups, oc // groups * kh * kw, cg).sum(axis=1).reshape(groups * cg)
        total = per if total is None else total + per
    return total


def zero_by_construction(graph: Graph, producer: dict[int, Node], vid: int) -> bool:
    """True for a value that is 0 whatever the inputs: a product with a constant that is zero
    everywhere (ConvNeXt V2's global response norm at its initial gamma = 0, beta = 0) or with
    such a value, a sum or difference of them and of zero constants, data moved from one."""
    n = producer.get(vid)
    if n is None:
        return False
    zero = [(v.is_constant and not v.array().any())
            or (not v.is_constant and zero_by_construction(graph, producer, v.id))
            for v in (graph.value(i) for i in n.inputs)]
    if n.kind == "XNNMultiply":
        return any(zero)
    if n.kind in ("XNNAdd", "XNNSubtract"):
        return all(zero)
    moved = [i for i in n.inputs if not graph.value(i).is_constant]
    return n.kind in DATA_MOVEMENT and len(moved) == 1 and zero_by_construction(graph, producer, moved[0])
