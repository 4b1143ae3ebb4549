"""The one weight policy: every weight scheme in one table, and which scheme each layer gets.

``weights=`` is parsed once, at the API edge, into a ``WeightScheme`` (a frozen dataclass
whose ``str`` gives the spelling back).  Each scheme is one row of ``SCHEMES``: its
datatype and bits, the layers XNNPACK 1.4.1 computes it right for (measured; the
reasons fill the report), and how its bytes are counted.  The lowering, the streaming
export, sequential calibration and the torchao adapter all read the same row:

==========  =========  ====================  ==============================================
spelling    datatype   activations in        refused for (XNNPACK 1.4.1, measured)
==========  =========  ====================  ==============================================
``fp32``    fp32       fp32                  nothing
``qc8w``    qcint8     qdint8, per token     depthwise and transposed convolutions (no
                       (per image for a      dynamically quantized kernel computes them
                       convolution)          right)
``qc4w``    qcint4     qdint8                convolutions (no 4-bit convolution); a linear
                                             with odd ``in_features`` (computed wrongly)
``qb4w:G``  qbint4     qdint8                convolutions; a linear whose ``in_features``
                                             G does not divide.  G: a multiple of 32
==========  =========  ====================  ==============================================

``weights=`` may also be a ``LayerPlan``: a scheme for each layer named (by the module path
the report gives it, ``Layer.path``) and one for every other layer; ``xq.export_llm``'s
``weights="auto:B"`` makes one from each layer's measured effect (``llm/mixed.py``).

A layer that cannot take the requested scheme takes a fallback: ``fallback="auto"`` (the
default) walks down ``LADDER`` from the requested scheme to the first one the layer takes
(qb4w:G -> qc4w -> qc8w -> fp32: a 4-bit convolution becomes qc8w, a depthwise one fp32,
an odd-width linear the next scheme that fits); ``fallback=None`` refuses the layer;
explicit schemes are tried in the order given.  Every fallback is a report row's reason.

Bytes in the payload (``stored_nbytes``): the codes (``tensor.packed_nbytes``) and the
scales: per-channel scales fp32 (4 bytes each); blockwise ones bf16 in the constant
segment (2 bytes, target 1.4.1) or fp32 plus bf16 copies in the flatbuffer (6 bytes, xn01).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import numpy as np

from ..constants import XNN_MIN_BLOCKSIZE
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..schemes import quantize_blockwise, quantize_per_channel
from ..schemes.blockwise import valid_group_sizes
from ..schemes.checks import ACTIVATION_AWARE_METHODS, METHODS, check_method
from ..tensor import QuantizedTensor, packed_nbytes

VALID_FORMS = "'fp32', 'qc8w', 'qc4w' or 'qb4w:G' with G a multiple of 32 (e.g. 'qb4w:32')"


class SchemeKind(str, Enum):
    """The kinds of weight scheme (``WeightScheme.kind``)."""

    FP32 = "fp32"
    QC8W = "qc8w"
    QC4W = "qc4w"
    QB4W = "qb4w"

    def __str__(self) -> str:
        return self.value


class LayerKind(str, Enum):
    """What a weight is the filter of, as far as XNNPACK's kernels differ."""

    LINEAR = "linear"  # a fully connected node: linears, matmuls by a constant, 1x1 convolutions
    CONV = "convolution"  # regular or grouped 2-D convolution
    DEPTHWISE = "depthwise convolution"
    TRANSPOSED = "transposed convolution"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Layer:
    """A layer as the weight policy sees it: its kind, for a linear ``in_features``, and its
    module path as the report names it ('' where not known), which a ``LayerPlan`` looks up."""

    kind: LayerKind
    in_features: int = 0
    path: str = ""


def _no_refusal(layer: Layer, scheme: WeightScheme) -> str | None:
    return None


def _int8_refusal(layer: Layer, scheme: WeightScheme) -> str | None:
    if layer.kind is LayerKind.DEPTHWISE:
        return "XNNPACK has no dynamically quantized depthwise convolution"
    if layer.kind is LayerKind.TRANSPOSED:
        return "XNNPACK's dynamically quantized transposed convolution was not measured correct"
    return None


def _int4_refusal(layer: Layer, scheme: WeightScheme) -> str | None:
    if layer.kind is not LayerKind.LINEAR:
        return "XNNPACK has no 4-bit convolution (its quantized convolutions take int8 filters)"
    k = layer.in_features
    if scheme.kind is SchemeKind.QC4W and k % 2:
        return f"qc4w with an odd in_features ({k}) is computed wrongly by XNNPACK's dynamically quantized int4 kernels"
    if scheme.kind is SchemeKind.QB4W and k % int(scheme.group_size or 0):
        valid = ", ".join(map(str, valid_group_sizes(k))) or "none"
        return f"group size {scheme.group_size} does not divide in_features {k} (group sizes that do: {valid})"
    return None


@dataclass(frozen=True)
class SchemeFacts:
    """One row of ``SCHEMES``."""

    datatype: Datatype
    bits: int
    refusal: Callable[[Layer, WeightScheme], str | None]


#: The scheme table (see the module docstring).
SCHEMES: dict[SchemeKind, SchemeFacts] = {
    SchemeKind.FP32: SchemeFacts(Datatype.fp32, 32, _no_refusal),
    SchemeKind.QC8W: SchemeFacts(Datatype.qcint8, 8, _int8_refusal),
    SchemeKind.QC4W: SchemeFacts(Datatype.qcint4, 4, _int4_refusal),
    SchemeKind.QB4W: SchemeFacts(Datatype.qbint4, 4, _int4_refusal),
}


@dataclass(frozen=True)
class WeightScheme:
    """How the weights of a layer are stored (see the module docstring).  ``method``, when
    set (spelled ``"qc8w@range"``), chooses this layer's scales whatever the export's
    ``method=`` (a weight-only method: a tied head keeps its token table's codes)."""

    kind: SchemeKind
    group_size: int | None = None
    method: str | None = None

    def __post_init__(self) -> None:
        if self.method is not None and (self.method in ACTIVATION_AWARE_METHODS or self.kind is SchemeKind.FP32):
            raise XnnquantError(f"a scheme's own method is a weight-only one for a quantized scheme: got "
                                f"{self.kind}@{self.method} (e.g. 'qc8w@range')")
        if self.method is not None:
            check_method(self.method)
        blockwise = self.kind is SchemeKind.QB4W
        if blockwise != (self.group_size is not None):
            raise XnnquantError(f"group_size goes with qb4w only: got kind {self.kind}, group_size {self.group_size}")
        if blockwise and (self.group_size < XNN_MIN_BLOCKSIZE or self.group_size % XNN_MIN_BLOCKSIZE):  # type: ignore[operator]
            raise XnnquantError(
                f"qb4w group size must be a positive multiple of {XNN_MIN_BLOCKSIZE}: got {self.group_size} "
                f"(valid forms: {VALID_FORMS})")

    def __str__(self) -> str:
        text = f"qb4w:{self.group_size}" if self.kind is SchemeKind.QB4W else self.kind.value
        return text if self.method is None else f"{text}@{self.method}"

    @classmethod
    def parse(cls, value: Any, name: str = "weights") -> WeightScheme:
        """``WeightScheme`` from itself or its spelling (case and spaces ignored; ``"S@method"``:
        scheme S with its own weight-only method)."""
        if isinstance(value, WeightScheme):
            return value
        if isinstance(value, str) and "@" in value:
            spelled, _, method = value.strip().lower().replace(" ", "").partition("@")
            base = cls.parse(spelled, name)
            if method in METHODS and method not in ACTIVATION_AWARE_METHODS and base.is_quantized:
                return cls(base.kind, base.group_size, method)
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            head, sep, tail = text.partition(":")
            if not sep and head in {k.value for k in SchemeKind} - {"qb4w"}:
                return cls(SchemeKind(head))
            if sep and head == "qb4w" and tail.isascii() and tail.isdigit():
                return cls(SchemeKind.QB4W, int(tail))
        raise XnnquantError(f"unknown {name} scheme: got {value!r}, expected {VALID_FORMS}")

    @property
    def facts(self) -> SchemeFacts:
        return SCHEMES[self.kind]

    @property
    def datatype(self) -> Datatype:
        """The weight's datatype: fp32, qcint8, qcint4 or qbint4."""
        return self.facts.datatype

    @property
    def is_quantized(self) -> bool:
        return self.kind is not SchemeKind.FP32

    @property
    def is_4bit(self) -> bool:
        return self.facts.bits == 4

    def refusal(self, layer: Layer) -> str | None:
        """Why ``layer`` cannot take this scheme (None: it can)."""
        return self.facts.refusal(layer, self)

    def quantize(self, weight: Any, method: str = "mse", calibration: Any = None, *,
                 axis: int = 0) -> QuantizedTensor | np.ndarray:
        """``weight`` (float, numpy or torch, in the layout the node reads: a linear's
        ``[out_features, in_features]``, a convolution's ``[OC, KH, KW, IC/groups]``) stored
        as this scheme says: a ``QuantizedTensor``, or float32 for fp32.

        ``axis``: the output-channel axis of the per-channel schemes.  ``calibration``: what
        an activation-aware ``method`` needs: for a convolution's ``[OC, KH, KW, IC]`` filter,
        the statistics of its im2col rows, whose columns follow the filter's rows flattened
        (``frontend.calibration``); the filter is quantized as the matrix ``[OC, KH*KW*IC]``.
        """
        chosen = check_method(method if self.method is None else self.method)
        if self.method is not None:
            calibration = None  # the layer's own weight-only method
        if self.kind is SchemeKind.FP32:
            return np.ascontiguousarray(np.asarray(weight, np.float32))
        if chosen in ACTIVATION_AWARE_METHODS and calibration is None:
            raise XnnquantError(
                f"method {chosen!r} has no calibration statistics for this layer: got none, expected the inputs of a "
                "linear or a one-group convolution reached by the calibration batches (grouped, depthwise and "
                "transposed convolutions are not calibrated); export such a model with method='mse'")
        extra: dict[str, Any] = {} if calibration is None else {"calibration": calibration}
        if calibration is not None and np.ndim(weight) > 2 and axis == 0:
            shape = tuple(int(d) for d in np.shape(weight))
            flat = self.quantize(np.asarray(weight, np.float32).reshape(shape[0], -1), chosen, calibration)
            assert isinstance(flat, QuantizedTensor)
            return QuantizedTensor(flat.datatype, flat.codes.reshape(shape), flat.scale, flat.zero_point,
                                   channel_dim=0, group_size=flat.group_size, meta=flat.meta)
        if self.kind is SchemeKind.QB4W:
            return quantize_blockwise(weight, group_size=int(self.group_size or 0), method=chosen, **extra)
        return quantize_per_channel(weight, bits=self.facts.bits, axis=axis, method=chosen, **extra)

    def holds(self, q: QuantizedTensor, shape: tuple[int, ...]) -> bool:
        """True when ``q`` is a weight of ``shape`` stored as this scheme (per output channel)."""
        return (self.is_quantized and q.datatype is self.datatype and q.group_size == self.group_size
                and q.codes.shape == tuple(shape) and q.channel_dim == 0)

    def stored_nbytes(self, dims: tuple[int, ...], axis: int = 0, scales_in_segment: bool = True) -> int:
        """Bytes a weight of ``dims`` takes in the payload: its codes and its scales (module docstring)."""
        if self.kind is SchemeKind.FP32:
            return 4 * math.prod(dims)
        data = packed_nbytes(self.datatype, dims)
        if self.group_size:
            return data + (2 if scales_in_segment else 6) * (math.prod(dims) // self.group_size)
        return data + 4 * dims[axis]


FP32 = WeightScheme(SchemeKind.FP32)


def ladder(requested: WeightScheme) -> tuple[WeightScheme, ...]:
    """The schemes ``fallback="auto"`` tries, most compact first: from ``requested`` down
    qb4w:G -> qb4w:G' for each smaller multiple of 32 G' (a layer whose in_features G does
    not divide takes the largest group that does: 96 for 576 features under qb4w:128) ->
    qc4w -> qc8w -> fp32."""
    order = [SchemeKind.QB4W, SchemeKind.QC4W, SchemeKind.QC8W, SchemeKind.FP32]
    rest = order[order.index(requested.kind) + 1:]
    smaller: list[WeightScheme] = []
    if requested.kind is SchemeKind.QB4W and requested.group_size:
        smaller = [WeightScheme(SchemeKind.QB4W, g) for g in range(requested.group_size - 32, 0, -32)]
    return (requested, *smaller, *(WeightScheme(k) for k in rest))


@dataclass(frozen=True)
class Choice:
    """The scheme a layer gets, and why it is not the requested one ('' when it is)."""

    scheme: WeightScheme
    note: str = ""


@dataclass(frozen=True)
class LayerPlan:
    """A scheme per layer: ``layers`` maps module paths (``Layer.path``, the report's) to the
    scheme each takes, ``default`` is every other layer's; ``why`` says, per path, how the
    plan chose (``llm/mixed.py`` fills it; '' when given by hand).  ``str``: the default's
    spelling with the count of layers planned otherwise."""

    default: WeightScheme
    layers: tuple[tuple[str, WeightScheme], ...] = ()
    why: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, default: Any, layers: Any, why: Any = None) -> LayerPlan:
        """From a default scheme and ``{path: scheme}`` (spellings or ``WeightScheme``s)."""
        if not isinstance(layers, dict) or not all(isinstance(k, str) and k for k in layers):
            raise XnnquantError(f"a layer plan maps module paths (str) to schemes: got {type(layers).__name__}")
        planned = tuple((path, WeightScheme.parse(scheme, f"the scheme of layer {path!r}"))
                        for path, scheme in sorted(layers.items()))
        return cls(WeightScheme.parse(default), planned, tuple(sorted((why or {}).items())))

    def scheme(self, path: str) -> WeightScheme:
        """The scheme layer ``path`` is planned to take."""
        return dict(self.layers).get(path, self.default)

    def __str__(self) -> str:
        others = sum(1 for _, scheme in self.layers if scheme != self.default)
        return f"{self.default} ({others} layers planned otherwise)" if others else str(self.default)


class WeightPolicy:
    """``weights`` and ``fallback`` of one export: which scheme each layer gets.

    ``weights``: a scheme (its spelling) or a ``LayerPlan``; ``fallback``: ``"auto"``
    (``ladder``, from the scheme each layer asks for), None (refuse), or schemes tried in order.
    """

    def __init__(self, weights: Any = "qb4w:32", fallback: Any = "auto") -> None:
        self.plan = weights if isinstance(weights, LayerPlan) else None
        self.weights = self.plan.default if self.plan is not None else WeightScheme.parse(weights)
        self.auto = isinstance(fallback, str) and fallback.strip().lower() == "auto"
        self.fallback = ladder(self.weights)[1:] if self.auto else parse_fallback(fallback)

    def requested(self, layer: Layer) -> WeightScheme:
        """The scheme ``layer`` asks for: the plan's for its path, else ``weights``."""
        return self.weights if self.plan is None else self.plan.scheme(layer.path)

    def choose(self, layer: Layer) -> Choice | str:
        """The ``Choice`` for ``layer``, or the reason it is refused (every scheme tried)."""
        requested = self.requested(layer)
        reason = requested.refusal(layer)
        if reason is None:
            return Choice(requested)
        reasons = [f"{requested}: {reason}"]
        for scheme in (ladder(requested)[1:] if self.auto else self.fallback):
            again = scheme.refusal(layer)
            if again is None:
                took = f"took {scheme} (fallback='auto')" if self.auto else f"took fallback {scheme}"
                return Choice(scheme, "; ".join(reasons) + "; " + took)
            if not self.auto:  # the ladder's steps are implied: only the requested scheme's reason is said
                reasons.append(f"fallback {scheme}: {again}")
        hint = "fallback='auto'" if not self.fallback else "a fallback it can take, e.g. fallback=('qc8w', 'fp32')"
        return f"{'; '.join(reasons)} (pass {hint})"


def parse_fallback(fallback: Any) -> tuple[WeightScheme, ...]:
    """``fallback=`` as schemes to try in order: None, one scheme, a sequence of them, or a
    comma-separated string (``"qc8w,fp32"``)."""
    if fallback is None:
        return ()
    if isinstance(fallback, str):
        items: list[Any] = fallback.split(",")
    elif isinstance(fallback, WeightScheme):
        items = [fallback]
    elif isinstance(fallback, (list, tuple)):
        items = list(fallback)
    else:
        raise XnnquantError(f"fallback must be 'auto', None, a scheme or a sequence of schemes: got "
                            f"{type(fallback).__name__} {fallback!r} (e.g. fallback=('qc8w', 'fp32'))")
    schemes = tuple(WeightScheme.parse(item, "fallback") for item in items)
    twice = sorted({str(s) for s in schemes if schemes.count(s) > 1})
    if twice:
        raise XnnquantError(f"fallback names {', '.join(map(repr, twice))} more than once: each scheme is tried once, "
                            f"in order; expected each scheme once (got {fallback!r})")
    return schemes


EMBEDDING_FORMS = ("None (float32 tables), 'int8' (int8 codes, one float32 scale per row) or 'int4:G' (int4 codes, "
                   "one bf16 scale per group of G values along the embedding dim, e.g. 'int4:32')")


@dataclass(frozen=True)
class EmbeddingScheme:
    """How ``embeddings=`` stores an embedding table ``(V, D)`` for ExecuTorch's quantized
    embedding kernels (``passes/embeddings.py``; ``pte/quantized.py`` for what they compute).

    ==========  ================================  =====================================  ===============
    spelling    codes                             scales                                 bytes (V, D)
    ==========  ================================  =====================================  ===============
    ``int8``    int8 in [-128, 127], per row:     float32 (V,), qc8w's (``minmax``:      V * D + 4 V
                the qcint8 codes of the table     ``max|row| / 127.5``, or ``mse``)
    ``int4:G``  int4 in [-8, 7], two a byte,      bf16 (V, D / G), qb4w's rule for any   V * D / 2 +
                high nibble first                 G dividing D (``minmax``: bf16 of      2 V D / G
                                                  ``max|group| / 7.5``, or ``mse``)
    ==========  ================================  =====================================  ===============

    Both symmetric (zero point 0, no zero points passed), as qc8w and qb4w.  The program
    also stores a ``(V, 1)`` bool guard table (V bytes, ``pte/quantized.py``), not counted here.
    """

    bits: int
    group_size: int | None = None

    def __str__(self) -> str:
        return "int8" if self.bits == 8 else f"int4:{self.group_size}"

    @classmethod
    def parse(cls, value: Any) -> EmbeddingScheme | None:
        """``embeddings=`` as given: None (float32 tables), an ``EmbeddingScheme``, or its spelling
        (case and spaces ignored; ``"fp32"`` is None)."""
        if value is None or isinstance(value, EmbeddingScheme):
            return value
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            head, sep, tail = text.partition(":")
            if text == "fp32":
                return None
            if text == "int8":
                return cls(8)
            if sep and head == "int4" and tail.isascii() and tail.isdigit() and int(tail) > 0:
                return cls(4, int(tail))
        raise XnnquantError(f"unknown embeddings scheme: got {value!r}, expected {EMBEDDING_FORMS}")

    @property
    def quant_range(self) -> tuple[int, int]:
        """The codes' range."""
        return (-128, 127) if self.bits == 8 else (-8, 7)

    def refusal(self, shape: tuple[int, ...]) -> str | None:
        """Why a table of ``shape`` cannot be stored so (None: it can)."""
        if len(shape) != 2 or 0 in shape:
            return f"expected a table (num_embeddings, embedding_dim) of rank 2 and no empty dim, got shape {shape}"
        dim = shape[1]
        if self.bits == 4 and dim % 2:
            return (f"int4 codes are packed two a byte along the embedding dim, which must be even: got "
                    f"embedding_dim {dim}")
        if self.group_size is not None and dim % self.group_size:
            divisors = ", ".join(str(g) for g in range(1, dim + 1) if dim % g == 0)
            return (f"the group size must divide the embedding dim: got group size {self.group_size}, embedding_dim "
                    f"{dim} (group sizes that do: {divisors})")
        return None

    def quantize(self, table: np.ndarray, method: str) -> QuantizedTensor:
        """The table's ``QuantizedTensor`` (qcint8 per row, or qbint4 in groups; see the class
        docstring); ``method``: ``"minmax"`` or ``"range"``, else ``"mse"`` (an activation-aware
        method's table: no activations reach it)."""
        from ..schemes.blockwise import quantize_groups

        chosen: Literal["minmax", "mse", "range"] = method if method in ("minmax", "range") else "mse"  # type: ignore[assignment]
        if self.bits == 8:
            return quantize_per_channel(table, bits=8, axis=0, method=chosen)
        return quantize_groups(table, int(self.group_size or 0), chosen)

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the codes and scales of a table of ``shape`` (the class docstring)."""
        rows, dim = shape
        if self.bits == 8:
            return rows * dim + 4 * rows
        return rows * dim // 2 + 2 * rows * (dim // int(self.group_size or 1))
