"""Sequential calibration of the numpy MiniLM, checked against the plain forward pass.

The reference for "the inputs that the already-quantized earlier linears produce" is
``minilm.linear_inputs`` run on weights where those linears are replaced by their
dequantized values: an independent path (one padded batch, no recording, no early stop).
"""

from __future__ import annotations

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.models import minilm, sequential
from xnnquant.models.sentences import calibration_sentences, evaluation_sentences

pytest.importorskip("safetensors")

SENTENCES = calibration_sentences()[:24]


@pytest.fixture(scope="module")
def weights() -> minilm.Weights:
    return minilm.minilm_tensors()


def test_each_stage_sees_the_outputs_of_the_quantized_linears_before_it(weights: minilm.Weights) -> None:
    seen: list[tuple[str, np.ndarray, int]] = []

    def quantize(name: str, w: np.ndarray, cal: xq.Calibration) -> xq.QuantizedTensor:
        seen.append((name, cal.gram.copy(), cal.tokens))
        return xq.quantize_blockwise(w, 32, "minmax")  # coarse on purpose: the inputs must change

    quantized = sequential.quantize_minilm(SENTENCES, quantize, weights=weights, batch_size=10)
    order = [f"encoder.layer.{i}.{name}.weight" for i in range(minilm.NUM_LAYERS) for name in minilm.LINEARS]
    assert [name for name, _, _ in seen] == order
    assert set(quantized) == set(order)
    tokens = int(minilm.tokenize_batch(SENTENCES)[1].sum())
    assert all(count == tokens for _, _, count in seen)  # real tokens only, no padding
    replaced = dict(weights)
    for index, (name, gram, _) in enumerate(seen[:12]):  # layers 0 and 1: 8 stages
        x = minilm.linear_inputs(SENTENCES, 2, replaced)[name[: -len(".weight")]].astype(np.float64)
        # float32 activations from differently shaped batches: GEMM results differ in the last bits
        np.testing.assert_allclose(gram, x.T @ x, rtol=1e-4, atol=1e-4 * np.abs(gram).max(), err_msg=name)
        replaced[name] = quantized[name].dequantize()
        if index % 6 in (0, 1):  # query and key: the value stage shares their input
            np.testing.assert_array_equal(gram, seen[index + 1][1])


def test_embeddings_match_the_float_model_and_keep_sentence_order(weights: minilm.Weights) -> None:
    text = evaluation_sentences()[:20]
    reference = minilm.sentence_embeddings(text, weights)
    np.testing.assert_allclose(sequential.sentence_embeddings(text, {}, weights=weights, batch_size=7), reference,
                               atol=2e-6)  # float32 sums over batches of another shape
    qt = {"encoder.layer.0.output.dense.weight": xq.quantize_per_channel(
        weights["encoder.layer.0.output.dense.weight"], 8)}
    mixed = dict(weights)
    mixed.update({name: q.dequantize() for name, q in qt.items()})
    np.testing.assert_allclose(sequential.sentence_embeddings(text, qt, weights=weights), minilm.sentence_embeddings(
        text, mixed), atol=2e-6)
    runtime = sequential.sentence_embeddings(text, qt, weights=weights, activations="runtime")
    assert 0 < np.abs(runtime - reference).max() < 0.05


def test_float_calibrations_share_one_object_per_input(weights: minilm.Weights) -> None:
    cals = sequential.linear_calibrations(SENTENCES, weights=weights)
    assert len(cals) == 36
    assert cals["encoder.layer.3.attention.self.query.weight"] is cals["encoder.layer.3.attention.self.value.weight"]
    x = minilm.linear_inputs(SENTENCES, 1, weights)["encoder.layer.0.intermediate.dense"].astype(np.float64)
    np.testing.assert_allclose(cals["encoder.layer.0.intermediate.dense.weight"].gram, x.T @ x, rtol=1e-4,
                               atol=1e-6 * np.abs(x.T @ x).max())


def test_bad_arguments(weights: minilm.Weights) -> None:
    with pytest.raises(xq.XnnquantError, match="sentences must be a non-empty sequence of strings: got 'abc'"):
        sequential.quantize_minilm("abc", lambda n, w, c: xq.quantize_per_channel(w, 8), weights=weights)
    with pytest.raises(xq.XnnquantError, match="activations must be 'float' or 'runtime': got 'int8'"):
        sequential.quantize_minilm(SENTENCES, lambda n, w, c: xq.quantize_per_channel(w, 8), weights=weights,
                                   activations="int8")  # type: ignore[arg-type]
    with pytest.raises(xq.XnnquantError, match="batch size must be a positive integer: got 0"):
        sequential.batches(SENTENCES, 0)
