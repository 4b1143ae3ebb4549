"""What the static int8 rewrite gives (``rewrite.py``): the ``Int8Graph``, its quantized layers
(``QuantizedLayer``), where it converts between fp32 and qint8 (``Boundary``) and the values
cross-layer equalization scaled (``Equalized``, ``equalization.py``).  Read by bias correction,
the self-check (``check.py``), the measurement and the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...graph import Graph
from ...tensor import QuantizedTensor
from ..report import ReportRow
from .observe import Measured
from .sensitivity import Sensitivity


@dataclass(frozen=True)
class Boundary:
    """Where the int8 graph converts: ``what`` (a graph input or output, or an ATen node left in
    fp32) and ``why``."""

    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.what}: {self.why}"


@dataclass
class QuantizedLayer:
    """One int8 filtered node: its new node index, the float filter and bias (graph layout, after
    equalization) it came from, the stored filter, the bias value to correct
    (``bias_correction.py``), and the float graph's own bias (``float_bias``, what torch adds)."""

    node: int
    filter_id: int  # in the float graph
    weights: np.ndarray
    bias: np.ndarray  # float32 (OC,), zeros where the layer had none
    stored: QuantizedTensor
    bias_id: int  # in the int8 graph
    input_id: int  # in the int8 graph
    input_scale: float
    float_bias: np.ndarray
    source: int = -1  # the float graph's node index
    input_source: int = -1  # the float graph's input value id
    #: the bias correction's input means (``bias_correction.InputMeans``, equalized), None without it
    means: np.ndarray | None = None


@dataclass(frozen=True)
class Equalized:
    """One equalized value (``equalization.py``): the float-graph node indices of its channel group's
    filtered producers and readers, the value, and the factors ``s`` float32 ``(C,)``."""

    producers: tuple[int, ...]
    readers: tuple[int, ...]
    value: int
    factors: np.ndarray


@dataclass
class Int8Graph:
    """What ``rewrite.Rewrite`` made (``rewrite.py``'s docstring).

    ``int8_of`` / ``float_of``: float-graph value id -> the int8 graph's qint8 / fp32 value
    holding it (either may be missing).  ``int8_handles``: debug handles of the ATen nodes
    computed in int8.  ``layers``: the quantized filtered nodes.
    """

    graph: Graph
    rows: list[ReportRow]
    boundaries: list[Boundary]
    int8_of: dict[int, int] = field(default_factory=dict)
    float_of: dict[int, int] = field(default_factory=dict)
    int8_handles: set[int] = field(default_factory=set)
    layers: list[QuantizedLayer] = field(default_factory=list)
    quant: dict[int, tuple[float, int]] = field(default_factory=dict)
    #: the equalized pairs; a float value ``v`` of ``equalized`` is held as ``v / factors`` (last dim)
    equalized: list[Equalized] = field(default_factory=list)
    #: float-graph filter id -> the float filter after equalization (graph layout)
    filters: dict[int, np.ndarray] = field(default_factory=dict)
    #: the float graph it was made from
    source: Graph | None = None
    #: what ``ranges="sensitivity"`` measured (None with any other method, or when it fell back)
    sensitivity: Sensitivity | None = None
    #: how the rewrite departed from its options, and why
    notes: list[str] = field(default_factory=list)
    #: mixed precision (``StaticInt8.budget``): one line per step of nodes kept in fp32, with its measured cost
    kept: list[str] = field(default_factory=list)
    #: the finished graph against the float graph on calibration inputs (``observe.measure``)
    measured: Measured | None = None
    #: for which CPU the time estimate priced the choices, and on what basis (one report line)
    estimate: str = ""

    def primary(self, vid: int) -> int:
        """The int8 graph's value standing for float-graph value ``vid`` (its qint8 one if any)."""
        return self.int8_of.get(vid, self.float_of.get(vid, -1))


def where(sources: Sequence[tuple[str, str, str]], handle: int) -> str:
    """How a report line names the ATen node of debug handle ``handle``: its op, name and module path."""
    if not 0 < handle <= len(sources):
        return "a node of the graph"
    op, name, path = sources[handle - 1]
    return f"{op} (node {name}, module {path or '<top level>'})"
