"""Every intermediate value of a graph, computed by the real XNNPACK, batch after batch.

``Exposed(graph, values)`` makes copies of ``graph`` in which each of ``values`` is an
extra external output (chunks of at most ``MAX_NUM_EXTERNS`` externals), once; ``run``
then executes them on the ExecuTorch runtime (loaded programs are cached by their bytes,
so each further batch costs one execution) and returns every value by id: fp32 values as
float32, qint8 ones as their int8 codes.  Calibration runs the float graph through it,
bias correction the static int8 one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from ...constants import MAX_NUM_EXTERNS
from ...graph import Graph
from ...graph.divergence import observable


class Exposed:
    """``graph`` with ``values`` (internal value ids computed by a node) exposed as outputs."""

    def __init__(self, graph: Graph, values: Sequence[int] | None = None) -> None:
        wanted = observable(graph) if values is None else list(values)
        self.graph = graph
        self.payloads: list[tuple[bytes, list[int]]] = []
        room = MAX_NUM_EXTERNS - graph.num_externs
        for start in range(0, max(len(wanted), 1), room):
            chunk = wanted[start:start + room]
            exposed = copy.copy(graph)  # values copied (their flags change), nodes and constants shared
            exposed.values = [copy.copy(v) for v in graph.values]
            exposed.nodes = list(graph.nodes)
            exposed.load_info = None
            for vid in chunk:
                exposed.output(vid)
            self.payloads.append((exposed.to_bytes(), chunk))

    def run(self, inputs: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """Every exposed value and every graph output on ``inputs`` (as ``graph.run`` takes them)."""
        from ...graph import run

        found: dict[int, np.ndarray] = {}
        for payload, chunk in self.payloads:
            results = run(payload, list(inputs), validate=False)  # validated when written
            outputs = len(results) - len(chunk)
            found.update(zip(self.graph.outputs, results[:outputs]))
            found.update(zip(chunk, results[outputs:]))
        for vid, x in zip(self.graph.inputs, inputs):
            found[vid] = np.asarray(x)
        return found
