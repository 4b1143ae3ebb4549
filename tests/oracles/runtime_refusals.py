"""Oracle: what the real runtime does with payloads our validation refuses.

Usage: ``runtime_refusals.py OUT.json``.  Each case builds a valid graph with
``xnnquant.graph``, breaks one thing (a field, or a byte of the payload), and writes the
bytes without validation.  For each case the JSON records our validation's (or
``load``'s) message and what ExecuTorch 1.4.1's runtime does
with the bytes (``run(..., validate=False)``): ``"ok"``, ``"refused: ..."`` or
``"crashed: signal N"``.  The parent builds each ``.pte`` (``to_pte``, which only
exports a stub and serializes) and executes nothing; every case executes in a forked
child, so a crashing case cannot take the others down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable

import numpy as np

import xnnquant as xq
from xnnquant.datatypes import storage
from xnnquant.graph import Graph, load, to_pte, writer
from xnnquant.graph.header import XNNHeader, align
from xnnquant.graph.model import PerChannelQuant, PerTensorQuant, PerTokenDynamicQuant
from xnnquant.graph.segment import ConstantSegment
from xnnquant.graph.writer import flatbuffer
from xnnquant.rounding import to_bf16
from xnnquant.tensor import QuantizedTensor

D = xq.Datatype
RNG = np.random.default_rng(0)


def unchecked_bytes(g: Graph) -> bytes:
    seg = ConstantSegment()
    fb = flatbuffer(g, seg)
    const = seg.to_bytes()
    return XNNHeader.for_sizes(len(fb), len(const)).to_bytes() + fb + bytes(align(len(fb)) - len(fb)) + const


def _fc(filter_qt: QuantizedTensor, dynamic: bool = True) -> tuple[Graph, int]:
    g = Graph()
    x = g.input((2, filter_qt.shape[1]))
    w = g.constant(filter_qt)
    g.output(g.fully_connected(g.convert(x, D.qdint8) if dynamic else x, w,
                               g.constant(np.zeros(filter_qt.shape[0], np.float32))))
    return g, w


def _qc8(shape: tuple[int, int] = (4, 64)) -> QuantizedTensor:
    return QuantizedTensor(D.qcint8, RNG.integers(-99, 99, shape).astype(np.int8),
                           np.full(shape[0], 0.05, np.float32), 0, channel_dim=0)


def _qb4(group: int = 32) -> QuantizedTensor:
    scale = to_bf16(np.full((4, 64 // group), 0.05, np.float32)).values
    return QuantizedTensor(D.qbint4, RNG.integers(-8, 8, (4, 64)).astype(np.int8), scale, 0,
                           channel_dim=0, group_size=group)


def fc_qcint8_channel_dim_1() -> Graph:
    g, w = _fc(_qc8((64, 64)))
    g.values[w].quant = dataclasses.replace(g.values[w].quant, channel_dim=1)
    return g


def fc_qbint4_group_16() -> Graph:
    g, w = _fc(_qb4(32))
    q = g.values[w].quant
    g.values[w].quant = dataclasses.replace(q, group_size=16, scale=np.repeat(q.scale, 2),
                                            scale_bf16=np.repeat(q.scale_bf16, 2))
    return g


def fc_fp32_input_qbint4() -> Graph:
    return _fc(_qb4(32), dynamic=False)[0]


def fc_fp16_input_qcint8() -> Graph:
    g = Graph()
    x = g.input((2, 64), D.fp16)
    g.output(g.fully_connected(x, g.constant(_qc8())))
    return g


def qint8_zero_point_200() -> Graph:
    g = Graph()
    x = g.input((2, 3), D.qint8, PerTensorQuant(0.5, 0))
    g.output(g.abs(x))
    g.values[0].quant = PerTensorQuant(0.5, 200)
    return g


def negative_scale() -> Graph:
    g = Graph()
    x = g.input((2, 3), D.qint8, PerTensorQuant(0.5, 0))
    g.output(g.abs(x))
    for v in g.values:
        v.quant = PerTensorQuant(-0.5, 0)
    return g


def qcint8_zero_scale() -> Graph:
    g, w = _fc(_qc8())
    g.values[w].quant.scale[1] = 0.0
    return g


def qdint8_too_many_nonbatch_dims() -> Graph:
    g = Graph()
    x = g.input((2, 64))
    q = g.convert(x, D.qdint8)
    g.output(g.fully_connected(q, g.constant(_qc8())))
    g.values[q].quant = PerTokenDynamicQuant(3)
    return g


def argmax_unused_indices() -> Graph:
    g = Graph()
    values, _ = g.argmax_pooling_2d(g.input((1, 4, 4, 2)), kernel=2)
    g.output(values)
    return g


def argmax_unused_node() -> Graph:
    g = Graph()
    x = g.input((1, 4, 4, 2))
    g.argmax_pooling_2d(x, kernel=2)
    g.output(g.abs(x))
    return g


def value_flag_bit_4() -> Graph:
    g = Graph()
    g.output(g.abs(g.input((2, 3))))
    g.values[0].flags = 1 | 4
    return g


def conv_filter_channel_dim_3() -> Graph:
    g = Graph()
    x = g.input((1, 5, 5, 2), D.qint8, PerTensorQuant(0.5, 0))
    w = g.constant(QuantizedTensor(D.qcint8, RNG.integers(-9, 9, (3, 3, 3, 2)).astype(np.int8),
                                   np.full(3, 0.1, np.float32), 0, channel_dim=0))
    y = g.conv2d(x, w)
    g.value(y).quant = PerTensorQuant(4.0, 0)
    g.output(y)
    g.values[w].quant = PerChannelQuant(np.full(2, 0.1, np.float32), 3)
    return g


def depthwise_filter_channel_dim_0() -> Graph:
    g = Graph()
    x = g.input((1, 5, 5, 4), D.qint8, PerTensorQuant(0.5, 0))
    w = g.constant(QuantizedTensor(D.qcint8, RNG.integers(-9, 9, (1, 3, 3, 4)).astype(np.int8),
                                   np.full(4, 0.1, np.float32), 0, channel_dim=3))
    y = g.depthwise_conv2d(x, w)
    g.value(y).quant = PerTensorQuant(4.0, 0)
    g.output(y)
    g.values[w].quant = PerChannelQuant(np.full(1, 0.1, np.float32), 0)
    return g


def output_min_above_max() -> Graph:
    g = Graph()
    g.output(g.add(g.input((2, 3)), g.input((2, 3)), output_min=1.0, output_max=-1.0))
    return g


def transpose_changes_quantization() -> Graph:
    g = Graph()
    y = g.static_transpose(g.input((2, 3), D.qint8, PerTensorQuant(0.5, 0)), (1, 0))
    g.value(y).quant = PerTensorQuant(0.25, 0)
    g.output(y)
    return g


def use_before_definition() -> Graph:
    g = Graph()
    y = g.abs(g.input((2, 3)))
    g.output(g.negate(y))
    g.nodes.reverse()
    return g


def constant_too_short() -> Graph:
    g = Graph()
    x = g.input((2, 64))
    w = g.constant(np.ones((4, 64), np.float32))
    g.output(g.fully_connected(x, w))
    g.values[w].constant = g.values[w].constant[:64]
    return g


def qbint4_scale_bf16_only() -> Graph:
    g, w = _fc(_qb4(32))
    g.values[w].quant = dataclasses.replace(g.values[w].quant, scale=np.zeros(0, np.float32))
    return g


def qbint4_no_scale_field() -> Graph:
    """Like qbint4_scale_bf16_only, with the empty ``scale`` vector left out entirely."""
    return qbint4_scale_bf16_only()


def _omit_empty_scales(graph: Graph) -> bytes:
    """``unchecked_bytes`` with empty ``scale`` vectors left out of the quant tables."""
    original = writer._vector

    def vector(b: object, ftype: str, items: object) -> object:
        if ftype == "[f32]" and len(items) == 0:  # type: ignore[arg-type]
            return None
        return original(b, ftype, items)  # type: ignore[arg-type]

    def table(b: object, name: str, fields: dict) -> int:
        return original_table(b, name, {k: v for k, v in fields.items() if v is not None})

    original_table = writer._table
    writer._vector, writer._table = vector, table
    try:
        return unchecked_bytes(graph)
    finally:
        writer._vector, writer._table = original, original_table


def outputs_before_inputs() -> Graph:
    g = Graph()
    x = g.input((2, 3))
    g.output(g.abs(x))
    g.values[0].external_id, g.values[1].external_id = 1, 0
    return g


def duplicate_external_id() -> Graph:
    g = Graph()
    a, b = g.input((2, 3)), g.input((2, 3))
    g.output(g.add(a, b))
    g.values[b].external_id = 0
    return g


def qbint4_channel_dim_1() -> Graph:
    g, w = _fc(_qb4(32))
    g.values[w].quant = dataclasses.replace(g.values[w].quant, channel_dim=1)
    return g


CASES: dict[str, Callable[[], Graph]] = {f.__name__: f for f in (
    outputs_before_inputs, duplicate_external_id, qbint4_channel_dim_1, qbint4_scale_bf16_only,
    qbint4_no_scale_field,
    fc_qcint8_channel_dim_1, fc_qbint4_group_16, fc_fp32_input_qbint4, fc_fp16_input_qcint8, qint8_zero_point_200,
    negative_scale, qcint8_zero_scale, qdint8_too_many_nonbatch_dims, argmax_unused_indices, argmax_unused_node,
    value_flag_bit_4, conv_filter_channel_dim_3, depthwise_filter_channel_dim_0, output_min_above_max,
    transpose_changes_quantization, use_before_definition, constant_too_short,
)}


def _inputs(g: Graph) -> list[np.ndarray]:
    out = []
    for i in g.inputs:
        v = g.value(i)
        dt = np.dtype(storage(v.datatype).numpy_dtype)
        out.append(np.ones(v.dims, dt))
    return out


def _small_graph() -> Graph:
    g = Graph()
    g.output(g.abs(g.input((2, 3))))
    return g


def _identifier(ident: bytes) -> Callable[[bytes], bytes]:
    return lambda payload: payload[:36] + ident + payload[40:]


# cases broken at the byte level: (graph, bytes -> bytes); the .pte is built from the
# intact payload and the broken bytes are spliced in (to_pte reads its payload first)
BYTE_CASES: dict[str, tuple[Callable[[], Graph], Callable[[bytes], bytes]]] = {
    "wrong_identifier": (_small_graph, _identifier(b"XN99")),
    "non_ascii_identifier": (_small_graph, _identifier(b"XN0\xa2")),
}


def _execute(pte: bytes, inputs: list[np.ndarray]) -> None:
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)  # kept alive while the method runs
    program.load_method("forward").execute([torch.from_numpy(a) for a in inputs])


def _runtime_verdict(g: Graph, corrupt: Callable[[bytes], bytes] | None = None,
                     serialize: Callable[[Graph], bytes] = unchecked_bytes) -> str:
    """Build the .pte here (no execution), execute it in a forked child."""
    payload = serialize(g)
    try:
        pte = to_pte(payload, validate=False, constants="inline")  # broken bytes are spliced in as they are
    except Exception as exc:
        return f"refused by to_pte: {type(exc).__name__}: {exc}"
    if corrupt is not None:
        broken = corrupt(payload)
        at = pte.find(payload)
        assert at >= 0 and len(broken) == len(payload)
        pte = pte[:at] + broken + pte[at + len(payload):]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: run with the runtime's log (stderr) captured, report, exit without cleanup
        os.close(read)
        log = tempfile.TemporaryFile()  # noqa: SIM115 (the child exits without cleanup)
        os.dup2(log.fileno(), 2)
        try:
            _execute(pte, _inputs(g))
            msg = "ok"
        except Exception as exc:
            log.seek(0)
            lines = [ln for ln in log.read().decode(errors="replace").splitlines() if "cpuinfo" not in ln]
            msg = f"refused: {type(exc).__name__}: {exc}; log: {' | '.join(lines[-6:])}"
        os.write(write, msg.encode()[:4000])
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 4096):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"crashed: signal {os.WTERMSIG(status)}"
    return b"".join(chunks).decode() or f"exited {os.WEXITSTATUS(status)} without a verdict"


def main(out: str) -> None:
    import torch  # noqa: F401  (once, here: each forked child would otherwise import torch and the runtime)
    from executorch.runtime import Runtime  # noqa: F401

    results = {}
    for name, build in CASES.items():
        g = build()
        try:
            g.validate()
            ours = None
        except xq.XnnquantError as exc:
            ours = f"{type(exc).__name__}: {exc}"
        serialize = _omit_empty_scales if name == "qbint4_no_scale_field" else unchecked_bytes
        results[name] = {"validation": ours, "runtime": _runtime_verdict(g, serialize=serialize)}
        print(name, results[name], flush=True)
    for name, (build, corrupt) in BYTE_CASES.items():
        g = build()
        try:
            load(corrupt(unchecked_bytes(g)))
            ours = None
        except xq.XnnquantError as exc:
            ours = f"{type(exc).__name__}: {exc}"
        results[name] = {"validation": ours, "runtime": _runtime_verdict(g, corrupt)}
        print(name, results[name], flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
