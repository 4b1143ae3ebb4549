"""Every intermediate value of a graph, computed by the real XNNPACK, batch after batch.

``Exposed(graph, values)`` makes copies of ``graph`` in which each of ``values`` is an
extra external output (chunks of at most ``MAX_NUM_EXTERNS`` externals), wraps each in a
``.pte`` with static input and output shapes and loads it on the ExecuTorch runtime,
once; ``run`` then executes them (one execution per chunk and batch) and returns every
value by id: fp32 values as float32, qint8 ones as their int8 codes.  Calibration runs the
float graph through it, bias correction the static int8 one.

Static shapes, not ``graph.run``'s bounded dynamic ones: measured on MobileNetV2 with 66
exposed values (28 MB of outputs a call), one execution takes 37 ms with static outputs
and 204 ms with bounded dynamic ones.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...constants import MAX_NUM_EXTERNS
from ...graph import Graph
from ...graph.divergence import observable


class Exposed:
    """``graph`` with ``values`` (internal value ids computed by a node) exposed as outputs."""

    def __init__(self, graph: Graph, values: Sequence[int] | None = None) -> None:
        from executorch.runtime import Runtime

        from ...graph import to_pte

        wanted = observable(graph) if values is None else list(values)
        self.graph = graph
        self.methods: list[tuple[Any, Any, list[int]]] = []  # (program, method, exposed ids)
        room = MAX_NUM_EXTERNS - graph.num_externs
        for start in range(0, max(len(wanted), 1), room):
            chunk = wanted[start:start + room]
            exposed = copy.copy(graph)  # values copied (their flags change), nodes and constants shared
            exposed.values = [copy.copy(v) for v in graph.values]
            exposed.nodes = list(graph.nodes)
            exposed.load_info = None
            for vid in chunk:
                exposed.output(vid)
            program = Runtime.get().load_program(to_pte(exposed.to_bytes(), dynamic=False))
            self.methods.append((program, program.load_method("forward"), chunk))  # the program outlives its method

    def run(self, inputs: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """Every exposed value and every graph output on ``inputs`` (as ``graph.run`` takes them, at
        the graph's own shapes).  The arrays may be the runtime's buffers: read them before the
        next ``run``."""
        import torch

        tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
        found: dict[int, np.ndarray] = {}
        for _, method, chunk in self.methods:
            results = [r.numpy() for r in method.execute(tensors)]
            outputs = len(results) - len(chunk)
            found.update(zip(self.graph.outputs, results[:outputs]))
            found.update(zip(chunk, results[outputs:]))
        for vid, x in zip(self.graph.inputs, inputs):
            found[vid] = np.asarray(x)
        return found
