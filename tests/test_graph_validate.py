"""Each rule the runtime enforces is an ``XnnquantError`` naming the value or node.

Graphs are built valid, then one field is broken by hand (the builder refuses most of
these up front), and both ``to_bytes`` and ``load`` of hand-broken bytes must refuse.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, load
from xnnquant.graph.header import XNNHeader, align
from xnnquant.graph.model import PerChannelQuant, PerTensorQuant, PerTokenDynamicQuant
from xnnquant.graph.segment import ConstantSegment
from xnnquant.graph.writer import flatbuffer
from xnnquant.rounding import to_bf16
from xnnquant.tensor import QuantizedTensor

D = xq.Datatype


def _payload_unchecked(g: Graph) -> bytes:
    """Bytes of ``g`` without validation (what a buggy writer could produce)."""
    seg = ConstantSegment()
    fbytes = flatbuffer(g, seg)
    const = seg.to_bytes()
    return XNNHeader.for_sizes(len(fbytes), len(const)).to_bytes() + fbytes + bytes(align(len(fbytes)) - len(fbytes)) + const


def _refused(g: Graph, message: str, error: type[Exception] = XnnquantError) -> None:
    with pytest.raises(error, match=message):
        g.to_bytes()
    with pytest.raises(error, match=message):
        load(_payload_unchecked(g))


def _fc(filter_qt: QuantizedTensor, *, dynamic: bool = True, transpose: bool = False) -> tuple[Graph, int, int]:
    g = Graph()
    k = filter_qt.shape[0] if transpose else filter_qt.shape[1]
    x = g.input((2, k))
    w = g.constant(filter_qt)
    qx = g.convert(x, D.qdint8) if dynamic else x
    # the weight-only path takes no bias (refused: test_weight_only_refusals)
    bias = g.constant(np.zeros(filter_qt.shape[1 if transpose else 0], np.float32)) if dynamic else None
    g.output(g.fully_connected(qx, w, bias, transpose_weights=transpose))
    return g, w, qx


def _qc(datatype: D, shape: tuple[int, int], channel_dim: int = 0) -> QuantizedTensor:
    lo, hi = (-8, 7) if datatype is D.qcint4 else (-127, 127)
    codes = np.random.default_rng(0).integers(lo, hi + 1, size=shape).astype(np.int8)
    return QuantizedTensor(datatype, codes, np.full(shape[channel_dim], 0.1, np.float32), 0, channel_dim=channel_dim)


def _qb(shape: tuple[int, int] = (4, 64), group: int = 32) -> QuantizedTensor:
    codes = np.random.default_rng(0).integers(-8, 8, size=shape).astype(np.int8)
    scale = to_bf16(np.full((shape[0], shape[1] // group), 0.1, np.float32)).values
    return QuantizedTensor(D.qbint4, codes, scale, 0, channel_dim=0, group_size=group)


def test_valid_graph_passes() -> None:
    g, _, _ = _fc(_qc(D.qcint8, (4, 8)))
    assert load(g.to_bytes()) == g


def test_ids_defined_before_use() -> None:
    g = Graph()
    x = g.input((2, 3))
    t = g.tensor((2, 3))
    g.output(g.add(x, t))
    _refused(g, r"node 0 \(XNNAdd\): input value 1 is used before any node defines it")
    g = Graph()
    x = g.input((2, 3))
    y = g.abs(x)
    g.output(g.negate(y))
    g.nodes.reverse()
    _refused(g, r"node 0 \(XNNNegate\): input value 1 is used before any node defines it")
    g.nodes.reverse()
    g.nodes[0].inputs = (7,)
    _refused(g, r"node 0 \(XNNAbs\): input id 7 names no value")


def test_output_written_twice() -> None:
    g = Graph()
    x = g.input((2,))
    y = g.abs(x)
    g.output(y)
    g.nodes.append(dataclasses.replace(g.nodes[0]))
    _refused(g, r"node 1 \(XNNAbs\): output value 1 is already defined")


def test_dims_consistent_with_constant_size() -> None:
    g, w, _ = _fc(_qc(D.qcint4, (4, 9)))  # 4 rows of ceil(9 / 2) = 5 bytes
    assert len(g.values[w].constant) == 20
    g.values[w].constant = g.values[w].constant[:-1]
    _refused(g, r"value 1: constant data size does not match dims: got 19 bytes for qcint4 \[4, 9\], expected 20")


@pytest.mark.parametrize("datatype, zp, ok", [(D.qint8, -128, True), (D.qint8, 128, False), (D.quint8, 255, True),
                                               (D.quint8, -1, False), (D.qint32, 1, False)])
def test_per_tensor_zero_points(datatype: D, zp: int, ok: bool) -> None:
    g = Graph()
    g.input((2,), datatype, PerTensorQuant(0.5, zp))
    if ok:
        g.to_bytes()
    else:
        _refused(g, rf"value 0: {datatype.name} zero point out of range: got {zp}")


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), 1e-40])
def test_scales_positive_and_normal(scale: float) -> None:
    g = Graph()
    g.input((2,), D.qint8, PerTensorQuant(scale, 0))
    _refused(g, "value 0: scales must be positive normal floats")
    g, w, _ = _fc(_qc(D.qcint8, (4, 8)))
    g.values[w].quant.scale[2] = scale
    _refused(g, r"value 1: scales must be positive normal floats: got .* at index 2")


def test_per_channel_scale_count_and_channel_dim() -> None:
    g, w, _ = _fc(_qc(D.qcint8, (4, 8)))
    g.values[w].quant = PerChannelQuant(np.full(3, 0.1, np.float32), 0)
    _refused(g, r"value 1: needs one scale per channel: got 3 scales, expected dims\[0\] = 4")
    g.values[w].quant = PerChannelQuant(np.full(4, 0.1, np.float32), 2)
    _refused(g, r"value 1: channel_dim out of range: got 2 for dims \[4, 8\]")


def test_fully_connected_channel_dim_rules() -> None:
    g, _, _ = _fc(_qc(D.qcint8, (4, 8), channel_dim=1))
    _refused(g, r"node 1 \(XNNFullyConnected\): qcint8 filter channel_dim must be the output-channel dim 0: got 1")
    g, _, _ = _fc(_qc(D.qcint8, (8, 4), channel_dim=0), transpose=True)
    _refused(g, r"qcint8 filter channel_dim must be the output-channel dim 1: got 0")
    g, _, _ = _fc(_qc(D.qcint8, (8, 4), channel_dim=1), transpose=True)
    g.to_bytes()


def test_blockwise_group_size_rules() -> None:
    g, w, _ = _fc(_qb((4, 64), 32))
    g.to_bytes()
    g.values[w].quant = dataclasses.replace(g.values[w].quant, group_size=16,
                                            scale=np.full(16, 0.1, np.float32), scale_bf16=None)
    _refused(g, "value 1: group_size must be a multiple of 32 dividing IC: got group_size=16, IC=64")
    g, w, _ = _fc(_qb((4, 96), 96))
    g.to_bytes()
    g.values[w].quant = dataclasses.replace(g.values[w].quant, group_size=64)
    _refused(g, "group_size must be a multiple of 32 dividing IC: got group_size=64, IC=96")
    g, w, _ = _fc(_qb((4, 64), 32))
    g.values[w].quant = dataclasses.replace(g.values[w].quant, channel_dim=1)
    _refused(g, "value 1: qbint4 channel_dim must be 0")
    g, w, _ = _fc(_qb((4, 64), 32))
    g.values[w].quant = dataclasses.replace(g.values[w].quant, scale=np.zeros(0, np.float32))
    _refused(g, "qbint4 needs its fp32 scales in 'scale', whatever scale_bf16 holds")
    g, w, _ = _fc(_qb((4, 64), 32))
    bits = g.values[w].quant.scale_bf16.copy()
    bits[0] += 1
    g.values[w].quant = dataclasses.replace(g.values[w].quant, scale_bf16=bits)
    _refused(g, "scale_bf16 must hold exactly the scales of 'scale'")


def test_blockwise_refused_configurations() -> None:
    qt = _qb((4, 64), 32)
    with pytest.raises(UnsupportedConfigError, match=r"qbint4 scales must hold bf16 values: got 0.10\d* at index \(0, 0\)"):
        Graph().constant(dataclasses.replace(qt, scale=qt.scale + np.float32(1e-4)))
    g, _, _ = _fc(qt)
    g.nodes[1].flags = 1
    _refused(g, "qbint4 filters with XNN_FLAG_TRANSPOSE_WEIGHTS compute wrong results", UnsupportedConfigError)
    g, _, _ = _fc(qt, dynamic=False)
    _refused(g, r"unsupported datatypes \(input, filter, bias, output\): got \('fp32', 'qbint4', None, 'fp32'\)")


def test_channel_dim_rules_of_convolutions() -> None:
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input((1, 4, 4, 2), D.qint8, PerTensorQuant(0.5, 0))
    ws = np.full(6, 0.1, np.float32)
    w = g.constant(QuantizedTensor(D.qcint8, rng.integers(-9, 9, (1, 3, 3, 6)).astype(np.int8), ws, 0, channel_dim=3))
    b = g.constant(QuantizedTensor(D.qcint32, np.zeros(6, np.int32), ws * 0.5, 0, channel_dim=0))
    g.output(g.depthwise_conv2d(x, w, b))
    g.to_bytes()
    g.values[w].quant = PerChannelQuant(np.full(1, 0.1, np.float32), 0)
    _refused(g, r"node 0 \(XNNDepthwiseConv2d\): qcint8 filter channel_dim must be 3: got 0")
    g = Graph()
    x = g.input((1, 4, 4, 2), D.qint8, PerTensorQuant(0.5, 0))
    w = g.constant(QuantizedTensor(D.qcint8, rng.integers(-9, 9, (6, 3, 3, 2)).astype(np.int8), ws, 0, channel_dim=0))
    g.output(g.conv2d(x, w))
    g.to_bytes()
    g.values[w].quant = PerChannelQuant(np.full(2, 0.1, np.float32), 3)
    _refused(g, r"node 0 \(XNNConv2d\): qcint8 filter channel_dim must be 0: got 3")


def test_external_ids_unique_and_dense() -> None:
    g = Graph()
    a, b = g.input((2,)), g.input((2,))
    g.output(g.add(a, b))
    g.values[b].external_id = 0
    _refused(g, "graph: external id 0 is used by more than one value")
    g.values[b].external_id = 5
    with pytest.raises(XnnquantError, match=r"value 1: external ids must be dense, inputs first: got 5 for an "
                                            r"input, expected \[0, 2\)"):
        g.to_bytes()
    # read back, gaps below num_externs are allowed (ExecuTorch leaves unused arguments), not beyond it
    with pytest.raises(XnnquantError, match=r"value 1: external id 5 is out of range: num_externs is 3"):
        load(_payload_unchecked(g))
    g.values[b].external_id = None
    _refused(g, "value 1: external values need both an external_id and a flag")
    g.values[b].external_id = 1
    out = g.outputs[0]
    g.values[out].external_id, g.values[a].external_id = 0, 2
    with pytest.raises(XnnquantError, match=r"graph: external ids must put inputs before outputs: got inputs "
                                            r"\[1, 2\], outputs \[0\]"):
        load(_payload_unchecked(g))
    g.values[out].external_id, g.values[a].external_id = 2, 0
    g.values[b].external_id, g.values[b].flags = 1, 3
    _refused(g, "value 1: a value cannot be both external input and output")
    g.values[b].flags = 4
    _refused(g, r"value 1: unsupported flag bits: got flags 0x4")


def test_dynamic_quantization_rules() -> None:
    g = Graph()
    x = g.input((2, 8))
    q = g.convert(x, D.qdint8)
    g.values[q].quant = PerTokenDynamicQuant(3)
    _refused(g, r"value 1: num_nonbatch_dims out of range: got 3, expected 0..2")
    with pytest.raises(UnsupportedConfigError, match="an external input cannot be qdint8"):
        g.input((2,), D.qdint8)
    with pytest.raises(UnsupportedConfigError, match="qdint8: dynamically quantized values stay internal"):
        g.output(q)


def test_output_bounds() -> None:
    g = Graph()
    g.output(g.add(g.input((2,)), g.input((2,)), output_min=1.0, output_max=0.0))
    _refused(g, r"node 0 \(XNNAdd\): output_min/output_max must be ordered and not NaN: got 1.0, 0.0")
    g.nodes[0].output_min = float("nan")
    _refused(g, "must be ordered and not NaN")


def test_quantized_data_movement_keeps_parameters() -> None:
    g = Graph()
    x = g.input((2, 3), D.qint8, PerTensorQuant(0.5, 1))
    y = g.static_transpose(x, (1, 0))
    g.output(y)
    g.to_bytes()
    g.values[y].quant = PerTensorQuant(0.25, 1)
    _refused(g, r"node 0 \(XNNStaticTranspose\): XNNStaticTranspose needs the same scale and zero point")


def test_builder_refuses_bad_shapes_early() -> None:
    g = Graph()
    x = g.input((2, 8))
    with pytest.raises(XnnquantError, match=r"XNNFullyConnected: input channels do not match the filter: got input "
                                            r"\(2, 8\) and filter \(4, 7\)"):
        g.fully_connected(x, g.constant(np.zeros((4, 7), np.float32)))
    with pytest.raises(XnnquantError, match=r"XNNAdd: input shapes do not broadcast: got \(2, 8\) and \(3,\)"):
        g.add(x, g.input((3,)))
    with pytest.raises(XnnquantError, match="a float constant must be float32 or float16: got dtype float64"):
        g.constant(np.zeros(3))
    with pytest.raises(UnsupportedConfigError, match="target xn01 concatenates 2 to 4 values in one node: got 5"):
        g.concatenate([x] * 5, 0)
    with pytest.raises(XnnquantError, match="value 0 is already an external input"):
        g.output(x)


def test_weight_only_refusals() -> None:
    """Measured on the runtime (test_graph_runtime.py, xnnquant.xnnpack.fully_connected):
    the weight-only path adds the bias before the filter scale, and a 1 x 1 or transposed
    qcint4 filter crashes XNNPACK while it packs; transposed qcint4 with odd N is misread."""
    for datatype in (D.qcint8, D.qcint4):
        g = Graph()
        x = g.input((2, 8))
        g.output(g.fully_connected(x, g.constant(_qc(datatype, (4, 8))), g.constant(np.zeros(4, np.float32))))
        _refused(g, r"node 0 \(XNNFullyConnected\): weight-only fully connected \(fp32 input x "
                    rf"{datatype.name} filter\) with a bias: XNNPACK 1adaa7c7 adds the bias before", UnsupportedConfigError)
    _refused(_fc(_qc(D.qcint4, (1, 1)), dynamic=False)[0], r"weight-only qcint4 with a 1 x 1 filter \(dims \[1, 1\]\) crashes",
             UnsupportedConfigError)
    _refused(_fc(_qc(D.qcint4, (8, 4), channel_dim=1), dynamic=False, transpose=True)[0],
             r"weight-only qcint4 with a transposed filter", UnsupportedConfigError)
    _refused(_fc(_qc(D.qcint4, (8, 5), channel_dim=1), transpose=True)[0],
             r"a transposed qcint4 filter \[K, N\] with odd N=5", UnsupportedConfigError)
    _fc(_qc(D.qcint4, (8, 6), channel_dim=1), transpose=True)[0].to_bytes()
    _fc(_qc(D.qcint8, (4, 8)), dynamic=False)[0].to_bytes()


def test_dynamic_qcint4_with_odd_k_is_refused() -> None:
    """Measured: qdint8 x qcint4 with odd K is wrong on the runtime when M > 1 (see
    test_graph_runtime.py); fp32 x qcint4 with odd K and even K are right."""
    g, _, _ = _fc(_qc(D.qcint4, (4, 9)))
    _refused(g, r"node 1 \(XNNFullyConnected\): qdint8 x qcint4 with an odd number of input channels \(K=9\)",
             UnsupportedConfigError)
    _fc(_qc(D.qcint4, (4, 10)))[0].to_bytes()
    _fc(_qc(D.qcint4, (4, 9)), dynamic=False)[0].to_bytes()


def test_builder_arguments_are_checked() -> None:
    g = Graph()
    with pytest.raises(XnnquantError, match=r"^dims must be a sequence of integers: got 'ab'$"):
        g.input("ab")
    with pytest.raises(XnnquantError, match=r"^dims must be a sequence of integers: got 2\.5 at index 0$"):
        g.input((2.5,))
    x = g.input((2,))
    with pytest.raises(XnnquantError, match=r"XNNAdd: unknown keyword argument\(s\) output_mn: node methods take"):
        g.add(x, x, output_mn=0.0)
