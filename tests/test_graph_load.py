"""``load`` on every payload form: with or without header, XN00 or XN01, inline legacy
constants, fields of later schemas (dq_datatype, named_key, input5_id), files."""

from __future__ import annotations

from pathlib import Path

import flatbuffers
import numpy as np
import pytest
from graph_examples import random_graph

import xnnquant as xq
from xnnquant.errors import PayloadError, XnnquantError
from xnnquant.graph import Graph, LoadInfo, load, writer
from xnnquant.graph import schema_generated as fb
from xnnquant.graph.header import XNNHeader, align
from xnnquant.graph.layout import slot
from xnnquant.graph.segment import ConstantSegment
from xnnquant.graph.writer import flatbuffer

D = xq.Datatype


@pytest.mark.parametrize("identifier", [b"XN00", b"XN01"])
def test_bare_flatbuffer_with_inline_constants(identifier: bytes) -> None:
    g = random_graph(21, ("XNNFullyConnected", "XNNConv2d", "XNNPReLU"))
    data = flatbuffer(g, ConstantSegment(), inline_constants=True, identifier=identifier)
    assert data[4:8] == identifier
    back = load(data)
    assert back == g and back.load_info is not None
    assert back.load_info.inline_constants and back.load_info.identifier == identifier.decode()
    info = load(g.to_bytes()).load_info
    assert info == LoadInfo("XN01", "0", g.num_externs, inline_constants=False)


def test_identifier_xn00_with_header() -> None:
    g = random_graph(22, ("XNNAdd", "XNNSoftmax"))
    data = bytearray(g.to_bytes())
    data[36:40] = b"XN00"
    assert load(bytes(data)) == g


def test_inline_constant_index_out_of_range() -> None:
    g = Graph()
    g.constant(np.ones(3, np.float32))
    data = bytearray(flatbuffer(g, ConstantSegment(), inline_constants=True))
    root = fb.XNNGraph.GetRootAs(bytes(data), 0)
    tv = fb.XNNTensorValue()
    tab = root.Xvalues(0).XvalueUnion()
    tv.Init(tab.Bytes, tab.Pos)
    at = tv._tab.Pos + tv._tab.Offset(10)  # constant_buffer_idx
    data[at] = 9
    with pytest.raises(PayloadError, match="constant_buffer_idx 9 is out of range: constant_buffer has 2 entries"):
        load(bytes(data))


def _dq_payload(dq: int) -> bytes:
    """A bare XN00 flatbuffer: one fp32 external input [2, 4] with the runtime-only dq_datatype."""
    b = flatbuffers.Builder(256)
    dims = b.CreateNumpyVector(np.array([2, 4], "<u4"))
    b.StartObject(8)  # XNNTensorValue with the runtime schema's 8th field
    fb.XNNTensorValueAddDatatype(b, 1)
    fb.XNNTensorValueAddNumDims(b, 2)
    fb.XNNTensorValueAddDims(b, dims)
    fb.XNNTensorValueAddFlags(b, 1)
    b.PrependInt16Slot(7, dq, 0)
    tv = b.EndObject()
    fb.XValueStart(b)
    fb.XValueAddXvalueUnionType(b, 1)
    fb.XValueAddXvalueUnion(b, tv)
    xv = fb.XValueEnd(b)
    b.StartVector(4, 1, 4)
    b.PrependUOffsetTRelative(xv)
    values = b.EndVector()
    b.StartVector(4, 0, 4)
    nodes = b.EndVector()
    fb.XNNGraphStart(b)
    fb.XNNGraphAddXvalues(b, values)
    fb.XNNGraphAddXnodes(b, nodes)
    fb.XNNGraphAddNumExterns(b, 1)
    b.Finish(fb.XNNGraphEnd(b), file_identifier=b"XN00")
    return bytes(b.Output())


def test_legacy_dq_datatype() -> None:
    assert slot("XNNTensorValue", "dq_datatype") == 18
    g = load(_dq_payload(int(D.qint8)))
    assert g.values[0].dq_datatype is D.qint8 and g.inputs == [0]
    with pytest.raises(XnnquantError, match="legacy dq_datatype is only valid as qint8"):
        load(_dq_payload(int(D.fp16)))
    with pytest.raises(PayloadError, match=r"unknown datatype 12 \(int32 in ExecuTorch 1.4.1's schema\)"):
        load(_dq_payload(12))


def test_named_keys_reported_and_resolved() -> None:
    """An ExecuTorch-1.4.1-style entry: offset UINT64_MAX and a named_key string (slot 2)."""
    g = Graph()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    g.output(g.fully_connected(g.input((1, 3)), g.constant(w)))
    b = flatbuffers.Builder(256)
    key = b.CreateString("abc123")
    b.StartObject(3)  # ConstantDataOffset with 1.4.1's third field
    b.PrependUint64Slot(0, 2**64 - 1, 0)
    b.PrependUint64Slot(1, w.nbytes, 0)
    b.PrependUOffsetTRelativeSlot(2, key, 0)
    named_entry = b.EndObject()
    fb.ConstantDataOffsetStart(b)
    reserved = fb.ConstantDataOffsetEnd(b)
    values = [writer._value(b, v, 1 if v.constant else 0) for v in g.values]
    nodes = [writer._node(b, n) for n in g.nodes]
    root = {"version": b.CreateString("0"), "xnodes": writer._table_vector(b, nodes),
            "xvalues": writer._table_vector(b, values), "num_externs": 2,
            "constant_data": writer._table_vector(b, [reserved, named_entry])}
    b.Finish(writer._table(b, "XNNGraph", root), file_identifier=b"XN01")
    fbytes = bytes(b.Output())
    payload = XNNHeader.for_sizes(len(fbytes), 0).to_bytes() + fbytes + bytes(align(len(fbytes)) - len(fbytes))
    bare = load(payload)
    assert bare.load_info.named_keys == ("abc123",) and bare.load_info.missing_named_keys == ("abc123",)
    assert bare.values[1].constant is None and bare.values[1].named_key == "abc123"
    with pytest.raises(XnnquantError, match="pass named_data= to load"):
        bare.values[1].array()
    full = load(payload, named_data={"abc123": w.tobytes()})
    assert full.load_info.missing_named_keys == ()
    np.testing.assert_array_equal(full.values[1].array(), w)
    with pytest.raises(XnnquantError, match="constant data size does not match dims"):
        load(payload, named_data={"abc123": w.tobytes()[:-4]})


def test_concatenate5_reads_its_fifth_input() -> None:
    """XNNConcatenate5 (tag 38, ExecuTorch 1.4.1) keeps input5_id in slot 7 of _XNNCat."""
    g = Graph()
    ins = [g.input((1, 2)) for _ in range(4)]
    g.output(g.concatenate(ins, 1))
    back = load(g.to_bytes())
    assert back.nodes[0].inputs == tuple(ins)
    data = bytearray(g.to_bytes())
    node = fb.XNNGraph.GetRootAs(bytes(data[32:]), 0).Xnodes(0)
    data[32 + node._tab.Pos + node._tab.Offset(4)] = 38  # same table, now "Concatenate5"
    # input5_id absent: it reads as the default 0, as the runtime would; the output, declared
    # [1, 8] for four inputs, is refused by validation (five compute [1, 10])
    with pytest.raises(XnnquantError, match=r"^node 0 \(XNNConcatenate5\): output value 4 is declared with dims "
                                            r"\[1, 8\], but the node computes \[1, 10\] from its inputs' dims "):
        load(bytes(data))
    five = load(bytes(data), validate=False)
    assert five.nodes[0].kind == "XNNConcatenate5" and five.nodes[0].inputs == (*ins, 0)
    five.value(five.outputs[0]).dims = (1, 10)
    assert five.target == "1.4.1" and load(five.to_bytes()) == five  # written back with 1.4.1's schema


def test_load_from_path_and_bad_sources(tmp_path: Path) -> None:
    g = random_graph(23, ("XNNMaximum",))
    path = g.save(tmp_path / "g.xnn")
    assert load(path) == load(str(path)) == load(bytearray(path.read_bytes())) == g
    with pytest.raises(XnnquantError, match="cannot read payload file"):
        load(tmp_path / "missing.xnn")
    with pytest.raises(XnnquantError, match=r"^load\(\) takes payload bytes or a path: got 3$"):
        load(3)  # type: ignore[arg-type]


def test_quantized_tensors_come_back_dequantizable() -> None:
    rng = np.random.default_rng(3)
    g = Graph()
    codes = rng.integers(-8, 8, size=(5, 7)).astype(np.int8)
    qt = xq.QuantizedTensor(D.qcint4, codes, rng.uniform(0.1, 1, 5).astype(np.float32), 0, channel_dim=0)
    g.constant(qt)
    back = load(g.to_bytes()).values[0].quantized_tensor()
    np.testing.assert_array_equal(back.codes, codes)
    np.testing.assert_array_equal(back.dequantize(), qt.dequantize())
