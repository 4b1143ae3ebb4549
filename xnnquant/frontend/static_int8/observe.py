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

Calibration loops keep torch on one thread (``evaluation.torch_threads(1)``): the runtime
hands its outputs back as torch tensors, copied by torch's own thread pool, whose threads
then spin-wait for more work while XNNPACK's pool runs the next execution on the same
cores (one execution of that MobileNetV2 graph on 2 cores: 320 ms with torch's default
threads, 12 ms with one).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...arrays import contiguous
from ...constants import MAX_NUM_EXTERNS
from ...errors import UnsupportedConfigError
from ...graph import Graph
from ...graph.divergence import observable
from ...graph.program import _captured_stderr


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
            pte = to_pte(exposed.to_bytes(), dynamic=False)
            with _captured_stderr() as log:  # the runtime's CPU probe and errors: kept out of the user's stderr
                try:
                    program = Runtime.get().load_program(pte)
                    method = program.load_method("forward")
                except RuntimeError as exc:
                    failure: Exception | None = exc
                else:
                    failure = None
            if failure is not None:
                raise UnsupportedConfigError(f"the ExecuTorch runtime refused the graph exposed for calibration: "
                                             f"{failure}; runtime log: {' | '.join(log[0].splitlines()[-8:])}")
            self.methods.append((program, method, chunk))  # the program outlives its method

    def run(self, inputs: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """Every exposed value and every graph output on ``inputs`` (as ``graph.run`` takes them, at
        the graph's own shapes).  The arrays may be the runtime's buffers: read them before the
        next ``run``."""
        import torch

        tensors = [torch.from_numpy(contiguous(x)) for x in inputs]
        found: dict[int, np.ndarray] = {}
        for _, method, chunk in self.methods:
            with _captured_stderr() as log:
                try:
                    results = [r.numpy() for r in method.execute(tensors)]
                except RuntimeError as exc:
                    failure: Exception | None = exc
                else:
                    failure = None
            if failure is not None:
                raise UnsupportedConfigError(f"the ExecuTorch runtime failed to run the graph exposed for "
                                             f"calibration: {failure}; runtime log: "
                                             f"{' | '.join(log[0].splitlines()[-8:])}")
            outputs = len(results) - len(chunk)
            found.update(zip(self.graph.outputs, results[:outputs]))
            found.update(zip(chunk, results[outputs:]))
        for vid, x in zip(self.graph.inputs, inputs):
            found[vid] = np.asarray(x)
        return found
