"""``xq.verify``: an export on the real XNNPACK, against the reference interpreter and the
float module, and the first node where the runtime and the interpreter part ways
(``graph.divergence.first_divergence``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import arguments
from ..arrays import contiguous, to_numpy
from ..errors import XnnquantError
from ..graph import Graph
from ..graph.divergence import TOLERANCE, Divergence, first_divergence
from ..metrics import sqnr_db


@dataclass(frozen=True)
class Comparison:
    """One output compared between two computations."""

    output: int
    pair: str  # "runtime-interpreter", "runtime-module", "interpreter-module"
    sqnr_db: float
    max_abs_error: float


@dataclass
class VerifyReport:
    """What ``verify`` found (``print`` it for a summary)."""

    comparisons: list[Comparison]
    nodes_checked: int
    tolerance: float
    first_divergence: Divergence | None
    worst_node_error: float = 0.0
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """No node diverged beyond the tolerance."""
        return self.first_divergence is None

    def __str__(self) -> str:
        lines = [f"{'output':<7}{'pair':<22}{'SQNR dB':>9}  {'max abs error':>13}"]
        for c in self.comparisons:
            sqnr = "exact" if math.isinf(c.sqnr_db) else f"{c.sqnr_db:.2f}"
            lines.append(f"{c.output:<7}{c.pair:<22}{sqnr:>9}  {c.max_abs_error:>13.3g}")
        verdict = (f"first diverging node: {self.first_divergence}" if self.first_divergence is not None else
                   f"no node diverges: {self.nodes_checked} nodes checked on the runtime's own inputs, worst relative "
                   f"error {self.worst_node_error:.3g} (tolerance {self.tolerance:g})")
        return "\n".join(lines + [verdict])


def _sqnr(reference: np.ndarray, approx: np.ndarray) -> float:
    """``metrics.sqnr_db``, with an exact match of a zero reference counted as exact."""
    value = sqnr_db(reference, approx)
    return math.inf if math.isnan(value) else value


def _compare(name: str, a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> list[Comparison]:
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            raise XnnquantError(f"output {i}: {name} shapes differ: {x.shape} and {y.shape}")
        out.append(Comparison(i, name, _sqnr(y, x), float(np.max(np.abs(x - y), initial=0.0))))
    return out


def _graph_and_sources(subject: Any) -> tuple[Graph, list[tuple[str, str, str]]]:
    from ..graph import load
    from .exported import Exported

    if isinstance(subject, Exported):
        return subject.graph, subject.sources
    if isinstance(subject, Graph):
        return subject, []
    if isinstance(subject, (bytes, bytearray, memoryview, str)) or hasattr(subject, "__fspath__"):
        return load(subject), []
    raise XnnquantError(f"verify takes an Exported, a Graph, payload bytes or a path: got {type(subject).__name__}")


def _module_outputs(module: Any, given: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``module(*given)`` as float32 arrays, ``count`` of them; ``XnnquantError`` when the module
    fails on the inputs or returns anything else."""
    import contextlib

    import torch

    from .caller import buffers_kept

    kept = buffers_kept(module) if isinstance(module, torch.nn.Module) else contextlib.nullcontext()
    try:
        with torch.no_grad(), kept:  # on copies: a forward may write into its inputs
            out = module(*[torch.from_numpy(np.array(a, order="C", copy=True)) for a in given])
    except Exception as exc:  # the module's own error: say it came from the module
        raise XnnquantError(f"module(*inputs) failed: {type(exc).__name__}: {exc}") from None
    flat = out if isinstance(out, (tuple, list)) else (out,)
    if len(flat) != count or not all(isinstance(o, torch.Tensor) for o in flat):
        raise XnnquantError(f"module(*inputs) must return {count} tensor(s), one per graph output: got "
                            f"{', '.join(arguments.shown(o) for o in flat) or 'nothing'}")
    return [np.asarray(o.detach().float().numpy(), np.float32) for o in flat]


def verify(subject: Any, inputs: Sequence[Any], module: Any = None, *, tolerance: float = TOLERANCE) -> VerifyReport:
    """Check ``subject`` (an ``Exported``, a ``Graph``, payload bytes or a path) on ``inputs``.

    ``inputs``: one array or tensor per graph input, in order (float32 for exported
    modules).  ``module``: the float ``torch.nn.Module`` to compare with, called as
    ``module(*inputs)``.  Returns a ``VerifyReport``: per-output SQNR and max error of
    runtime vs interpreter (and vs the module), and the first diverging node.
    """
    from ..graph import interpret, run
    from .exported import Exported

    tolerance = arguments.number(tolerance, "tolerance", low=0.0)
    if module is not None and not callable(module):
        raise XnnquantError(f"module must be the float torch.nn.Module to compare with (called as module(*inputs)), "
                            f"or None: got {arguments.shown(module)}")
    graph, sources = _graph_and_sources(subject)
    if isinstance(inputs, (np.ndarray, str, bytes)) or not isinstance(inputs, Sequence):
        raise XnnquantError(f"verify takes a list of inputs, one per graph input: got {type(inputs).__name__}")
    given = [to_numpy(x, f"inputs[{i}]") for i, x in enumerate(inputs)]
    if len(given) != len(graph.inputs):
        raise XnnquantError(f"verify needs one input per graph input: got {len(given)}, expected {len(graph.inputs)}")
    layouts = subject if isinstance(subject, Exported) else None
    # the graph reads each input with its dims in the program's declared order (channels-last ones NHWC)
    arrays = [layouts._laid_out(x, spec, i) for i, (x, spec) in enumerate(zip(given, layouts.inputs))] \
        if layouts is not None else [contiguous(x) for x in given]
    payload = graph.to_bytes()
    results = {"runtime": run(payload, arrays), "interpreter": interpret(graph, arrays)}
    if layouts is not None:  # back to torch's dim order, to compare with the module
        results = {k: [r if spec.contiguous else np.transpose(r, np.argsort(spec.dim_order))
                       for r, spec in zip(v, layouts.outputs)] for k, v in results.items()}
    if module is not None:
        results["module"] = _module_outputs(module, given, len(results["interpreter"]))
    comparisons = _compare("runtime-interpreter", results["runtime"], results["interpreter"])
    if module is not None:
        comparisons += _compare("runtime-module", results["runtime"], results["module"])
        comparisons += _compare("interpreter-module", results["interpreter"], results["module"])
    divergence, checked, worst = first_divergence(graph, arrays, sources, tolerance)
    return VerifyReport(comparisons, checked, tolerance, divergence, worst, results)
