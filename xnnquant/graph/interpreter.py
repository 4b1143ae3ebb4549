"""A numpy reference interpreter for XNNGraph graphs.

``interpret(graph, inputs)`` computes what the graph means, node by node, in float64
and float32 numpy, independently of XNNPACK's kernels, so that ``run`` (the real
runtime) can be checked against it.

Static int8: a qint8 value (per-tensor scale and zero point) is held as its int8 codes,
and a node whose first input or output is qint8 is computed by ``int8.py`` exactly as
XNNPACK computes it in integers (its requantizations, fixed-point multipliers and
lookup tables), so ``interpret`` and ``run`` give identical codes.

Other quantized values follow dequantize-quantize semantics: every value holds the real
numbers it stands for.  A quantized constant is its ``QuantizedTensor.dequantize()``;
a node whose output is quantized computes on real numbers and then snaps its result to
the output's grid:

==========================  ===================================================
output datatype             what the result becomes
==========================  ===================================================
fp32                        float32
fp16                        rounded to float16 (held as float32)
quint8                      ``(clamp(rint(x / scale) + zp) - zp) * scale``
qdint8                      per-token quantized with ``xq.quantize_per_token``
                            (XNNPACK's own conversion), then dequantized
==========================  ===================================================

so a fully-connected node with a qdint8 input and a qcint4 filter computes
``dequant(quant(x)) @ dequant(w).T + bias``: what XNNPACK computes exactly in
integers, up to float rounding.

``output_min`` / ``output_max`` are applied where the 1.4.1 runtime forwards them to
XNNPACK (``CLAMPED_KINDS``) and ignored elsewhere, as the runtime does.  Known runtime
quirks are not reproduced: the interpreter gives the intended result (e.g. the
weight-only fp32 x qcint8 fully connected, where XNNPACK scales the bias too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import arguments
from ..arrays import ArrayInput, to_numpy
from ..compute.special import gelu
from ..constants import (
    XNN_FLAG_ALIGN_CORNERS,
    XNN_FLAG_TENSORFLOW_LEGACY_MODE,
    XNN_FLAG_TRANSPOSE_B,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
)
from ..datatypes import Datatype, storage
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import quantize_values
from . import int8
from .builder import Graph
from .model import Node, PerTensorQuant, PerTokenDynamicQuant, Value
from .reader import load
from .shapes import Window, reshape, slice_kept, windows, within

if TYPE_CHECKING:
    import os

#: Node kinds whose ``output_min`` / ``output_max`` the 1.4.1 runtime passes to XNNPACK.
CLAMPED_KINDS = frozenset({
    "XNNAdd", "XNNSubtract", "XNNMultiply", "XNNDiv", "XNNFullyConnected", "XNNConv2d",
    "XNNDepthwiseConv2d", "XNNConvTranspose2d", "XNNAvgPooling2d", "XNNMaxPooling2d",
    "XNNGlobalAvgPooling2d", "XNNClamp",
})
#: Kinds whose output dims are a reshape of what they compute (reshape; global pooling
#: with or without XNN_FLAG_KEEP_DIMS; fully connected, which flattens leading dims).
RESHAPING_KINDS = frozenset({"XNNStaticReshape", "XNNGlobalAvgPooling2d", "XNNFullyConnected"})

Handler = Callable[[Any, list[np.ndarray]], list[np.ndarray]]


# ------------------------------------------------------ convolution, pooling


def _grouped_conv(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, node: Node, groups: int) -> np.ndarray:
    """NHWC ``x`` ``[N, H, W, G * Cg]`` with OHWI ``w`` ``[G * OCg, KH, KW, Cg]`` -> ``[N, OH, OW, OC]``.

    ``y[n, oy, ox, g * OCg + o] = sum_{i, j, c} win[n, oy, ox, i, j, g * Cg + c] * w[g * OCg + o, i, j, c]``.
    """
    window = Window.of_conv(node.params).with_padding_for(node.flags, x.shape)
    win = windows(x, window, 0.0, node.kind)
    n, oh, ow, kh, kw, c = win.shape
    oc = w.shape[0]
    win = win.reshape(n, oh, ow, kh, kw, groups, c // groups).astype(np.float64)
    wg = w.reshape(groups, oc // groups, kh, kw, w.shape[3]).astype(np.float64)
    y = np.einsum("nhwijgc,goijc->nhwgo", win, wg, optimize=True).reshape(n, oh, ow, oc)
    if bias is not None:
        y = y + bias.astype(np.float64)
    return y.astype(np.float32)


def _conv2d(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    x, w, *bias = args
    return [_grouped_conv(x, w, bias[0] if bias else None, node, node.params["groups"])]


def _depthwise_conv2d(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Filter ``[1, KH, KW, OC]``; output channel ``o`` reads input channel ``o // (OC / C)``."""
    x, w, *bias = args
    as_groups = np.ascontiguousarray(w.transpose(3, 1, 2, 0))  # [OC, KH, KW, 1]
    return [_grouped_conv(x, as_groups, bias[0] if bias else None, node, x.shape[3])]


def _conv_transpose2d(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Transposed conv (deconvolution), filter ``[OC, KH, KW, IC/g]``.

    Each input pixel ``(y, x)`` adds ``in[y, x] . w[:, i, j, :]`` to output pixel
    ``(y * sh + i * dh - top, x * sw + j * dw - left)``; the output has
    ``(H - 1) * sh + adj_h + (KH - 1) * dh + 1 - top - bottom`` rows (likewise columns).
    Loops run over the KH x KW taps only.
    """
    x, w, *bias = args
    p = node.params
    window = Window.of_conv(p)
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    top, right, bottom, left = window.padding
    groups = p["groups"]
    n, h, wd, c = x.shape
    oc = w.shape[0]
    full_h = (h - 1) * sh + p.get("adjustment_height", 0) + (kh - 1) * dh + 1
    full_w = (wd - 1) * sw + p.get("adjustment_width", 0) + (kw - 1) * dw + 1
    out = np.zeros((n, full_h, full_w, oc), np.float64)
    xg = x.reshape(n, h, wd, groups, c // groups).astype(np.float64)
    wg = w.reshape(groups, oc // groups, kh, kw, w.shape[3]).astype(np.float64)
    for i in range(kh):
        for j in range(kw):
            tap = np.einsum("nhwgc,goc->nhwgo", xg, wg[:, :, i, j, :]).reshape(n, h, wd, oc)
            out[:, i * dh: i * dh + (h - 1) * sh + 1: sh, j * dw: j * dw + (wd - 1) * sw + 1: sw, :] += tap
    out = out[:, top: full_h - bottom, left: full_w - right, :]
    if bias:
        out = out + bias[0].astype(np.float64)
    return [out.astype(np.float32)]


def _max_pooling(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Max over each window; padding never wins (padded with -inf)."""
    x = args[0]
    window = Window.of_pool(node.params).with_padding_for(node.flags, x.shape)
    return [windows(x, window, -np.inf, node.kind).max(axis=(3, 4))]


def _avg_pooling(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Mean over the window's pixels that lie inside the input (padding not counted)."""
    x = args[0]
    stored = Window.of_pool(node.params)  # average pooling has no dilation
    window = Window(stored.kernel, stored.stride, (1, 1), stored.padding).with_padding_for(node.flags, x.shape)
    total = windows(x.astype(np.float64), window, 0.0, node.kind).sum(axis=(3, 4))
    count = windows(np.ones(x.shape[:3] + (1,)), window, 0.0, node.kind).sum(axis=(3, 4))
    return [(total / count).astype(np.float32)]


def _argmax_pooling(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Max of each window and its index within the window (first on ties).

    Taps are numbered column by column, as XNNPACK walks them: tap ``(i, j)`` (row ``i``
    of ``KH``, column ``j`` of ``KW``) has index ``j * KH + i``.  Windows do not overlap
    (stride = kernel).  Indices come back as float64 holding integers; the output value
    gets them as int64 (see ``interpret``).
    """
    x = args[0]
    stored = Window.of_pool(node.params)
    kernel = stored.kernel
    window = Window(kernel, kernel, (1, 1), stored.padding).with_padding_for(node.flags, x.shape)
    win = windows(x, window, -np.inf, node.kind)
    flat = win.swapaxes(3, 4).reshape(win.shape[:3] + (kernel[0] * kernel[1], win.shape[5]))
    return [flat.max(axis=3), flat.argmax(axis=3).astype(np.float64)]


def _global_avg_pooling(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    return [args[0].astype(np.float64).mean(axis=(1, 2), keepdims=True).astype(np.float32)]


# ----------------------------------------------------------- dense algebra


def _fully_connected(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """``x [..., K] @ w.T + bias`` with ``w [N, K]`` (``x @ w`` with ``w [K, N]`` if transposed)."""
    x, w, *bias = args
    w64 = w.astype(np.float64)
    y = x.astype(np.float64) @ (w64 if node.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else w64.T)
    if bias:
        y = y + bias[0].astype(np.float64)
    return [y.astype(np.float32)]


def _batch_matrix_multiply(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """``a [..., M, K] @ b [..., K, N]`` (``b [..., N, K]`` with XNN_FLAG_TRANSPOSE_B), batch broadcast."""
    a, b = (v.astype(np.float64) for v in args)
    if node.flags & XNN_FLAG_TRANSPOSE_B:
        b = np.swapaxes(b, -1, -2)
    return [(a @ b).astype(np.float32)]


def _softmax_last(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _scaled_dot_product_attention(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """``softmax((q * scale) @ k^T + mask) @ v``; ``scale`` ``[C]`` multiplies q's channels."""
    q, k, v, scale, mask = (a.astype(np.float64) for a in args)
    logits = (q * scale) @ np.swapaxes(k, -1, -2) + mask
    return [(_softmax_last(logits) @ v).astype(np.float32)]


# -------------------------------------------------------- element by element


def _unary(fn: Callable[..., np.ndarray]) -> Handler:
    def handler(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(fn(node, args[0].astype(np.float64))).astype(np.float32)]
    return handler


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Handler:
    def handler(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
        return [fn(args[0].astype(np.float64), args[1].astype(np.float64)).astype(np.float32)]
    return handler


def _concatenate(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    return [np.concatenate(args, axis=node.params["axis"])]


def bilinear_taps(size_in: int, size_out: int, align: bool, legacy: bool) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
    """Along one axis of a bilinear resize (``_resize_bilinear``): per output position its two
    input neighbours (int64) and the weight of the second (float64).

    Source coordinate of output ``o`` along an axis of input size ``I``, output size ``O``:
    align corners: ``o * (I - 1) / (O - 1)``; TensorFlow legacy: ``o * I / O``; otherwise
    half-pixel ``(o + 0.5) * I / O - 0.5`` clamped to ``[0, I - 1]``, in float32 as XNNPACK
    computes it.  Neighbours are the floor and the next pixel (clamped), weighted by the fraction.
    """
    adjust = 1 if align and size_out != 1 else 0
    scale = np.float32((size_in - adjust) / (size_out - adjust))
    o = np.arange(size_out, dtype=np.float32)
    if align or legacy:
        src = o * scale
    else:
        src = np.clip(o * scale + (np.float32(0.5) * scale - np.float32(0.5)), 0, size_in - 1)
    low = src.astype(np.int64)
    return low, np.minimum(low + 1, size_in - 1), (src - low).astype(np.float64)


def _resize_bilinear(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Bilinear resize of NHWC ``[N, H, W, C]`` to ``[N, new_height, new_width, C]`` (``bilinear_taps``)."""
    x = args[0].astype(np.float64)
    align = bool(node.flags & XNN_FLAG_ALIGN_CORNERS)
    legacy = bool(node.flags & XNN_FLAG_TENSORFLOW_LEGACY_MODE)
    top, bottom, fy = bilinear_taps(x.shape[1], node.params["new_height"], align, legacy)
    left, right, fx = bilinear_taps(x.shape[2], node.params["new_width"], align, legacy)
    fy, fx = fy[None, :, None, None], fx[None, None, :, None]
    upper = x[:, top][:, :, left] * (1 - fx) + x[:, top][:, :, right] * fx
    lower = x[:, bottom][:, :, left] * (1 - fx) + x[:, bottom][:, :, right] * fx
    return [(upper * (1 - fy) + lower * fy).astype(np.float32)]


def _static_slice(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """What XNNPACK keeps at the input's actual dims (``shapes.slice_kept``)."""
    offsets, sizes = slice_kept(args[0].shape, node.params["offsets"], node.params["sizes"])
    return [args[0][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]]


def _static_reshape(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """``new_shape``, its inferred dim (stored as 0) taken from the input's element count."""
    return [np.reshape(args[0], reshape(args[0].shape, node.params["new_shape"]))]


def _static_constant_pad(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    p = node.params
    widths = list(zip(p["pre_paddings"], p["post_paddings"]))
    return [np.pad(args[0], widths, constant_values=p["padding_value"])]


def _same(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    return [args[0]]


def _leaky_relu(node: Node, x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, x, x * node.params["negative_slope"])


def _elu(node: Node, x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, node.params["alpha"] * np.expm1(np.minimum(x, 0)))


HANDLERS: dict[str, Handler] = {
    "XNNAdd": _binary(np.add),
    "XNNSubtract": _binary(np.subtract),
    "XNNMultiply": _binary(np.multiply),
    "XNNDiv": _binary(np.divide),
    "XNNMinimum": _binary(np.minimum),
    "XNNMaximum": _binary(np.maximum),
    "XNNPReLU": _binary(lambda x, slope: np.where(x > 0, x, x * slope)),
    "XNNFullyConnected": _fully_connected,
    "XNNBatchMatrixMultiply": _batch_matrix_multiply,
    "XNNConv2d": _conv2d,
    "XNNDepthwiseConv2d": _depthwise_conv2d,
    "XNNConvTranspose2d": _conv_transpose2d,
    "XNNAvgPooling2d": _avg_pooling,
    "XNNMaxPooling2d": _max_pooling,
    "XNNGlobalAvgPooling2d": _global_avg_pooling,
    "XNNArgMaxPooling2d": _argmax_pooling,
    "XNNSoftmax": _unary(lambda n, x: _softmax_last(x)),
    "XNNSigmoid": _unary(lambda n, x: 1.0 / (1.0 + np.exp(-x))),
    "XNNHardswish": _unary(lambda n, x: x * np.clip(x + 3.0, 0.0, 6.0) / 6.0),
    "XNNAbs": _unary(lambda n, x: np.abs(x)),
    "XNNNegate": _unary(lambda n, x: -x),
    "XNNSquare": _unary(lambda n, x: x * x),
    "XNNSquareRoot": _unary(lambda n, x: np.sqrt(x)),
    "XNNReciprocalSquareRoot": _unary(lambda n, x: 1.0 / np.sqrt(x)),
    "XNNFloor": _unary(lambda n, x: np.floor(x)),
    "XNNCeiling": _unary(lambda n, x: np.ceil(x)),
    "XNNLeakyReLU": _unary(_leaky_relu),
    "XNNELU": _unary(_elu),
    "XNNTanh": _unary(lambda n, x: np.tanh(x)),
    "XNNExp": _unary(lambda n, x: np.exp(x)),
    "XNNLog": _unary(lambda n, x: np.log(x)),
    "XNNSin": _unary(lambda n, x: np.sin(x)),
    "XNNCos": _unary(lambda n, x: np.cos(x)),
    "XNNGelu": _unary(lambda n, x: gelu(x)),
    "XNNClamp": _same,  # the bounds are output_min / output_max, applied by interpret
    "XNNCopy": _same,
    "XNNConvert": _same,  # the output datatype does the conversion (see _fit)
    "XNNStaticReshape": _static_reshape,
    "XNNStaticTranspose": lambda node, args: [np.transpose(args[0], node.params["perm"])],
    "XNNStaticSlice": _static_slice,
    "XNNStaticConstantPad": _static_constant_pad,
    "XNNStaticResizeBilinear2D": _resize_bilinear,
    "XNNConcatenate2": _concatenate,
    "XNNConcatenate3": _concatenate,
    "XNNConcatenate4": _concatenate,
    "XNNConcatenate5": _concatenate,
    "XNNScaledDotProductAttention": _scaled_dot_product_attention,
}


# ------------------------------------------------------------ the interpreter


def _fit(value: Value, x: np.ndarray) -> np.ndarray:
    """Real values ``x`` snapped to what ``value``'s datatype can hold (float32 result)."""
    datatype = Datatype(value.datatype)
    if datatype is Datatype.fp32:
        return np.asarray(x, np.float32)
    if datatype is Datatype.fp16:
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)
    if datatype is Datatype.qdint8:
        from ..schemes import quantize_per_token

        quant = value.quant
        nonbatch = quant.num_nonbatch_dims if isinstance(quant, PerTokenDynamicQuant) else 1
        return quantize_per_token(np.asarray(x, np.float32), num_nonbatch_dims=nonbatch).dequantize()
    if datatype in (Datatype.qint8, Datatype.quint8) and isinstance(value.quant, PerTensorQuant):
        codes = _codes(value, x)
        return ((codes.astype(np.float32) - np.float32(value.quant.zero_point))
                * np.float32(value.quant.scale)).astype(np.float32)
    raise UnsupportedConfigError(
        f"value {value.id}: the interpreter has no activation semantics for datatype {datatype.name}"
    )


def as_codes(value: Value, x: np.ndarray) -> np.ndarray:
    """The int8 codes of qint8 ``value`` from what the interpreter holds for it: its codes
    (an int8 array, as ``interpret`` keeps them) or real values (anything else, snapped
    to the grid with ``clamp(rint(x / scale) + zp)``)."""
    x = np.asarray(x)
    return x if x.dtype == np.int8 else _codes(value, x)


def to_real(value: Value, x: np.ndarray) -> np.ndarray:
    """Real values of ``x``: int8 codes of a qint8 value are dequantized, anything else kept."""
    x = np.asarray(x)
    if x.dtype == np.int8 and int8.is_int8(value):
        return int8.dequantize(x, *int8.quant(value))
    return x


def _codes(value: Value, x: np.ndarray) -> np.ndarray:
    """Per-tensor codes of real values ``x``: ``clamp(rint(x / scale) + zp)``."""
    q = value.quant
    assert isinstance(q, PerTensorQuant)  # validation: qint8 / quint8 values carry PerTensorQuant
    facts = storage(value.datatype)
    inv = np.float32(1) / np.float32(q.scale)
    return quantize_values(np.asarray(x, np.float32), inv, int(q.zero_point), facts.code_min, facts.code_max,
                           facts.numpy_dtype)


#: Datatypes the interpreter takes as external inputs (as ``run`` does, qint32 aside).
_EXTERNAL_INPUT_TYPES = (Datatype.fp32, Datatype.fp16, Datatype.qint8, Datatype.quint8)


def _external_input(value: Value, x: ArrayInput, i: int) -> np.ndarray:
    """Real values of external input ``i`` given as the runtime takes it (codes if quantized)."""
    arr = to_numpy(x, f"inputs[{i}]")
    datatype = Datatype(value.datatype)
    if datatype not in _EXTERNAL_INPUT_TYPES:
        raise UnsupportedConfigError(f"external input value {value.id} has datatype {datatype.name}: "
                                     "expected fp32, fp16, qint8 or quint8")
    expected = np.dtype(storage(datatype).numpy_dtype)
    if arr.dtype != expected or not within(arr.shape, value.dims) or 0 in arr.shape:
        raise XnnquantError(
            f"inputs[{i}] does not match external input value {value.id}: got shape {tuple(arr.shape)} "
            f"{arr.dtype}, expected {tuple(value.dims)} {expected} (or smaller dims, each at least 1)"
        )
    if int8.is_int8(value):
        return arr.copy()  # qint8 values are held as their codes
    if datatype is Datatype.quint8:
        q = value.quant
        assert isinstance(q, PerTensorQuant)  # validation: quint8 values carry PerTensorQuant
        return ((arr.astype(np.float32) - np.float32(q.zero_point)) * np.float32(q.scale)).astype(np.float32)
    real = arr.astype(np.float32)
    if value.dq_datatype == Datatype.qint8:  # legacy runtime path: quantized per row on entry
        from ..schemes import quantize_per_token

        real = quantize_per_token(real, num_nonbatch_dims=1).dequantize()
    return real


def _external_output(value: Value, x: np.ndarray, index: bool) -> np.ndarray:
    """What the runtime hands back for an external output (codes if quantized)."""
    if index:
        return np.asarray(x).astype(np.int64)
    datatype = Datatype(value.datatype)
    if datatype is Datatype.fp16:
        return np.asarray(x).astype(np.float16)
    if int8.is_int8(value):
        return as_codes(value, x)
    if datatype is Datatype.quint8:
        return _codes(value, x)
    return np.asarray(x, np.float32)


def _constant(value: Value) -> np.ndarray:
    qt = value.quantized_tensor()
    if qt is not None and int8.is_int8(value):
        return np.asarray(qt.codes, np.int8)
    if qt is not None:
        return qt.dequantize()
    return value.array().astype(np.float32)


def interpret(graph: Graph | bytes | bytearray | memoryview | str | os.PathLike[str], inputs: Sequence[ArrayInput], *,
              named_data: Mapping[str, bytes] | None = None) -> list[np.ndarray]:
    """Compute ``graph``'s outputs with numpy.

    ``graph``: a ``Graph``, or payload bytes / a path (read with ``load``, using
    ``named_data``).  ``inputs``: one array per external input in external-id order, as
    ``run`` takes them (fp32 -> float32, fp16 -> float16, qint8 -> int8 codes, quint8 ->
    uint8 codes).  Returns one array per external output in external-id order, as
    ``run`` returns them (argmax-pooling indices as int64).

    An input may be smaller than its value's dims (same rank, each dim at least 1): the
    dims are then upper bounds, and every node's output shape follows from its actual
    inputs as in XNNPACK's reshape step (``shapes.node_output_dims``).
    """
    if not isinstance(graph, Graph):
        graph = load(graph, named_data=named_data)
    elif named_data is not None:
        raise XnnquantError("named_data= goes with payload bytes or a path: a Graph has its constants already")
    env = interpret_values(graph, inputs)
    index_values = {node.outputs[1] for node in graph.nodes
                    if node.kind == "XNNArgMaxPooling2d" and len(node.outputs) > 1}
    outputs = []
    for vid in graph.outputs:
        if vid not in env:
            raise XnnquantError(f"external output value {vid} is never written by a node")
        outputs.append(_external_output(graph.value(vid), env[vid], vid in index_values))
    return outputs


def interpret_values(graph: Graph, inputs: Sequence[ArrayInput]) -> dict[int, np.ndarray]:
    """Every value of ``graph`` as ``interpret`` computes it, by value id: the real numbers each
    holds (constants dequantized, inputs as ``interpret`` takes them)."""
    if not isinstance(inputs, (list, tuple)) or len(inputs) != len(graph.inputs):
        got = f"{len(inputs)} arrays" if isinstance(inputs, (list, tuple)) else arguments.shown(inputs)
        raise XnnquantError(f"interpret needs one array per external input, in a list: got {got}, "
                            f"expected {len(graph.inputs)}")
    env: dict[int, np.ndarray] = {}
    for i, (vid, x) in enumerate(zip(graph.inputs, inputs)):
        env[vid] = _external_input(graph.value(vid), x, i)
    env.update(constant_values(graph))
    for position, node in enumerate(graph.nodes):
        missing = [i for i in node.inputs if i not in env]
        if missing:
            raise XnnquantError(f"node {position} ({node.kind}) reads value {missing[0]} before any node wrote it")
        results = evaluate_node(graph, node, [env[i] for i in node.inputs], position)
        env.update(zip(node.outputs, results))
    return env


def constant_values(graph: Any) -> dict[int, np.ndarray]:
    """The real values of every constant of ``graph`` (dequantized), by value id."""
    return {value.id: _constant(value) for value in graph.values if value.is_constant}


def evaluate_node(graph: Any, node: Any, args: list[np.ndarray], position: int | None = None) -> list[np.ndarray]:
    """One node's outputs from the real values of its inputs (``args``, in ``node.inputs``
    order): the handler, the output bounds where the runtime applies them, the reshape of
    the reshaping kinds, and the snap to each output value's datatype.  What ``interpret``
    does at every node; ``xq.verify`` calls it on the runtime's own intermediate values.
    """
    where = f"node {node.kind}" if position is None else f"node {position} ({node.kind})"
    ins = [graph.value(i) for i in node.inputs]
    outs = [graph.value(i) for i in node.outputs]
    if int8.applies(node, ins, outs):
        int8_handler = int8.HANDLERS.get(node.kind)
        if int8_handler is None:
            raise UnsupportedConfigError(f"{where}: the interpreter has no static int8 (qint8) reference for it")
        codes = [as_codes(v, a) if int8.is_int8(v) else a for v, a in zip(ins, args)]
        result = int8_handler(node, ins, outs[0], codes)
        if node.kind in RESHAPING_KINDS or node.kind == "XNNStaticReshape":
            result = np.reshape(result, outs[0].dims)
        if not within(result.shape, outs[0].dims):  # dims are upper bounds when inputs run smaller
            raise XnnquantError(f"{where} computes shape {tuple(result.shape)} but its output value "
                                f"{outs[0].id} has dims {tuple(outs[0].dims)}")
        return [result]
    args = [to_real(v, a) for v, a in zip(ins, args)]
    handler = HANDLERS.get(node.kind)
    if handler is None:
        raise UnsupportedConfigError(f"{where}: the interpreter has no reference for it")
    try:
        results = handler(node, args)
    except XnnquantError:
        raise
    except ValueError as exc:  # numpy: input shapes that do not fit together (inputs below their dims)
        raise XnnquantError(f"{where}: inputs of shapes {[a.shape for a in args]} do not fit together: {exc}") \
            from None
    out = []
    for k, (vid, result) in enumerate(zip(node.outputs, results)):
        value = graph.value(vid)
        if node.kind == "XNNArgMaxPooling2d" and k == 1:
            out.append(result)
            continue
        if node.kind in CLAMPED_KINDS and node.output_min is not None:
            result = np.clip(result, node.output_min, node.output_max)
        if node.kind in RESHAPING_KINDS and result.size == int(np.prod(value.dims, dtype=np.int64)):
            result = np.reshape(result, value.dims)
        if not within(result.shape, value.dims):  # dims are upper bounds when inputs run smaller
            raise XnnquantError(
                f"{where} computes shape {tuple(result.shape)} but its output value {vid} has dims "
                f"{tuple(value.dims)}"
            )
        out.append(_fit(value, result))
    return out
