"""``Exported``: what ``xq.export`` returns.

It holds the lowered ``Graph`` and the per-weight report, and gives the payload
(``to_bytes``), the ExecuTorch program (``to_pte``), a file (``save``), and runs on the
real XNNPACK (``run``).  ``print(exported)`` shows the report as a table with totals.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import arguments
from ..arrays import contiguous
from ..errors import XnnquantError
from ..files import write_atomic
from ..graph import Graph, Target
from .report import ReportRow, format_report, totals
from .weights import WeightScheme

if TYPE_CHECKING:
    from ..pte.planned import MemoryCheck


@dataclass(frozen=True)
class DynamicDim:
    """A dim of an input or output that the program takes at any size in ``[min, max]``:
    its name (the size symbol torch.export gave it, e.g. ``s27``) and its range."""

    name: str
    min: int
    max: int

    def __str__(self) -> str:
        return f"{self.name} in [{self.min}, {self.max}]"


@dataclass(frozen=True)
class TensorIO:
    """One input or output of the program: its name, torch shape, dtype and dim order.

    ``dim_order`` lists the dims from outermost to innermost in memory, as ``torch.Tensor.dim_order()``
    gives them: ``(0, 1, 2, 3)`` for a contiguous NCHW tensor, ``(0, 2, 3, 1)`` for a channels-last one.
    The ``.pte`` declares it, as ExecuTorch's own flow does, and ExecuTorch's runtime reads a tensor's
    memory in that order (it does not check the strides of what it is given).  ``Exported.run`` takes
    tensors of any strides and lays them out as declared.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    dim_order: tuple[int, ...] = ()
    #: per dim, its ``DynamicDim`` or None (static; ``shape`` holds it); () when every dim is static.
    #: ``shape`` holds a dynamic dim's upper bound.
    dynamic: tuple[DynamicDim | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.dim_order:
            object.__setattr__(self, "dim_order", tuple(range(len(self.shape))))

    @property
    def contiguous(self) -> bool:
        return self.dim_order == tuple(range(len(self.shape)))

    def check(self, shape: tuple[int, ...], what: str) -> None:
        """``XnnquantError`` unless ``shape`` fits: static dims equal, dynamic ones in range."""
        if len(shape) != len(self.shape):
            raise XnnquantError(f"{what} ({self.name!r}) has shape {shape}: expected rank {len(self.shape)}, "
                                f"shape {self.describe()}")
        for i, (got, fixed) in enumerate(zip(shape, self.shape)):
            dim = self.dynamic[i] if self.dynamic else None
            if dim is None and got != fixed:
                raise XnnquantError(f"{what} ({self.name!r}) has shape {shape}: dim {i} is fixed at {fixed} "
                                    f"(expected shape {self.describe()})")
            if dim is not None and not dim.min <= got <= dim.max:
                raise XnnquantError(f"{what} ({self.name!r}) has size {got} in dim {i}: the program takes "
                                    f"{dim} there (its memory is planned at {dim.max}); expected shape "
                                    f"{self.describe()}")

    def describe(self) -> str:
        """The shape, with each dynamic dim shown as ``name<=max``."""
        dims = [str(d) if not self.dynamic or self.dynamic[i] is None else
                f"{self.dynamic[i].name}<={self.dynamic[i].max}"  # type: ignore[union-attr]
                for i, d in enumerate(self.shape)]
        return "(" + ", ".join(dims) + ")"


#: File suffixes ``save`` writes, and what each holds.
SUFFIXES = {".pte": "an ExecuTorch program (one method, the payload as its XNNPACK delegate)",
            ".xnn": "the bare XNNGraph payload (XNNHeader, flatbuffer, constant segment)"}


@dataclass
class Exported:
    """A module lowered onto XNNPACK: one graph (a pure program), or XNNPACK delegates and
    ExecuTorch's portable kernels in one program (a mixed one, ``mixed``).

    ``inputs`` / ``outputs``: the module's inputs and outputs, in order (``TensorIO``).
    ``timings``: seconds spent in each stage of the export.
    ``sources``: what a node's ``debug_handle`` h (1, 2, ...) stands for, ``sources[h - 1]`` =
    (ATen op, ATen node name, module path).
    A mixed program also has ``delegates`` (each delegate's ``Graph``; ``graph`` is the
    first), ``delegate_sources``, ``placement`` (where each ATen node runs and why:
    ``emit.Placement``) and ``builder`` (the program, ``pte.ProgramBuilder``).
    """

    graph: Graph
    report: list[ReportRow]
    weights: WeightScheme
    method: str
    target: Target
    inputs: list[TensorIO]
    outputs: list[TensorIO]
    timings: dict[str, float] = field(default_factory=dict)
    sources: list[tuple[str, str, str]] = field(default_factory=list)
    #: what the self-check found (``selfcheck.SelfCheck``), or why it did not run
    self_check: Any = None
    delegates: list[Graph] = field(default_factory=list)
    delegate_sources: list[list[tuple[str, str, str]]] = field(default_factory=list)
    placement: list[Any] = field(default_factory=list)
    builder: Any = None
    #: how embedding tables are stored (``weights.EmbeddingScheme``; None: float32)
    embeddings: Any = None
    #: ``"dynamic"``, or the static int8 choices (``"qint8"``, ``StaticInt8``'s spelling)
    activations: str = "dynamic"
    #: static int8: where the graph converts between fp32 and qint8, and why (one line each)
    boundaries: list[str] = field(default_factory=list)
    #: static int8: what its stages made (``static_int8.StaticResult``: the float graph, the int8
    #: one, the calibration statistics), for inspection; None otherwise
    static_int8: Any = None
    #: the buffers the module updates, by name: their shapes (method state of the program, kept
    #: from one call to the next, starting from the module's values when exported)
    state: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: an LLM program (``xq.export_llm``): its interface and metadata (``llm.export.LLMInfo``)
    llm: Any = None
    #: an LLM program of ``weights="auto:B"``: the plan's rows, what each layer got and why (``llm.mixed.PlanRow``)
    plan: Any = None
    #: the inputs the module's forward writes into (``x.mul_(2)``), by name: their new values
    #: are the program's first outputs, in this order, before the module's own (as in
    #: ExecuTorch's programs; ``caller.py``)
    mutated_inputs: list[str] = field(default_factory=list)
    #: the planned memory and what it was checked against (``pte.planned.MemoryCheck``: the target's
    #: memory when ``memory=`` was given, else this machine's); None for a streaming export without
    #: ``memory=`` (with it: set when ``save`` has the bytes)
    memory_check: MemoryCheck | None = None
    #: a streaming export's options when ``memory=`` was given: its planned memory is checked when
    #: ``save`` has its bytes (``stages/write.py``)
    _check_at_save: Any = field(default=None, repr=False)
    _payload: bytes | None = field(default=None, repr=False)
    _pte: bytes | None = field(default=None, repr=False)

    @property
    def mixed(self) -> bool:
        """True for a program of XNNPACK delegates and portable kernels (``builder``)."""
        return self.builder is not None

    def to_bytes(self) -> bytes:
        """The XNNGraph payload: XNNHeader + XN01 flatbuffer + constant segment (computed once).
        A mixed program has one per delegate (``delegates``): ``to_pte`` gives its program."""
        if self.mixed:
            raise XnnquantError(f"a mixed program has {len(self.delegates)} XNNPACK delegate(s) and portable kernels, "
                                "no single payload: write it with to_pte() or save('model.pte'); each delegate's "
                                "payload is exported.delegates[k].to_bytes()")
        if self._payload is None:
            self._payload = self.graph.to_bytes()
        return self._payload

    def to_pte(self) -> bytes:
        """An ExecuTorch ``.pte`` program whose ``forward`` method takes the module's inputs in
        order and returns its outputs (computed once)."""
        if self._pte is None:
            if self.mixed:
                self._pte = self.builder.to_bytes()
            else:  # the constants as named data (graph.program's module docstring), as save() streams them
                from ..graph import pte_chunks

                self._pte = b"".join(pte_chunks(self.graph, self._specs(self.inputs), self._specs(self.outputs),
                                                self.dynamic))
        return self._pte

    @property
    def dynamic(self) -> bool:
        """True when some input or output has a dynamic dim (the program takes other sizes)."""
        return any(t.dynamic for t in self.inputs + self.outputs)

    @staticmethod
    def _specs(items: list[TensorIO]) -> list[tuple[tuple[int, ...], str, tuple[int, ...]]]:
        return [(t.shape, t.dtype, t.dim_order) for t in items]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_pte()`` (suffix ``.pte``) or ``to_bytes()`` (suffix ``.xnn``) atomically.

        A graph with its scales in the constant segment (target 1.4.1) is written one
        constant at a time (``graph.pte_chunks``, ``Graph.save``): the same bytes, and a
        streaming export's weights are read and quantized only now.
        """
        path = arguments.path(path)
        suffix = path.suffix.lower()
        if suffix not in SUFFIXES:
            raise XnnquantError(f"cannot tell what to write from the suffix of {os.fspath(path)!r}: expected "
                                + " or ".join(f"{s} ({what})" for s, what in SUFFIXES.items()))
        if self.mixed:
            if suffix == ".xnn":
                raise XnnquantError(f"cannot write {os.fspath(path)!r}: a mixed program (XNNPACK delegates and "
                                    "portable kernels) is an ExecuTorch program: save it as .pte")
            if self._check_at_save is not None:  # a streaming export's bytes exist only now: checked before writing
                from .stages.write import check_planned

                self.memory_check = check_planned(self, self._check_at_save)
            return write_atomic(path, self.to_pte())
        if self._payload is None and self.graph.scales_in_segment:
            from ..graph import pte_chunks

            if suffix == ".xnn":
                return self.graph.save(path)
            return write_atomic(path, pte_chunks(self.graph, self._specs(self.inputs), self._specs(self.outputs),
                                                 self.dynamic))
        return write_atomic(path, self.to_pte() if suffix == ".pte" else self.to_bytes())

    def source(self, node_index: int) -> tuple[str, str, str] | None:
        """(ATen op, ATen node, module path) that graph node ``node_index`` was lowered from
        (None for a node that stands for no ATen node); ``node_index`` in ``[0, len(graph.nodes))``."""
        count = len(self.graph.nodes)
        if not arguments.is_plain_int(node_index) or not 0 <= node_index < count:
            raise XnnquantError(f"node_index must be the index of a graph node, an integer from 0 to {count - 1}: got "
                                f"{arguments.shown(node_index)}")
        handle = self.graph.nodes[int(node_index)].debug_handle
        return self.sources[handle - 1] if 0 < handle <= len(self.sources) else None

    def run(self, *inputs: Any) -> list[np.ndarray]:
        """Run the graph on the real XNNPACK (ExecuTorch 1.4.1 runtime) with the module's
        inputs (numpy arrays or torch tensors, float32, the example inputs' shapes)."""
        from ..arrays import to_numpy
        from ..graph import run

        if len(inputs) != len(self.inputs):
            raise XnnquantError(f"run takes the module's {len(self.inputs)} input(s): got {len(inputs)}")
        arrays = [self._laid_out(to_numpy(x, f"inputs[{i}]"), spec, i) for i, (x, spec) in
                  enumerate(zip(inputs, self.inputs))]
        if self.mixed:
            return self._run_program(arrays)
        results = run(self.to_bytes(), arrays, validate=False)
        return [r if spec.contiguous else contiguous(np.transpose(r, np.argsort(spec.dim_order)))
                for r, spec in zip(results, self.outputs)]

    def _run_program(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The program on ExecuTorch's runtime, each input a tensor in its declared dtype and dim order."""
        from ..pte.run import run_method

        results = run_method(self.to_pte(), "forward", self._tensors(arrays))
        return [contiguous(r) for r in results]

    def _tensors(self, arrays: list[np.ndarray]) -> list[Any]:
        """``arrays`` (laid out in the declared dim orders) as the tensors the runtime takes."""
        import torch

        tensors = []
        for array, spec in zip(arrays, self.inputs):
            if str(array.dtype) != spec.dtype:
                raise XnnquantError(f"input {spec.name!r} is {array.dtype}: the program takes {spec.dtype}")
            # torch's logical sizes over memory laid out in the declared dim order
            tensors.append(torch.from_numpy(array).permute(*np.argsort(spec.dim_order).tolist()))
        return tensors

    def session(self) -> Session:
        """The program loaded once on ExecuTorch's runtime: ``session.run(*inputs)`` calls its
        ``forward`` on the state the previous calls left (``state``: a module with a cache,
        called step by step), ``session.reset()`` starts again from the exported values."""
        return Session(self)

    @staticmethod
    def _laid_out(x: np.ndarray, spec: TensorIO, i: int) -> np.ndarray:
        """Input ``x`` (torch order, any strides) as the payload reads it: its dims in ``spec``'s order."""
        spec.check(tuple(x.shape), f"inputs[{i}]")
        return contiguous(x if spec.contiguous else np.transpose(x, spec.dim_order))

    @property
    def summary(self) -> dict[str, Any]:
        """Totals of the report, the options, the payload's size and the stage timings."""
        graphs = self.delegates if self.mixed else [self.graph]
        return {"weights": str(self.weights),
                "embeddings": None if self.embeddings is None else str(self.embeddings),
                "method": self.method, "target": str(self.target),
                "activations": str(self.activations), "boundaries": list(self.boundaries),
                "delegates": len(graphs), "portable_nodes": sum(p.where == "portable kernels" for p in self.placement),
                "nodes": sum(len(g.nodes) for g in graphs), "values": sum(len(g.values) for g in graphs),
                **totals(self.report), "timings": dict(self.timings),
                "memory": None if self.memory_check is None else self.memory_check.as_dict()}

    def to_json(self) -> str:
        """The report rows, the summary and where each ATen node runs, as JSON (what
        ``xnnquant export --json`` prints)."""
        from dataclasses import asdict

        return json.dumps({"summary": self.summary, "rows": [r.as_dict() for r in self.report],
                           "placement": [asdict(p) for p in self.placement]}, indent=2)

    def __str__(self) -> str:
        if not self.mixed:
            head = (f"xnnquant export: weights {self.weights}{self._tables}, method {self.method}, target "
                    f"{self.target}" + ("" if self.activations == "dynamic" else f", activations {self.activations}")
                    + f"; {len(self.graph.nodes)} nodes, {len(self.graph.values)} values")
            text = head + "\n" + format_report(self.report)
            if self.activations != "dynamic":
                text += f"\nfp32 <-> qint8 boundaries ({len(self.boundaries)}):" + "".join(
                    f"\n  {b}" for b in self.boundaries)
                int8 = self.static_int8.int8 if self.static_int8 is not None else None
                if int8 is not None and int8.measured is not None:
                    text += f"\n{int8.measured}"
                if int8 is not None and int8.estimate:
                    text += f"\n{int8.estimate}"
                text += "".join(f"\nnot as asked: {note}" for note in (int8.notes if int8 is not None else []))
            return text + self._kernels + self._mutations + self._memory
        head = "" if self.llm is None else f"{self.llm}\n"
        return (head + self.delegation_report() + "\n" + format_report(self.report) + self._kernels + self._mutations
                + self._memory)

    @property
    def _kernels(self) -> str:
        """The fully connected kernels XNNPACK runs on this machine (``xnnpack.cpu``): they
        depend on the CPU that runs the program, not on the file (``docs/cpus.md``)."""
        from ..xnnpack.cpu import fully_connected_kernels, this_cpu

        kernels = fully_connected_kernels(self.delegates if self.mixed else [self.graph])
        if not kernels:
            return ""
        return f"\nfully connected kernels on this machine, {this_cpu().label}: " + "; ".join(kernels)

    @property
    def _memory(self) -> str:
        """The memory check's line, where its answer could depend on the exporting machine: a
        program planned at dynamic dims' upper bounds, or one checked against ``memory=``."""
        check = self.memory_check
        return "" if check is None or not (self.dynamic or check.target) else f"\n{check}"

    @property
    def _mutations(self) -> str:
        return "".join(f"\noutput {k}: input {name!r} as forward leaves it (forward writes into it)"
                       for k, name in enumerate(self.mutated_inputs))

    @property
    def _tables(self) -> str:
        return "" if self.embeddings is None else f", embeddings {self.embeddings}"

    def delegation_report(self) -> str:
        """How many delegates, which ops ran where and why."""
        from collections import Counter

        if not self.mixed:
            return (f"xnnquant export: weights {self.weights}, method {self.method}, target {self.target}; "
                    f"1 XNNPACK delegate (the whole program, {len(self.graph.nodes)} XNNPACK nodes), 0 nodes on "
                    "ExecuTorch's portable kernels")

        delegated = Counter(p.where for p in self.placement if p.where != "portable kernels")
        portable = Counter((p.op, p.why) for p in self.placement if p.where == "portable kernels")
        lines = [f"xnnquant export: weights {self.weights}{self._tables}, method {self.method}, target {self.target}; "
                 f"{len(self.delegates)} XNNPACK delegate(s) ({sum(delegated.values())} ATen nodes), "
                 f"{sum(portable.values())} node(s) on ExecuTorch's portable kernels"]
        for (op, why), n in sorted(portable.items()):
            paths = sorted({p.module or "<top level>" for p in self.placement if p.op == op and p.why == why})
            lines.append(f"  portable: {op} x{n} ({why}); modules {', '.join(paths[:4])}"
                         + (", ..." if len(paths) > 4 else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Exported(weights={str(self.weights)!r}, method={self.method!r}, target={str(self.target)!r}, "
                f"{len(self.graph.nodes)} nodes, {len(self.report)} weights)")



class Session:
    """``Exported.session()``: the exported program loaded once (``pte.run.Session``), called
    with the module's inputs as ``Exported.run`` takes them."""

    def __init__(self, exported: Exported) -> None:
        from ..pte.run import Session as ProgramSession

        self.exported = exported
        self._session = ProgramSession(exported.to_pte())

    def run(self, *inputs: Any) -> list[np.ndarray]:
        """``forward`` on ``inputs`` (numpy arrays or torch tensors), after every earlier call."""
        from ..arrays import to_numpy

        specs = self.exported.inputs
        if len(inputs) != len(specs):
            raise XnnquantError(f"run takes the module's {len(specs)} input(s): got {len(inputs)}")
        arrays = [Exported._laid_out(to_numpy(x, f"inputs[{i}]"), spec, i) for i, (x, spec) in
                  enumerate(zip(inputs, specs))]
        results = self._session.run("forward", self.exported._tensors(arrays))
        return [contiguous(r) for r in results]

    def reset(self) -> None:
        """Load the program again: its state holds the values it was exported with."""
        self._session.reset()
