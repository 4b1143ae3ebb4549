"""The walk: an ``AtenProgram`` (after the passes) onto one ``xnnquant.graph.Graph``.

``lower`` visits the program's nodes in order.  User inputs become fp32 external inputs
(in the dim order of the example input: channels-last inputs arrive NHWC); constant
placeholders stay torch tensors until a lowering places them in the graph; every other
node goes to its registered lowering (``LOWERINGS``) with a ``LoweringContext``.  Outputs
become external outputs in the order the module returns them, in the dim order torch
gives them.

Every node a lowering emits carries the debug handle of its ATen node (``sources``), so a
diverging node is named with its ATen op and module path.  A lowering's refusal, and an
op without a lowering, become one line naming the operator, the node and the module path;
the walk carries on with a stand-in value, and ``lower`` raises one
``UnsupportedConfigError`` listing every line at the end.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...datatypes import Datatype
from ...errors import SelfCheckError, UnsupportedConfigError, XnnquantError
from ...graph import Graph, Target
from ...graph.model import PerTensorQuant
from ..exported import DynamicDim, TensorIO
from ..passes.partition import reads_int8
from ..program import AtenProgram, Size
from ..report import ReportRow
from . import LOWERINGS, load_lowerings, op_name, sizes_stay_dynamic
from .context import NHWC, Activation, LoweringContext, QuantizedReference, WeightOptions, WeightRefusal, identity

Progress = Callable[[Iterator[Any], int], Iterator[Any]]


@dataclass
class Lowered:
    """What ``lower`` made: the graph, the report rows, the program's inputs and outputs,
    what each debug handle stands for, and what each ATen node lowered to."""

    graph: Graph
    rows: list[ReportRow]
    inputs: list[TensorIO]
    outputs: list[TensorIO]
    #: ``sources[h - 1]`` = (ATen op, ATen node name, module path) of debug handle h
    sources: list[tuple[str, str, str]] = field(default_factory=list)
    #: ATen node -> the ``Activation`` (or tuple of them) it lowered to, or its constant
    values: dict[Any, Any] = field(default_factory=dict)
    #: ATen node -> how the self-check computes it, for nodes whose lowering quantized
    references: dict[Any, QuantizedReference] = field(default_factory=dict)
    #: value id -> (producer's bounds before fusing, the ATen nodes whose clamps were fused into them)
    fused: dict[int, tuple[tuple[float | None, float | None], list[tuple[Any, float, float]]]] = \
        field(default_factory=dict)
    #: what could not be lowered, one line each (``lower(..., raise_refusals=False)``)
    refusals: list[str] = field(default_factory=list)
    #: ATen node -> its op, for every node that was lowered (not refused)
    lowered_ops: list[str] = field(default_factory=list)
    #: call node name -> why its lowering refused it (not for its weights: ``weight_refusals``)
    refused: dict[str, str] = field(default_factory=dict)
    #: the ATen nodes whose values the graph's inputs and outputs are, in order (a delegate of
    #: a mixed program: what it takes from and gives to the rest of the program)
    input_nodes: list[Any] = field(default_factory=list)
    output_nodes: list[Any] = field(default_factory=list)
    #: graph value id of each float filter -> where it came from (``FilterOrigin``)
    filters: dict[int, Any] = field(default_factory=dict)
    #: the refusals of layers that cannot take their weights (``WeightRefusal``), also in
    #: ``refusals``: the weights asked for, never a reason to run the node elsewhere
    weight_refusals: list[str] = field(default_factory=list)


def new_graph(target: Target) -> Graph:
    """An empty graph for ``target``.  For 1.4.1, scales go to the constant segment as
    ExecuTorch 1.4.1 stores them (blockwise: bf16, 2 bytes each); XN01-era runtimes read
    them from the flatbuffer, blockwise ones as bf16 copies besides the fp32 list."""
    later = target is not Target.XN01
    return Graph(target=target, write_scale_bf16=not later, scales_in_segment=later)


def lower(program: AtenProgram, target: Target, weights: WeightOptions, progress: Progress | None = None, *,
          raise_refusals: bool = True, members: set[Any] | None = None) -> Lowered:
    """Lower every node of ``program`` (or only ``members``, one delegate of a mixed program:
    the values it reads from other nodes become its inputs, the values other nodes or the
    program's outputs read become its outputs, contiguous); raise one
    ``UnsupportedConfigError`` listing all refusals (or, with ``raise_refusals=False``,
    return them in ``Lowered.refusals``)."""
    load_lowerings()
    import torch

    walk = _Walk(LoweringContext(program, new_graph(target), weights), members)
    nodes = list(program.graph.nodes)
    visits: Iterator[Any] = iter(nodes) if progress is None else progress(iter(nodes), len(nodes))
    with torch.no_grad():
        for node in visits:
            walk.visit(node)
    if walk.refusals and raise_refusals:
        lines = "\n".join(f"  - {r}" for r in walk.refusals)
        raise UnsupportedConfigError(f"export refused {len(walk.refusals)} node(s) or layer(s):\n{lines}")
    ctx = walk.ctx
    return Lowered(ctx.graph, ctx.rows, walk.inputs, walk.outputs, walk.sources, walk.env, ctx.references,
                   ctx.fused, walk.refusals, walk.lowered_ops, walk.refused, walk.input_nodes, walk.output_nodes,
                   ctx.filters, walk.weight_refusals)


class _Walk:
    """The walk's own state: what each node lowered to, refusals, debug handles."""

    def __init__(self, ctx: LoweringContext, members: set[Any] | None = None) -> None:
        self.ctx = ctx
        self.members = members
        self.input_nodes: list[Any] = []
        self.output_nodes: list[Any] = []
        self.env: dict[Any, Any] = {}
        self.refusals: list[str] = []
        self.sources: list[tuple[str, str, str]] = []
        self.inputs: list[TensorIO] = []
        self.outputs: list[TensorIO] = []
        self.lowered_ops: list[str] = []
        self.refused: dict[str, str] = {}  # call node name -> why its lowering refused it
        self.weight_refusals: list[str] = []

    def visit(self, node: Any) -> None:
        ctx, program = self.ctx, self.ctx.program
        ctx.node = node
        if node.op == "placeholder":
            if program.is_constant(node):
                tensor = program.constants[node.name]
                ctx.bind_constant(node.name, tensor)
                self.env[node] = tensor
            elif self.members is None:
                self.env[node] = self._input(node)
        elif node.op == "call_function":
            if self.members is None or node in self.members:
                self._call(node)
        elif node.op == "output":
            start = len(ctx.graph.nodes)
            if self.members is None:
                self._outputs(node)
            else:
                self._delegate_outputs(node)
            self._stamp(node, start)
        else:
            self.refuse(node, f"{node.op} nodes are not supported")

    def refuse(self, node: Any, reason: str, weights: bool = False) -> None:
        """Note that ``node`` cannot be lowered (``weights``: because of the scheme asked for)."""
        where = AtenProgram.module_path(node) or "<top level>"
        op = op_name(node.target) if node.op == "call_function" else node.op
        self.refusals.append(f"{op} (node {node.name}, module {where}): {reason}")
        if weights:
            self.weight_refusals.append(self.refusals[-1])
        elif node.op == "call_function":
            self.refused.setdefault(node.name, reason)

    # ------------------------------------------------------------------ inputs

    def _lookup(self, node: Any) -> Any:
        """What ``node`` lowered to; in a delegate, a value of another node becomes an input."""
        if node in self.env:
            return self.env[node]
        val = node.meta.get("val")
        if isinstance(val, (int, float, bool)) or type(val).__name__ in ("SymInt", "SymFloat", "SymBool"):
            return val  # a size: its traced value
        if self.members is None:
            raise KeyError(node)
        self.env[node] = self._input(node)
        self.input_nodes.append(node)
        return self.env[node]

    def _delegate_outputs(self, output: Any) -> None:
        """A delegate's outputs: its values that a node outside it, or the program's output, reads."""
        ctx = self.ctx
        returned = set(output.all_input_nodes)
        for node in ctx.program.graph.nodes:
            if node not in self.members or not any(u not in self.members for u in node.users):  # type: ignore[operator]
                continue
            value = self.env.get(node)
            if not isinstance(value, Activation):
                continue  # a tuple's items are read through getitem nodes, members too
            only_returned = all(u is output for u in node.users) and node in returned
            order = declared_dim_order(node.meta.get("val")) if only_returned else identity(value.rank)
            vid = ctx.in_layout(value, order)
            v = ctx.graph.value(vid)
            if v.is_input or v.is_output or v.is_constant:
                vid = ctx.copy(vid)
            ctx.graph.output(vid)
            sizes = ctx.program.shape(node.meta.get("val"), f"the value of {node.name}")
            self.outputs.append(TensorIO(node.name, value.shape, "float32", order, _dynamic_dims(ctx.program, sizes)))
            self.output_nodes.append(node)

    def _input(self, node: Any) -> Activation:
        val = node.meta.get("val")
        name = self.ctx.program.input_names.get(node.name, node.name)
        sizes = self.ctx.program.shape(val, f"input {name!r}")
        shape = tuple(s.bound for s in sizes)
        dtype = str(getattr(val, "dtype", "")).removeprefix("torch.")
        if dtype == "int8" and any(reads_int8(user) for user in node.users):  # the partition lets no other in
            return self._int8_input(node, name, sizes)
        if dtype != "float32":  # listed with the other refusals (strict=True)
            self.refuse(node, f"input {name!r} is {dtype or type(val).__name__}: XNNPACK's external values are "
                              "float32 (without strict=True, nodes that read it run on ExecuTorch's portable kernels)")
            return Activation(self.ctx.graph.input(shape), shape, identity(len(shape)))
        if math.prod(shape) == 0:
            raise XnnquantError(f"input {name!r} has no elements (shape {shape}): XNNPACK cannot run a value of "
                                "size 0; expected every dim >= 1")
        order = declared_dim_order(val)
        vid = self.ctx.graph.input(tuple(shape[d] for d in order))
        dynamic = _dynamic_dims(self.ctx.program, sizes)
        self.inputs.append(TensorIO(name, shape, "float32", order, dynamic))
        return Activation(vid, shape, order, tuple(s.expr for s in sizes) if dynamic else ())

    def _int8_input(self, node: Any, name: str, sizes: Any) -> Activation:
        """An int8 input read only by conversions to float32 (``partition.reads_int8``): a qint8
        external value of scale 1 and zero point 0, whose conversion gives its integers."""
        shape = tuple(s.bound for s in sizes)
        order = declared_dim_order(node.meta.get("val"))
        vid = self.ctx.graph.input(tuple(shape[d] for d in order), Datatype.qint8, PerTensorQuant(1.0, 0))
        dynamic = _dynamic_dims(self.ctx.program, sizes)
        self.inputs.append(TensorIO(name, shape, "int8", order, dynamic))
        return Activation(vid, shape, order, tuple(s.expr for s in sizes) if dynamic else ())

    # ------------------------------------------------------------------- calls

    def _call(self, node: Any) -> None:
        ctx = self.ctx
        val = node.meta.get("val")
        if isinstance(val, (int, float, bool)) or type(val).__name__ in ("SymInt", "SymFloat", "SymBool"):
            self.env[node] = val  # shape arithmetic (sym_size, ...): the traced value, read by shape arguments
            return
        args, kwargs = _map(node.args, self._lookup), _map(node.kwargs, self._lookup)
        if node.target is operator.getitem:
            self.env[node] = args[0][args[1]] if args[0] is not None else None
            if self.env[node] is None and node.users:
                self.refuse(node, "this output of its producer is not supported (only the first result is)")
                self.env[node] = self._stand_in(node)
            return
        registration = LOWERINGS.get(node.target)
        if registration is None:
            self.refuse(node, "unsupported operator")
            self.env[node] = self._stand_in(node)
            return
        start = len(ctx.graph.nodes)
        try:
            with sizes_stay_dynamic(node, ctx.program.dim_names):
                reason = registration.check(node) if registration.check is not None else None
                if reason is not None:
                    raise XnnquantError(reason)
                result = registration.fn(ctx, *args, **kwargs)
            self.lowered_ops.append(op_name(node.target))
        except XnnquantError as exc:
            self.refuse(node, str(exc), isinstance(exc, WeightRefusal))
            result = self._stand_in(node)
        self._stamp(node, start)
        for emitted in ctx.graph.nodes[start:]:
            assert emitted.kind in registration.emits, (op_name(node.target), emitted.kind)
            for vid in emitted.outputs:
                ctx.producer[vid] = emitted
        try:
            result = self._annotated(node, result)
        except XnnquantError as exc:
            self.refuse(node, str(exc))
            result = self._stand_in(node)
        for t in _leaves(result):
            if isinstance(t, Activation):
                ctx.aliases.setdefault(t.id, []).append(node)
        self.env[node] = result

    def _annotated(self, node: Any, result: Any) -> Any:
        """``result`` with each activation's dynamic dims as torch traced them (``node.meta["val"]``),
        after checking that its shape is the one torch traced (at the bounds)."""
        vals = node.meta.get("val")
        if not isinstance(result, tuple):
            result, vals = (result,), (vals,)
        out = []
        for k, (item, val) in enumerate(zip(result, vals if isinstance(vals, (tuple, list)) else (vals,))):
            if isinstance(item, Activation) and hasattr(val, "shape"):
                sizes = self.ctx.program.shape(val, f"output {k}")
                bounds = tuple(s.bound for s in sizes)
                if bounds != item.shape:
                    raise SelfCheckError(f"the lowering computed shape {item.shape}, torch traced {bounds} (at the "
                                         "bounds of its dynamic dims): a fault of the lowering; please report it")
                item = Activation(item.id, item.shape, item.perm, tuple(s.expr for s in sizes)
                                  if any(s.expr is not None for s in sizes) else ())
            out.append(item)
        return out[0] if len(out) == 1 and not isinstance(node.meta.get("val"), (tuple, list)) else tuple(out)

    def _stamp(self, node: Any, start: int) -> None:
        """Give the nodes emitted since ``start`` the debug handle of ATen node ``node``."""
        graph = self.ctx.graph
        if len(graph.nodes) == start:
            return
        self.sources.append((op_name(node.target) if node.op == "call_function" else node.op, node.name,
                             AtenProgram.module_path(node)))
        for emitted in graph.nodes[start:]:
            emitted.debug_handle = len(self.sources)

    def _stand_in(self, node: Any) -> Any:
        """A value of the node's shape so that lowering can go on (never written: ``lower`` raises)."""
        def make(val: Any) -> Any:
            if isinstance(val, (tuple, list)):
                return tuple(make(v) for v in val)
            if getattr(val, "shape", None) is None:
                return None
            try:
                dims = tuple(s.bound for s in self.ctx.program.shape(val, "a stand-in"))
            except XnnquantError:  # an unbounded size: refused where it arose
                return None
            dims = tuple(max(d, 1) for d in dims) or (1,)  # 0-d stands as [1], as the graph holds it; size 0 as 1
            return Activation(self.ctx.graph.tensor(dims), dims, identity(len(dims)))
        return make(node.meta.get("val"))

    # ----------------------------------------------------------------- outputs

    def _outputs(self, node: Any) -> None:
        ctx = self.ctx
        results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
        used: set[int] = set()
        for i, item in enumerate(results):
            value = self.env.get(item) if item is not None else None
            if not isinstance(value, Activation):
                self.refuse(node, f"output {i} is not computed by the graph (got {type(value).__name__}): "
                            "outputs must depend on the inputs")
                continue
            order = declared_dim_order(item.meta.get("val"))
            vid = ctx.in_layout(value, order)
            v = ctx.graph.value(vid)
            if v.is_input or v.is_output or v.is_constant or vid in used:
                vid = ctx.copy(vid)  # an external value is input or output once; copy it
            used.add(vid)
            ctx.graph.output(vid)
            sizes = ctx.program.shape(item.meta.get("val"), f"output {i}")
            self.outputs.append(TensorIO(f"output {i}", value.shape, "float32", order,
                                         _dynamic_dims(ctx.program, sizes)))


def declared_dim_order(val: Any) -> tuple[int, ...]:
    """The dim order a program input or output declares for example tensor ``val``: channels-last
    ``(0, 2, 3, 1)`` when ``val`` is laid out so, else contiguous (other strides are converted at
    the boundary: ``Exported.run`` lays its inputs out contiguously)."""
    rank = len(getattr(val, "shape", ()))
    order = identity(rank)
    try:
        found = tuple(int(d) for d in val.dim_order())
    except Exception:  # no strides (a symbolic or non-dense tensor): contiguous
        return order
    return found if found == NHWC else order


def _dynamic_dims(program: AtenProgram, sizes: tuple[Size, ...]) -> tuple[DynamicDim | None, ...]:
    """Per dim, its ``DynamicDim`` (name and range) when it is dynamic, else None; () when none is."""
    from torch.utils._sympy.value_ranges import bound_sympy

    if all(s.expr is None for s in sizes):
        return ()
    out: list[DynamicDim | None] = []
    for s in sizes:
        if s.expr is None:
            out.append(None)
            continue
        lower = bound_sympy(s.expr, program.ranges).lower
        name = program.dim_names.get(str(s.expr), str(s.expr))
        try:
            low = max(1, int(lower))  # a size of 0 crashes the runtime
        except (TypeError, ValueError, OverflowError, AttributeError):
            low = 1
        out.append(DynamicDim(name, low, s.bound))
    return tuple(out)


def _map(value: Any, lookup: Callable[[Any], Any]) -> Any:
    """ATen node arguments with every input node replaced by what it lowered to."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, lookup) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, lookup) for k, v in value.items()}
    if hasattr(value, "op") and hasattr(value, "users"):  # an fx Node
        return lookup(value)
    return value


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value
