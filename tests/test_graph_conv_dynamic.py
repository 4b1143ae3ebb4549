"""Dynamically quantized convolution (qdint8 input x qcint8 filter) on the real XNNPACK.

Measured on ExecuTorch 1.4.1: the input must be quantized per image (one scale and zero
point over H, W and C: ``num_nonbatch_dims=3``), which the runtime computes exactly as the
interpreter does; one scale per pixel (``num_nonbatch_dims=1``) loads but computes wrong
results, so validation refuses it.  There is no 4-bit convolution and no dynamically
quantized depthwise convolution: the runtime refuses both at load.
"""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.datatypes import Datatype
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, interpret

pytestmark = pytest.mark.xnnpack

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 9, 11, 16)).astype(np.float32)
W = (RNG.standard_normal((24, 3, 3, 16)) * 0.1).astype(np.float32)
B = RNG.standard_normal(24).astype(np.float32)


def _conv_graph(num_nonbatch_dims: int, groups: int = 1) -> Graph:
    g = Graph()
    q = g.convert(g.input(X.shape), Datatype.qdint8, num_nonbatch_dims=num_nonbatch_dims)
    w = xq.quantize_per_channel(W[:, :, :, : 16 // groups], bits=8, axis=0)
    g.output(g.conv2d(q, g.constant(w), g.constant(B), padding=1, groups=groups))
    return g


@pytest.mark.parametrize("groups", [1, 2])
def test_per_image_dynamic_conv_matches_the_interpreter(groups: int) -> None:
    from xnnquant.graph import run

    g = _conv_graph(3, groups)
    (got,) = run(g.to_bytes(), [X])
    (expected,) = interpret(g, [X])
    # same integer products, float32 sums in another order: relative 1e-6 of the range
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()


def test_per_pixel_dynamic_conv_is_computed_wrongly_and_refused() -> None:
    from xnnquant.graph import run

    g = _conv_graph(1)
    (got,) = run(_unvalidated(g), [X], validate=False)
    (expected,) = interpret(g, [X])
    assert np.abs(got - expected).max() > 0.1 * np.abs(expected).max()  # measured 0.6
    with pytest.raises(UnsupportedConfigError, match=r"node 1 \(XNNConv2d\): a qdint8 convolution input must be "
                                                     r"quantized per image \(num_nonbatch_dims 3\): got 1"):
        g.to_bytes()


def _unvalidated(g: Graph) -> bytes:
    """The payload of ``g`` without validation, to see what the runtime itself does."""
    from xnnquant.graph.header import XNNHeader, align
    from xnnquant.graph.segment import ConstantSegment
    from xnnquant.graph.writer import flatbuffer

    segment = ConstantSegment()
    fb = flatbuffer(g, segment)
    constants = segment.to_bytes()
    return XNNHeader.for_sizes(len(fb), len(constants)).to_bytes() + fb + b"\0" * (align(len(fb)) - len(fb)) + constants


def test_runtime_refuses_4bit_and_depthwise_dynamic_conv() -> None:
    from xnnquant.graph import run
    from xnnquant.graph.model import Node

    g = Graph()
    q = g.convert(g.input(X.shape), Datatype.qdint8, num_nonbatch_dims=3)
    w4 = g.constant(xq.quantize_per_channel(W, bits=4, axis=0))
    out = g.tensor((2, 9, 11, 24))
    g.nodes.append(Node("XNNConv2d", (q, w4, g.constant(B)), (out,), dict(_conv_graph(3).nodes[1].params)))
    g.output(out)
    with pytest.raises(XnnquantError, match="unsupported datatypes"):
        g.to_bytes()
    with pytest.raises(UnsupportedConfigError, match="Failed to create convolution node"):
        run(_unvalidated(g), [X], validate=False)

    g = Graph()
    q = g.convert(g.input(X.shape), Datatype.qdint8, num_nonbatch_dims=3)
    wd = g.constant(xq.quantize_per_channel(RNG.standard_normal((1, 3, 3, 16)).astype(np.float32), bits=8, axis=3))
    g.output(g.depthwise_conv2d(q, wd, g.constant(B[:16]), padding=1))
    with pytest.raises(XnnquantError, match="unsupported datatypes"):
        g.to_bytes()
    with pytest.raises(UnsupportedConfigError, match="Failed to create depthwise convolution node"):
        run(_unvalidated(g), [X], validate=False)

