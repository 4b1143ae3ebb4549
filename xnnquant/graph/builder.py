"""``Graph``: build an XNNGraph value by value and node by node.

Every method returns value ids (the schema's ``id_out``, equal to the index in
``g.values``).  Node methods create their output value with the shape XNNPACK will
compute and the input's datatype (fp32 after a qdint8 input).  Every node method also
takes these keyword-only arguments (passed through ``**kw``):

* ``output_min`` / ``output_max``: clamp bounds (``XNode.output_min_max``; giving one
  sets the other to -inf / +inf);
* ``debug_handle``: an int the runtime shows in its error messages (default 0);
* ``output``: an existing value id (from ``g.tensor``) to write instead of a new value,
  to choose its datatype and quantization, e.g. for static int8 outputs;
* ``flags``: the node's XNNPACK flags, where the method does not set them itself.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from .. import arguments
from ..arrays import ArrayInput, is_int, to_numpy
from ..constants import (
    XNN_FLAG_ALIGN_CORNERS,
    XNN_FLAG_KEEP_DIMS,
    XNN_FLAG_TRANSPOSE_B,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
    XNN_VALUE_FLAG_EXTERNAL_INPUT,
    XNN_VALUE_FLAG_EXTERNAL_OUTPUT,
)
from ..datatypes import Datatype, ScaleKind, datatype_of, storage
from ..errors import UnsupportedConfigError, XnnquantError
from ..files import write_atomic
from ..rounding import check_bf16_exact
from ..tensor import QuantizedTensor
from . import shapes
from .layout import NODE_KINDS
from .model import (
    ConstantData,
    Deferred,
    LoadInfo,
    Node,
    PerChannelGroupQuant,
    PerChannelQuant,
    PerTensorQuant,
    PerTokenDynamicQuant,
    QuantParams,
    Value,
)
from .shapes import PaddingSpec, PairSpec
from .targets import Target

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

DEFAULT_DEBUG_HANDLE = 0
#: The largest value of the schema's u32 fields (dims, flags, debug handles).
U32_MAX = 2**32 - 1


class NodeOptions(TypedDict, total=False):
    """The keyword arguments every node method takes (see the module docstring)."""

    flags: int
    output: int
    output_min: float
    output_max: float
    debug_handle: int
#: Graph attributes that moved to ``Graph.load_info`` (old name -> LoadInfo field), and
#: what the old attributes held for a graph built here.
_MOVED_TO_LOAD_INFO = {"version": "version", "named_keys": "named_keys", "missing_named_keys": "missing_named_keys",
                       "declared_num_externs": "num_externs", "legacy_inline_constants": "inline_constants",
                       "identifier": "identifier"}
_BUILT_DEFAULTS: dict[str, Any] = {"version": "0", "named_keys": [], "missing_named_keys": [],
                                   "declared_num_externs": None, "legacy_inline_constants": False,
                                   "identifier": "XN01"}


def _f32(x: float, name: str = "value") -> float:
    """``x`` (a real number, ``arguments.number``; NaN too, which validation refuses where the
    runtime does) rounded to float32 (what the schema stores); -0.0 becomes 0.0.

    Flatbuffers omits a field equal to its default (0.0 == -0.0), so a stored -0.0
    would read back as 0.0 anyway.
    """
    return float(np.float32(arguments.number(x, name, nan=True))) + 0.0


class Graph:
    """An XNNGraph under construction (or read back by ``load``).

    ``write_scale_bf16``: also store blockwise scales as bf16 bit patterns in
    ``PerChannelGroupQuant.scale_bf16`` (runtimes before ExecuTorch 1.4.1 read those; 1.4.1 reads ``scale``).

    ``scales_in_segment`` (target 1.4.1 only): per-channel and blockwise scales are stored in
    the constant segment, referenced by ``scale_buffer_idx``, as ExecuTorch 1.4.1 itself
    stores them (in named data); the flatbuffer then depends on metadata alone, which is
    what constants made later (``Deferred``, streaming export) need.  See writer.SegmentPlan.

    ``target``: ``"xn01"`` (default) allows the XN01 schema's node kinds only, so the payload
    runs on every runtime generation; ``"1.4.1"`` also allows the kinds ExecuTorch 1.4.1
    appended (``gelu``, ``tanh``, ``exp``, ``log``, ``reciprocal_square_root``, ``sin``,
    ``cos``, ``copy``, ``conv_transpose2d``, five-way ``concatenate``).  See targets.py.
    """

    def __init__(self, *, write_scale_bf16: bool = True, target: Target | str = Target.XN01,
                 scales_in_segment: bool = False) -> None:
        self.target = Target.parse(target)
        write_scale_bf16 = arguments.flag(write_scale_bf16, "write_scale_bf16")
        scales_in_segment = arguments.flag(scales_in_segment, "scales_in_segment")
        if scales_in_segment and not self.target.uses_later_kinds:
            raise UnsupportedConfigError(
                "scales_in_segment writes per-channel and blockwise scales as constant data "
                "(scale_buffer_idx), which only ExecuTorch 1.4.1 and later read: use target='1.4.1'")
        self.scales_in_segment = scales_in_segment
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.write_scale_bf16 = write_scale_bf16
        self.load_info: LoadInfo | None = None  # what load() read; None for a graph built here
        # id -> value and the external values, kept up to date as the builder adds values,
        # rebuilt by a scan when ``values`` was replaced or grew by other means (see _lookup)
        self._by_id: dict[int, Value] = {}
        self._externs: list[Value] = []
        self._indexed: tuple[int, int] = (id(self.values), 0)

    if not TYPE_CHECKING:  # hidden from mypy, so the library itself cannot use the old names

        def __getattr__(self, name: str) -> Any:
            # only reached for names the instance lacks: the reader's former Graph attributes
            if name in _MOVED_TO_LOAD_INFO:
                new = _MOVED_TO_LOAD_INFO[name]
                warnings.warn(f"Graph.{name} is deprecated: use Graph.load_info.{new} (None for a graph built here)",
                              DeprecationWarning, stacklevel=2)
                info = self.__dict__.get("load_info")
                value = _BUILT_DEFAULTS[name] if info is None else getattr(info, new)
                return list(value) if isinstance(value, (list, tuple)) else value
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ values

    @property
    def inputs(self) -> list[int]:
        """Ids of the external inputs, in external-id order."""
        return [v.id for v in sorted(self._externals(XNN_VALUE_FLAG_EXTERNAL_INPUT),
                                     key=lambda v: int(v.external_id or 0))]

    @property
    def outputs(self) -> list[int]:
        """Ids of the external outputs, in external-id order."""
        return [v.id for v in sorted(self._externals(XNN_VALUE_FLAG_EXTERNAL_OUTPUT),
                                     key=lambda v: int(v.external_id or 0))]

    @property
    def num_externs(self) -> int:
        return sum(1 for v in self.values if v.flags & (XNN_VALUE_FLAG_EXTERNAL_INPUT | XNN_VALUE_FLAG_EXTERNAL_OUTPUT))

    def _externals(self, flag: int) -> list[Value]:
        return [v for v in self.values if v.flags & flag and v.external_id is not None]

    def _lookup(self) -> tuple[dict[int, Value], list[Value]]:
        """(id -> value, external values in order of creation), O(1) while the builder adds values.

        Rebuilt by one scan when ``values`` is another list or has another length than when
        last indexed (a graph from ``load``, or values appended by hand); values changed in
        place (``id``, ``flags``) after that are not seen until the next rebuild.
        """
        if self._indexed != (id(self.values), len(self.values)):
            self._by_id = {v.id: v for v in self.values}
            self._externs = [v for v in self.values if v.flags and v.external_id is not None]
            self._indexed = (id(self.values), len(self.values))
        return self._by_id, self._externs

    def value(self, value_id: int) -> Value:
        """The value with this id (O(1)); ``XnnquantError`` when there is none."""
        if is_int(value_id):
            if 0 <= value_id < len(self.values):
                v = self.values[int(value_id)]
                if v.id == value_id:
                    return v
            found = self._lookup()[0].get(int(value_id))
            if found is not None:
                return found
        given = repr(value_id) if is_int(value_id) else arguments.shown(value_id)
        raise XnnquantError(f"no value with id {given}: the graph has {len(self.values)} values (ids are integers)")

    def _add_value(self, datatype: Datatype, dims: Sequence[int], *, quant: QuantParams | None = None,
                   constant: ConstantData | None = None, external_id: int | None = None, flags: int = 0) -> int:
        dims = arguments.integers(dims, "dims", high=U32_MAX)  # the schema stores dims as u32
        if any(d < 1 for d in dims):
            raise XnnquantError(f"dims must be integers >= 1: got {dims} (XNNPACK cannot run a value of size 0, and "
                                "ExecuTorch 1.4.1's runtime aborts the process on one)")
        by_id, externs = self._lookup()
        vid = len(self.values)
        if vid in by_id:  # a loaded graph whose ids are not indices
            vid = max(by_id) + 1
        value = Value(vid, Datatype(datatype), dims, external_id=external_id, flags=flags, constant=constant,
                      quant=quant)
        self.values.append(value)
        by_id[vid] = value
        if value.flags:
            externs.append(value)
        self._indexed = (id(self.values), len(self.values))
        return vid

    @staticmethod
    def _check_quant(datatype: Datatype, quant: QuantParams | None) -> None:
        kind = storage(datatype).quant_params.name
        got = "none" if quant is None else type(quant).__name__
        if got != kind:
            raise XnnquantError(f"a {Datatype(datatype).name} value needs quant={kind}: got {got}")

    def tensor(self, dims: Sequence[int], datatype: Datatype = Datatype.fp32,
               quant: QuantParams | None = None) -> int:
        """An internal (non-constant, non-external) value; returns its id.

        ``quant`` must be the datatype's kind: ``PerTensorQuant`` for qint8 / quint8 /
        qint32, ``PerTokenDynamicQuant`` for qdint8, None for fp32 / fp16.
        """
        self._check_quant(datatype, quant)
        return self._add_value(datatype, dims, quant=quant)

    def input(self, dims: Sequence[int], datatype: Datatype = Datatype.fp32,
              quant: QuantParams | None = None) -> int:
        """An external input.  Inputs take external ids 0, 1, ... in call order; outputs follow."""
        storage(datatype)
        if Datatype(datatype) is Datatype.qdint8:
            raise UnsupportedConfigError(
                "an external input cannot be qdint8 (XNNPACK refuses external dynamically quantized "
                "values): declare an fp32 input and convert it"
            )
        self._check_quant(datatype, quant)
        externs = self._lookup()[1]
        n_inputs = sum(1 for v in externs if v.is_input)
        for v in externs:
            if v.is_output:
                v.external_id = int(v.external_id) + 1  # type: ignore[arg-type]
        return self._add_value(datatype, dims, quant=quant, external_id=n_inputs, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)

    def output(self, value_id: int) -> int:
        """Mark ``value_id`` as the next external output; returns it."""
        v = self.value(value_id)
        if v.flags:
            role = "input" if v.is_input else "output"
            raise XnnquantError(
                f"value {value_id} is already an external {role}: a value can be an output only once "
                "and never both input and output (ExecuTorch refuses pass-through outputs)"
            )
        if v.is_constant:
            raise XnnquantError(f"value {value_id} is a constant: constants cannot be graph outputs")
        if v.datatype is Datatype.qdint8:
            raise UnsupportedConfigError(f"value {value_id} is qdint8: dynamically quantized values stay internal")
        externs = self._lookup()[1]
        v.external_id = len(externs)
        v.flags = XNN_VALUE_FLAG_EXTERNAL_OUTPUT
        externs.append(v)
        return v.id

    def constant(self, data: QuantizedTensor | Deferred | ArrayInput) -> int:
        """A constant: a ``QuantizedTensor``, a ``Deferred`` one (made when the payload is
        written), or a float32 / float16 array (or torch tensor).

        Quantized constants take the quantization parameters of their datatype:
        qint8 / quint8 / qint32 ``PerTensorQuant``; qcint8 / qcint4 / qcint32
        ``PerChannelQuant``; qbint4 ``PerChannelGroupQuant`` with bf16-exact ``scale``
        (and ``scale_bf16`` unless ``write_scale_bf16`` is off).
        """
        if isinstance(data, QuantizedTensor):
            return self._quantized_constant(data)
        if isinstance(data, Deferred):
            return self._deferred_constant(data)
        arr = to_numpy(data, "constant")
        if arr.dtype not in (np.float32, np.float16):
            raise XnnquantError(
                f"a float constant must be float32 or float16: got dtype {arr.dtype} "
                "(convert it, or pass a QuantizedTensor)"
            )
        datatype = Datatype.fp32 if arr.dtype == np.float32 else Datatype.fp16
        blob = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        return self._add_value(datatype, arr.shape, constant=blob)

    def _quantized_constant(self, qt: QuantizedTensor) -> int:
        facts = storage(qt.datatype)
        name = qt.datatype.name
        quant: QuantParams
        # QuantizedTensor has checked the zero point: 0 for every type but qint8 / quint8
        if facts.scale is ScaleKind.TENSOR:
            quant = PerTensorQuant(_f32(float(qt.scale)), int(np.asarray(qt.zero_point)))
        elif facts.scale is ScaleKind.CHANNEL:
            quant = PerChannelQuant(np.ascontiguousarray(qt.scale, np.float32).ravel(), int(qt.channel_dim or 0))
        elif facts.scale is ScaleKind.GROUP_BF16:
            scale = np.ascontiguousarray(qt.scale, np.float32).ravel()
            bf16 = check_bf16_exact(qt.scale, "qbint4 scales")
            inline_bf16 = self.write_scale_bf16 and not self.scales_in_segment
            quant = PerChannelGroupQuant(scale, int(qt.channel_dim or 0), int(qt.group_size),  # type: ignore[arg-type]
                                         bf16.bits.ravel().copy() if inline_bf16 else None)
        else:
            raise XnnquantError(
                f"{name} values are never constants (XNNPACK quantizes them per token at run time): "
                "use g.convert(x, Datatype.qdint8)"
            )
        return self._add_value(qt.datatype, qt.shape, constant=qt.to_bytes(), quant=quant)

    def _deferred_constant(self, d: Deferred) -> int:
        """A constant whose data (and scales) ``d.make()`` gives when the payload is written."""
        facts = storage(d.datatype)
        quant: QuantParams | None = None
        if not self.scales_in_segment:
            raise UnsupportedConfigError(
                f"{d.source}: a deferred constant needs Graph(target='1.4.1', scales_in_segment=True) "
                "(otherwise its scales belong in the flatbuffer, which is written before the data exists)")
        if facts.scale is ScaleKind.CHANNEL:
            quant = PerChannelQuant(np.zeros(0, np.float32), int(d.channel_dim))
        elif facts.scale is ScaleKind.GROUP_BF16:
            if not d.group_size:
                raise XnnquantError(f"{d.source}: a deferred qbint4 constant needs group_size")
            quant = PerChannelGroupQuant(np.zeros(0, np.float32), 0, int(d.group_size))
        elif facts.quantized:
            raise UnsupportedConfigError(
                f"{d.source}: {d.datatype.name} constants cannot be deferred (their one scale lives in the "
                "flatbuffer): use fp32, fp16, qcint8, qcint4 or qbint4")
        return self._add_value(d.datatype, d.dims, constant=d, quant=quant)

    # ------------------------------------------------------------------- nodes

    def _node(self, kind: str, inputs: Sequence[int], out_dims: Sequence[Sequence[int]],
              out_types: Sequence[tuple[Datatype, QuantParams | None]], params: dict[str, Any] | None = None,
              *, flags: int = 0, output: int | None = None, output_min: float | None = None,
              output_max: float | None = None, debug_handle: int | None = None,
              **unknown: Any) -> tuple[int, ...]:
        assert kind in NODE_KINDS
        if kind not in self.target.node_kinds:
            raise UnsupportedConfigError(
                f"{kind} is a node kind of ExecuTorch 1.4.1's schema, not of XN01: build the graph with "
                f"Graph(target='1.4.1') to write it (such payloads need an ExecuTorch 1.4.1 runtime)")
        if unknown:
            raise XnnquantError(
                f"{kind}: unknown keyword argument(s) {', '.join(sorted(unknown))}: node methods take "
                "flags, output, output_min, output_max and debug_handle besides their own parameters")
        flags = arguments.integer(flags, f"{kind}: flags", low=0, high=U32_MAX)
        handle = DEFAULT_DEBUG_HANDLE if debug_handle is None else arguments.integer(
            debug_handle, f"{kind}: debug_handle", low=0, high=U32_MAX)
        bounds = [None if b is None else _f32(b, f"{kind}: {name}")
                  for b, name in ((output_min, "output_min"), (output_max, "output_max"))]
        for i in inputs:
            self.value(i)
        if output is not None:
            if len(out_dims) != 1:
                raise XnnquantError(f"{kind}: output= is for single-output nodes")
            v = self.value(output)
            if tuple(v.dims) != tuple(out_dims[0]):
                raise XnnquantError(f"{kind}: output value {output} has dims {v.dims}, expected {tuple(out_dims[0])}")
            outs: tuple[int, ...] = (output,)
        else:
            outs = tuple(self._add_value(dt, d, quant=q) for d, (dt, q) in zip(out_dims, out_types))
        low, high = bounds
        if (low is None) != (high is None):
            low = -np.inf if low is None else low
            high = np.inf if high is None else high
        self.nodes.append(Node(kind, tuple(int(i) for i in inputs), outs, dict(params or {}), flags, handle, low, high))
        return outs

    def _like(self, x: int) -> tuple[Datatype, QuantParams | None]:
        v = self.value(x)
        if v.datatype is Datatype.qdint8:
            return Datatype.fp32, None
        return v.datatype, v.quant

    def _binary(self, kind: str, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        dims = shapes.broadcast(kind, self.value(a).dims, self.value(b).dims)
        return self._node(kind, (a, b), [dims], [self._like(a)], **kw)[0]

    def _unary(self, kind: str, x: int, params: dict[str, Any] | None = None, **kw: Unpack[NodeOptions]) -> int:
        return self._node(kind, (x,), [self.value(x).dims], [self._like(x)], params, **kw)[0]

    def add(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        """``a + b`` with broadcasting (XNNAdd)."""
        return self._binary("XNNAdd", a, b, **kw)

    def subtract(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        return self._binary("XNNSubtract", a, b, **kw)

    def multiply(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        return self._binary("XNNMultiply", a, b, **kw)

    def divide(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        return self._binary("XNNDiv", a, b, **kw)

    def minimum(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        return self._binary("XNNMinimum", a, b, **kw)

    def maximum(self, a: int, b: int, **kw: Unpack[NodeOptions]) -> int:
        return self._binary("XNNMaximum", a, b, **kw)

    def prelu(self, x: int, slope: int, **kw: Unpack[NodeOptions]) -> int:
        """``x if x > 0 else slope * x``; ``slope`` broadcasts against x (XNNPReLU)."""
        shapes.broadcast("XNNPReLU", self.value(x).dims, self.value(slope).dims)
        return self._node("XNNPReLU", (x, slope), [self.value(x).dims], [self._like(x)], **kw)[0]

    def batch_matrix_multiply(self, a: int, b: int, *, transpose_b: bool = False,
                              **kw: Unpack[NodeOptions]) -> int:
        """``[..., M, K] @ [..., K, N]`` (XNNBatchMatrixMultiply), batch dims broadcast.

        ``transpose_b``: ``b`` is ``[..., N, K]`` and the product is ``a @ b^T``
        (XNN_FLAG_TRANSPOSE_B).
        """
        transpose_b = arguments.flag(transpose_b, "transpose_b")
        bd = self.value(b).dims
        if transpose_b and len(bd) >= 2:
            bd = bd[:-2] + (bd[-1], bd[-2])
        dims = shapes.batch_matrix_multiply(self.value(a).dims, bd)
        kw["flags"] = kw.get("flags", 0) | (XNN_FLAG_TRANSPOSE_B if transpose_b else 0)
        return self._node("XNNBatchMatrixMultiply", (a, b), [dims], [self._like(a)], **kw)[0]

    def fully_connected(self, x: int, w: int, bias: int | None = None, *, transpose_weights: bool = False,
                        **kw: Unpack[NodeOptions]) -> int:
        """``x [..., K] @ w.T + bias``; ``w`` is ``[N, K]`` (``[K, N]`` with transpose_weights)."""
        transpose_weights = arguments.flag(transpose_weights, "transpose_weights")
        dims = shapes.fully_connected(self.value(x).dims, self.value(w).dims, transpose_weights)
        inputs = (x, w) if bias is None else (x, w, bias)
        kw["flags"] = kw.get("flags", 0) | (XNN_FLAG_TRANSPOSE_WEIGHTS if transpose_weights else 0)
        return self._node("XNNFullyConnected", inputs, [dims], [self._like(x)], **kw)[0]

    def _conv(self, kind: str, x: int, w: int, bias: int | None, padding: PaddingSpec, stride: PairSpec,
              dilation: PairSpec, groups: int, kw: NodeOptions) -> int:
        groups = arguments.integer(groups, f"{kind}: groups", low=1)
        xd, wd = self.value(x).dims, self.value(w).dims
        if len(wd) != 4:
            raise XnnquantError(f"{kind}: filter must be 4-D: got dims {wd}")
        if kind == "XNNDepthwiseConv2d":
            one, kh, kwid, oc = wd
            channels = shapes.nhwc(kind, xd)[3]
            if one != 1 or oc % channels:
                raise XnnquantError(
                    f"XNNDepthwiseConv2d: filter must be [1, KH, KW, OC] with OC a multiple of the input "
                    f"channels: got filter {wd}, input {xd}"
                )
            groups, gic, goc = channels, 1, oc // channels
        else:
            oc, kh, kwid, gic = wd
            channels = shapes.nhwc(kind, xd)[3]
            if groups < 1 or oc % groups or channels != groups * gic:
                raise XnnquantError(
                    f"XNNConv2d: channels do not match: got input {xd}, filter [OC, KH, KW, IC/g] = {wd}, "
                    f"groups={groups}; expected C == groups * IC/g and OC % groups == 0"
                )
            goc = oc // groups
        window = shapes.Window((kh, kwid), shapes.as_pair(stride, "stride"), shapes.as_pair(dilation, "dilation"),
                               shapes.as_padding(padding))
        oh, ow = window.output_hw(kind, xd)
        params = {**window.conv_params(), "group_input_channels": gic, "group_output_channels": goc,
                  "groups": groups, "adjustment_height": 0, "adjustment_width": 0}
        inputs = (x, w) if bias is None else (x, w, bias)
        return self._node(kind, inputs, [(xd[0], oh, ow, oc)], [self._like(x)], params, **kw)[0]

    def conv2d(self, x: int, w: int, bias: int | None = None, *, padding: PaddingSpec = 0, stride: PairSpec = 1,
               dilation: PairSpec = 1, groups: int = 1, **kw: Unpack[NodeOptions]) -> int:
        """2-D convolution: x NHWC ``[N, H, W, C]``, w OHWI ``[OC, KH, KW, C/groups]``."""
        return self._conv("XNNConv2d", x, w, bias, padding, stride, dilation, groups, kw)

    def depthwise_conv2d(self, x: int, w: int, bias: int | None = None, *, padding: PaddingSpec = 0,
                         stride: PairSpec = 1, dilation: PairSpec = 1, **kw: Unpack[NodeOptions]) -> int:
        """Depthwise convolution: x NHWC ``[N, H, W, C]``, w ``[1, KH, KW, OC]`` (OC = C * multiplier)."""
        return self._conv("XNNDepthwiseConv2d", x, w, bias, padding, stride, dilation, 1, kw)

    def _pool(self, kind: str, x: int, kernel: PairSpec, stride: PairSpec, padding: PaddingSpec, dilation: PairSpec,
              kw: NodeOptions) -> int:
        xd = self.value(x).dims
        window = shapes.Window(shapes.as_pair(kernel, "kernel"), shapes.as_pair(stride, "stride"),
                               shapes.as_pair(dilation, "dilation"), shapes.as_padding(padding))
        oh, ow = window.output_hw(kind, xd)
        return self._node(kind, (x,), [(xd[0], oh, ow, xd[3])], [self._like(x)], window.pool_params(), **kw)[0]

    def avg_pooling_2d(self, x: int, *, kernel: PairSpec, stride: PairSpec | None = None, padding: PaddingSpec = 0,
                       **kw: Unpack[NodeOptions]) -> int:
        """Average pooling over NHWC windows (stride defaults to the kernel)."""
        return self._pool("XNNAvgPooling2d", x, kernel, kernel if stride is None else stride, padding, 1, kw)

    def max_pooling_2d(self, x: int, *, kernel: PairSpec, stride: PairSpec | None = None, padding: PaddingSpec = 0,
                       dilation: PairSpec = 1, **kw: Unpack[NodeOptions]) -> int:
        """Max pooling over NHWC windows (stride defaults to the kernel)."""
        return self._pool("XNNMaxPooling2d", x, kernel, kernel if stride is None else stride, padding, dilation, kw)

    def global_avg_pooling_2d(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """Mean over H and W of NHWC ``[N, H, W, C]`` -> ``[N, 1, 1, C]`` (flag KEEP_DIMS)."""
        n, _, _, c = shapes.nhwc("XNNGlobalAvgPooling2d", self.value(x).dims)
        kw.setdefault("flags", XNN_FLAG_KEEP_DIMS)
        return self._node("XNNGlobalAvgPooling2d", (x,), [(n, 1, 1, c)], [self._like(x)], **kw)[0]

    def argmax_pooling_2d(self, x: int, *, kernel: PairSpec, padding: PaddingSpec = 0,
                          **kw: Unpack[NodeOptions]) -> tuple[int, int]:
        """Max and its index over non-overlapping NHWC windows -> (values id, indices id).

        The index output is labelled fp32 (as ExecuTorch does); XNNPACK writes uint32 indices.
        """
        xd = self.value(x).dims
        k = shapes.as_pair(kernel, "kernel")
        window = shapes.Window(k, k, (1, 1), shapes.as_padding(padding))
        oh, ow = window.output_hw("XNNArgMaxPooling2d", xd)
        out = (xd[0], oh, ow, xd[3])
        values, indices = self._node("XNNArgMaxPooling2d", (x,), [out, out], [self._like(x), (Datatype.fp32, None)],
                                     window.pool_params(strided=False), **kw)
        return values, indices

    def softmax(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """Softmax over the last dim."""
        return self._unary("XNNSoftmax", x, **kw)

    def sigmoid(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNSigmoid", x, **kw)

    def hardswish(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNHardswish", x, **kw)

    def abs(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNAbs", x, **kw)

    def negate(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNNegate", x, **kw)

    def square(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNSquare", x, **kw)

    def square_root(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNSquareRoot", x, **kw)

    def floor(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNFloor", x, **kw)

    def ceiling(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNCeiling", x, **kw)

    def clamp(self, x: int, min_value: float, max_value: float, **kw: Unpack[NodeOptions]) -> int:
        """``clip(x, min_value, max_value)``; the bounds are stored in ``output_min_max``."""
        if "output_min" in kw or "output_max" in kw:
            raise XnnquantError("clamp takes its bounds as min_value and max_value, not output_min / output_max")
        kw["output_min"] = _f32(min_value, "clamp: min_value")
        kw["output_max"] = _f32(max_value, "clamp: max_value")
        return self._unary("XNNClamp", x, **kw)

    def leaky_relu(self, x: int, negative_slope: float, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNLeakyReLU", x, {"negative_slope": _f32(negative_slope, "negative_slope")}, **kw)

    def elu(self, x: int, alpha: float = 1.0, **kw: Unpack[NodeOptions]) -> int:
        return self._unary("XNNELU", x, {"alpha": _f32(alpha, "alpha")}, **kw)

    # ---------------------------------------------- ExecuTorch 1.4.1 node kinds

    def gelu(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """Exact GELU ``x / 2 * (1 + erf(x / sqrt(2)))`` (XNNGelu; target 1.4.1)."""
        return self._unary("XNNGelu", x, **kw)

    def tanh(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """XNNTanh (target 1.4.1)."""
        return self._unary("XNNTanh", x, **kw)

    def exp(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """XNNExp (target 1.4.1)."""
        return self._unary("XNNExp", x, **kw)

    def log(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """Natural logarithm, XNNLog (target 1.4.1)."""
        return self._unary("XNNLog", x, **kw)

    def reciprocal_square_root(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """``1 / sqrt(x)``, XNNReciprocalSquareRoot (target 1.4.1)."""
        return self._unary("XNNReciprocalSquareRoot", x, **kw)

    def sin(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """XNNSin (target 1.4.1)."""
        return self._unary("XNNSin", x, **kw)

    def cos(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """XNNCos (target 1.4.1)."""
        return self._unary("XNNCos", x, **kw)

    def copy(self, x: int, **kw: Unpack[NodeOptions]) -> int:
        """A copy of ``x``, XNNCopy (target 1.4.1)."""
        return self._unary("XNNCopy", x, **kw)

    def conv_transpose2d(self, x: int, w: int, bias: int | None = None, *, padding: PaddingSpec = 0,
                         stride: PairSpec = 1, dilation: PairSpec = 1, groups: int = 1, adjustment: PairSpec = 0,
                         **kw: Unpack[NodeOptions]) -> int:
        """Transposed 2-D convolution (XNNConvTranspose2d; target 1.4.1).

        x NHWC ``[N, H, W, groups * Cg]``, w ``[OC, KH, KW, Cg]`` (OC = groups * OCg).  Output
        ``[N, OH, OW, OC]`` with ``OH = (H - 1) * stride_h + adjustment_h + (KH - 1) * dilation_h + 1
        - top - bottom`` (likewise OW): each input pixel spreads its taps over the output,
        and ``padding`` crops the result.
        """
        groups = arguments.integer(groups, "XNNConvTranspose2d: groups", low=1)
        xd, wd = self.value(x).dims, self.value(w).dims
        adj = shapes.as_pair(adjustment, "adjustment")
        if len(wd) != 4:
            raise XnnquantError(f"XNNConvTranspose2d: filter must be 4-D: got dims {wd}")
        oc, kh, kwid, gic = wd
        n, _, _, channels = shapes.nhwc("XNNConvTranspose2d", xd)
        if groups < 1 or oc % groups or channels != groups * gic:
            raise XnnquantError(
                f"XNNConvTranspose2d: channels do not match: got input {xd}, filter [OC, KH, KW, IC/g] = {wd}, "
                f"groups={groups}; expected C == groups * IC/g and OC % groups == 0")
        window = shapes.Window((kh, kwid), shapes.as_pair(stride, "stride"), shapes.as_pair(dilation, "dilation"),
                               shapes.as_padding(padding))
        oh, ow = window.transposed_output_hw("XNNConvTranspose2d", xd, adj)
        params = {**window.conv_params(), "group_input_channels": gic, "group_output_channels": oc // groups,
                  "groups": groups, "adjustment_height": adj[0], "adjustment_width": adj[1]}
        inputs = (x, w) if bias is None else (x, w, bias)
        return self._node("XNNConvTranspose2d", inputs, [(n, oh, ow, oc)], [self._like(x)], params, **kw)[0]

    # ------------------------------------------------------------ conversions

    def convert(self, x: int, datatype: Datatype, *, num_nonbatch_dims: int = 1, scale: float | None = None,
                zero_point: int | None = None, **kw: Unpack[NodeOptions]) -> int:
        """Convert ``x`` to ``datatype`` (XNNConvert).

        qdint8: per-token dynamic quantization, a row being the last ``num_nonbatch_dims``
        dims.  qint8 / quint8: static, needs ``scale`` and ``zero_point``.  fp32 / fp16:
        dequantize or cast.
        """
        datatype = datatype_of(datatype)
        dims = self.value(x).dims
        quant: QuantParams | None = None
        num_nonbatch_dims = arguments.integer(num_nonbatch_dims, "num_nonbatch_dims")
        static = datatype in (Datatype.qint8, Datatype.quint8)
        if not static and (scale is not None or zero_point is not None):
            raise XnnquantError(f"convert to {datatype.name} takes no scale= or zero_point= (they go with qint8 and "
                                f"quint8): got scale={arguments.shown(scale)}, "
                                f"zero_point={arguments.shown(zero_point)}")
        if datatype is Datatype.qdint8:
            if not 0 <= num_nonbatch_dims <= len(dims):
                raise XnnquantError(f"num_nonbatch_dims must be in [0, {len(dims)}]: got {num_nonbatch_dims}")
            quant = PerTokenDynamicQuant(num_nonbatch_dims)
        elif datatype in (Datatype.qint8, Datatype.quint8):
            if scale is None or zero_point is None:
                raise XnnquantError(f"convert to {datatype.name} needs scale= and zero_point=")
            quant = PerTensorQuant(_f32(scale, "convert: scale"), arguments.integer(zero_point, "convert: zero_point"))
        elif datatype not in (Datatype.fp32, Datatype.fp16):
            raise UnsupportedConfigError(
                f"convert target must be fp32, fp16, qint8, quint8 or qdint8: got {datatype.name}"
            )
        return self._node("XNNConvert", (x,), [dims], [(datatype, quant)], **kw)[0]

    def static_reshape(self, x: int, new_shape: Sequence[int], **kw: Unpack[NodeOptions]) -> int:
        """``x`` with dims ``new_shape``; one dim may be inferred, written -1 (or 0).

        The inferred dim is stored as 0, which XNNPACK resolves from the input's element
        count on every call: the reshape then also holds when ``x`` runs at other sizes
        than its dims (a dynamic sequence length).  The output value's dims resolve it
        against ``x``'s dims.
        """
        new_shape = arguments.integers(new_shape, "XNNStaticReshape: new_shape", low=-1, high=U32_MAX)
        dims = shapes.reshape(self.value(x).dims, new_shape)
        return self._node("XNNStaticReshape", (x,), [dims], [self._like(x)],
                          {"num_dims": len(dims), "new_shape": shapes.stored_new_shape(new_shape)}, **kw)[0]

    def static_transpose(self, x: int, perm: Sequence[int], **kw: Unpack[NodeOptions]) -> int:
        perm = arguments.integers(perm, "XNNStaticTranspose: perm")
        dims = shapes.transpose(self.value(x).dims, perm)
        return self._node("XNNStaticTranspose", (x,), [dims], [self._like(x)],
                          {"num_dims": len(perm), "perm": perm}, **kw)[0]

    def static_slice(self, x: int, offsets: Sequence[int], sizes: Sequence[int], **kw: Unpack[NodeOptions]) -> int:
        offsets = arguments.integers(offsets, "XNNStaticSlice: offsets")
        sizes = arguments.integers(sizes, "XNNStaticSlice: sizes")
        dims = shapes.slice_(self.value(x).dims, offsets, sizes)
        return self._node("XNNStaticSlice", (x,), [dims], [self._like(x)],
                          {"num_dims": len(dims), "offsets": offsets, "sizes": sizes}, **kw)[0]

    def static_constant_pad(self, x: int, pre_paddings: Sequence[int], post_paddings: Sequence[int],
                            padding_value: float = 0.0, **kw: Unpack[NodeOptions]) -> int:
        pre = arguments.integers(pre_paddings, "XNNStaticConstantPad: pre_paddings")
        post = arguments.integers(post_paddings, "XNNStaticConstantPad: post_paddings")
        value = _f32(padding_value, "XNNStaticConstantPad: padding_value")
        dims = shapes.pad(self.value(x).dims, pre, post)
        return self._node("XNNStaticConstantPad", (x,), [dims], [self._like(x)],
                          {"pre_paddings": pre, "post_paddings": post, "padding_value": value}, **kw)[0]

    def static_resize_bilinear_2d(self, x: int, new_height: int, new_width: int, *, align_corners: bool = False,
                                  **kw: Unpack[NodeOptions]) -> int:
        """Bilinear resize of NHWC ``[N, H, W, C]`` -> ``[N, new_height, new_width, C]``."""
        n, _, _, c = shapes.nhwc("XNNStaticResizeBilinear2D", self.value(x).dims)
        new_height = arguments.integer(new_height, "new_height", low=1, high=U32_MAX)
        new_width = arguments.integer(new_width, "new_width", low=1, high=U32_MAX)
        align_corners = arguments.flag(align_corners, "align_corners")
        kw.setdefault("flags", XNN_FLAG_ALIGN_CORNERS if align_corners else 0)
        return self._node("XNNStaticResizeBilinear2D", (x,), [(n, new_height, new_width, c)], [self._like(x)],
                          {"new_height": new_height, "new_width": new_width}, **kw)[0]

    def concatenate(self, inputs: Sequence[int], axis: int, **kw: Unpack[NodeOptions]) -> int:
        """Concatenate 2, 3 or 4 values along ``axis`` (5 with ``target="1.4.1"``)."""
        inputs = arguments.integers(inputs, "concatenate: inputs")
        axis = arguments.integer(axis, "concatenate: axis")
        most = 5 if "XNNConcatenate5" in self.target.node_kinds else 4
        if not 2 <= len(inputs) <= most:
            raise UnsupportedConfigError(
                f"target {self.target} concatenates 2 to {most} values in one node: got {len(inputs)}")
        kind = f"XNNConcatenate{len(inputs)}"
        dims = shapes.concatenate(kind, [self.value(i).dims for i in inputs], axis)
        return self._node(kind, inputs, [dims], [self._like(inputs[0])], {"axis": axis}, **kw)[0]

    def scaled_dot_product_attention(self, query: int, key: int, value: int, scale: int, mask: int,
                                     **kw: Unpack[NodeOptions]) -> int:
        """``softmax(q @ k^T * scale + mask) @ v``: q ``[..., T, C]``, k ``[..., U, C]``,
        v ``[..., U, D]``, scale ``[C]``, mask ``[T, U]`` -> ``[..., T, D]``.

        ExecuTorch 1.4.1's runtime no longer maps this node kind.
        """
        q, k, v = (self.value(i).dims for i in (query, key, value))
        if len(q) < 2 or len(k) != len(q) or len(v) != len(q) or q[-1] != k[-1] or k[-2] != v[-2]:
            raise XnnquantError(
                f"XNNScaledDotProductAttention: expected q [..., T, C], k [..., U, C], v [..., U, D]: "
                f"got {q}, {k}, {v}"
            )
        return self._node("XNNScaledDotProductAttention", (query, key, value, scale, mask),
                          [q[:-1] + (v[-1],)], [self._like(query)], **kw)[0]

    # -------------------------------------------------------------- payloads

    def validate(self, *, writing: bool = True) -> None:
        """Raise ``XnnquantError`` naming the first value or node the runtime would refuse.

        ``writing=False`` (what ``load`` uses) also accepts the node kinds that only later
        ExecuTorch schemas define.
        """
        from .rules import validate

        validate(self, writing=writing)

    def to_bytes(self) -> bytes:
        """The payload: XNNHeader, XN01 flatbuffer, constant segment (validated first)."""
        from .writer import to_bytes

        return to_bytes(self)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_bytes()`` to ``path`` atomically (``files.write_atomic``); with
        ``scales_in_segment``, one constant at a time (``writer.payload_chunks``)."""
        path = arguments.path(path)
        if self.scales_in_segment:
            from .writer import payload_chunks

            return write_atomic(path, payload_chunks(self))
        return write_atomic(path, self.to_bytes())

    # ------------------------------------------------------------- comparing

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Graph) and self.values == other.values and self.nodes == other.nodes)

    def __repr__(self) -> str:
        return (f"Graph({len(self.values)} values, {len(self.nodes)} nodes, inputs={self.inputs}, "
                f"outputs={self.outputs})")

