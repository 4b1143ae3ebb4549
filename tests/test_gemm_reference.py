"""pack_gemm against a literal, element-by-element model of the packed layouts.

The model below is written from the layout rules (the docstrings of
``xnnquant.packing.gemm_layouts`` and XNNPACK's packing loops as read at 1adaa7c7), one
value at a time with plain Python loops and ``struct``: no reshapes, no shared helpers.
It is slow and obviously structured, and serves as the oracle for every configuration of
``kernel_configs()`` and for random tile parameters (``sr > 1``, odd ``kr``-multiples,
partial tiles) that no CPU here selects.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xnnquant as xq
from xnnquant.packing import kernel_configs, pack_gemm


def ru(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def first_channel(chunk_start: int, row: int, kr: int, sr: int) -> int:
    """Input channel where row ``row`` of the chunk starting at ``chunk_start`` begins."""
    group = kr * sr
    return chunk_start // group * group + (chunk_start + row * kr) % group


def model_f32(w: np.ndarray, bias, nr: int, kr: int, sr: int, pad_rows: str) -> bytes:
    n, k = w.shape
    kp = ru(k, kr * sr)
    out = bytearray()
    for t in range(0, n, nr):
        real = min(nr, n - t)
        for o in range(nr):
            out += struct.pack("<f", bias[t + o] if bias is not None and o < real else 0.0)
        for start in range(0, kp, kr):
            for o in range(nr):
                source = t + o if o < real else (t + real - 1 if pad_rows != "zero" else None)
                for j in range(kr):
                    ch = first_channel(start, o, kr, sr) + j
                    value = 0.0
                    if source is not None and ch < k:
                        value = float(w[source, ch])
                    if pad_rows == "replicate" and o >= real and o == nr - 1 and ch < k // 4 * 4:
                        value = 0.0
                    out += struct.pack("<f", value)
    return bytes(out) + bytes(-len(out) % 64)


def model_qc8w(q: np.ndarray, scale, bias, nr: int, kr: int, sr: int, pad_rows: str) -> bytes:
    n, k = q.shape
    kp = ru(k, kr * sr)
    out = bytearray()
    for t in range(0, n, nr):
        real = min(nr, n - t)
        rows = [t + o if o < real else (t + real - 1 if pad_rows == "replicate_all" else None) for o in range(nr)]
        for r in rows:
            out += struct.pack("<i", -int(q[r].astype(int).sum()) if r is not None else 0)
        for start in range(0, kp, kr):
            for o, r in enumerate(rows):
                for j in range(kr):
                    ch = first_channel(start, o, kr, sr) + j
                    out += struct.pack("<b", int(q[r, ch]) if r is not None and ch < k else 0)
        for o in range(nr):
            out += struct.pack("<f", scale[t + o] if o < real else 0.0)
        for o in range(nr):
            out += struct.pack("<f", bias[t + o] if bias is not None and o < real else 0.0)
    return bytes(out) + bytes(-len(out) % 64)


def nibble_pairs(q: np.ndarray, row: int, start: int, o: int, kr: int, sr: int) -> list[tuple[int, int]]:
    """(low code, high code) of the ``kr`` bytes of row ``o`` in the chunk at ``start``."""
    k = q.shape[1]
    base = first_channel(start, o, kr, sr)
    code = lambda ch: int(q[row, ch]) if ch < k else 0  # noqa: E731
    return [(code(base + j), code(base + j + kr)) for j in range(kr)]


def model_qc4w(q: np.ndarray, scale, bias, nr: int, kr: int, sr: int, unsigned: bool) -> bytes:
    n, k = q.shape
    kp = ru(ru(k, 2), 2 * kr * sr)
    out = bytearray()
    for t in range(0, n, nr):
        real = min(nr, n - t)
        for o in range(nr):
            total = int(q[t + o].astype(int).sum()) if o < real else 0
            out += struct.pack("<i", -total if unsigned else -16 * total)
        for start in range(0, kp, 2 * kr):
            for o in range(nr):
                for low, high in (nibble_pairs(q, t + o, start, o, kr, sr) if o < real else [(None, None)] * kr):
                    if low is None:
                        out.append(0)
                    elif unsigned:
                        out.append((low + 8) | (high + 8) << 4)
                    else:
                        out.append((low & 15) | (high & 15) << 4)
        for o in range(nr):
            out += struct.pack("<f", scale[t + o] if o < real else 0.0)
        for o in range(nr):
            out += struct.pack("<f", bias[t + o] if bias is not None and o < real else 0.0)
    return bytes(out) + bytes(-len(out) % 64)


def model_qb4w(q: np.ndarray, scale: np.ndarray, bias, group: int, nr: int, kr: int, sr: int) -> bytes:
    n, k = q.shape
    out = bytearray()
    for t in range(0, n, nr):
        real = min(nr, n - t)
        corrections, body = [], bytearray()
        for o in range(nr):
            acc = np.float32(0.0)
            if o < real:
                for start in range(0, k, 2 * kr):
                    chunk_sum = sum(a + b for a, b in nibble_pairs(q, t + o, start, o, kr, sr))
                    acc = np.float32(acc - np.float32(np.float32(chunk_sum) * scale[t + o, start // group]))
            corrections.append(acc)
        for start in range(0, k, 2 * kr):
            for o in range(nr):
                for low, high in (nibble_pairs(q, t + o, start, o, kr, sr) if o < real else [(None, None)] * kr):
                    body.append(0 if low is None else (low & 15) | (high & 15) << 4)
            if (start + 2 * kr) % group == 0:
                for o in range(nr):
                    s16 = np.float32(scale[t + o, start // group] / np.float32(16)) if o < real else np.float32(0)
                    body += struct.pack("<H", int(s16.view(np.uint32)) >> 16)
        out += b"".join(struct.pack("<f", c) for c in corrections) + body
        for o in range(nr):
            out += struct.pack("<f", bias[t + o] if bias is not None and o < real else 0.0)
    return bytes(out) + bytes(-len(out) % 64)


_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_TILE = dict(nr=st.sampled_from([1, 2, 3, 4, 8]), kr=st.sampled_from([1, 2, 4, 8]), sr=st.sampled_from([1, 2, 4]))


@_SETTINGS
@given(n=st.integers(1, 11), k=st.integers(1, 19), seed=st.integers(0, 2**32 - 1), with_bias=st.booleans(),
       pad=st.sampled_from(["zero", "replicate", "replicate_all"]), **_TILE)
def test_f32_matches_the_model(n, k, seed, with_bias, pad, nr, kr, sr) -> None:
    if sr > nr:
        return
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    pad = pad if kr == 1 and sr == 1 else "zero"
    got = pack_gemm(w, bias, nr=nr, kr=kr, sr=sr, pad_rows=pad)
    assert got.tobytes() == model_f32(w, bias, nr, kr, sr, pad)


@_SETTINGS
@given(n=st.integers(1, 11), k=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), with_bias=st.booleans(),
       replicate=st.booleans(), **_TILE)
def test_qc8w_matches_the_model(n, k, seed, with_bias, replicate, nr, kr, sr) -> None:
    if sr > nr:
        return
    rng = np.random.default_rng(seed)
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    w = xq.QuantizedTensor(xq.Datatype.qcint8, q, scale, channel_dim=0)
    pad = "replicate_all" if replicate else "zero"
    got = pack_gemm(w, bias, nr=nr, kr=kr, sr=sr, pad_rows=pad)
    assert got.tobytes() == model_qc8w(q, scale, bias, nr, kr, sr, pad)


@_SETTINGS
@given(n=st.integers(1, 11), k=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), with_bias=st.booleans(),
       unsigned=st.booleans(), **_TILE)
def test_qc4w_matches_the_model(n, k, seed, with_bias, unsigned, nr, kr, sr) -> None:
    if sr > nr:
        return
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    w = xq.QuantizedTensor(xq.Datatype.qcint4, q, scale, channel_dim=0)
    got = pack_gemm(w, bias, nr=nr, kr=kr, sr=sr, layout="qc4uw" if unsigned else "qc4w")
    assert got.tobytes() == model_qc4w(q, scale, bias, nr, kr, sr, unsigned)


@_SETTINGS
@given(n=st.integers(1, 9), blocks=st.integers(1, 3), group=st.sampled_from([32, 64]),
       seed=st.integers(0, 2**32 - 1), with_bias=st.booleans(), nr=st.sampled_from([1, 3, 4, 8]),
       kr=st.sampled_from([1, 2, 4, 8]), sr=st.sampled_from([1, 2]), planes=st.sampled_from([1, 2]))
def test_qb4w_matches_the_model(n, blocks, group, seed, with_bias, nr, kr, sr, planes) -> None:
    if sr > nr:
        return
    rng = np.random.default_rng(seed)
    k = blocks * group
    q = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 10, (n, blocks)).astype(ml_dtypes.bfloat16).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    w = xq.QuantizedTensor(xq.Datatype.qbint4, q, scale, group_size=group)
    got = pack_gemm(w, bias, nr=nr, kr=kr, sr=sr, planes=planes)
    assert got.tobytes() == model_qb4w(q, scale, bias, group, nr, kr, sr)


def test_every_table_row_matches_the_model() -> None:
    rng = np.random.default_rng(3)
    n, k = 5, 64  # a partial tile for every nr in the table; K a multiple of 32
    w = rng.standard_normal((n, k)).astype(np.float32)
    q8 = rng.integers(-128, 128, (n, k)).astype(np.int8)
    q4 = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, n).astype(np.float32)
    block_scale = rng.uniform(1e-3, 1, (n, 2)).astype(ml_dtypes.bfloat16).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    for c in kernel_configs():
        if c.weights == "f32":
            expected = model_f32(w, bias, c.nr, c.kr, c.sr, c.pad_rows)
            weight = w
        elif c.weights == "qc8w":
            expected = model_qc8w(q8, scale, bias, c.nr, c.kr, c.sr, c.pad_rows)
            weight = xq.QuantizedTensor(xq.Datatype.qcint8, q8, scale, channel_dim=0)
        elif c.weights in ("qc4w", "qc4uw"):
            expected = model_qc4w(q4, scale, bias, c.nr, c.kr, c.sr, c.weights == "qc4uw")
            weight = xq.QuantizedTensor(xq.Datatype.qcint4, q4, scale, channel_dim=0)
        else:
            expected = model_qb4w(q4, block_scale, bias, 32, c.nr, c.kr, c.sr)
            weight = xq.QuantizedTensor(xq.Datatype.qbint4, q4, block_scale, group_size=32)
        assert pack_gemm(weight, bias, config=c).tobytes() == expected, c


def test_row_blocks_give_the_same_bytes(monkeypatch) -> None:
    """Large quantized weights are packed a row block at a time; force tiny blocks and check
    every table row against the model again (partial last tile included)."""
    from xnnquant.packing import gemm

    monkeypatch.setattr(gemm, "ROW_BLOCK_BYTES", 64)
    rng = np.random.default_rng(4)
    n, k = 37, 64
    q8 = rng.integers(-128, 128, (n, k)).astype(np.int8)
    q4 = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, n).astype(np.float32)
    block_scale = rng.uniform(1e-3, 1, (n, 2)).astype(ml_dtypes.bfloat16).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for c in kernel_configs():
        if c.weights == "f32":
            expected, weight = model_f32(w, bias, c.nr, c.kr, c.sr, c.pad_rows), w
        elif c.weights == "qc8w":
            expected = model_qc8w(q8, scale, bias, c.nr, c.kr, c.sr, c.pad_rows)
            weight = xq.QuantizedTensor(xq.Datatype.qcint8, q8, scale, channel_dim=0)
        elif c.weights in ("qc4w", "qc4uw"):
            expected = model_qc4w(q4, scale, bias, c.nr, c.kr, c.sr, c.weights == "qc4uw")
            weight = xq.QuantizedTensor(xq.Datatype.qcint4, q4, scale, channel_dim=0)
        elif c.weights == "qb4w":
            expected = model_qb4w(q4, block_scale, bias, 32, c.nr, c.kr, c.sr)
            weight = xq.QuantizedTensor(xq.Datatype.qbint4, q4, block_scale, group_size=32)
        assert pack_gemm(weight, bias, config=c).tobytes() == expected, c
