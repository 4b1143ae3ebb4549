"""Prepacked bytes in use: XNNPACK runs on pack_gemm's buffer instead of packing its own.

A weights cache whose look-up always hits (``PrepackedCache``) makes the runtime skip
packing and read ``pack_gemm``'s bytes.  The outputs must be bit-identical to a runtime
that packed the same weights itself, and must change when one packed byte is corrupted
(proof that the prepacked buffer is what the kernel reads).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq
from xnnquant.constants import XNN_VALUE_FLAG_EXTERNAL_INPUT, XNN_VALUE_FLAG_EXTERNAL_OUTPUT
from xnnquant.packing import pack_gemm, pack_int4

pytestmark = pytest.mark.xnnpack

RNG = np.random.default_rng(7)
D = xq.Datatype


def run_linear(weight, bias: np.ndarray, x: np.ndarray, cache=None) -> np.ndarray:
    """y = linear(x) through the subgraph ExecuTorch builds (dynamic quantization for
    quantized weights), optionally with a weights cache."""
    from xnnquant.xnnpack import _capi
    from xnnquant.xnnpack.subgraph import Runtime, Subgraph

    m, k = x.shape
    n = weight.shape[0]
    source = _capi.padded(x)
    y = np.zeros((m, n), np.float32)
    with Subgraph(2) as graph:
        xi = graph.tensor(D.fp32, (m, k), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        yi = graph.tensor(D.fp32, (m, n), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        b = graph.tensor(D.fp32, (n,), bias)
        if isinstance(weight, np.ndarray):
            graph.fully_connected(xi, graph.tensor(D.fp32, (n, k), weight), b, yi)
        else:
            q = graph.dynamic_tensor((m, k))
            graph.convert(xi, q)
            if weight.datatype is D.qbint4:
                bits = weight.scale.astype(ml_dtypes.bfloat16).view(np.uint16)
                f = graph.blockwise_tensor((n, k), bits, weight.group_size, 8, pack_int4(weight.codes))
            elif weight.datatype is D.qcint4:
                f = graph.channelwise_tensor(D.qcint4, (n, k), weight.scale, 0, 8, pack_int4(weight.codes))
            else:
                f = graph.channelwise_tensor(D.qcint8, (n, k), weight.scale, 0, 0, weight.codes)
            graph.fully_connected(q, f, b, yi)
        with Runtime(graph, weights_cache=None if cache is None else cache.provider) as runtime:
            runtime.run({0: source, 1: y})
    return y


def weights():
    n, k = 21, 128
    yield "f32", RNG.standard_normal((n, k)).astype(np.float32)
    yield "qc8w", xq.QuantizedTensor(D.qcint8, RNG.integers(-128, 128, (n, k)).astype(np.int8),
                                     RNG.uniform(1e-3, 1e-2, n).astype(np.float32), channel_dim=0)
    yield "qc4w", xq.QuantizedTensor(D.qcint4, RNG.integers(-8, 8, (n, k)).astype(np.int8),
                                     RNG.uniform(1e-2, 1e-1, n).astype(np.float32), channel_dim=0)
    scale = RNG.uniform(1e-2, 1e-1, (n, k // 64)).astype(ml_dtypes.bfloat16).astype(np.float32)
    yield "qb4w", xq.QuantizedTensor(D.qbint4, RNG.integers(-8, 8, (n, k)).astype(np.int8), scale,
                                     group_size=64)


@pytest.mark.parametrize("kind,weight", list(weights()))
def test_runtime_reads_the_prepacked_buffer(kind: str, weight) -> None:
    from xnnquant.xnnpack.capture import PrepackedCache, capture_runtime_packed_weights

    n, k = weight.shape
    bias = RNG.standard_normal(n).astype(np.float32)
    x = RNG.standard_normal((5, k)).astype(np.float32)
    config = capture_runtime_packed_weights(weight, bias).config  # the tile XNNPACK picks here
    packed = pack_gemm(weight, bias, config=config)

    cache = PrepackedCache(packed)
    expected = run_linear(weight, bias, x)
    got = run_linear(weight, bias, x, cache)
    assert cache.hits == 1
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))

    corrupted = packed.copy()
    first_weight = 4 * config.nr  # first byte after the tile's bias / correction lanes
    corrupted[first_weight + (3 if kind == "f32" else 0)] ^= 0x11  # f32: the exponent byte
    assert not np.array_equal(run_linear(weight, bias, x, PrepackedCache(corrupted)), expected)
