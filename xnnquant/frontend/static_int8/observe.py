"""Every intermediate value of a graph, computed by the real XNNPACK, batch after batch.

``Exposed(graph, values)`` makes copies of ``graph`` in which each of ``values`` is an
extra external output (chunks of at most ``MAX_NUM_EXTERNS`` externals), wraps each in a
``.pte`` with static input and output shapes and loads it on the ExecuTorch runtime,
once; ``run`` then executes them (one execution per chunk and batch) and returns every
value by id: fp32 values as float32, qint8 ones as their int8 codes.  Calibration runs the
float graph through it; ``measure`` runs the finished int8 graph beside the float one (their
outputs' SQNR and run times, ``Measured``).

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
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arrays import contiguous
from ...constants import MAX_NUM_EXTERNS
from ...errors import UnsupportedConfigError
from ...graph import Graph
from ...graph.divergence import observable
from ...graph.program import _captured_stderr
from ...metrics import sqnr_db
from ..evaluation import torch_threads


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


#: How many calibration inputs (spread over them) a finished program is measured on, and how many
#: times each is timed (after one untimed run of each graph).
MEASURED_INPUTS = 4
TIMED_ROUNDS = 3


@dataclass(frozen=True)
class Measured:
    """A finished int8 graph against its float graph, both on the real runtime, on ``inputs``
    calibration inputs: its float outputs' SQNR (``db``) and the median wall time of one run of
    each (``int8_ms``, ``float_ms``; ``runs`` per input) on this machine with the runtime's threads;
    ``cpu``: this machine's CPU (``xnnpack.cpu.Cpu.label``), which the times are of."""

    db: float
    inputs: int
    runs: int
    int8_ms: float
    float_ms: float
    cpu: str = ""

    def __str__(self) -> str:
        return (f"outputs against the float graph: {self.db:.1f} dB SQNR on {self.inputs} of the calibration inputs "
                f"(inputs its grids were chosen on); run time on this machine, {self.cpu or 'CPU unknown'}, "
                f"{self.int8_ms:.3g} ms against the float graph's {self.float_ms:.3g} ms "
                f"({self.int8_ms / max(self.float_ms, 1e-9):.2f}x)")


def measure(float_graph: Graph, int8_graph: Graph, batches: Sequence[Sequence[np.ndarray]]) -> Measured:
    """``Measured`` over ``MEASURED_INPUTS`` of ``batches`` (as the graphs take them; at least one)."""
    from .sensitivity import spread

    chosen = [batches[i] for i in spread(MEASURED_INPUTS, len(batches))]
    floats, ints = Exposed(float_graph, []), Exposed(int8_graph, [])
    times: dict[str, list[float]] = {"float": [], "int8": []}
    want: list[np.ndarray] = []
    got: list[np.ndarray] = []
    with torch_threads(1):
        floats.run(chosen[0])
        ints.run(chosen[0])
        for batch in chosen:
            for _ in range(TIMED_ROUNDS):
                for name, exposed in (("float", floats), ("int8", ints)):
                    start = time.perf_counter()
                    exposed.run(batch)
                    times[name].append(time.perf_counter() - start)
            f, q = floats.run(batch), ints.run(batch)  # the runtime's buffers: copied before the next run
            for a, b in zip(float_graph.outputs, int8_graph.outputs):
                if q[b].dtype == np.float32:  # not an index output
                    want.append(np.array(f[a], np.float64).reshape(-1))
                    got.append(np.array(q[b], np.float64).reshape(-1))
    db = sqnr_db(np.concatenate(want), np.concatenate(got)) if want else float("nan")
    from ...xnnpack.cpu import this_cpu

    return Measured(db, len(chosen), TIMED_ROUNDS, 1e3 * statistics.median(times["int8"]),
                    1e3 * statistics.median(times["float"]), this_cpu().label)
