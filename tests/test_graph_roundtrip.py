"""Round trip ``load(g.to_bytes()) == g`` and byte stability over random graphs.

The graphs come from ``tests/graph_examples.py``'s ``random_graph``: all 37 node kinds, all
ten datatypes and the four quant-params kinds.  (The same graphs written by ExecuTorch's
own serializer are read back in test_graph_executorch_oracle.py.)
"""

from __future__ import annotations

import copy

import numpy as np
from graph_examples import random_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xnnquant as xq
from xnnquant.graph import Graph, load
from xnnquant.graph.layout import XN01_NODE_KINDS
from xnnquant.graph.model import PerChannelGroupQuant, PerChannelQuant, PerTensorQuant, PerTokenDynamicQuant

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_random_graph_covers_the_whole_schema() -> None:
    g = random_graph(0)
    assert {n.kind for n in g.nodes} == set(XN01_NODE_KINDS)
    assert {v.datatype for v in g.values} == set(xq.Datatype) - {xq.Datatype.invalid}
    assert {type(v.quant) for v in g.values} == {type(None), PerTensorQuant, PerChannelQuant,
                                                  PerChannelGroupQuant, PerTokenDynamicQuant}
    assert any(v.flags == 1 for v in g.values) and any(v.flags == 2 for v in g.values)
    assert any(n.output_min is not None for n in g.nodes)


@SETTINGS
@given(st.integers(0, 2**32 - 1))
def test_round_trip_all_node_kinds(seed: int) -> None:
    g = random_graph(seed)
    payload = g.to_bytes()
    back = load(payload)
    assert back == g
    assert back.inputs == g.inputs and back.outputs == g.outputs
    assert back.to_bytes() == payload  # what we read is written back to the same bytes
    for ours, theirs in zip(g.values, back.values):
        qt = ours.quantized_tensor()
        if qt is not None:
            got = theirs.quantized_tensor()
            assert got.datatype is qt.datatype and got.shape == qt.shape
            np.testing.assert_array_equal(got.codes, qt.codes)
            np.testing.assert_array_equal(got.dequantize(), qt.dequantize())
        elif ours.datatype in (xq.Datatype.fp32, xq.Datatype.fp16) and ours.constant is not None:
            np.testing.assert_array_equal(theirs.array(), ours.array())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.sampled_from(XN01_NODE_KINDS), min_size=1, max_size=6, unique=True))
def test_round_trip_small_graphs(seed: int, kinds: list[str]) -> None:
    g = random_graph(seed, tuple(kinds), every_datatype=False)
    assert load(g.to_bytes()) == g


@SETTINGS
@given(st.integers(0, 2**32 - 1))
def test_same_graph_same_bytes(seed: int) -> None:
    assert random_graph(seed).to_bytes() == random_graph(seed).to_bytes()


def test_equality_sees_every_difference() -> None:
    g = random_graph(5)
    changes = [
        lambda h: setattr(h.values[3], "dims", h.values[3].dims + (1,)),
        lambda h: setattr(h.nodes[2], "debug_handle", h.nodes[2].debug_handle + 1),
        lambda h: setattr(h.nodes[4], "flags", h.nodes[4].flags ^ 0x10),
        lambda h: h.nodes[6].params.update(extra=1),
        lambda h: setattr(next(v for v in h.values if v.constant), "constant", b"\1" * 4),
        lambda h: setattr(next(v for v in h.values if isinstance(v.quant, PerChannelQuant)), "quant",
                          PerChannelQuant(np.ones(1, np.float32), 0)),
    ]
    for change in changes:
        h = copy.deepcopy(g)
        assert h == g
        change(h)
        assert h != g


def test_blockwise_scales_are_written_twice_unless_disabled() -> None:
    from xnnquant.rounding import to_bf16
    from xnnquant.tensor import QuantizedTensor

    codes = np.arange(64 * 2, dtype=np.int64).reshape(2, 64).astype(np.int8) % 8
    scale = to_bf16(np.float32([[0.1, 0.2], [0.3, 0.4]])).values
    qt = QuantizedTensor(xq.Datatype.qbint4, codes, scale, 0, channel_dim=0, group_size=32)
    for flag in (True, False):
        g = Graph(write_scale_bf16=flag)
        g.constant(qt)
        q = load(g.to_bytes()).values[0].quant
        np.testing.assert_array_equal(q.scale, scale.ravel())
        if flag:
            np.testing.assert_array_equal(q.scale_bf16, to_bf16(scale).bits.ravel())
        else:
            assert q.scale_bf16 is None


@settings(max_examples=60, deadline=None)
@given(st.floats(width=32), st.floats(width=32), st.floats(width=32, allow_nan=False),
       st.integers(0, 2**32 - 1))
def test_round_trip_any_float_parameter(slope: float, value: float, bound: float, handle: int) -> None:
    g = Graph()
    x = g.input((1, 2, 2, 3))
    g.output(g.leaky_relu(x, slope, debug_handle=handle))
    g.output(g.elu(x, value))
    g.output(g.static_constant_pad(x, (0, 1, 0, 0), (0, 0, 2, 0), value))
    g.output(g.add(x, x, output_min=min(bound, 0.0), output_max=max(bound, 0.0)))
    assert load(g.to_bytes()) == g
