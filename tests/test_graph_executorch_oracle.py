"""The writer and reader against ExecuTorch 1.4.1's own serializer (run in one subprocess).

Two oracles (tests/oracles/), run together so that the expensive ExecuTorch import
happens once:

* et_constant_segment.py: the node visitor's byte preparation (raw storage, qc4w
  packing, channels-last conv weights), the NamedDataStore (identical bytes once), the
  16-byte padding helpers and ``serialize_xnnpack_binary``'s header, fed with our
  flatbuffer: our whole payload must come out byte for byte.
* et_serialize_graph.py: ExecuTorch's dataclasses -> JSON -> flatc writes a random graph
  covering all 37 node kinds, once in the seed form (own constant segment) and once in
  the form 1.4.1 emits (constants and scales in named data): ``load`` must give back
  our graph, and with the named data, the same codes and scales.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from graph_examples import random_graph

import xnnquant as xq
from xnnquant.graph import Graph, load
from xnnquant.graph.model import PerChannelGroupQuant, PerChannelQuant
from xnnquant.graph.segment import ConstantSegment
from xnnquant.graph.writer import flatbuffer, node_fields
from xnnquant.packing import conv_weight, depthwise_weight
from xnnquant.tensor import QuantizedTensor

ORACLES = Path(__file__).parent / "oracles"
pytestmark = pytest.mark.xnnpack


def _constants_graph() -> tuple[Graph, list[tuple[np.ndarray, str]]]:
    """A graph holding one constant of every storage kind, plus what ExecuTorch gets for each."""
    rng = np.random.default_rng(7)
    g = Graph()
    specs: list[tuple[np.ndarray, str]] = []

    def add(value: object, arr: np.ndarray, kind: str) -> None:
        g.constant(value)
        specs.append((arr, kind))

    f32 = rng.standard_normal((5, 3)).astype(np.float32)  # 60 bytes: padded to 64
    add(f32, f32, "raw")
    f16 = rng.standard_normal(7).astype(np.float16)  # 14 bytes
    add(f16, f16, "raw")
    c4 = rng.integers(-8, 8, size=(6, 9)).astype(np.int8)  # odd K: one padding nibble per row
    add(QuantizedTensor(xq.Datatype.qcint4, c4, np.full(6, 0.5, np.float32), 0, channel_dim=0), c4, "qc4w")
    c8 = rng.integers(-128, 128, size=(4, 10)).astype(np.int8)
    add(QuantizedTensor(xq.Datatype.qcint8, c8, np.full(4, 0.1, np.float32), 0, channel_dim=0), c8, "raw")
    b32 = rng.integers(-(2**31), 2**31 - 1, size=4).astype(np.int32)
    add(QuantizedTensor(xq.Datatype.qcint32, b32, np.full(4, 0.01, np.float32), 0, channel_dim=0), b32, "raw")
    add(QuantizedTensor(xq.Datatype.qint32, b32[:3].copy(), np.float32(0.02), 0), b32[:3].copy(), "raw")
    add(f32, f32, "raw")  # identical bytes: stored once
    w = rng.standard_normal((8, 3, 3, 2)).astype(np.float32)  # OIHW
    add(conv_weight(w), w, "conv")
    dw = rng.standard_normal((6, 1, 3, 3)).astype(np.float32)
    add(depthwise_weight(dw), dw, "depthwise")
    q8 = rng.integers(-128, 128, size=(3, 3)).astype(np.int8)
    add(QuantizedTensor(xq.Datatype.qint8, q8, np.float32(0.5), -3), q8, "raw")
    x = g.input((5, 3))
    g.output(g.add(x, 0))
    return g, specs


def _describe(g: Graph) -> dict:
    """The graph field by field, in the schema's names, for et_serialize_graph.py."""
    blobs: list[str] = []
    values = []
    for v in g.values:
        q = None
        if v.quant is not None:
            q = {"type": type(v.quant).__name__, **{k: getattr(v.quant, k) for k in v.quant.__dataclass_fields__
                                                     if k not in ("scale_buffer_idx", "num_scales")}}
            for k, a in list(q.items()):
                if isinstance(a, np.ndarray):
                    q[k] = a.tolist()
            if q.get("scale_bf16", 0) is None:
                del q["scale_bf16"]
        if v.constant is not None:
            blobs.append(v.constant.hex())
        values.append({"datatype": int(v.datatype), "dims": list(v.dims), "external_id": 0xFFFFFFFF
                       if v.external_id is None else v.external_id, "flags": v.flags, "id_out": v.id,
                       "constant": len(blobs) - 1 if v.constant is not None else None, "quant": q})
    nodes = [{"kind": n.kind, "fields": {k: list(x) if isinstance(x, tuple) else x for k, x in node_fields(n).items()},
              "debug_handle": n.debug_handle, "output_min": n.output_min, "output_max": n.output_max}
             for n in g.nodes]
    return {"values": values, "nodes": nodes, "constants": blobs, "num_externs": g.num_externs,
            "input_ids": g.inputs, "output_ids": g.outputs}


@pytest.fixture(scope="module")
def oracle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("et_oracle")
    g, specs = _constants_graph()
    segment = ConstantSegment()
    (d / "fb.bin").write_bytes(flatbuffer(g, segment))
    np.savez(d / "in.npz", kinds=np.array([k for _, k in specs]), **{f"c{i}": a for i, (a, _) in enumerate(specs)})
    (d / "graph.json").write_text(json.dumps(_describe(random_graph(2024, repeat=2))))
    script = (
        "import runpy, sys\n"
        "d, o = sys.argv[1], sys.argv[2]\n"
        "sys.argv = ['x', d + '/in.npz', d + '/fb.bin', d]\n"
        "runpy.run_path(o + '/et_constant_segment.py', run_name='__main__')\n"
        "sys.argv = ['x', d + '/graph.json', d]\n"
        "runpy.run_path(o + '/et_serialize_graph.py', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(d), str(ORACLES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return d


def test_constant_segment_and_framing_match_executorch(oracle_dir: Path) -> None:
    g, specs = _constants_graph()
    segment = ConstantSegment()
    flatbuffer(g, segment)
    assert segment.to_bytes() == (oracle_dir / "segment.bin").read_bytes()
    et_entries = [tuple(e) for e in json.loads((oracle_dir / "entries.json").read_text())]
    assert sorted(set(et_entries)) == sorted(segment.entries[1:])  # one entry per distinct blob, same places
    assert g.to_bytes() == (oracle_dir / "payload.bin").read_bytes()
    back = load(g.to_bytes())
    np.testing.assert_array_equal(back.values[2].quantized_tensor().codes, specs[2][0])


def test_executorch_serialized_graph_loads_back_equal(oracle_dir: Path) -> None:
    g = random_graph(2024, repeat=2)
    assert load((oracle_dir / "seed.bin").read_bytes()) == g


def test_executorch_named_data_payload_resolves(oracle_dir: Path) -> None:
    g = random_graph(2024, repeat=2)
    payload = (oracle_dir / "named.bin").read_bytes()
    bare = load(payload)
    constants = [v for v in g.values if v.constant is not None]
    assert len(bare.load_info.missing_named_keys) == len(bare.load_info.named_keys) >= len(constants)
    assert all(v.constant is None for v in bare.values)
    named = {p.stem: p.read_bytes() for p in (oracle_dir / "named").iterdir()}
    full = load(payload, named_data=named)
    assert full.load_info.missing_named_keys == () and full.nodes == g.nodes
    for ours, theirs in zip(g.values, full.values):
        assert (ours.id, ours.datatype, ours.dims, ours.flags, ours.constant) == \
               (theirs.id, theirs.datatype, theirs.dims, theirs.flags, theirs.constant)
        if isinstance(ours.quant, (PerChannelQuant, PerChannelGroupQuant)):
            assert theirs.quant.scale_buffer_idx > 0
            np.testing.assert_array_equal(theirs.quant.scale, ours.quant.scale)
        else:
            assert theirs.quant == ours.quant
        qt = ours.quantized_tensor()
        if qt is not None:
            back = theirs.quantized_tensor()
            np.testing.assert_array_equal(back.codes, qt.codes)
            np.testing.assert_array_equal(back.scale, qt.scale)
