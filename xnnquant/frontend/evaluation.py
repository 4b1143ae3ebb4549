"""Running an ``AtenProgram`` in torch on several batches of inputs at once, node by node.

``evaluate(program, batches, before=..., after=...)`` visits the program's nodes in order
and computes each node for every batch before going to the next node, so when a node is
reached the values of its inputs over *all* batches are there::

    for node in program's nodes:            placeholders: the batch's inputs, or the constant
        swap = before(node, run)            a hook may look at run.values(input) of every batch
                                            and give replacement tensors for some arguments
        for b in batches:                   (e.g. a layer's filter: its quantized values)
            value[node][b] = node.target(*args of batch b, swapped)
        after(node, run)                    a hook may look at the new values
        free the values whose last user was this node

With several batches and several cores, a node's batches are computed side by side, one
per core, torch on one thread each (``parallel.for_ranges``): no op then waits for threads
of its own at every step (figures in docs/benchmarks.md).  Each node is computed once per batch,
and a value is dropped as soon as the last node reading it has been computed, so at most
the values live across one point of the graph are held (for every batch).  Constants
(parameters, buffers, folded tensors) are shared by all batches.

Nodes compute as the self-check computes them (``torch_op``): a ``view`` as a
``reshape``, since the cleanup pass removed the ``contiguous`` copies views relied on.
An error of torch on a batch (a batch that does not fit the program) becomes
``XnnquantError`` naming the batch, the node, its op and its module path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..compute.blas import one_blas_thread
from ..compute.parallel import for_ranges, num_threads
from ..errors import XnnquantError
from .program import AtenProgram

#: ``before(node, run)``: {argument node: the tensor to read instead} for computing
#: ``node`` (every batch alike), or None.
Before = Callable[[Any, "BatchRun"], "dict[Any, Any] | None"]
#: ``after(node, run)``: called once ``node``'s values are computed.
After = Callable[[Any, "BatchRun"], None]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at ``n`` inside the block (a process-wide setting)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def single_threaded() -> Iterator[None]:
    """torch's and numpy's BLAS threads at one inside the block (the self-check's work on
    the example inputs: products too small for threads to pay for waking each other)."""
    with torch_threads(1), one_blas_thread():
        yield


def torch_op(target: Any) -> Any:
    """The op torch computes ``target``'s values with: a view as a reshape (the cleanup pass
    drops ``contiguous`` copies, which layouts make no matter to in the graph)."""
    import torch

    aten = torch.ops.aten
    return aten.reshape.default if target in (aten.view.default, aten._unsafe_view.default) else target


class BatchRun:
    """The values of one run of ``evaluate`` (see the module docstring)."""

    def __init__(self, program: AtenProgram, batches: Sequence[tuple[Any, ...]],
                 programs: Sequence[AtenProgram] | None = None) -> None:
        self.program = program
        self.batches = batches
        self.programs = tuple(programs) if programs is not None else (program,) * len(batches)
        primary = list(program.graph.nodes)
        #: per batch: ``program``'s node -> the same node of the batch's program (None: the same program)
        self._twins = [None if p is program else dict(zip(primary, p.graph.nodes)) for p in self.programs]
        self._back = [None if t is None else {v: k for k, v in t.items()} for t in self._twins]
        self._values: dict[Any, list[Any]] = {}
        self._shapes: dict[Any, list[tuple[int, ...]]] = {}
        #: batches computed side by side on the cores, torch on one thread each (see ``evaluate``)
        self.parallel = len(batches) > 1 and num_threads() > 1

    def shapes(self, node: Any) -> list[tuple[int, ...]] | None:
        """``node``'s shape in every batch, kept after its values are freed (None: not a tensor,
        or not computed yet)."""
        return self._shapes.get(node)

    def values(self, node: Any) -> list[Any]:
        """``node``'s value for every batch (a constant: the same tensor for each)."""
        if self.program.is_constant(node):
            return [self.program.constants[node.name]] * len(self.batches)
        return self._values[node]

    def _compute(self, node: Any, swap: dict[Any, Any]) -> list[Any]:
        import torch

        out: list[Any] = [None] * len(self.batches)

        def some(lo: int, hi: int) -> None:
            # grad mode is per thread: without this, a worker thread would record autograd
            # graphs through the module's parameters and keep every value alive with them
            with torch.no_grad():
                for b in range(lo, hi):
                    out[b] = self._one(node, swap, b)

        if self.parallel:
            for_ranges(some, len(self.batches), 1)
        else:
            some(0, len(self.batches))
        return out

    def _one(self, node: Any, swap: dict[Any, Any], b: int) -> Any:
        import torch

        program, twins, back = self.programs[b], self._twins[b], self._back[b]
        own = node if twins is None else twins[node]

        def arg(n: Any) -> Any:
            mine = n if back is None else back[n]
            if mine in swap:
                return swap[mine]
            return program.constants[n.name] if program.is_constant(n) else self._values[mine][b]

        args = torch.fx.node.map_arg(own.args, arg)
        kwargs = torch.fx.node.map_arg(own.kwargs, arg)
        try:
            return torch_op(own.target)(*args, **kwargs)
        except Exception as exc:  # torch's own error on inputs that do not fit the program
            path = AtenProgram.module_path(node) or "<top level>"
            raise XnnquantError(
                f"calibration batch {b} does not run through the program: node {node.name} "
                f"({getattr(node.target, '__name__', node.target)}, module {path}) fails: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def last_uses(program: AtenProgram, outputs: bool = True) -> dict[Any, list[Any]]:
    """node -> the nodes whose values may be dropped once ``node`` is computed (those it
    is the last reader of; constants are never dropped).  ``outputs=False``: the output
    node reads nothing (a value only the outputs read is dropped when computed)."""
    order = {node: i for i, node in enumerate(program.graph.nodes)}
    last: dict[Any, Any] = {}
    for node in program.graph.nodes:
        if node.op == "output" and not outputs:
            continue
        for source in node.all_input_nodes:
            if not program.is_constant(source) and (source not in last or order[node] > order[last[source]]):
                last[source] = node
    dropped: dict[Any, list[Any]] = {}
    for source, reader in last.items():
        dropped.setdefault(reader, []).append(source)
    return dropped


def evaluate(program: AtenProgram, batches: Sequence[tuple[Any, ...]], *, before: Before | None = None,
             after: After | None = None, programs: Sequence[AtenProgram] | None = None,
             outputs: bool = True) -> list[Any]:
    """Run ``program`` on every batch (each a tuple of its user inputs), node by node; the
    output node's value for each batch (module docstring), or ``[]`` with ``outputs=False``
    (for the hooks alone: no value is kept for the end, an LLM's updated KV caches among them).
    A state's values (``program.state``) are copied for each batch where a node first reads them.

    ``programs``: per batch, the program to compute it with when the batches need programs
    traced at their own shapes (``batches.CalibrationData.programs_for``): each has the
    nodes of ``program`` in the same order (``batches.isomorphic``), and node ``i`` of
    batch ``b`` is computed with the size arguments of node ``i`` of ``programs[b]``.
    Hooks and values see ``program``'s nodes.
    """
    import torch

    run = BatchRun(program, batches, programs)
    dropped = last_uses(program, outputs)
    position = {name: i for i, name in enumerate(program.inputs)}
    results: list[Any] = []
    with torch.no_grad(), torch_threads(1 if run.parallel else torch.get_num_threads()):
        for node in program.graph.nodes:
            if node.op == "placeholder":
                if not program.is_constant(node) and not program.is_state(node):
                    run._values[node] = [batch[position[node.name]] for batch in batches]
                continue
            if node.op == "output" and not outputs:
                break
            for source in node.all_input_nodes:  # each batch from the state's values when exported
                if source.op == "placeholder" and program.is_state(source) and source not in run._values:
                    run._values[source] = [program.state[source.name].clone() for _ in batches]
            if node.op == "call_function":
                swap = before(node, run) if before is not None else None
                run._values[node] = run._compute(node, swap or {})
                if all(hasattr(v, "shape") for v in run._values[node]):
                    run._shapes[node] = [tuple(v.shape) for v in run._values[node]]
                if after is not None:
                    after(node, run)
            elif node.op == "output":
                results = [torch.fx.node.map_arg(node.args[0], lambda n, b=b: run.values(n)[b])
                           for b in range(len(batches))]
            for source in dropped.get(node, ()):
                run._values.pop(source, None)
            if not node.users:  # nothing reads it (the output node reads the outputs)
                run._values.pop(node, None)
    return results
