"""What the self-check needs to judge a static int8 graph against torch (``selfcheck.py``).

An ATen node whose output is a qint8 value is computed by torch on the real values of its
inputs as the int8 graph feeds them (each int8 input dequantized exactly:
``(code - zero_point) * scale``), with its filter replaced by the stored one (dequantized,
in the torch argument's layout) and the bias correction added along the output
channels.  That result, clipped to the output's grid ``[(-128 - zp) s, (127 - zp) s]``
and to the node's output bounds, must lie within

    ``(0.5 + slack(kind)) * s + TOLERANCE * max |reference|``

of the graph's dequantized output.  Why half a step: every int8 node XNNPACK computes
rounds its exact result once to the output grid (its integer accumulation is exact);
``slack`` is what its fixed-point arithmetic adds to that rounding:

=============================  =========  ==========================================================
kinds                          slack      from
=============================  =========  ==========================================================
FullyConnected, Conv2d,        1e-3       a float32 multiplier ``f32(f32(s_x s_w) / s_y)`` (3 ulp) times
DepthwiseConv2d, Multiply,                at most 2^8 codes
Add, Subtract, lookup tables,
GlobalAvgPooling2d
StaticResizeBilinear2D         0.13       11-bit weights: each off by at most 2^-12 of up to 255 codes,
                                          once per axis (2 * 255 / 4096 = 0.125)
LeakyReLU                      0.5        8-bit multipliers ``lrintf(256 r)``: off by 1/512 of up to
                                          255 codes
Multiply of silu               (below)    ``x * sigmoid(x)`` as two int8 nodes: the sigmoid's half
                                          step ``s_s / 2``, times ``max |x|`` on x's grid, in steps
                                          ``s_y`` of the output: ``max|x| s_s / (2 s_y)`` more
data movement, clamps, max     0          codes moved or compared, never recomputed
pooling
=============================  =========  ==========================================================

and ``TOLERANCE * max |reference|`` (``graph.divergence``) covers torch's own float32
sums (about 1e-6 of the sum of the terms' magnitudes).  A wrong scale, zero point or
layout moves outputs by a step or more, and is caught.

The stored filters and biases, which those comparisons take as given, are checked
against the module's own by ``check_layers``: each equalized float filter is the module's
times its factors (float32 rounding apart), each stored filter's codes are that filter
divided by its scales, rounded (within half a code, one with learned rounding, or
saturated), and each stored bias
is the float bias (equalized) plus the bias correction recomputed from the stored filter
(within half a bias step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...constants import XNN_FLAG_TRANSPOSE_WEIGHTS
from ...errors import SelfCheckError
from ...graph import Graph, int8
from ...graph.rules import DATA_MOVEMENT
from .bias_correction import corrected_bias
from .equalization import out_axis
from .int8_graph import Int8Graph
from .rewrite import accumulator_reach

SLACK = {"XNNStaticResizeBilinear2D": 0.13, "XNNLeakyReLU": 0.5}
DEFAULT_SLACK = 1e-3


@dataclass
class Int8Check:
    """The static int8 graph as the self-check reads it.

    ``int8_version``: a value id of the int8 graph -> its qint8 twin (itself for a qint8
    value; the convert's output for an fp32 value some int8 node reads).  ``float_version``:
    a qint8 value id -> its fp32 twin, where the graph has one (a node left in fp32 reads
    that, not the codes: an fp32 producer's own output).  ``int8_nodes``: the ATen nodes
    computed in int8 (the others are computed in fp32, their output converted when it is
    qint8).  ``filters``: ATen
    node name -> (the torch filter tensor, the stored filter dequantized in its layout).
    ``bias_delta``: ATen node name -> float64 ``(OC,)``, the stored bias minus the float one.
    """

    graph: Graph
    int8_version: dict[int, int] = field(default_factory=dict)
    float_version: dict[int, int] = field(default_factory=dict)
    int8_nodes: set[str] = field(default_factory=set)
    filters: dict[str, tuple[Any, np.ndarray]] = field(default_factory=dict)
    bias_delta: dict[str, np.ndarray] = field(default_factory=dict)

    def is_int8(self, vid: int) -> bool:
        return int8.is_int8(self.graph.value(vid))

    def real(self, vid: int, x: np.ndarray) -> np.ndarray:
        """float64 real values of ``x`` held for value ``vid`` (int8 codes dequantized as XNNPACK's
        convert does, ``f32(f32(code - zp) * s)``)."""
        v = self.graph.value(vid)
        if int8.is_int8(v) and np.asarray(x).dtype == np.int8:
            return int8.dequantize(x, *int8.quant(v)).astype(np.float64)
        return np.asarray(x, np.float64)

    def tolerance(self, vid: int, magnitude: float, tolerance: float) -> float:
        """The bound of the module docstring for qint8 value ``vid``, in real units."""
        scale, _ = int8.quant(self.graph.value(vid))
        return (0.5 + self.slack(vid)) * scale + tolerance * magnitude

    def slack(self, vid: int) -> float:
        """``SLACK`` of the node computing ``vid`` (through data movement), 0 when only moved."""
        producers = {o: n for n in self.graph.nodes for o in n.outputs}
        node = producers.get(vid)
        while node is not None and node.kind in DATA_MOVEMENT:
            node = producers.get(node.inputs[0])
        if node is None:
            return 0.0
        if node.kind == "XNNConvert":
            return 0.0  # fp32 -> qint8: one rounding to nearest
        if node.kind == "XNNMultiply":  # silu, x * sigmoid(x): the sigmoid's own rounding, times |x|
            for x, s in (node.inputs, node.inputs[::-1]):
                sigmoid = producers.get(s)
                if sigmoid is not None and sigmoid.kind == "XNNSigmoid" and sigmoid.inputs[0] == x:
                    s_x, zp_x = int8.quant(self.graph.value(x))
                    s_s, _ = int8.quant(self.graph.value(s))
                    s_y, _ = int8.quant(self.graph.value(node.outputs[0]))
                    largest = max(128 + zp_x, 127 - zp_x) * float(s_x)
                    return DEFAULT_SLACK + largest * float(s_s) * (0.5 + DEFAULT_SLACK) / float(s_y)
        return SLACK.get(node.kind, DEFAULT_SLACK)

    def grid_clip(self, vid: int, ref: np.ndarray, bounds: tuple[float | None, float | None]) -> np.ndarray:
        """``ref`` clipped to value ``vid``'s grid and to ``bounds`` (real units)."""
        scale, zp = int8.quant(self.graph.value(vid))
        lo, hi = (-128 - zp) * np.float64(np.float32(scale)), (127 - zp) * np.float64(np.float32(scale))
        if bounds[0] is not None:
            lo = max(lo, bounds[0])
        if bounds[1] is not None:
            hi = min(hi, bounds[1])
        return np.clip(ref, lo, hi)


def int8_check(result: Int8Graph, sources: list[tuple[str, str, str]], filters: dict[int, Any]) -> Int8Check:
    """The ``Int8Check`` of a rewrite's result; ``filters``: the float lowering's ``FilterOrigin`` by
    float-graph filter id."""
    check = Int8Check(result.graph)
    check.int8_nodes = {sources[h - 1][1] for h in result.int8_handles if 0 < h <= len(sources)}
    for fv, vid in result.int8_of.items():
        check.int8_version[vid] = vid
        if fv in result.float_of:
            check.int8_version[result.float_of[fv]] = vid
            check.float_version[vid] = result.float_of[fv]
    for layer in result.layers:
        node = result.graph.nodes[layer.node]
        handle = node.debug_handle
        if not 0 < handle <= len(sources):
            continue
        name = sources[handle - 1][1]
        origin = filters.get(layer.filter_id)
        if origin is not None:
            check.filters[name] = (origin.weight, origin.unlaid(layer.stored.dequantize()))
        stored = result.graph.value(layer.bias_id).quantized_tensor()
        assert stored is not None  # the rewrite stores every int8 layer's bias as a constant
        check.bias_delta[name] = (stored.codes.astype(np.float64) * np.asarray(stored.scale, np.float64)
                                  - layer.float_bias.astype(np.float64))
    return check


def _equalized(result: Int8Graph, filter_id: int, node_index: int, original: np.ndarray) -> np.ndarray:
    """The module's filter (float graph, graph layout) times the equalization factors of its node's
    output channels (divided) and input channels (multiplied), float64."""
    assert result.source is not None
    node = result.source.nodes[node_index]
    w = original.astype(np.float64)
    for e in result.equalized:
        f = e.factors.astype(np.float64)
        if node_index in e.producers and e.value == node.outputs[0]:
            shape = [1] * w.ndim
            shape[out_axis(node)] = -1
            w = w / f.reshape(shape)
        if node_index in e.readers and e.value == node.inputs[0]:
            if node.kind == "XNNFullyConnected":
                w = w * (f[:, None] if node.flags & XNN_FLAG_TRANSPOSE_WEIGHTS else f[None, :])
            elif node.kind == "XNNDepthwiseConv2d":
                w = w * np.repeat(f, w.shape[3] // f.size)[None, None, None, :]
            else:
                groups = int(node.params.get("groups", 1))
                oc, kh, kw, cg = w.shape
                w = (w.reshape(groups, oc // groups, kh, kw, cg) * f.reshape(groups, 1, 1, 1, cg)).reshape(w.shape)
    return w


def check_layers(result: Int8Graph, sources: list[tuple[str, str, str]]) -> None:
    """``SelfCheckError`` unless every int8 layer's stored filter and bias are the module's
    (module docstring)."""
    assert result.source is not None
    producer = {v: n for n in result.source.nodes for v in n.outputs}
    for eq in result.equalized:  # a clamp's bounds other than 0 do not commute with per-channel factors
        node = producer[eq.value]
        lo, hi = float(node.output_min or 0.0), float(node.output_max or math.inf)
        if (math.isfinite(hi) or lo not in (0.0, -math.inf)) and not np.all(eq.factors == 1):
            raise SelfCheckError(f"self-check failed: value {eq.value} is equalized through {node.kind}'s clamp to "
                                 f"[{lo:g}, {hi:g}] with factors from {float(np.min(eq.factors)):.3g} to "
                                 f"{float(np.max(eq.factors)):.3g} (the clamp would cut each channel at other "
                                 "bounds than the module's); please report it")
    for layer in result.layers:
        node = result.graph.nodes[layer.node]
        handle = node.debug_handle
        op, name, path = sources[handle - 1] if 0 < handle <= len(sources) else (node.kind, str(layer.node), "")
        where = f"{op} (node {name}, module {path or '<top level>'})"
        original = result.source.value(layer.filter_id).array()
        expected = _equalized(result, layer.filter_id, layer.source, original)
        equalized = layer.weights.astype(np.float64)
        if not np.allclose(equalized, expected, rtol=1e-5, atol=1e-30 + 1e-6 * float(np.abs(expected).max())):
            raise SelfCheckError(f"self-check failed at {where}: its equalized float filter is not the module's "
                                 "filter times its equalization factors; please report it")
        stored = layer.stored
        scales = np.asarray(stored.scale, np.float64)
        shape = [1] * equalized.ndim
        shape[stored.channel_dim or 0] = -1
        ideal = equalized / scales.reshape(shape)
        codes = stored.codes.astype(np.float64)
        inside = np.abs(ideal) < 127  # saturated codes may be clipped by the scale search
        reach = 1.0 if stored.meta.get("rounding") == "learned" else 0.5  # learned: floor or ceil
        if not np.all(np.abs(codes - ideal)[inside] <= reach + 1e-3) or np.any(np.abs(codes) > 128):
            raise SelfCheckError(f"self-check failed at {where}: its stored int8 filter is not its float filter "
                                 "divided by its scales and rounded; please report it")
        bias = result.graph.value(layer.bias_id).quantized_tensor()
        assert bias is not None
        bias_scale = np.asarray(bias.scale, np.float64)
        want = corrected_bias(layer, result.source.nodes[layer.source]).astype(np.float64)
        # half a step, plus the float32 product b * (1 / scale) that xq.quantize_bias rounds (2 ulp)
        bound = 0.5 * bias_scale + 2.5e-7 * np.abs(want)
        off = np.abs(bias.codes.astype(np.float64) * bias_scale - want)
        if not np.all(off <= bound):
            c = int(np.argmax(off - bound))
            raise SelfCheckError(f"self-check failed at {where}: its stored int32 bias is not its float bias plus "
                                 f"its bias correction (channel {c}: {off[c]:.4g} away, bound {bound[c]:.4g}); "
                                 "please report it")
        steps = _reach_in_steps(result, layer.node, stored, bias.codes)
        if not np.all(steps < REACH_LIMIT):
            c = int(np.argmax(steps))
            raise SelfCheckError(f"self-check failed at {where}: some int8 input would drive output channel {c}'s "
                                 f"accumulator to {steps[c]:.4g} output steps, where XNNPACK's static int8 kernels "
                                 "compute differently on AVX-512 and AVX-VNNI CPUs than on others (past 2^31: "
                                 "graph.int8.requantize_fp32); please report it")


#: Below this many output steps an accumulator converts to int32 without overflow on any CPU:
#: 2^31 less the float32 roundings of ``f32(acc)`` and of the product (2^-23 each, and more).
REACH_LIMIT = 2.0**31 * (1 - 2**-20)


def _reach_in_steps(result: Int8Graph, node_index: int, stored: Any, bias_codes: np.ndarray) -> np.ndarray:
    """float64 ``(OC,)``: the most output steps the scaled accumulator of int8 layer ``node_index``
    reaches on any int8 input: ``(|bias code| + rewrite.accumulator_reach) * m``, with XNNPACK's
    multiplier ``m = f32(f32(s_x * s_w) / s_y)``."""
    node = result.graph.nodes[node_index]
    s_x, zp_x = int8.quant(result.graph.value(node.inputs[0]))
    s_y, _ = int8.quant(result.graph.value(node.outputs[0]))
    m = ((np.float32(s_x) * np.asarray(stored.scale, np.float32)) / np.float32(s_y)).astype(np.float64)
    reach = np.abs(np.asarray(bias_codes, np.float64)).reshape(-1) + accumulator_reach(stored, zp_x)
    return reach * m
