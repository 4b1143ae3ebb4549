"""The rules the real runtime enforces, checked before writing and after reading.

Sources: XNNPACK 1adaa7c7 (``src/tensor.c``, ``src/subgraph/fully-connected.c``,
``convolution-2d.c``, ``depthwise-convolution-2d.c``, ``validation.c``) and ExecuTorch
1.4.1 (``backends/xnnpack/runtime/XNNCompiler.cpp``, ``XNNExecutor.cpp``).  Each
failure is an ``XnnquantError`` (``UnsupportedConfigError`` for configurations the
runtime accepts but computes wrongly) that names the value or node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..arguments import flag
from ..arrays import first_not_positive_normal
from ..constants import (
    MAX_NUM_EXTERNS,
    XNN_FLAG_TENSORFLOW_SAME_PADDING,
    XNN_FLAG_TRANSIENT_INDIRECTION_BUFFER,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
    XNN_INVALID_VALUE_ID,
    XNN_MAX_TENSOR_DIMS,
    XNN_MIN_BLOCKSIZE,
    XNN_VALUE_FLAG_EXTERNAL_INPUT,
    XNN_VALUE_FLAG_EXTERNAL_OUTPUT,
)
from ..datatypes import Datatype, QuantParamsKind, ZeroPoint, storage
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import bf16_bits_to_float32, runtime_bf16
from .layout import NODE_KINDS
from .model import (
    Deferred,
    Node,
    PerChannelGroupQuant,
    PerChannelQuant,
    PerTensorQuant,
    PerTokenDynamicQuant,
    Value,
)
from .shapes import INFERRED_DIM, node_output_dims
from .targets import Target

if TYPE_CHECKING:
    from .builder import Graph

D = Datatype
#: The flags a convolution node may carry.
CONV_FLAGS = XNN_FLAG_TENSORFLOW_SAME_PADDING | XNN_FLAG_TRANSIENT_INDIRECTION_BUFFER

# (input, filter, bias, output) accepted by xnn_define_fully_connected (schema datatypes only)
FC_TYPES = {
    (D.fp32, D.fp32, D.fp32, D.fp32), (D.fp16, D.fp32, D.fp32, D.fp16),
    (D.fp16, D.fp16, D.fp16, D.fp16), (D.fp32, D.fp16, D.fp16, D.fp32), (D.fp32, D.fp16, D.fp32, D.fp32),
    (D.fp32, D.qcint4, D.fp32, D.fp32), (D.qdint8, D.qcint4, D.fp32, D.fp32), (D.qdint8, D.qcint4, D.fp32, D.fp16),
    (D.qint8, D.qcint4, D.qcint32, D.qint8),
    (D.qdint8, D.qbint4, D.fp32, D.fp32), (D.qdint8, D.qbint4, D.fp32, D.fp16),
    (D.fp32, D.qcint8, D.fp32, D.fp32), (D.qdint8, D.qcint8, D.fp32, D.fp32), (D.qdint8, D.qcint8, D.fp32, D.fp16),
    (D.qint8, D.qcint8, D.qcint32, D.qint8),
    (D.qint8, D.qint8, D.qint32, D.qint8), (D.quint8, D.quint8, D.qint32, D.quint8),
}
# xnn_define_convolution_2d
CONV_TYPES = {
    (D.fp32, D.fp32, D.fp32, D.fp32), (D.fp16, D.fp32, D.fp32, D.fp16),
    (D.fp32, D.fp16, D.fp16, D.fp32), (D.fp32, D.fp16, D.fp32, D.fp32),
    (D.qint8, D.qint8, D.qint32, D.qint8), (D.qint8, D.qcint8, D.qcint32, D.qint8),
    (D.qdint8, D.qcint8, D.fp32, D.fp32), (D.qdint8, D.qcint8, D.fp32, D.fp16),
    (D.quint8, D.quint8, D.qint32, D.quint8),
}
# xnn_define_depthwise_convolution_2d
DEPTHWISE_TYPES = {
    (D.fp32, D.fp32, D.fp32, D.fp32), (D.fp16, D.fp32, D.fp32, D.fp16), (D.fp32, D.fp16, D.fp16, D.fp32),
    (D.qint8, D.qint8, D.qint32, D.qint8), (D.qint8, D.qcint8, D.qcint32, D.qint8),
    (D.quint8, D.quint8, D.qint32, D.quint8),
}
#: the node kinds that read a filter (input 1) and a bias (input 2): fully connected and convolutions
WEIGHTED = ("XNNFullyConnected", "XNNConv2d", "XNNDepthwiseConv2d")
# nodes that move data without arithmetic: quantized input and output must share scale and zero point
DATA_MOVEMENT = {"XNNMaxPooling2d", "XNNStaticReshape", "XNNStaticConstantPad", "XNNStaticTranspose",
                 "XNNStaticSlice", "XNNStaticResizeBilinear2D", "XNNCopy", "XNNConcatenate2", "XNNConcatenate3",
                 "XNNConcatenate4", "XNNConcatenate5"}
#: qint8 node kinds XNNPACK 1adaa7c7 refuses (its average pooling and softmax take fp16 / fp32 only).
INT8_REFUSED = {"XNNAvgPooling2d", "XNNSoftmax"}
#: Where XNNPACK's parameter set-up asserts its scale ratios lie (``microparams-init.c``), per kind:
#: outside, its debug build aborts and the release build computes other codes than these formulas
#: (measured: add with both ratios 1e-4, qint8 -> qint8 convert and leaky ReLU with ratio 129 and 200).
INT8_RATIO_RANGES = {
    "XNNAdd": (2.0**-10, 2.0**8, False), "XNNSubtract": (2.0**-10, 2.0**8, False),
    "XNNMultiply": (2.0**-16, 2.0**8, False), "XNNConvert": (2.0**-8, 2.0**7, True),
    "XNNLeakyReLU": (2.0**-8, 2.0**7, True),
}
#: Relative difference allowed between a static int8 bias's scale and input_scale * filter_scale
#: (float32 products computed in another order or precision differ by a few ulps).
BIAS_SCALE_RTOL = 1e-6


def _fail(what: str, message: str, error: type[XnnquantError] = XnnquantError) -> XnnquantError:
    return error(f"{what}: {message}")


def expected_nbytes(v: Value) -> int:
    """Bytes of constant data XNNPACK reads for ``v`` (4-bit rows padded to whole bytes)."""
    facts = storage(v.datatype)
    count = int(np.prod(v.dims, dtype=object)) if v.dims else 1
    if facts.bits == 4:
        k = v.dims[-1] if v.dims else 1
        return (count // k) * ((k + 1) // 2) if k else 0
    return count * facts.bits // 8


def _check_scales(what: str, scale: np.ndarray) -> None:
    where = first_not_positive_normal(scale.ravel())
    if where is not None:
        (i,) = where
        raise _fail(what, f"scales must be positive normal floats: got {scale.ravel()[i]!r} at index {i}")


def check_value(v: Value) -> None:
    """Rules of ``xnn_define_*tensor_value`` and of ExecuTorch's ``defineTensor``."""
    what = f"value {v.id}"
    if v.id == XNN_INVALID_VALUE_ID:
        raise _fail(what, "id_out 0xFFFFFFFF is reserved for 'no value'")
    if v.datatype is D.invalid:
        raise _fail(what, "datatype is invalid (0)")
    if len(v.dims) > XNN_MAX_TENSOR_DIMS:
        raise _fail(what, f"too many dims: got {len(v.dims)}, expected at most {XNN_MAX_TENSOR_DIMS}")
    if 0 in v.dims:
        raise _fail(what, f"dims {list(v.dims)} hold a 0: XNNPACK cannot run a value of size 0 (ExecuTorch 1.4.1's "
                          "runtime aborts the process on one); expected every dim >= 1")
    if v.flags & ~(XNN_VALUE_FLAG_EXTERNAL_INPUT | XNN_VALUE_FLAG_EXTERNAL_OUTPUT):
        raise _fail(what, f"unsupported flag bits: got flags 0x{v.flags:x}, expected a subset of 0x3")
    facts = storage(v.datatype)
    if facts.quant_params is QuantParamsKind.none:
        if v.quant is not None:
            raise _fail(what, f"{v.datatype.name} values carry no quantization parameters: "
                              f"got {type(v.quant).__name__}")
    elif v.quant is None or type(v.quant).__name__ != facts.quant_params.name:
        got = "none" if v.quant is None else type(v.quant).__name__
        raise _fail(what, f"{v.datatype.name} needs {facts.quant_params.name}: got {got}")
    if v.dq_datatype is not D.invalid:
        if v.dq_datatype is not D.qint8 or not v.is_input or v.is_constant or v.quant is not None:
            raise _fail(what, "legacy dq_datatype is only valid as qint8 on a non-constant float external input: "
                              f"got dq_datatype {v.dq_datatype.name}, flags {v.flags}")
    if v.constant is not None:
        expected = expected_nbytes(v)
        if len(v.constant) != expected:
            raise _fail(what, f"constant data size does not match dims: got {len(v.constant)} bytes for "
                              f"{v.datatype.name} {list(v.dims)}, expected {expected}")
    q = v.quant
    if isinstance(q, PerTensorQuant):
        _check_scales(what, np.array([q.scale], np.float32))
        lo, hi = (facts.code_min, facts.code_max) if facts.zero_point is ZeroPoint.FREE else (0, 0)
        if not lo <= q.zero_point <= hi:
            raise _fail(what, f"{v.datatype.name} zero point out of range: got {q.zero_point}, expected [{lo}, {hi}]")
    elif isinstance(q, PerChannelQuant):
        if not v.dims or not 0 <= q.channel_dim < len(v.dims):
            raise _fail(what, f"channel_dim out of range: got {q.channel_dim} for dims {list(v.dims)}")
        if (q.scale_buffer_idx == 0 or q.scale.size) and not isinstance(v.constant, Deferred):
            if q.scale.size != v.dims[q.channel_dim]:
                raise _fail(what, f"needs one scale per channel: got {q.scale.size} scales, expected "
                                  f"dims[{q.channel_dim}] = {v.dims[q.channel_dim]}")
            _check_scales(what, q.scale)
    elif isinstance(q, PerChannelGroupQuant):
        _check_group(what, v, q)
    elif isinstance(q, PerTokenDynamicQuant):
        if v.flags or v.is_constant:
            raise _fail(what, "qdint8 values must be internal and non-constant (XNNPACK quantizes them at run time)")
        if not 0 <= q.num_nonbatch_dims <= len(v.dims):
            raise _fail(what, f"num_nonbatch_dims out of range: got {q.num_nonbatch_dims}, expected 0..{len(v.dims)}")


def _check_group(what: str, v: Value, q: PerChannelGroupQuant) -> None:
    if len(v.dims) != 2:
        raise _fail(what, f"qbint4 values must be 2-D [OC, IC]: got dims {list(v.dims)}")
    if q.channel_dim != 0:
        raise _fail(what, f"qbint4 channel_dim must be 0 (output channels): got {q.channel_dim}")
    g = q.group_size
    if g < XNN_MIN_BLOCKSIZE or g % XNN_MIN_BLOCKSIZE or v.dims[1] % g:
        raise _fail(what, f"group_size must be a multiple of {XNN_MIN_BLOCKSIZE} dividing IC: got group_size={g}, "
                          f"IC={v.dims[1]}")
    n = v.dims[0] * v.dims[1] // g
    from_buffer = q.scale_buffer_idx != 0
    if from_buffer and q.scale.size == 0 and q.scale_bf16 is None:
        return  # unresolved named data: nothing to check yet
    if isinstance(v.constant, Deferred):
        return  # scales are made with the data, when the payload is written
    if not from_buffer and q.scale.size == 0:
        raise _fail(what, "qbint4 needs its fp32 scales in 'scale', whatever scale_bf16 holds: ExecuTorch 1.4.1 "
                          "refuses an empty list and crashes (segfault) when the list is absent")
    scale = q.scale if q.scale.size else bf16_bits_to_float32(q.scale_bf16)  # type: ignore[arg-type]
    if scale.size != n:
        raise _fail(what, f"needs OC * IC / group_size = {n} scales: got {scale.size}")
    _check_scales(what, runtime_bf16(scale).values)
    if q.scale_bf16 is not None and not from_buffer:
        if q.scale_bf16.size != n or bf16_bits_to_float32(q.scale_bf16).view(np.uint32).tolist() != \
                scale.view(np.uint32).tolist():
            raise _fail(what, "scale_bf16 must hold exactly the scales of 'scale' (runtimes of both generations "
                              "must read the same values)")


def _check_externals(graph: Graph) -> None:
    """External ids: dense, inputs first, for graphs built here.  A payload read back may
    declare more externals than it has external values: the delegate call's argument at
    position ``external_id`` feeds each value, and ExecuTorch 1.4.1 passes arguments that
    no value uses (measured: a weight-only int-x linear's delegate gets the unused scale
    and zero-point tensors as externals 0 and 1, its input and output are 2 and 3 of 4).
    There the ids must lie below ``num_externs`` and inputs still come before outputs."""
    externals = [v for v in graph.values if v.flags or v.external_id is not None]
    declared = None if graph.load_info is None else graph.load_info.num_externs
    n = len(externals) if declared is None else declared
    if n > MAX_NUM_EXTERNS:
        raise XnnquantError(f"graph: num_externs {n} exceeds the runtime's limit of {MAX_NUM_EXTERNS}")
    if declared is not None and declared < len(externals):
        raise XnnquantError(f"graph: num_externs is {declared} but {len(externals)} values are external")
    n_in = sum(1 for v in externals if v.is_input)
    for v in externals:
        what = f"value {v.id}"
        if v.external_id is None or not v.flags:
            raise _fail(what, f"external values need both an external_id and a flag: got external_id "
                              f"{v.external_id}, flags {v.flags}")
        if v.flags == XNN_VALUE_FLAG_EXTERNAL_INPUT | XNN_VALUE_FLAG_EXTERNAL_OUTPUT:
            raise _fail(what, "a value cannot be both external input and output (ExecuTorch refuses pass-through)")
        if declared is not None:
            if not 0 <= v.external_id < declared:
                raise _fail(what, f"external id {v.external_id} is out of range: num_externs is {declared}")
            continue
        lo, hi = (0, n_in) if v.is_input else (n_in, n)
        if not lo <= v.external_id < hi:
            raise _fail(what, f"external ids must be dense, inputs first: got {v.external_id} for an "
                              f"{'input' if v.is_input else 'output'}, expected [{lo}, {hi})")
    if declared is not None:
        ins = [v.external_id for v in externals if v.is_input and v.external_id is not None]
        outs = [v.external_id for v in externals if v.is_output and v.external_id is not None]
        if ins and outs and max(ins) > min(outs):
            raise XnnquantError(f"graph: external ids must put inputs before outputs: got inputs {sorted(ins)}, "
                                f"outputs {sorted(outs)}")
    dup = _first_duplicate([v.external_id for v in externals])
    if dup is not None:
        raise XnnquantError(f"graph: external id {dup} is used by more than one value")


def _node_rules(what: str, n: Node, vals: dict[int, Value]) -> None:
    """Per-kind rules of the XNNPACK define functions."""
    ins = [vals[i] for i in n.inputs]
    out = vals[n.outputs[0]]
    if n.kind == "XNNFullyConnected":
        x, w = ins[0], ins[1]
        b = ins[2] if len(ins) > 2 else None
        if w.datatype not in (D.fp32, D.fp16) and w.constant is None and w.named_key is None:
            raise _fail(what, f"a {w.datatype.name} filter must be a constant (value {w.id})")
        if len(w.dims) != 2:
            raise _fail(what, f"filter must be 2-D: got dims {list(w.dims)} (value {w.id})")
        transposed = bool(n.flags & XNN_FLAG_TRANSPOSE_WEIGHTS)
        if isinstance(w.quant, PerChannelQuant) and w.quant.channel_dim != (1 if transposed else 0):
            raise _fail(what, f"{w.datatype.name} filter channel_dim must be the output-channel dim "
                              f"{1 if transposed else 0}: got {w.quant.channel_dim} (value {w.id})")
        if w.datatype is D.qbint4:
            if transposed:
                raise _fail(what, "qbint4 filters with XNN_FLAG_TRANSPOSE_WEIGHTS compute wrong results "
                                  "in XNNPACK 1adaa7c7: store the filter as [OC, IC]", UnsupportedConfigError)
            if x.dims and x.dims[-1] != w.dims[1]:
                raise _fail(what, f"input channels {x.dims[-1]} do not match the qbint4 filter's IC {w.dims[1]}")
        k = w.dims[0] if transposed else w.dims[1]
        if x.datatype is D.qdint8 and w.datatype is D.qcint4 and k % 2:
            raise _fail(what, f"qdint8 x qcint4 with an odd number of input channels (K={k}) is computed wrongly "
                              "by XNNPACK 1adaa7c7 when there is more than one row (measured relative errors 0.4 "
                              "to 1.1): pad K to an even count with zero weights", UnsupportedConfigError)
        weight_only = x.datatype in (D.fp32, D.fp16) and w.datatype in (D.qcint8, D.qcint4)
        if weight_only and b is not None:
            raise _fail(what, f"weight-only fully connected ({x.datatype.name} input x {w.datatype.name} filter) "
                              "with a bias: XNNPACK 1adaa7c7 adds the bias before the per-channel filter scale, "
                              "computing (x . q + bias) * scale, so the bias comes out scaled; quantize the input "
                              "(convert to qdint8), or add the bias with a separate XNNAdd node",
                        UnsupportedConfigError)
        if weight_only and w.datatype is D.qcint4 and (transposed or tuple(w.dims) == (1, 1)):
            raise _fail(what, f"weight-only qcint4 with {'a transposed' if transposed else 'a 1 x 1'} filter "
                              f"(dims {list(w.dims)}) crashes XNNPACK 1adaa7c7 while it packs the weights",
                        UnsupportedConfigError)
        if x.datatype is D.qdint8 and w.datatype is D.qcint4 and transposed and w.dims[1] % 2:
            raise _fail(what, f"a transposed qcint4 filter [K, N] with odd N={w.dims[1]}: XNNPACK 1adaa7c7 reads "
                              "its nibbles as one continuous stream, not as rows padded to whole bytes as "
                              "stored; store the filter as [N, K]", UnsupportedConfigError)
        n_out = w.dims[1] if transposed else w.dims[0]
        if b is not None and tuple(b.dims) != (n_out,):
            raise _fail(what, f"the bias must have one element per output channel: got dims {list(b.dims)}, "
                              f"expected [{n_out}] (value {b.id})")
        key = (x.datatype, w.datatype, b.datatype if b else None, out.datatype)
        allowed = FC_TYPES if b else {(i, f, None, o) for i, f, _, o in FC_TYPES}
        if key not in allowed:
            raise _fail(what, "unsupported datatypes (input, filter, bias, output): got "
                              f"{tuple(d.name if d else None for d in key)}")
        if b is not None and isinstance(b.quant, PerChannelQuant) and b.quant.channel_dim != 0:
            raise _fail(what, f"qcint32 bias channel_dim must be 0: got {b.quant.channel_dim}")
    elif n.kind in ("XNNConv2d", "XNNDepthwiseConv2d"):
        x, w = ins[0], ins[1]
        b = ins[2] if len(ins) > 2 else None
        depthwise = n.kind == "XNNDepthwiseConv2d"
        if w.constant is None and w.named_key is None:
            raise _fail(what, f"the filter must be a constant (value {w.id})")
        if n.flags & ~CONV_FLAGS:
            raise _fail(what, f"unsupported flags 0x{n.flags:x}, expected a subset of 0x{CONV_FLAGS:x}")
        if len(w.dims) == 4 and b is not None and tuple(b.dims) != (w.dims[3 if depthwise else 0],):
            raise _fail(what, f"the bias must have one element per output channel: got dims {list(b.dims)}, "
                              f"expected [{w.dims[3 if depthwise else 0]}] (value {b.id})")
        table = DEPTHWISE_TYPES if depthwise else CONV_TYPES
        key = (x.datatype, w.datatype, b.datatype if b else None, out.datatype)
        allowed = table if b else {(i, f, None, o) for i, f, _, o in table}
        if key not in allowed:
            raise _fail(what, "unsupported datatypes (input, filter, bias, output): got "
                              f"{tuple(d.name if d else None for d in key)}")
        if isinstance(x.quant, PerTokenDynamicQuant) and x.quant.num_nonbatch_dims != 3:
            raise _fail(what, f"a qdint8 convolution input must be quantized per image (num_nonbatch_dims 3): "
                              f"got {x.quant.num_nonbatch_dims}; XNNPACK 1adaa7c7 computes it wrongly otherwise "
                              "(measured relative error 0.6 with one scale per pixel)", UnsupportedConfigError)
        if isinstance(w.quant, PerChannelQuant):
            want = len(w.dims) - 1 if depthwise else 0
            if w.quant.channel_dim != want:
                raise _fail(what, f"qcint8 filter channel_dim must be {want}: got {w.quant.channel_dim}")
        if b is not None and isinstance(b.quant, PerChannelQuant) and b.quant.channel_dim != 0:
            raise _fail(what, f"qcint32 bias channel_dim must be 0: got {b.quant.channel_dim}")
        p = n.params
        if not depthwise and len(w.dims) == 4 and w.dims[0] != p.get("groups", 0) * p.get("group_output_channels", 0):
            raise _fail(what, f"filter dims[0] {w.dims[0]} must equal groups * group_output_channels = "
                              f"{p.get('groups')} * {p.get('group_output_channels')}")
    elif n.kind == "XNNConvert" and out.datatype is D.qdint8 and ins[0].datatype not in (D.fp32, D.fp16):
        raise _fail(what, f"dynamic quantization needs an fp32 or fp16 input: got {ins[0].datatype.name}")
    elif n.kind in DATA_MOVEMENT:
        for v in ins:
            if isinstance(v.quant, PerTensorQuant) and v.quant != out.quant:
                raise _fail(what, f"{n.kind} needs the same scale and zero point on input and output: got "
                                  f"{v.quant} (value {v.id}) and {out.quant}")
    if n.kind == "XNNStaticReshape":
        new_shape = tuple(n.params.get("new_shape", ()))
        if new_shape.count(INFERRED_DIM) > 1:
            raise _fail(what, f"new_shape {new_shape} infers {new_shape.count(INFERRED_DIM)} dims (each 0): XNNPACK "
                              "1adaa7c7 infers at most one, and refuses the graph on every call "
                              "(xnn_status_invalid_parameter)")


def _check_output_dims(what: str, n: Node, vals: dict[int, Value]) -> None:
    """Each output's declared dims are what the node computes from its inputs' declared dims
    (``shapes.node_output_dims``, XNNPACK's reshape step): the program plans every external
    tensor at its declared dims, so a disagreement fails at run time, or worse."""
    given = [tuple(vals[i].dims) for i in n.inputs]
    try:
        computed = node_output_dims(n, given)
    except UnsupportedConfigError:  # a kind without a shape rule: nothing to compare with
        return
    except (KeyError, TypeError, IndexError):  # params the reader left out: malformed, refused as such
        raise _fail(what, f"its parameters do not give output dims (got params {n.params})") from None
    except XnnquantError as exc:
        raise _fail(what, f"its inputs do not fit together: {exc}") from None
    for vid, dims in zip(n.outputs, computed):
        if tuple(vals[vid].dims) != tuple(dims):
            raise _fail(what, f"output value {vid} is declared with dims {list(vals[vid].dims)}, but the node computes "
                              f"{list(dims)} from its inputs' dims {[list(d) for d in given]}")


def _is_qint8(v: Value) -> bool:
    return v.datatype is D.qint8 and isinstance(v.quant, PerTensorQuant)


def _scale(v: Value) -> np.float32:
    assert isinstance(v.quant, PerTensorQuant)
    return np.float32(v.quant.scale)


def _check_ratio(what: str, kind: str, name: str, ratio: float) -> None:
    lo, hi, hi_inclusive = INT8_RATIO_RANGES[kind]
    if not (lo <= abs(ratio) and (abs(ratio) <= hi if hi_inclusive else abs(ratio) < hi)):
        bracket = "]" if hi_inclusive else ")"
        raise _fail(what, f"qint8 {kind[3:]} needs {name} in [2^{int(np.log2(lo))}, 2^{int(np.log2(hi))}{bracket}: "
                          f"got {ratio:.7g}; XNNPACK 1adaa7c7 asserts this range and computes other codes "
                          "outside it (choose closer scales)", UnsupportedConfigError)


def _int8_rules(what: str, n: Node, ins: list[Value], out: Value) -> None:
    """Rules of static int8 (qint8) nodes; the measurements are in tests/test_graph_int8.py."""
    if n.kind in INT8_REFUSED:
        raise _fail(what, f"XNNPACK 1adaa7c7 has no qint8 {n.kind[3:]} (the runtime refuses the node: "
                          "xnn_status_invalid_parameter); compute it in fp32 between converts")
    if n.kind in ("XNNFullyConnected", "XNNConv2d", "XNNDepthwiseConv2d") and len(ins) > 1:
        w, b = ins[1], (ins[2] if len(ins) > 2 else None)
        if isinstance(w.quant, PerTensorQuant) and w.quant.zero_point != 0:
            raise _fail(what, f"a qint8 filter needs zero point 0: got {w.quant.zero_point} (value {w.id}); "
                              "XNNPACK 1adaa7c7 ignores a filter's zero point and computes as if it were 0",
                        UnsupportedConfigError)
        s_w = w.quant.scale if isinstance(w.quant, (PerTensorQuant, PerChannelQuant)) else None
        if s_w is None or (isinstance(w.quant, PerChannelQuant) and w.quant.scale.size == 0):
            return  # scales not known yet (named data or deferred constants)
        accumulator = (_scale(ins[0]) * np.asarray(s_w, np.float32)).astype(np.float32)
        requant = accumulator / _scale(out)
        if np.any(requant >= 256):
            raise _fail(what, f"input_scale * filter_scale / output_scale must be below 256: got "
                              f"{float(np.max(requant)):.7g}; XNNPACK 1adaa7c7 refuses it (unsupported parameter)")
        if b is not None and isinstance(b.quant, (PerTensorQuant, PerChannelQuant)):
            got, want = np.broadcast_arrays(np.asarray(b.quant.scale, np.float32), accumulator)
            if got.size and not np.allclose(got, want, rtol=BIAS_SCALE_RTOL, atol=0):
                i = int(np.argmax(np.abs(got - want).ravel()))
                raise _fail(what, f"the int32 bias scale must be input_scale * filter_scale: got "
                                  f"{got.ravel()[i]:.9g}, expected {want.ravel()[i]:.9g} (channel {i}); XNNPACK "
                                  "1adaa7c7 adds the bias codes to the accumulator and never reads the bias scale "
                                  "(use xq.quantize_bias)", UnsupportedConfigError)
    elif n.kind in ("XNNAdd", "XNNSubtract") and all(_is_qint8(v) for v in (*ins[:2], out)):
        for i, v in enumerate(ins[:2]):
            _check_ratio(what, n.kind, f"input {i} scale / output scale", float(_scale(v) / _scale(out)))
    elif n.kind == "XNNMultiply" and all(_is_qint8(v) for v in (*ins[:2], out)):
        _check_ratio(what, n.kind, "input scale product / output scale",
                     float((_scale(ins[0]) * _scale(ins[1])) / _scale(out)))
    elif n.kind == "XNNConvert" and _is_qint8(ins[0]) and _is_qint8(out):
        _check_ratio(what, n.kind, "input scale / output scale", float(_scale(ins[0]) / _scale(out)))
    elif n.kind == "XNNLeakyReLU" and _is_qint8(ins[0]) and _is_qint8(out):
        positive = _scale(ins[0]) / _scale(out)
        _check_ratio(what, n.kind, "input scale / output scale", float(positive))
        _check_ratio(what, n.kind, "|negative_slope| * input scale / output scale",
                     float(positive * np.float32(n.params.get("negative_slope", 0.0))))


def check_nodes(graph: Graph, *, writing: bool) -> None:
    target = getattr(graph, "target", Target.XN01)
    vals = {v.id: v for v in graph.values}
    produced = {v.id for v in graph.values if v.is_input or v.is_constant}
    written: set[int] = set()
    for i, n in enumerate(graph.nodes):
        what = f"node {i} ({n.kind})"
        kind = NODE_KINDS.get(n.kind)
        if kind is None:
            raise _fail(what, "unknown node kind")
        if writing and n.kind not in target.node_kinds:
            raise _fail(what, f"this node kind is not part of the schema of target {target} (it needs "
                              "Graph(target='1.4.1'))", UnsupportedConfigError)
        if len(n.inputs) < kind.n_required or len(n.inputs) > len(kind.input_fields):
            raise _fail(what, f"needs {kind.n_required}..{len(kind.input_fields)} inputs: got {len(n.inputs)}")
        if len(n.outputs) != len(kind.output_fields):
            raise _fail(what, f"needs {len(kind.output_fields)} outputs: got {len(n.outputs)}")
        for vid in n.inputs:
            if vid not in vals:
                raise _fail(what, f"input id {vid} names no value")
            if vid not in produced:
                raise _fail(what, f"input value {vid} is used before any node defines it "
                                  "(and it is neither an external input nor a constant)")
        for vid in n.outputs:
            if vid not in vals:
                raise _fail(what, f"output id {vid} names no value")
            v = vals[vid]
            if v.is_input or v.is_constant or vid in written:
                raise _fail(what, f"output value {vid} is already defined (external input, constant, or "
                                  "the output of an earlier node)")
            written.add(vid)
        produced.update(n.outputs)
        if n.output_min is not None or n.output_max is not None:
            lo = -np.inf if n.output_min is None else n.output_min
            hi = np.inf if n.output_max is None else n.output_max
            if np.isnan(lo) or np.isnan(hi) or lo > hi:
                raise _fail(what, f"output_min/output_max must be ordered and not NaN: got {lo}, {hi}")
        _node_rules(what, n, vals)
        _check_output_dims(what, n, vals)
        ins, out = [vals[i] for i in n.inputs], vals[n.outputs[0]]
        if (ins and _is_qint8(ins[0])) or _is_qint8(out):
            _int8_rules(what, n, ins, out)
    used = {vid for n in graph.nodes for vid in n.inputs} | {v.id for v in graph.values if v.is_output}
    for i, n in enumerate(graph.nodes):
        if n.kind == "XNNArgMaxPooling2d":
            for vid in n.outputs:
                if vid not in used:
                    raise _fail(f"node {i} ({n.kind})",
                                f"output value {vid} is never used: the ExecuTorch 1.4.1 runtime crashes (segfault) "
                                "unless both the values and the indices feed a later node or are graph outputs",
                                UnsupportedConfigError)


def _first_duplicate(items: list[Any]) -> Any:
    seen: set[Any] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


def validate(graph: Graph, *, writing: bool = True) -> None:
    """Raise ``XnnquantError`` naming the first value or node the runtime would refuse."""
    writing = flag(writing, "writing")
    dup = _first_duplicate([v.id for v in graph.values])
    if dup is not None:
        raise XnnquantError(f"value id {dup} is defined more than once")
    for v in graph.values:
        check_value(v)
    _check_externals(graph)
    check_nodes(graph, writing=writing)
