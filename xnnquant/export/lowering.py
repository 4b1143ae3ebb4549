"""The lowering pass: an ATen graph (``torch.export``, decomposed) onto ``xnnquant.graph.Graph``.

``Lowerer.run`` walks the exported program's nodes in order.  User inputs become fp32
external inputs; parameters, buffers and lifted constants stay torch tensors until a
lowering places them in the graph; a node whose inputs are all constants is computed by
torch right away (constant folding, e.g. a transposed weight); every other node goes to
its registered lowering (``registry.LOWERINGS``).  Outputs become external outputs in
the order the module returns them.

Layouts.  Each lowered value is a ``Tensor``: a graph value id, the torch (logical) shape
and a permutation ``perm`` such that the graph value's dims are ``shape[perm[i]]``.  Most
values are in torch's order (``perm`` the identity).  Convolutions and poolings work in
NHWC, so their results carry ``perm = NHWC = (0, 2, 3, 1)``::

    torch NCHW [N, C, H, W]  --XNNStaticTranspose perm (0, 2, 3, 1)-->  graph NHWC [N, H, W, C]
    graph NHWC [N, H, W, C]  --XNNStaticTranspose perm (0, 3, 1, 2)-->  torch NCHW [N, C, H, W]

Element-wise nodes keep their input's layout (constants are permuted to match, for free),
so a chain conv -> batch norm -> hardswish -> conv needs no transpose at all; a transpose is
emitted only where a node needs another layout (``in_layout``), and each is emitted once
per value and layout.  ``permute`` itself emits nothing: it only changes ``perm``.  This is
where ExecuTorch inserts its NCHW <-> NHWC transposes too: at the boundaries of NHWC regions.

Refusals.  A lowering that cannot map its node raises ``XnnquantError``; a layer that
cannot take the weight scheme asks ``weight_scheme``; an op without a lowering is noted.
Each becomes one line naming the operator, the node and the module path
(``nn_module_stack``), lowering carries on with a stand-in value, and ``run`` raises one
``UnsupportedConfigError`` listing every line at the end.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..datatypes import Datatype
from ..errors import UnsupportedConfigError, XnnquantError
from ..graph import Graph, Target
from ..graph.model import Node
from ..tensor import QuantizedTensor
from .exported import TensorIO
from .options import FP32, WeightScheme
from .quantize import is_stored_as, quantize_weight, weight_nbytes, weight_sqnr
from .registry import LOWERINGS, op_name
from .report import ReportRow
from .streaming import WeightFile, is_meta, meta_tensor_refusal

NHWC = (0, 2, 3, 1)


def identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


@dataclass(frozen=True)
class Tensor:
    """A lowered activation: graph value ``id`` holding torch shape ``shape`` laid out by ``perm``."""

    id: int
    shape: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        """The graph value's dims: ``shape`` permuted by ``perm``."""
        return tuple(self.shape[p] for p in self.perm)

    def physical(self, dim: int) -> int:
        """Where torch dim ``dim`` sits among the graph value's dims."""
        return self.perm.index(dim % self.rank)


def pair(v: Any, default: tuple[int, int] | None = None) -> tuple[int, int]:
    """An ATen int-or-list argument (kernel, stride, padding, ...) as (height, width);
    an empty list is ``default`` (``max_pool2d``'s stride defaults to its kernel so)."""
    if isinstance(v, (list, tuple)):
        if not v:
            if default is None:
                raise XnnquantError("an empty size list where one or two sizes were expected")
            return default
        t = tuple(int(d) for d in v)
        return (t[0], t[0]) if len(t) == 1 else (t[0], t[1])
    return int(v), int(v)


def moves_only_ones(shape: tuple[int, ...], perm: tuple[int, ...]) -> bool:
    """True when permuting ``shape`` by ``perm`` keeps every dim larger than 1 in order,
    so the elements stay in the same memory order (a reshape does the transpose)."""
    big = [p for p in perm if shape[p] != 1]
    return big == sorted(big)


class Lowerer:
    """State of one export: the graph under construction and what each ATen node became."""

    def __init__(self, program: Any, *, weights: WeightScheme, fallback: tuple[WeightScheme, ...], method: str,
                 target: Target, statistics: Any = None,
                 progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None,
                 weight_file: WeightFile | None = None) -> None:
        self.program = program
        self.weights, self.fallback, self.method, self.target = weights, fallback, method, target
        self.statistics = statistics  # calibration.LinearStatistics, or None
        self.equalized: dict[Any, Any] = {}  # linear ATen node -> its layer norm's (shared input) node
        self._equalization: dict[Any, np.ndarray] = {}  # input node -> its scales
        self.progress = progress
        # for 1.4.1, scales go to the constant segment as ExecuTorch 1.4.1 stores them (blockwise:
        # bf16, 2 bytes each, 0.65 MB less for MiniLM at qb4w:32); XN01-era runtimes read them
        # from the flatbuffer, blockwise ones as bf16 copies besides the fp32 list
        later = target is not Target.XN01
        self.graph = Graph(target=target, write_scale_bf16=not later, scales_in_segment=later)
        self.weight_file = weight_file  # streaming export: where meta tensors' values are
        self.stored: dict[int, str] = {}  # id(torch tensor) -> its name, for parameters and buffers only
        self.env: dict[Any, Any] = {}
        self.node: Any = None  # the ATen node being lowered
        self.refusals: list[str] = []
        self.rows: list[ReportRow] = []
        self.producer: dict[int, Node] = {}
        self.folded_batch_norms: dict[Any, Any] = {}  # conv node -> the batch-norm node folded into it
        self._layouts: dict[tuple[int, tuple[int, ...]], int] = {}
        self._dynamic: dict[tuple[int, int], int] = {}
        self._scaled: dict[tuple[int, int], int] = {}
        self._constants: dict[tuple[int, tuple[int, ...]], tuple[Any, int]] = {}
        self.aliases: dict[int, list[Any]] = {}  # value id -> the ATen nodes that lowered to it
        self.origins: dict[int, str] = {}  # id(torch tensor) -> its parameter / buffer name
        #: what each node's ``debug_handle`` (1, 2, ...) stands for: (ATen op, ATen node, module path)
        self.sources: list[tuple[str, str, str]] = []
        self.input_specs: list[TensorIO] = []
        self.output_specs: list[TensorIO] = []

    # ------------------------------------------------------------- the walk

    def run(self) -> Graph:
        """Lower every node; raise one ``UnsupportedConfigError`` listing all refusals."""
        import torch

        from . import conv

        program = self.program
        sig = program.graph_signature
        named = {**program.state_dict, **getattr(program, "constants", {})}
        sources = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                   **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
        if getattr(sig, "buffers_to_mutate", None):
            raise UnsupportedConfigError(
                f"the module mutates buffers ({', '.join(sorted(sig.buffers_to_mutate.values()))}): "
                "a delegate cannot hold state; export the module in eval mode without in-place buffer updates")
        user_inputs = list(sig.user_inputs)
        conv.plan_batch_norm_folding(self, program.graph)
        if self.statistics is not None and not self.statistics.grams:
            from . import linear

            linear.plan_equalization(self, program.graph)
        nodes = list(program.graph.nodes)
        walk: Iterator[Any] = iter(nodes)
        if self.progress is not None:
            walk = self.progress(walk, len(nodes))
        with torch.no_grad():
            for node in walk:
                self.node = node
                if node.op == "placeholder":
                    if node.name in sources:
                        tensor = named[sources[node.name]]
                        self.origins[id(tensor)] = sources[node.name]
                        self.stored[id(tensor)] = sources[node.name]
                        self.env[node] = tensor
                    elif node.name in user_inputs:
                        self.env[node] = self._input(node)
                    else:
                        raise UnsupportedConfigError(f"placeholder {node.name!r} is neither an input nor a weight")
                elif node.op == "call_function":
                    self._call(node)
                elif node.op == "output":
                    self._outputs(node)
                else:
                    self.refuse(f"{node.op} nodes are not supported")
        if self.refusals:
            lines = "\n".join(f"  - {r}" for r in self.refusals)
            raise UnsupportedConfigError(f"export refused {len(self.refusals)} node(s) or layer(s):\n{lines}")
        return self.graph

    def _input(self, node: Any) -> Tensor:
        val = node.meta.get("val")
        shape = self._static_shape(val, f"input {node.name!r}")
        dtype = str(getattr(val, "dtype", "")).removeprefix("torch.")
        if dtype != "float32":
            raise XnnquantError(
                f"input {node.name!r} is {dtype or type(val).__name__}: XNNPACK's external values are float32 "
                "here; pass float32 example inputs (cast masks and ids-derived tensors to float)")
        order = _declared_dim_order(val)
        vid = self.graph.input(tuple(shape[d] for d in order))
        self.input_specs.append(TensorIO(node.name, shape, "float32", order))
        return Tensor(vid, shape, order)

    @staticmethod
    def _static_shape(val: Any, what: str) -> tuple[int, ...]:
        shape = getattr(val, "shape", None)
        if shape is None:
            raise XnnquantError(f"{what} is not a tensor: got {type(val).__name__}")
        dims = []
        for d in shape:
            if not isinstance(d, int):
                raise XnnquantError(
                    f"{what} has a dynamic dimension {d} (shape {tuple(shape)}): XNNPACK payloads written by "
                    "xnnquant have static shapes; export with static example inputs (no dynamic_shapes)")
            dims.append(int(d))
        return tuple(dims)

    def _call(self, node: Any) -> None:
        args = _map(node.args, self.env)
        kwargs = _map(node.kwargs, self.env)
        if node.target is operator.getitem or not any(isinstance(a, Tensor) for a in _leaves((args, kwargs))):
            if node.target is operator.getitem:
                self.env[node] = args[0][args[1]] if args[0] is not None else None
                if self.env[node] is None and node.users:
                    self.refuse("this output of its producer is not supported (only the first result is)")
                    self.env[node] = self._stand_in(node)
                return
            self.env[node] = self._fold(node, args, kwargs)
            return
        registration = LOWERINGS.get(node.target)
        if registration is None:
            self.refuse("unsupported operator")
            self.env[node] = self._stand_in(node)
            return
        start = len(self.graph.nodes)
        try:
            result = registration.fn(self, *args, **kwargs)
        except XnnquantError as exc:
            self.refuse(str(exc))
            result = self._stand_in(node)
        self._stamp(start)
        for emitted in self.graph.nodes[start:]:
            assert emitted.kind in registration.emits, (op_name(node.target), emitted.kind)
            for vid in emitted.outputs:
                self.producer[vid] = emitted
        for t in _leaves(result):
            if isinstance(t, Tensor):
                self.aliases.setdefault(t.id, []).append(node)
        self.env[node] = result

    def _fold(self, node: Any, args: Any, kwargs: Any) -> Any:
        """Compute a node whose inputs are all constants with torch itself."""
        try:
            result = node.target(*args, **kwargs)
        except Exception as exc:  # torch's own error on constant inputs: report it as a refusal
            self.refuse(f"cannot compute on constant inputs: {type(exc).__name__}: {exc}")
            return self._stand_in(node)
        tensors = [a for a in _leaves((args, kwargs)) if id(a) in self.origins]
        if len(tensors) == 1 and hasattr(result, "shape"):  # e.g. a transposed weight keeps its name
            self.origins[id(result)] = self.origins[id(tensors[0])]
        return result

    def _stamp(self, start: int) -> None:
        """Give the nodes emitted since ``start`` the debug handle of the current ATen node."""
        if len(self.graph.nodes) == start:
            return
        node = self.node
        self.sources.append((op_name(node.target) if node.op == "call_function" else node.op, node.name,
                             self.module_path()))
        for emitted in self.graph.nodes[start:]:
            emitted.debug_handle = len(self.sources)

    def _outputs(self, node: Any) -> None:
        start = len(self.graph.nodes)
        self._emit_outputs(node)
        self._stamp(start)

    def _emit_outputs(self, node: Any) -> None:
        results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
        used: set[int] = set()
        for i, item in enumerate(results):
            value = self.env.get(item) if item is not None else None
            if not isinstance(value, Tensor):
                self.refuse(f"output {i} is not computed by the graph (got {type(value).__name__}): "
                            "outputs must depend on the inputs")
                continue
            order = _declared_dim_order(item.meta.get("val"))
            vid = self.in_layout(value, order)
            v = self.graph.value(vid)
            if v.is_input or v.is_output or v.is_constant or vid in used:
                vid = self.copy(vid)  # an external value is input or output once; copy it
            used.add(vid)
            self.graph.output(vid)
            self.output_specs.append(TensorIO(f"output {i}", value.shape, "float32", order))

    # ------------------------------------------------------------ refusals

    def module_path(self, node: Any = None) -> str:
        """The module the node came from (``nn_module_stack``), '' at the top level."""
        node = self.node if node is None else node
        stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        return str(path)

    def refuse(self, reason: str) -> None:
        """Note that the current node cannot be lowered (see the module docstring)."""
        node = self.node
        where = self.module_path() or "<top level>"
        op = op_name(node.target) if node is not None and node.op == "call_function" else getattr(node, "op", "?")
        self.refusals.append(f"{op} (node {getattr(node, 'name', '?')}, module {where}): {reason}")

    def _stand_in(self, node: Any) -> Any:
        """A value of the node's shape so that lowering can go on (never written: run raises)."""
        def make(val: Any) -> Any:
            if isinstance(val, (tuple, list)):
                return tuple(make(v) for v in val)
            shape = getattr(val, "shape", None)
            if shape is None or not all(isinstance(d, int) for d in shape):
                return None
            dims = tuple(int(d) for d in shape)
            return Tensor(self.graph.tensor(dims), dims, identity(len(dims)))
        return make(node.meta.get("val"))

    # ------------------------------------------------------------- values

    def tensor(self, vid: int, shape: tuple[int, ...], perm: tuple[int, ...] | None = None) -> Tensor:
        """Wrap graph value ``vid`` as the torch shape ``shape`` (laid out by ``perm``)."""
        perm = identity(len(shape)) if perm is None else perm
        dims = tuple(shape[p] for p in perm)
        got = tuple(self.graph.value(vid).dims)
        assert got == dims, (got, dims, shape, perm)
        return Tensor(vid, tuple(shape), perm)

    def value(self, x: Any) -> Tensor:
        """``x`` as a graph ``Tensor``: activations as they are, constants placed in the graph."""
        if isinstance(x, Tensor):
            return x
        arr = self.constant_array(x)
        return Tensor(self.constant(arr, key=x), arr.shape, identity(arr.ndim))

    def constant_array(self, x: Any, what: str = "constant") -> np.ndarray:
        """A torch tensor, numpy array or Python number as a float32 numpy array (``()`` for a scalar)."""
        if isinstance(x, bool) or x is None:
            raise XnnquantError(f"{what} must be a float tensor or number: got {x!r}")
        if isinstance(x, (int, float)):
            return np.asarray(x, np.float32)
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "fiu":
                raise XnnquantError(f"{what} has dtype {x.dtype}: expected a float array")
            return np.asarray(x, np.float32)
        import torch

        if not isinstance(x, torch.Tensor):
            raise XnnquantError(f"{what} must be a tensor or a number: got {type(x).__name__}")
        if not (x.dtype.is_floating_point or x.dtype in (torch.int64, torch.int32)):
            raise XnnquantError(f"{what} has dtype {x.dtype}: expected a float tensor")
        if x.device.type == "meta":
            name = self.stored.get(id(x))
            if self.weight_file is None:
                raise XnnquantError(f"{what} is on the meta device: its values are needed here (pass "
                                    "state_dict= with a safetensors file holding the module's tensors)")
            if name is None:
                raise XnnquantError(meta_tensor_refusal(what, self.origins.get(id(x))))
            return self.weight_file.array(name, tuple(int(d) for d in x.shape), what)
        return x.detach().to(torch.float32).contiguous().numpy()

    def constant(self, arr: np.ndarray, key: Any = None, dims: tuple[int, ...] | None = None) -> int:
        """A float32 constant value; the same ``key`` object (and dims) gives the same value."""
        data = np.ascontiguousarray(arr, np.float32)
        if dims is not None:
            data = data.reshape(dims)
        if data.ndim == 0:
            data = data.reshape(1)  # XNNPACK serializes a scalar as [1]
        cache = None if key is None else (id(key), data.shape)
        if cache is not None and cache in self._constants:
            held, vid = self._constants[cache]
            if held is key:  # the key object is kept alive by the entry, so its id is not reused
                return vid
        vid = self.graph.constant(data)
        if cache is not None:
            self._constants[cache] = (key, vid)
        return vid

    def constant_like(self, x: Any, like: Tensor) -> int:
        """Constant ``x`` laid out to broadcast against ``like`` as torch would.

        Torch aligns shapes from the right; the constant gets ``like``'s rank (leading
        ones) and is permuted by ``like.perm``.
        """
        arr = self.constant_array(x)
        if arr.ndim > like.rank:
            raise XnnquantError(f"a constant of shape {arr.shape} does not broadcast into {like.shape}")
        full = arr.reshape((1,) * (like.rank - arr.ndim) + arr.shape)
        if arr.size == 1:
            return self.constant(arr.reshape(1), key=x if not isinstance(x, (int, float)) else None)
        laid = np.ascontiguousarray(full.transpose(like.perm)) if like.perm != identity(like.rank) else full
        return self.constant(laid, key=x if like.perm == identity(like.rank) else None)

    # ------------------------------------------------------------ layouts

    def in_layout(self, x: Tensor, perm: tuple[int, ...]) -> int:
        """Graph value holding ``x`` laid out by ``perm`` (a transpose when needed, emitted once)."""
        if x.perm == perm:
            return x.id
        key = (x.id, perm)
        if key not in self._layouts:
            order = tuple(x.perm.index(p) for p in perm)  # new dim i = old dim order[i]
            dims = tuple(x.shape[p] for p in perm)
            if moves_only_ones(x.dims, order):
                self._layouts[key] = self.graph.static_reshape(x.id, dims)
            else:
                self._layouts[key] = self.graph.static_transpose(x.id, order)
            self._note_producer()
        return self._layouts[key]

    def canonical(self, x: Tensor) -> int:
        """Graph value holding ``x`` in torch's dim order."""
        return self.in_layout(x, identity(x.rank))

    def relaid(self, x: Tensor, perm: tuple[int, ...]) -> Tensor:
        return Tensor(self.in_layout(x, perm), x.shape, perm)

    def _note_producer(self) -> None:
        node = self.graph.nodes[-1]
        for vid in node.outputs:
            self.producer[vid] = node

    def dynamic(self, vid: int, num_nonbatch_dims: int) -> int:
        """``vid`` converted to qdint8 (per-row dynamic int8), one conversion per value."""
        key = (vid, num_nonbatch_dims)
        if key not in self._dynamic:
            self._dynamic[key] = self.graph.convert(vid, Datatype.qdint8, num_nonbatch_dims=num_nonbatch_dims)
        return self._dynamic[key]

    def scaled_input(self, vid: int, source: Any, scales: np.ndarray) -> int:
        """``vid / scales`` along the last dim (equalization), one multiply per input."""
        key = (vid, id(source))
        if key not in self._scaled:
            inverse = (np.float32(1) / scales).astype(np.float32)
            self._scaled[key] = self.graph.multiply(vid, self.constant(inverse))
        return self._scaled[key]

    def copy(self, vid: int) -> int:
        """A copy of ``vid`` (XNNCopy for 1.4.1; a same-shape reshape for XN01)."""
        if "XNNCopy" in self.graph.target.node_kinds:
            return self.graph.copy(vid)
        return self.graph.static_reshape(vid, self.graph.value(vid).dims)

    def fuse_clamp(self, x: Tensor, low: float, high: float) -> Tensor | None:
        """Clamp ``x`` by tightening its producer's output bounds, when that is exact.

        Exact when the producer is a node whose bounds the runtime applies and nothing
        else reads its value: every ATen node that lowered to that value (the producer's
        node and any ``permute`` / ``view`` aliases of it) has exactly one user, so the
        only reader is the chain ending in the current node.  Returns the clamped tensor
        (the same value), or None.
        """
        from ..graph.interpreter import CLAMPED_KINDS

        producer = self.producer.get(x.id)
        if producer is None or producer.kind not in CLAMPED_KINDS or self.graph.value(x.id).is_output:
            return None
        nodes = self.aliases.get(x.id)
        if not nodes or any(len(n.users) != 1 for n in nodes):
            return None
        lo = -np.inf if producer.output_min is None else producer.output_min
        hi = np.inf if producer.output_max is None else producer.output_max
        producer.output_min = float(np.float32(max(lo, low))) + 0.0
        producer.output_max = float(np.float32(min(hi, high))) + 0.0
        return x

    # ------------------------------------------------------------ weights

    def equalization(self, source: Any, path: str) -> np.ndarray:
        """Per-channel scales ``s`` of the input ATen node ``source`` shared by the linears
        that read it (``calibration.equalization_scales``), computed once."""
        if source not in self._equalization:
            from .calibration import equalization_scales

            readers = [n for n, s in self.equalized.items() if s is source]
            weights = [self.constant_array(self.env[n.args[1]]) for n in readers]
            self._equalization[source] = equalization_scales(self.statistics.absmax[path], weights)
        return self._equalization[source]

    def weight_path(self, weight: Any) -> str:
        """The module a weight belongs to: its parameter name without ``.weight``."""
        name = self.origins.get(id(weight))
        if name is None:
            return self.module_path()
        if name == "weight":  # the exported module itself is the layer
            return ""
        return name[: -len(".weight")] if name.endswith(".weight") else name

    def weight_scheme(self, path: str, refusal: Callable[[WeightScheme], str | None]) -> tuple[WeightScheme, str]:
        """The scheme layer ``path`` gets, and the reason when it is not the requested one.

        ``refusal(scheme)`` says why the layer cannot take ``scheme`` (None: it can).  A
        refused layer takes the first ``fallback`` scheme that fits, else it is refused
        (noted; the export then fails naming it).
        """
        reason = refusal(self.weights)
        if reason is None:
            return self.weights, ""
        reasons = [f"{self.weights}: {reason}"]
        for scheme in self.fallback:
            again = refusal(scheme)
            if again is None:
                return scheme, "; ".join(reasons) + f"; took fallback {scheme}"
            reasons.append(f"fallback {scheme}: {again}")
        hint = "fallback='fp32'" if not self.fallback else "a fallback it can take, e.g. fallback=('qc8w', 'fp32')"
        self.refuse(f"layer {path or '<top level>'!r} cannot take its weights: {'; '.join(reasons)} (pass {hint})")
        return FP32, reason

    def quantized_weight(self, weight: Any, path: str, scheme: WeightScheme, note: str,
                         layout: Callable[[np.ndarray], np.ndarray] | None = None,
                         axis: int = 0) -> int:
        """Quantize a layer's weight (in the layout the node reads), record it in the report,
        and place it in the graph; returns the value id.  A meta weight of a streaming export
        is quantized only when the payload is written (``streaming.WeightFile.weight``)."""
        if is_meta(weight) and self.weight_file is not None:
            name = self.stored.get(id(weight))
            if name is None:
                raise XnnquantError(meta_tensor_refusal(f"the weight of {path!r}", self.origins.get(id(weight))))
            shape = tuple(int(d) for d in weight.shape)
            deferred = self.weight_file.weight(name, shape, path, scheme, self.method, note, layout, axis, self.rows)
            return self.graph.constant(deferred)
        arr = self.constant_array(weight, f"the weight of {path!r}")
        if layout is not None:
            arr = np.ascontiguousarray(layout(arr))
        grams = {} if self.statistics is None else self.statistics.grams
        done = None if self.statistics is None else self.statistics.quantized.get(path)
        if done is not None and axis == 0 and is_stored_as(done, scheme, arr.shape):
            q = done  # quantized by sequential calibration (calibration.sequential_statistics)
        else:
            q = quantize_weight(arr, scheme, self.method, grams.get(path), axis=axis)
        self.rows.append(ReportRow(path, tuple(int(d) for d in arr.shape), str(scheme),
                                   weight_nbytes(q, self.graph.scales_in_segment), weight_sqnr(arr, q), note))
        if isinstance(q, QuantizedTensor):
            return self.graph.constant(q)
        return self.constant(q)


def _declared_dim_order(val: Any) -> tuple[int, ...]:
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


def _map(value: Any, env: dict[Any, Any]) -> Any:
    """ATen node arguments with every input node replaced by what it lowered to."""
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, env) for k, v in value.items()}
    if hasattr(value, "op") and hasattr(value, "users"):  # an fx Node
        return env[value]
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
