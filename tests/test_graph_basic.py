"""First checks of the graph layer: build, write, read back (fp32, FC, convert, quantized constants)."""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.graph import Graph, load
from xnnquant.rounding import to_bf16
from xnnquant.tensor import QuantizedTensor


def _dynamic_fc_graph() -> tuple[Graph, dict[str, int]]:
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input((2, 64))
    codes = rng.integers(-8, 8, size=(16, 64)).astype(np.int8)
    w4 = g.constant(QuantizedTensor(xq.Datatype.qcint4, codes, np.full(16, 0.25, np.float32), 0, channel_dim=0))
    scales = to_bf16(rng.uniform(0.01, 0.1, size=(16, 2)).astype(np.float32)).values
    wb = g.constant(QuantizedTensor(xq.Datatype.qbint4, codes, scales, 0, channel_dim=0, group_size=32))
    w8 = g.constant(QuantizedTensor(xq.Datatype.qcint8, codes * 9, np.linspace(0.1, 1, 16, dtype=np.float32), 0,
                                    channel_dim=0))
    b = g.constant(rng.standard_normal(16).astype(np.float32))
    qx = g.convert(x, xq.Datatype.qdint8)
    ys = [g.output(g.fully_connected(qx, w, bias=b)) for w in (w4, wb, w8)]
    return g, {"x": x, "w4": w4, "wb": wb, "w8": w8, "b": b, "y": ys[0]}


def test_round_trip_dynamic_fully_connected() -> None:
    g, ids = _dynamic_fc_graph()
    payload = g.to_bytes()
    back = load(payload)
    assert back == g
    assert back.inputs == [ids["x"]] and len(back.outputs) == 3
    qt = back.values[ids["wb"]].quantized_tensor()
    assert qt is not None and qt.datatype is xq.Datatype.qbint4 and qt.group_size == 32
    np.testing.assert_array_equal(qt.dequantize(), g.values[ids["wb"]].quantized_tensor().dequantize())
    np.testing.assert_array_equal(back.values[ids["b"]].array(), g.values[ids["b"]].array())


def test_payload_is_byte_stable() -> None:
    assert _dynamic_fc_graph()[0].to_bytes() == _dynamic_fc_graph()[0].to_bytes()


def test_save_is_atomic_and_loadable(tmp_path) -> None:
    g, _ = _dynamic_fc_graph()
    path = g.save(tmp_path / "model.xnn")
    assert path.read_bytes() == g.to_bytes()
    assert list(tmp_path.iterdir()) == [path]
    assert load(path) == g


def test_external_ids_inputs_first_whatever_the_call_order() -> None:
    g = Graph()
    a = g.input((2,))
    y = g.output(g.abs(a))
    b = g.input((2,))  # declared after an output: the output moves up
    z = g.output(g.negate(b))
    assert [g.value(i).external_id for i in (a, b, y, z)] == [0, 1, 2, 3]
    back = load(g.to_bytes())
    assert back.inputs == [a, b] and back.outputs == [y, z] and back.load_info.num_externs == 4


def test_save_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch) -> None:
    import os

    g, _ = _dynamic_fc_graph()
    path = tmp_path / "model.xnn"
    path.write_bytes(b"old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        g.save(path)
    assert path.read_bytes() == b"old" and list(tmp_path.iterdir()) == [path]
