"""Scales in the constant segment, deferred constants, and payloads / .pte files written as streams.

Oracles: the real ExecuTorch 1.4.1 runtime (the segment layout must compute exactly what
the inline layout computes, and must actually be read: doubled segment scales double the
output), ExecuTorch's own .pte serializer (a streamed .pte must equal the one it builds
for the whole payload), and byte layouts spelled out here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from et_lowered import lowered_pte

import xnnquant as xq
from xnnquant.graph import Deferred, Graph, interpret, load, program, run, writer
from xnnquant.graph.header import XNNHeader

pytestmark = pytest.mark.xnnpack

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((64, 128)).astype(np.float32)
W2 = RNG.standard_normal((32, 64)).astype(np.float32)
W3 = RNG.standard_normal((16, 32)).astype(np.float32)
BIAS = RNG.standard_normal(16).astype(np.float32)
X = RNG.standard_normal((4, 128)).astype(np.float32)


def weights() -> list[xq.QuantizedTensor | np.ndarray]:
    return [xq.quantize_blockwise(W1, 32), xq.quantize_per_channel(W2, 8), xq.quantize_per_channel(W3, 4), BIAS]


def deferred(made: list[str] | None = None) -> list[Deferred]:
    """The same constants as ``weights()``, made on demand (and noted in ``made``)."""
    def maker(i: int) -> object:
        def make() -> object:
            if made is not None:
                made.append(f"w{i}")
            return weights()[i]
        return make
    kinds = [(xq.Datatype.qbint4, (64, 128), 32), (xq.Datatype.qcint8, (32, 64), None),
             (xq.Datatype.qcint4, (16, 32), None), (xq.Datatype.fp32, (16,), None)]
    return [Deferred(d, dims, maker(i), f"w{i}", group_size=g) for i, (d, dims, g) in enumerate(kinds)]


def mlp(constants: list, **graph_options: object) -> Graph:
    g = Graph(**graph_options)  # type: ignore[arg-type]
    x = g.input((4, 128))
    c1, c2, c3, b = (g.constant(c) for c in constants)
    h = g.fully_connected(g.convert(x, xq.Datatype.qdint8), c1)
    h = g.fully_connected(g.convert(h, xq.Datatype.qdint8), c2)
    g.output(g.fully_connected(g.convert(h, xq.Datatype.qdint8), c3, b))
    return g


SEGMENT = {"target": "1.4.1", "scales_in_segment": True}


def test_segment_layout_runs_as_the_inline_layout_on_the_runtime() -> None:
    (inline,) = run(mlp(weights()).to_bytes(), [X])
    (segment,) = run(mlp(weights(), **SEGMENT).to_bytes(), [X])
    np.testing.assert_array_equal(segment, inline)  # same codes, same scales: the same kernels


def test_runtime_reads_the_scales_from_the_segment() -> None:
    """Doubling the blockwise scales in the segment doubles the first layer's output."""
    g = Graph(**SEGMENT)
    x = g.input((4, 128))
    g.output(g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(weights()[0])))
    payload = bytearray(g.to_bytes())
    header = XNNHeader.from_bytes(bytes(payload))
    plan = writer.SegmentPlan.of(g)
    (offset, size), = [plan.entries[i] for i, _ in plan.scale_index.values()]
    at = header.constant_data_offset + offset
    bits = np.frombuffer(payload[at:at + size], "<u2")
    assert bits.tobytes() == xq.packing.to_bf16(weights()[0].scale.ravel()).bits.tobytes()
    payload[at:at + size] = (bits + 0x80).astype("<u2").tobytes()  # exponent + 1: every scale doubled
    (base,) = run(g.to_bytes(), [X])
    (doubled,) = run(bytes(payload), [X])
    np.testing.assert_allclose(doubled, 2 * base, rtol=1e-6)  # float32 rounding of the products only


def test_segment_layout_byte_by_byte() -> None:
    """Each constant's data, then its scales, each 16-aligned; empty scale vectors in the flatbuffer."""
    g = mlp(weights(), **SEGMENT)
    payload = g.to_bytes()
    header = XNNHeader.from_bytes(payload)
    segment = payload[header.constant_data_offset:]
    w = weights()
    expected = [w[0].to_bytes(), xq.packing.to_bf16(w[0].scale.ravel()).bits.astype("<u2").tobytes(),
                w[1].to_bytes(), w[1].scale.astype("<f4").tobytes(),
                w[2].to_bytes(), w[2].scale.astype("<f4").tobytes(), BIAS.astype("<f4").tobytes()]
    offset = 0
    for i, blob in enumerate(expected):
        assert segment[offset:offset + len(blob)] == blob, i
        pad = -len(blob) % 16
        assert segment[offset + len(blob):offset + len(blob) + pad] == bytes(pad)
        offset += len(blob) + pad
    assert offset == len(segment) == header.constant_data_size
    loaded = load(payload)
    quants = [v.quant for v in loaded.values if v.is_constant and v.quant is not None]
    assert [(q.scale_buffer_idx, q.num_scales) for q in quants] == [(2, 64 * 4), (4, 32), (6, 16)]
    np.testing.assert_array_equal(quants[0].scale, w[0].scale.ravel())


def test_deferred_constants_give_the_same_bytes_and_are_made_one_at_a_time() -> None:
    made: list[str] = []
    g = mlp(deferred(made), **SEGMENT)
    chunks = writer.payload_chunks(g)
    head = [next(chunks) for _ in range(3)]  # header, flatbuffer, padding: from metadata alone
    assert made == []
    rest = []
    for chunk in chunks:
        rest.append(chunk)
        if len(made) == 1:
            assert len(rest) <= 4  # w0's data and scales (with padding) before w1 is made
    assert made == ["w0", "w1", "w2", "w3"]
    assert b"".join(head + rest) == mlp(weights(), **SEGMENT).to_bytes()
    (out,) = interpret(g, [X])  # the interpreter makes deferred constants as it needs them
    (ref,) = interpret(mlp(weights(), **SEGMENT), [X])
    np.testing.assert_array_equal(out, ref)


def test_streamed_pte_is_executorchs_pte_of_the_whole_payload(tmp_path: Path) -> None:
    g = mlp(deferred(), **SEGMENT)
    streamed = b"".join(program.pte_chunks(g))
    whole = mlp(weights(), **SEGMENT).to_bytes()
    assert streamed == program.to_pte(whole)  # the constants as named data, made one at a time
    specs = program.TensorSpec((4, 128), np.dtype(np.float32)), program.TensorSpec((4, 16), np.dtype(np.float32))
    inline = program.to_pte(whole, constants="inline")
    assert inline == lowered_pte(whole, specs[:1], specs[1:])  # ExecuTorch's own serializer
    (out,) = run(mlp(weights(), **SEGMENT).to_bytes(), [X])
    import torch
    from executorch.runtime import Runtime

    # the Method points into its Program, which must outlive it (dropping it crashed the runtime)
    path = tmp_path / "streamed.pte"
    path.write_bytes(streamed)  # from its file: the runtime frees the delegate's bytes after init
    pte_program = Runtime.get().load_program(str(path))
    method = pte_program.load_method("forward")
    np.testing.assert_array_equal(method.execute([torch.from_numpy(X)])[0].numpy(), out)


def test_deferred_mismatch_and_misuse_are_refused() -> None:
    bad = Deferred(xq.Datatype.qbint4, (64, 128), lambda: xq.quantize_blockwise(W1, 64), "layers.0.q_proj",
                   group_size=32)
    g = mlp([bad] + deferred()[1:], **SEGMENT)
    with pytest.raises(xq.XnnquantError, match=r"^layers\.0\.q_proj: made QuantizedTensor\(qbint4, shape=\(64, 128\), "
                       r"scale\(64, 2\), channel_dim=0, group_size=64\), but the graph holds qbint4 \(64, 128\) "
                       r"in groups of 32$"):
        g.to_bytes()
    with pytest.raises(xq.UnsupportedConfigError, match="a deferred constant needs Graph"):
        Graph(target="1.4.1").constant(deferred()[0])
    with pytest.raises(xq.UnsupportedConfigError, match=r"only ExecuTorch 1\.4\.1 and later read: use target='1\.4\.1'"):
        Graph(scales_in_segment=True)
    with pytest.raises(xq.UnsupportedConfigError, match="qint8 constants cannot be deferred"):
        Graph(**SEGMENT).constant(Deferred(xq.Datatype.qint8, (4,), lambda: None, "x"))


def test_save_streams_and_a_failure_leaves_no_file(tmp_path: Path) -> None:
    made: list[str] = []
    path = mlp(deferred(made), **SEGMENT).save(tmp_path / "m.xnn")
    assert path.read_bytes() == mlp(weights(), **SEGMENT).to_bytes() and len(made) == 4

    def broken() -> object:
        raise xq.XnnquantError("tensor 'w2' is truncated")

    constants = deferred()
    constants[2] = Deferred(xq.Datatype.qcint4, (16, 32), broken, "w2")
    with pytest.raises(xq.XnnquantError, match="tensor 'w2' is truncated"):
        mlp(constants, **SEGMENT).save(tmp_path / "bad.xnn")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.xnn"]

