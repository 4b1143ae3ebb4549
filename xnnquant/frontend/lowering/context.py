"""``LoweringContext``: the only surface a lowering sees, and ``Activation``, its value handle.

Layouts.  Each lowered activation is an ``Activation``: a graph value id, the torch
(logical) shape and a permutation ``perm`` such that the graph value's dims are
``shape[perm[i]]``.  Most values are in torch's order (``perm`` the identity).
Convolutions and poolings work in NHWC, so their results carry ``perm = NHWC =
(0, 2, 3, 1)``::

    torch NCHW [N, C, H, W]  --XNNStaticTranspose perm (0, 2, 3, 1)-->  graph NHWC [N, H, W, C]
    graph NHWC [N, H, W, C]  --XNNStaticTranspose perm (0, 3, 1, 2)-->  torch NCHW [N, C, H, W]

Element-wise nodes keep their input's layout (constants are permuted to match, for
free), so a chain conv -> batch norm -> hardswish -> conv needs no transpose at all; a
transpose is emitted only where a node needs another layout (``in_layout``), once per
value and layout.  ``permute`` itself emits nothing: it only changes ``perm``.  This is
where ExecuTorch inserts its NCHW <-> NHWC transposes too: at the boundaries of NHWC
regions.  A channels-last program input arrives as NHWC (``perm = NHWC``) and needs none.

Weights.  ``weight(tensor, layer, layout)`` is where a layer's filter enters the graph:
the weight policy (``weights.WeightPolicy``) chooses its scheme, it is quantized (or taken
from sequential calibration, or deferred to the write for a streaming export) and a
report row records it.

Refusals.  A lowering that cannot map its node raises ``XnnquantError`` with the reason;
the walker (``walk.py``) notes it with the node's op and module path.

(Over 500 lines, one module: the context is the one object a lowering sees, and its layouts,
constants and weights work on the same graph and values; ``Activation`` and the weight
options are what its methods take and give.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...datatypes import Datatype
from ...errors import XnnquantError
from ...graph import Graph
from ...graph.interpreter import CLAMPED_KINDS
from ...graph.model import Node
from ...tensor import QuantizedTensor
from ..prequantized import stored_of
from ..program import AtenProgram
from ..report import ReportRow
from ..streaming import is_meta, laid_out_shape, meta_tensor_refusal
from ..weight_sqnr import weight_sqnr
from ..weights import Choice, Layer, WeightPolicy, WeightScheme

NHWC = (0, 2, 3, 1)


def identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = i
    return tuple(out)


@dataclass(frozen=True)
class Activation:
    """A lowered activation: graph value ``id`` holding torch shape ``shape`` laid out by ``perm``.

    ``sym``: per torch dim, the sympy expression of a dynamic size (None for a static one;
    empty: all static); ``shape`` then holds its upper bound, the size the graph value is
    declared with (``program.Size``).
    """

    id: int
    shape: tuple[int, ...]
    perm: tuple[int, ...]
    sym: tuple[Any, ...] = ()

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        """The graph value's dims: ``shape`` permuted by ``perm``."""
        return tuple(self.shape[p] for p in self.perm)

    @property
    def exprs(self) -> tuple[Any, ...]:
        """``sym`` with one entry per dim (None for static)."""
        return self.sym if self.sym else (None,) * self.rank

    @property
    def physical_exprs(self) -> tuple[Any, ...]:
        """``exprs`` in the graph value's dim order."""
        exprs = self.exprs
        return tuple(exprs[p] for p in self.perm)

    def is_dynamic(self, dim: int) -> bool:
        return self.exprs[dim % self.rank] is not None

    @property
    def dynamic(self) -> bool:
        return any(e is not None for e in self.exprs)

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


class WeightRefusal(XnnquantError):
    """A layer that cannot take the weights asked for (``fallback=None``), or whose weights
    cannot be quantized as asked (their calibration does not fit, they are not finite):
    refused, never sent to the portable kernels in float."""


@dataclass(frozen=True)
class FilterOrigin:
    """Where a float filter constant came from: the torch ``weight`` argument, the ``layout``
    that turned its values (of ``pre_shape``) into the graph's, and the weight's own
    ``shape``; ``row``: its report row.  ``unlaid(a)`` takes an array in the graph's layout
    back to the weight's (what the static int8 self-check feeds torch)."""

    weight: Any
    layout: Callable[[np.ndarray], np.ndarray] | None
    pre_shape: tuple[int, ...]
    shape: tuple[int, ...]
    row: int

    def unlaid(self, laid: np.ndarray) -> np.ndarray:
        return _unlaid(laid, self.layout, self.pre_shape, self.shape)


@dataclass(frozen=True)
class QuantizedReference:
    """How the self-check computes an ATen node whose lowering quantized: the filter argument
    ``weight`` replaced by ``dequantized`` (the stored filter's values, in that argument's
    layout), the activation input multiplied by ``input_scale`` along its last dim when
    given (equalization), then quantized to int8 per row of ``nonbatch_dims`` dims with its
    torch dims in the order ``input_layout`` (as the graph's XNNConvert sees it)."""

    weight: Any
    dequantized: np.ndarray
    input_scale: np.ndarray | None
    input_layout: tuple[int, ...]
    nonbatch_dims: int


@dataclass
class WeightOptions:
    """What ``LoweringContext.weight`` needs besides the policy: the scale-choice method,
    calibration (``calibration.LayerStatistics``, or None) and the report to fill."""

    policy: WeightPolicy
    method: str = "mse"
    statistics: Any = None
    rows: list[ReportRow] | None = None
    #: choose schemes and fill the report without quantizing (``xq.check``): filters become
    #: stand-in values of their stored shape, never written
    dry_run: bool = False
    #: filters already quantized in this export, for a program lowered twice (a dynamic pure program
    #: whose refused nodes go to the portable kernels: ``stages.partition.portable_after_refusals``):
    #: (tensor id, scheme, method, axis, layer) -> (the float values quantized, what they
    #: became), reused when the values are equal (``_known``); None: nothing kept.
    #: ``dataclasses.replace`` copies share it; the export clears it after lowering.
    memo: dict[tuple[Any, ...], tuple[np.ndarray, Any]] | None = field(default=None, compare=False)


def _known(memo: dict[tuple[Any, ...], tuple[np.ndarray, Any]] | None, key: tuple[Any, ...],
           arr: np.ndarray) -> Any:
    """What ``arr`` was quantized to under ``key`` earlier in this export, or None (its values
    compared in full: two nodes may read one tensor in two layouts of one shape)."""
    seen = None if memo is None else memo.get(key)
    if seen is not None and seen[0].shape == arr.shape and np.array_equal(seen[0], arr):
        return seen[1]
    return None


class LoweringContext:
    """The graph under construction and what a lowering may ask of it (module docstring)."""

    def __init__(self, program: AtenProgram, graph: Graph, weights: WeightOptions) -> None:
        self.program = program
        self.graph = graph
        self.weights = weights
        self.rows: list[ReportRow] = weights.rows if weights.rows is not None else []
        self.node: Any = None  # the ATen node being lowered
        #: graph value id -> the node that produced it (``fuse_clamp`` reads it)
        self.producer: dict[int, Node] = {}
        #: graph value id -> the ATen nodes that lowered to it (a value and its permute / view aliases)
        self.aliases: dict[int, list[Any]] = {}
        self._names: dict[int, str] = {}  # id(constant tensor) -> placeholder name
        self._layouts: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
        self._dynamic: dict[tuple[int, int], int] = {}
        self._scaled: dict[tuple[int, int], int] = {}
        self._constants: dict[tuple[int, tuple[int, ...]], tuple[Any, int]] = {}
        self._filled: dict[tuple[tuple[int, ...], float], int] = {}
        self._dequantized: dict[int, tuple[Any, np.ndarray]] = {}  # id(filter tensor) -> (it, its stored values)
        #: ATen node -> how the self-check computes it (nodes whose lowering quantized)
        self.references: dict[Any, QuantizedReference] = {}
        #: graph value id of each float filter -> where it came from (read by the static int8 rewrite)
        self.filters: dict[int, FilterOrigin] = {}
        #: graph value id -> (its producer's bounds before any clamp was fused into them, and each
        #: ATen node whose clamp was, in order, with the bounds the producer had after it), for
        #: the self-check
        self.fused: dict[int, tuple[tuple[float | None, float | None], list[tuple[Any, float, float]]]] = {}

    @property
    def target(self) -> Any:
        return self.graph.target

    def bind_constant(self, name: str, tensor: Any) -> None:
        """Remember that ``tensor`` is the constant placeholder ``name`` (its origin names report rows)."""
        self._names[id(tensor)] = name

    def module_path(self) -> str:
        """The module the node being lowered was traced in, '' at the top level."""
        return AtenProgram.module_path(self.node)

    def annotation(self, key: str) -> Any:
        """What a pass noted on the node being lowered (``node.meta[key]``), or None."""
        return self.node.meta.get(key) if self.node is not None else None

    # ----------------------------------------------------------------- values

    def tensor(self, vid: int, shape: tuple[int, ...], perm: tuple[int, ...] | None = None,
               sym: tuple[Any, ...] = ()) -> Activation:
        """Wrap graph value ``vid`` as the torch shape ``shape`` (laid out by ``perm``; ``sym``:
        its dynamic dims, see ``Activation``)."""
        perm = identity(len(shape)) if perm is None else perm
        dims = tuple(shape[p] for p in perm)
        got = tuple(self.graph.value(vid).dims)
        assert got == dims, (got, dims, shape, perm)
        return Activation(vid, tuple(shape), perm, tuple(sym) if any(e is not None for e in sym) else ())

    def reshape(self, vid: int, dims: tuple[int, ...], exprs: tuple[Any, ...] = ()) -> int:
        """Graph value ``vid`` read in its memory order as ``dims`` (XNNStaticReshape).

        ``exprs``: per new dim, its dynamic size (None for static).  A dynamic dim is written
        as inferred (XNNPACK resolves it from the element count on every call); XNNPACK
        infers one dim at most, so a reshape to two dynamic dims is refused.
        """
        dynamic = [i for i, e in enumerate(exprs) if e is not None]
        if len(dynamic) > 1:
            raise XnnquantError(
                f"a reshape to {tuple(e if e is not None else d for d, e in zip(dims, exprs))} has "
                f"{len(dynamic)} dynamic dims: XNNPACK infers at most one dim of a reshape on each call "
                "(export with fewer dynamic dims, e.g. a static batch)")
        return self.graph.static_reshape(vid, tuple(-1 if i in dynamic else d for i, d in enumerate(dims)))

    def value(self, x: Any) -> Activation:
        """``x`` as an ``Activation``: activations as they are, constants placed in the graph."""
        if isinstance(x, Activation):
            return x
        arr = self.constant_array(x)
        return Activation(self.constant(arr, key=x), arr.shape, identity(arr.ndim))

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
        name = self._names.get(id(x))
        if is_meta(x):
            if name is None:
                raise XnnquantError(meta_tensor_refusal(what, None))
            return self.program.array(name, what)
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

    def filled(self, dims: tuple[int, ...], value: float) -> int:
        """A float32 constant of ``dims`` holding ``value`` everywhere (one value per dims and value)."""
        key = (tuple(dims), float(np.float32(value)))
        vid = self._filled.get(key)
        if vid is None:
            vid = self._filled[key] = self.graph.constant(np.full(dims, value, np.float32))
        return vid

    def constant_like(self, x: Any, like: Activation) -> int:
        """Constant ``x`` laid out to broadcast against ``like`` as torch would.

        Torch aligns shapes from the right; the constant gets ``like``'s rank (leading
        ones) and is permuted by ``like.perm``.
        """
        arr = self.constant_array(x)
        if arr.ndim > like.rank:
            raise XnnquantError(f"a constant of shape {arr.shape} does not broadcast into {like.shape}")
        full = arr.reshape((1,) * (like.rank - arr.ndim) + arr.shape)
        for d, e in enumerate(like.exprs):
            if e is not None and full.shape[d] != 1:
                raise XnnquantError(f"a constant of shape {arr.shape} is combined with dim {d} of {like.shape}, "
                                    f"which is dynamic ({e}): a constant cannot follow its size")
        if arr.size == 1:
            return self.constant(arr.reshape(1), key=x if not isinstance(x, (int, float)) else None)
        laid = np.ascontiguousarray(full.transpose(like.perm)) if like.perm != identity(like.rank) else full
        return self.constant(laid, key=x if like.perm == identity(like.rank) else None)

    # ---------------------------------------------------------------- layouts

    def in_layout(self, x: Activation, perm: tuple[int, ...]) -> int:
        """Graph value holding ``x`` laid out by ``perm`` (a transpose when needed, emitted once)."""
        if x.perm == perm:
            return x.id
        key = (x.id, x.perm, perm)  # one value read as two tensors (q and q^T of q @ q^T): two layouts
        if key not in self._layouts:
            order = tuple(x.perm.index(p) for p in perm)  # new dim i = old dim order[i]
            dims = tuple(x.shape[p] for p in perm)
            exprs = tuple(x.exprs[p] for p in perm)
            if moves_only_ones(x.dims, order) and sum(e is not None for e in exprs) <= 1:
                self._layouts[key] = self.reshape(x.id, dims, exprs)
            else:
                self._layouts[key] = self.graph.static_transpose(x.id, order)
        return self._layouts[key]

    def canonical(self, x: Activation) -> int:
        """Graph value holding ``x`` in torch's dim order."""
        return self.in_layout(x, identity(x.rank))

    def relaid(self, x: Activation, perm: tuple[int, ...]) -> Activation:
        return Activation(self.in_layout(x, perm), x.shape, perm, x.sym)

    def dynamic(self, vid: int, num_nonbatch_dims: int) -> int:
        """``vid`` converted to qdint8 (per-row dynamic int8), one conversion per value."""
        key = (vid, num_nonbatch_dims)
        if key not in self._dynamic:
            self._dynamic[key] = self.graph.convert(vid, Datatype.qdint8, num_nonbatch_dims=num_nonbatch_dims)
        return self._dynamic[key]

    @staticmethod
    def reciprocal(scales: np.ndarray) -> np.ndarray:
        """``1 / scales`` in float32, the constant an equalized input is multiplied by."""
        return (np.float32(1) / scales).astype(np.float32)

    def scaled_input(self, vid: int, source: Any, scales: np.ndarray) -> int:
        """``vid / scales`` along the last dim (equalization), one multiply per input."""
        key = (vid, id(source))
        if key not in self._scaled:
            self._scaled[key] = self.graph.multiply(vid, self.constant(self.reciprocal(scales)))
        return self._scaled[key]

    def copy(self, vid: int) -> int:
        """A copy of ``vid`` (XNNCopy for 1.4.1; a same-shape reshape for XN01)."""
        if "XNNCopy" in self.graph.target.node_kinds:
            return self.graph.copy(vid)
        return self.graph.static_reshape(vid, self.graph.value(vid).dims)  # static: XN01 has no dynamic dims

    def fuse_clamp(self, x: Activation, low: float, high: float) -> Activation | None:
        """Clamp ``x`` by tightening its producer's output bounds, when that is exact.

        Exact when the producer is a node whose bounds the runtime applies and nothing
        else reads its value: every ATen node that lowered to that value (the producer's
        node and any ``permute`` / ``view`` aliases of it) has exactly one user, so the
        only reader is the chain ending in the current node.  Returns the clamped
        activation (the same value), or None.
        """
        producer = self.producer.get(x.id)
        if producer is None or producer.kind not in CLAMPED_KINDS or self.graph.value(x.id).is_output:
            return None
        nodes = self.aliases.get(x.id)
        if not nodes or any(len(n.users) != 1 for n in nodes):
            return None
        before = (producer.output_min, producer.output_max)
        lo = -np.inf if producer.output_min is None else producer.output_min
        hi = np.inf if producer.output_max is None else producer.output_max
        producer.output_min = float(np.float32(max(lo, low))) + 0.0
        producer.output_max = float(np.float32(min(hi, high))) + 0.0
        self.fused.setdefault(x.id, (before, []))[1].append((self.node, producer.output_min, producer.output_max))
        return x

    # ---------------------------------------------------------------- weights

    def weight_path(self, weight: Any) -> str:
        """The module a weight belongs to (``AtenProgram.layer_path``)."""
        return self.program.layer_path(self._names.get(id(weight), ""), self.node)

    def choose(self, path: str, layer: Layer) -> Choice:
        """The scheme layer ``path`` takes (``WeightPolicy.choose``), or a refusal naming it."""
        from ..passes.rotation import ROTATE
        from ..weights import Choice, WeightScheme

        if self.annotation(ROTATE):  # the rotation's own Hadamard matrix is exact only in fp32
            return Choice(WeightScheme.parse("fp32"), f"the online rotation (Hadamard {self.annotation(ROTATE)}): fp32")
        choice = self.weights.policy.choose(layer)
        if isinstance(choice, str):
            raise WeightRefusal(f"layer {path or '<top level>'!r} cannot take its weights: {choice}")
        return choice

    def weight(self, weight: Any, layer: Layer, *, path: str | None = None,
               layout: Callable[[np.ndarray], np.ndarray] | None = None, axis: int = 0,
               values: np.ndarray | None = None) -> tuple[int, WeightScheme]:
        """Place a layer's filter in the graph as its scheme says; returns (value id, scheme).

        ``weight``: the torch tensor (its name gives the report row's path); ``values``:
        its float values when the lowering computed them (a reshaped or scaled filter);
        ``layout``: how the node reads it (e.g. OIHW -> OHWI), applied before quantizing;
        ``axis``: the output-channel axis after ``layout``.  A streaming export's meta
        filter is read, quantized and written only when the payload is written
        (``streaming.WeightFile.weight``).
        """
        path = self.weight_path(weight) if path is None else path
        if stored_of(weight) is not None:
            return self.torchao_weight(weight, path, layout, axis, values)
        choice = self.choose(path, layer)
        scheme, note = choice.scheme, choice.note
        options = self.weights
        if options.dry_run:
            dims = laid_out_shape(tuple(int(d) for d in (values if values is not None else weight).shape), layout)
            self.rows.append(ReportRow(path, dims, str(scheme), scheme.stored_nbytes(dims, axis), math.nan, note))
            return self.graph.tensor(dims), scheme
        name = self._names.get(id(weight))
        file = self.program.weight_file
        if values is None and is_meta(weight) and file is not None:
            stored = self.program.stored.get(name or "")
            if stored is None:
                origin = self.program.origins.get(name or "")
                raise XnnquantError(meta_tensor_refusal(f"the weight of {path!r}", origin, file))
            shape = tuple(int(d) for d in weight.shape)
            deferred = file.weight(stored, shape, path, scheme, options.method, note, layout, axis, self.rows)
            return self.graph.constant(deferred), scheme
        pre = self.constant_array(weight, f"the weight of {path!r}") if values is None else values
        arr = pre if layout is None else np.ascontiguousarray(layout(pre))
        stats = options.statistics
        key = path if stats is None else stats.key(name or "", path)
        done = None if stats is None else stats.quantized.get(key)
        if done is not None and axis == 0 and scheme.holds(done, arr.shape):
            stored_q = done  # quantized by sequential calibration (calibration.statistics)
        else:
            memo = (id(weight), str(scheme), options.method, axis, key)
            stored_q = _known(options.memo, memo, arr)  # quantized so by an earlier lowering
            if stored_q is None:
                grams = None if stats is None else stats.grams.get(key)
                try:
                    stored_q = scheme.quantize(arr, options.method, grams, axis=axis)
                except WeightRefusal:
                    raise
                except XnnquantError as exc:  # about these weights, whatever the node
                    raise WeightRefusal(str(exc)) from exc
                if options.memo is not None:
                    options.memo[memo] = (arr, stored_q)
        self.rows.append(ReportRow(path, tuple(int(d) for d in arr.shape), str(scheme),
                                   scheme.stored_nbytes(tuple(arr.shape), axis, self.graph.scales_in_segment),
                                   weight_sqnr(arr, stored_q), note))
        if isinstance(stored_q, QuantizedTensor):
            shape = tuple(int(d) for d in weight.shape) if hasattr(weight, "shape") else pre.shape
            self._dequantized[id(weight)] = (weight, _unlaid(stored_q.dequantize(), layout, pre.shape, shape))
            return self.graph.constant(stored_q), scheme
        vid = self.constant(stored_q)
        shape = tuple(int(d) for d in weight.shape) if hasattr(weight, "shape") else pre.shape
        self.filters[vid] = FilterOrigin(weight, layout, tuple(pre.shape), shape, len(self.rows) - 1)
        return vid, scheme

    def torchao_weight(self, weight: Any, path: str, layout: Callable[[np.ndarray], np.ndarray] | None, axis: int,
                       values: np.ndarray | None) -> tuple[int, WeightScheme]:
        """A weight torchao quantized (``prequantized.py``): its codes and scales stored as they
        are, ``[N, K]`` as a linear reads them; returns (value id, the scheme that holds them)."""
        stored = stored_of(weight)
        assert stored is not None
        if layout is not None or axis != 0 or values is not None:
            raise WeightRefusal(f"layer {path or '<top level>'!r} holds torchao's codes [N, K], and this node reads "
                                "its weight in another layout or scaled: the codes would change")
        q = stored.quantized
        kind = {Datatype.qcint8: "qc8w", Datatype.qcint4: "qc4w", Datatype.qbint4: f"qb4w:{q.group_size}"}
        scheme = WeightScheme.parse(kind[q.datatype])
        label = f"{scheme} (torchao)" if stored.dynamic else f"{scheme} fp32 activations (torchao)"
        self.rows.append(ReportRow(path, q.shape, label, scheme.stored_nbytes(q.shape, 0, self.graph.scales_in_segment),
                                   math.inf))
        if self.weights.dry_run:
            return self.graph.tensor(q.shape), scheme
        if stored.dynamic:  # the self-check quantizes the input as the graph does (``note_quantized``)
            self._dequantized[id(weight)] = (weight, q.dequantize())
        return self.graph.constant(q), scheme

    def note_quantized(self, weight: Any, *, input_scale: np.ndarray | None = None,
                       input_layout: tuple[int, ...], nonbatch_dims: int) -> None:
        """Record how the node being lowered quantized (``QuantizedReference``), for the self-check."""
        if id(weight) not in self._dequantized:  # a dry run, or a streaming export's deferred filter
            return
        held, dequantized = self._dequantized[id(weight)]
        assert held is weight
        self.references[self.node] = QuantizedReference(weight, dequantized, input_scale, input_layout,
                                                        nonbatch_dims)


def _unlaid(laid: np.ndarray, layout: Callable[[np.ndarray], np.ndarray] | None, pre_shape: tuple[int, ...],
            shape: tuple[int, ...]) -> np.ndarray:
    """``laid`` (a filter in the layout the node reads) back in the layout of the torch argument
    of ``shape``: ``layout`` undone through the positions it moves (it only moves elements),
    from the ``pre_shape`` it was given, then the caller's reshape (a 1x1 convolution's
    ``[OC, C]`` is its ``[OC, C, 1, 1]`` filter)."""
    if layout is not None:
        positions = np.ascontiguousarray(layout(np.arange(laid.size).reshape(pre_shape))).ravel()
        flat = np.empty(laid.size, laid.dtype)
        flat[positions] = laid.ravel()
        laid = flat.reshape(pre_shape)
    return laid.reshape(shape)
