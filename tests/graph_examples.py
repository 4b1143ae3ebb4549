"""Random but valid graphs: every node kind, datatype and quant-params kind of the schema.

``random_graph(seed)`` is what the round-trip, stability and fuzz tests start from, and
a quick way to get a payload to look at.  Each node kind is built by one small function
on fresh inputs and constants of random shapes, so the graph exercises the whole
schema without the kinds constraining each other; a random subset of node outputs
become graph outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from xnnquant.datatypes import Datatype
from xnnquant.graph.builder import Graph
from xnnquant.graph.layout import XN01_NODE_KINDS
from xnnquant.graph.model import PerTensorQuant
from xnnquant.rounding import to_bf16
from xnnquant.tensor import QuantizedTensor

D = Datatype
Rng = np.random.Generator


def _f32(rng: Rng, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _scales(rng: Rng, n: int | tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.01, 1.0, n).astype(np.float32)


def _codes(rng: Rng, shape: tuple[int, ...], lo: int, hi: int, dtype: str) -> np.ndarray:
    return rng.integers(lo, hi + 1, size=shape).astype(dtype)


def _bias_scale(g: Graph, x: int, weight_scale: np.ndarray) -> np.ndarray:
    """input_scale * weight_scale (float32): the only int32 bias scale XNNPACK computes right."""
    quant = g.value(x).quant
    assert isinstance(quant, PerTensorQuant)
    return (np.float32(quant.scale) * weight_scale).astype(np.float32)


def _qint8_input(g: Graph, rng: Rng, dims: tuple[int, ...], datatype: Datatype = D.qint8) -> int:
    zp = int(rng.integers(-128, 128)) if datatype is D.qint8 else int(rng.integers(0, 256))
    return g.input(dims, datatype, PerTensorQuant(float(_scales(rng, 1)[0]), zp))


def _float_input(g: Graph, rng: Rng, dims: tuple[int, ...]) -> int:
    return g.input(dims, D.fp16 if rng.random() < 0.25 else D.fp32)


def _minmax(rng: Rng) -> dict[str, float]:
    if rng.random() < 0.5:
        return {}
    lo = float(rng.uniform(-5, 0))
    return {"output_min": lo, "output_max": lo + float(rng.uniform(0, 10))}


def _binary(kind: str) -> Callable[[Graph, Rng], int]:
    method = {"XNNAdd": "add", "XNNSubtract": "subtract", "XNNMultiply": "multiply", "XNNDiv": "divide",
              "XNNMinimum": "minimum", "XNNMaximum": "maximum", "XNNPReLU": "prelu",
              "XNNBatchMatrixMultiply": "batch_matrix_multiply"}[kind]

    def build(g: Graph, rng: Rng) -> int:
        if kind == "XNNBatchMatrixMultiply":
            b, m, k, n = (int(x) for x in rng.integers(1, 5, 4))
            return g.batch_matrix_multiply(g.input((b, m, k)), g.input((b, k, n)), debug_handle=int(rng.integers(0, 99)))
        dims = tuple(int(d) for d in rng.integers(1, 5, int(rng.integers(1, 5))))
        if rng.random() < 0.2:
            a, other = _qint8_input(g, rng, dims), _qint8_input(g, rng, dims)
        else:
            a = g.input(dims)
            other = g.constant(_f32(rng, dims[-1:])) if rng.random() < 0.5 else g.input(dims)
        kw = _minmax(rng) if kind in ("XNNAdd", "XNNSubtract", "XNNMultiply", "XNNDiv") else {}
        return getattr(g, method)(a, other, **kw)
    return build


def _unary(method: str) -> Callable[[Graph, Rng], int]:
    def build(g: Graph, rng: Rng) -> int:
        dims = tuple(int(d) for d in rng.integers(1, 6, int(rng.integers(1, 5))))
        x = _float_input(g, rng, dims)
        if method == "clamp":
            lo = float(rng.uniform(-3, 0))
            return g.clamp(x, lo, lo + float(rng.uniform(0, 6)))
        if method == "leaky_relu":
            return g.leaky_relu(x, float(rng.uniform(0, 1)))
        if method == "elu":
            return g.elu(x, float(rng.uniform(0.1, 2)))
        return getattr(g, method)(x)
    return build


def _fully_connected(g: Graph, rng: Rng, choice: int | None = None) -> int:
    """One of six filter set-ups (fp32, static int8 per channel / per tensor, dynamic qc8 / qc4 / qb4)."""
    n, m = (int(x) for x in rng.integers(1, 9, 2))
    choice = int(rng.integers(0, 6)) if choice is None else choice
    if choice == 0:  # fp32, maybe transposed
        k = int(rng.integers(1, 17))
        t = bool(rng.random() < 0.5)
        w = g.constant(_f32(rng, (k, n) if t else (n, k)))
        bias = g.constant(_f32(rng, (n,))) if rng.random() < 0.5 else None
        return g.fully_connected(g.input((m, k)), w, bias, transpose_weights=t, **_minmax(rng))
    if choice == 1:  # static int8: qint8 x qcint8 + qcint32 -> qint8
        k = int(rng.integers(1, 17))
        x = _qint8_input(g, rng, (m, k))
        ws = _scales(rng, n)
        w = g.constant(QuantizedTensor(D.qcint8, _codes(rng, (n, k), -127, 127, "int8"), ws, 0, channel_dim=0))
        b = g.constant(QuantizedTensor(D.qcint32, _codes(rng, (n,), -1000, 1000, "int32"), _bias_scale(g, x, ws), 0,
                                       channel_dim=0))
        out = g.tensor((m, n), D.qint8, PerTensorQuant(4.0, int(rng.integers(-10, 10))))
        return g.fully_connected(x, w, b, output=out)
    if choice == 2:  # per-tensor qint8 filter, qint32 bias
        k = int(rng.integers(1, 17))
        x = _qint8_input(g, rng, (m, k))
        w = g.constant(QuantizedTensor(D.qint8, _codes(rng, (n, k), -127, 127, "int8"), np.float32(0.05), 0))
        b = g.constant(QuantizedTensor(D.qint32, _codes(rng, (n,), -1000, 1000, "int32"),
                                       _bias_scale(g, x, np.float32(0.05)), 0))
        out = g.tensor((m, n), D.qint8, PerTensorQuant(2.0, 0))
        return g.fully_connected(x, w, b, output=out)
    # dynamic: fp32 -> qdint8 x (qcint8 | qcint4 | qbint4) + fp32 bias -> fp32
    if choice == 5:
        k = 32 * int(rng.integers(1, 4))
        group = 32 * int(rng.choice([d for d in (1, 2, 3) if (k // 32) % d == 0]))
        scale = to_bf16(_scales(rng, (n, k // group))).values
        w = g.constant(QuantizedTensor(D.qbint4, _codes(rng, (n, k), -8, 7, "int8"), scale, 0,
                                       channel_dim=0, group_size=group))
    else:  # qdint8 x qcint4 needs an even K (XNNPACK computes odd K wrongly)
        k = int(rng.integers(1, 17)) if choice == 3 else 2 * int(rng.integers(1, 9))
        dt, lo, hi = (D.qcint8, -127, 127) if choice == 3 else (D.qcint4, -8, 7)
        w = g.constant(QuantizedTensor(dt, _codes(rng, (n, k), lo, hi, "int8"), _scales(rng, n), 0, channel_dim=0))
    x = g.convert(g.input((m, k)), D.qdint8, num_nonbatch_dims=1)
    bias = g.constant(_f32(rng, (n,))) if rng.random() < 0.7 else None
    return g.fully_connected(x, w, bias, **_minmax(rng))


def _conv(depthwise: bool) -> Callable[[Graph, Rng], int]:
    def build(g: Graph, rng: Rng) -> int:
        n, h, w_, c = 1, int(rng.integers(3, 8)), int(rng.integers(3, 8)), int(rng.integers(1, 5))
        kh, kw = (int(x) for x in rng.integers(1, 4, 2))
        pads = tuple(int(p) for p in rng.integers(0, 2, 4))
        stride = tuple(int(s) for s in rng.integers(1, 3, 2))
        kwargs = {"padding": pads, "stride": stride, "dilation": 1, **_minmax(rng)}
        quantized = rng.random() < 0.3
        if depthwise:
            oc = c * int(rng.integers(1, 3))
            shape, cdim = (1, kh, kw, oc), 3
        else:
            groups = int(rng.choice([d for d in (1, 2) if c % d == 0]))
            oc = groups * int(rng.integers(1, 4))
            shape, cdim = (oc, kh, kw, c // groups), 0
            kwargs["groups"] = groups
        if quantized:
            x = _qint8_input(g, rng, (n, h, w_, c))
            ws = _scales(rng, oc)
            wt = g.constant(QuantizedTensor(D.qcint8, _codes(rng, shape, -127, 127, "int8"), ws, 0, channel_dim=cdim))
            b = g.constant(QuantizedTensor(D.qcint32, _codes(rng, (oc,), -99, 99, "int32"), _bias_scale(g, x, ws), 0,
                                           channel_dim=0))
        else:
            x, wt, b = g.input((n, h, w_, c)), g.constant(_f32(rng, shape)), g.constant(_f32(rng, (oc,)))
        y = (g.depthwise_conv2d if depthwise else g.conv2d)(x, wt, b, **kwargs)
        if quantized:  # requantize into a fresh output value with its own parameters
            v = g.value(y)
            v.quant = PerTensorQuant(8.0, 1)
        return y
    return build


def _pool(kind: str) -> Callable[[Graph, Rng], int]:
    def build(g: Graph, rng: Rng) -> int:
        x = g.input((1, int(rng.integers(4, 9)), int(rng.integers(4, 9)), int(rng.integers(1, 4))))
        if kind == "XNNGlobalAvgPooling2d":
            return g.global_avg_pooling_2d(x, **_minmax(rng))
        k = tuple(int(v) for v in rng.integers(1, 4, 2))
        pads = tuple(int(p) for p in rng.integers(0, 2, 4))
        if kind == "XNNArgMaxPooling2d":  # both outputs must be used (the 1.4.1 runtime crashes otherwise)
            values, indices = g.argmax_pooling_2d(x, kernel=k, padding=pads)
            g.output(indices)
            return values
        stride = tuple(int(s) for s in rng.integers(1, 3, 2))
        method = g.avg_pooling_2d if kind == "XNNAvgPooling2d" else g.max_pooling_2d
        return method(x, kernel=k, stride=stride, padding=pads, **_minmax(rng))
    return build


def _convert(g: Graph, rng: Rng, target: str | None = None) -> int:
    dims = tuple(int(d) for d in rng.integers(1, 5, int(rng.integers(1, 4))))
    target = str(rng.choice(["qdint8", "qint8", "quint8", "fp16", "fp32"])) if target is None else target
    if target == "qdint8":
        return g.convert(g.input(dims), D.qdint8, num_nonbatch_dims=int(rng.integers(0, len(dims) + 1)))
    if target in ("qint8", "quint8"):
        return g.convert(g.input(dims), D[target], scale=float(_scales(rng, 1)[0]),
                         zero_point=int(rng.integers(0, 100)))
    if target == "fp16":
        return g.convert(g.input(dims), D.fp16)
    return g.convert(_qint8_input(g, rng, dims, D.quint8), D.fp32)


def _shape_op(kind: str) -> Callable[[Graph, Rng], int]:
    def build(g: Graph, rng: Rng) -> int:
        rank = int(rng.integers(1, 5)) if kind != "XNNStaticResizeBilinear2D" else 4
        dims = tuple(int(d) for d in rng.integers(1, 5, rank))
        x = _qint8_input(g, rng, dims) if rng.random() < 0.2 else g.input(dims)
        if kind == "XNNStaticReshape":
            flat = int(np.prod(dims))
            return g.static_reshape(x, (flat,) if rng.random() < 0.5 else (-1, 1))
        if kind == "XNNStaticTranspose":
            return g.static_transpose(x, tuple(int(p) for p in rng.permutation(rank)))
        if kind == "XNNStaticSlice":
            offsets = tuple(int(rng.integers(0, d)) for d in dims)
            sizes = tuple(int(rng.integers(1, d - o + 1)) for d, o in zip(dims, offsets))
            return g.static_slice(x, offsets, sizes)
        if kind == "XNNStaticConstantPad":
            pre, post = (tuple(int(p) for p in rng.integers(0, 3, rank)) for _ in range(2))
            return g.static_constant_pad(x, pre, post, float(rng.uniform(-1, 1)))
        return g.static_resize_bilinear_2d(x, int(rng.integers(1, 9)), int(rng.integers(1, 9)),
                                           align_corners=bool(rng.random() < 0.5))
    return build


def _concatenate(count: int) -> Callable[[Graph, Rng], int]:
    def build(g: Graph, rng: Rng) -> int:
        rank = int(rng.integers(1, 4))
        dims = tuple(int(d) for d in rng.integers(1, 4, rank))
        axis = int(rng.integers(0, rank))
        ins = []
        for _ in range(count):
            d = list(dims)
            d[axis] = int(rng.integers(1, 4))
            ins.append(g.input(tuple(d)))
        return g.concatenate(ins, axis)
    return build


def _sdpa(g: Graph, rng: Rng) -> int:
    h, t, u, c, d = (int(x) for x in rng.integers(1, 5, 5))
    q, k, v = g.input((1, h, t, c)), g.input((1, h, u, c)), g.input((1, h, u, d))
    return g.scaled_dot_product_attention(q, k, v, g.constant(np.full(c, c ** -0.5, np.float32)),
                                          g.constant(_f32(rng, (t, u))))


BUILDERS: dict[str, Callable[[Graph, Rng], int]] = {
    **{k: _binary(k) for k in ("XNNAdd", "XNNSubtract", "XNNMultiply", "XNNDiv", "XNNMinimum", "XNNMaximum",
                               "XNNPReLU", "XNNBatchMatrixMultiply")},
    **{k: _unary(m) for k, m in (("XNNSoftmax", "softmax"), ("XNNSigmoid", "sigmoid"), ("XNNClamp", "clamp"),
                                  ("XNNFloor", "floor"), ("XNNSquareRoot", "square_root"), ("XNNCeiling", "ceiling"),
                                  ("XNNHardswish", "hardswish"), ("XNNLeakyReLU", "leaky_relu"),
                                  ("XNNNegate", "negate"), ("XNNSquare", "square"), ("XNNELU", "elu"),
                                  ("XNNAbs", "abs"))},
    "XNNFullyConnected": _fully_connected,
    "XNNConv2d": _conv(False),
    "XNNDepthwiseConv2d": _conv(True),
    **{k: _pool(k) for k in ("XNNAvgPooling2d", "XNNMaxPooling2d", "XNNGlobalAvgPooling2d", "XNNArgMaxPooling2d")},
    "XNNConvert": _convert,
    **{k: _shape_op(k) for k in ("XNNStaticReshape", "XNNStaticTranspose", "XNNStaticSlice",
                                  "XNNStaticConstantPad", "XNNStaticResizeBilinear2D")},
    **{f"XNNConcatenate{n}": _concatenate(n) for n in (2, 3, 4)},
    "XNNScaledDotProductAttention": _sdpa,
}
assert set(BUILDERS) == set(XN01_NODE_KINDS)


def _every_datatype(g: Graph, rng: Rng) -> list[int]:
    """Nodes that together hold every datatype and quant-params kind of the schema."""
    return [*(_fully_connected(g, rng, choice) for choice in range(6)), _convert(g, rng, "fp32"),
            _convert(g, rng, "qdint8")]


def random_graph(seed: int, kinds: tuple[str, ...] = XN01_NODE_KINDS, repeat: int = 1,
                 every_datatype: bool = True) -> Graph:
    """A valid graph with ``repeat`` nodes of each of ``kinds`` (default: all 37), in random order.

    ``every_datatype`` adds nodes that use all ten datatypes and four quant-params kinds
    (quint8 and fp16 inputs, qint32 / qcint32 biases, qcint8 / qcint4 / qbint4 filters...).
    """
    rng = np.random.default_rng(seed)
    g = Graph(write_scale_bf16=bool(rng.random() < 0.8))
    order = [k for k in kinds for _ in range(repeat)]
    outs = [BUILDERS[order[i]](g, rng) for i in rng.permutation(len(order))]
    if every_datatype:
        outs += _every_datatype(g, rng)
        g.input((1,), D.fp16)
    for y in outs:
        v = g.value(y)
        if not v.flags and v.datatype is not D.qdint8 and (rng.random() < 0.6 or _must_be_used(g, y)):
            g.output(y)
    return g


def _must_be_used(g: Graph, value_id: int) -> bool:
    return any(n.kind == "XNNArgMaxPooling2d" and value_id in n.outputs for n in g.nodes)
