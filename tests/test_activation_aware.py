"""The activation-aware methods on real all-MiniLM-L6-v2 layers.

* their results are ordinary QuantizedTensors: codes in range, zero point 0, scales
  positive normal (bf16 values for qbint4), accepted by packing and the graph builder;
* the real XNNPACK (dynamic fully connected: per-token int8 inputs) computes with them
  what a float64 reference computes from the codes;
* on held-out sentences they beat the weight-only ``mse`` search on every linear of a
  layer (layer-output error).
"""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.models import minilm
from xnnquant.models.sentences import calibration_sentences, evaluation_sentences

pytest.importorskip("safetensors")

LAYER = 1
CALIBRATION = 160  # sentences: ~2,400 tokens, more than the widest input (1536)
SCHEMES = [("qb4w:32", lambda w, m, cal: xq.quantize_blockwise(w, 32, m, calibration=cal)),
           ("qb4w:128", lambda w, m, cal: xq.quantize_blockwise(w, 128, m, calibration=cal)),
           ("qc4w", lambda w, m, cal: xq.quantize_per_channel(w, 4, method=m, calibration=cal)),
           ("qc8w", lambda w, m, cal: xq.quantize_per_channel(w, 8, method=m, calibration=cal))]


@pytest.fixture(scope="module")
def layer() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """name -> (weight [N, K], calibration inputs (T, K), held-out inputs (T', K)), float32."""
    weights = minilm.minilm_tensors()
    cal = minilm.linear_inputs(calibration_sentences()[:CALIBRATION], LAYER + 1, weights)
    held_out = minilm.linear_inputs(evaluation_sentences(), LAYER + 1, weights)
    out = {}
    for name in minilm.LINEARS:
        key = f"encoder.layer.{LAYER}.{name}"
        out[name] = (weights[key + ".weight"], cal[key], held_out[key])
    return out


def _output_sqnr(x: np.ndarray, w: np.ndarray, wq: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(10 * np.log10(np.sum((x64 @ w.T.astype(np.float64)) ** 2)
                               / np.sum((x64 @ (w.astype(np.float64) - wq).T) ** 2)))


def test_results_are_valid_for_their_datatype(layer: dict) -> None:
    w, x_cal, _ = layer["intermediate.dense"]
    for label, quantize in SCHEMES:
        for method in ("act_mse", "gptq"):
            qt = quantize(w, method, x_cal)
            facts = xq.storage(qt.datatype)
            assert qt.codes.dtype == np.int8 and qt.codes.shape == w.shape, label
            assert facts.code_min <= qt.codes.min() and qt.codes.max() <= facts.code_max, label
            assert qt.zero_point == 0 and qt.scale.dtype == np.float32
            assert np.all(qt.scale >= np.finfo(np.float32).tiny) and np.isfinite(qt.scale).all()
            if qt.datatype is xq.Datatype.qbint4:
                bf16 = xq.packing.to_bf16(qt.scale).values
                np.testing.assert_array_equal(qt.scale, bf16)
            assert len(qt.to_bytes()) > 0
            graph = xq.graph.Graph()
            graph.output(graph.fully_connected(graph.convert(graph.input((2, w.shape[1])), xq.Datatype.qdint8),
                                               graph.constant(qt)))
            assert xq.graph.load(graph.to_bytes()).values  # written and read back


@pytest.mark.xnnpack
def test_real_xnnpack_computes_the_reference(layer: dict) -> None:
    """Reference: the per-token int8 inputs XNNPACK forms (``quantize_per_token``, bit-exact
    with it), times the weight from its codes and scales, in float64."""
    xx = pytest.importorskip("xnnquant.xnnpack")
    for name in ("attention.self.query", "output.dense"):
        w, x_cal, x_eval = layer[name]
        x = x_eval[:48]
        x_seen = xq.quantize_per_token(x).dequantize().astype(np.float64)
        for label, quantize in SCHEMES:
            for method in ("act_mse", "gptq"):
                qt = quantize(w, method, x_cal)
                got = xx.fully_connected(x, qt)
                ref = x_seen @ qt.dequantize().astype(np.float64).T
                # XNNPACK sums int8 x int4/int8 products exactly in int32 and applies the
                # scales in float32: ~1e-6 of the output's size.
                err = np.abs(got - ref).max() / np.abs(ref).max()
                assert err < 1e-5, (name, label, method, err)


def test_beat_mse_on_held_out_layer_outputs(layer: dict) -> None:
    for name, (w, x_cal, x_eval) in layer.items():
        for label, quantize in SCHEMES[:3]:  # int4: where the choice of codes matters
            plain = quantize(w, "mse", None).dequantize()
            base = _output_sqnr(x_eval, w, plain)
            act = _output_sqnr(x_eval, w, quantize(w, "act_mse", x_cal).dequantize())
            gptq = _output_sqnr(x_eval, w, quantize(w, "gptq", x_cal).dequantize())
            assert act > base and gptq > act + 0.5, (name, label, base, act, gptq)
