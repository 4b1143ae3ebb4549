"""Sequential calibration of all-MiniLM-L6-v2: each linear quantized on the inputs that the
already-quantized linears before it produce.

Quantizing every linear on the float model's activations ignores that, once deployed, a
layer sees inputs computed by quantized layers.  Here the model is quantized in the order
data flows through it, four stages per encoder layer (linears that read the same input
share one stage and one ``Calibration``)::

    stage 1   query, key, value      input: the layer input h (from quantized earlier layers)
    stage 2   attention.output       input: attention context of the quantized q, k, v
    stage 3   intermediate           input: LayerNorm(h + attention output), quantized
    stage 4   output                 input: GELU of the quantized intermediate

For each stage the calibration sentences run through the layer (in batches of similar
length, padding excluded from the statistics) until the stage's input is known; its
``Calibration`` accumulates ``X^T X``; then ``quantize(name, weight, calibration)`` gives the
stage's ``QuantizedTensor``s, and later stages compute with them.  Outputs of linears
already quantized are kept per batch, so each linear runs once per batch; the last stage
runs the whole layer, and only its final step (``LayerNorm(attended + output(...))``) is
redone with the quantized output linear.

``activations="runtime"`` makes the quantized linears compute as XNNPACK's dynamic fully
connected does, on per-token int8 inputs (``quantize_per_token``); ``"float"`` multiplies
float inputs by the dequantized weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np

from ..errors import XnnquantError
from ..schemes.calibration import Calibration
from ..schemes.per_token import quantize as quantize_per_token
from ..tensor import QuantizedTensor
from . import minilm
from .weights import minilm_tensors

#: ``quantize(weight name, weight float32 [N, K], calibration) -> QuantizedTensor``.
Quantize = Callable[[str, np.ndarray, Calibration], QuantizedTensor]

#: The linears of one encoder layer grouped by the input they read, in data-flow order.
STAGES: tuple[tuple[str, ...], ...] = (minilm.LINEARS[:3], minilm.LINEARS[3:4], minilm.LINEARS[4:5],
                                       minilm.LINEARS[5:6])
#: Sentences per batch (batches hold sentences of similar length, to limit padding).
BATCH_SENTENCES = 64


class _InputSeen(Exception):
    """Raised by the recording linear once the stage's input is known: the rest of the
    layer is not needed yet."""


class Batch(NamedTuple):
    """Sentences of similar length: their indices in the caller's list ``(B,)`` int64, token
    ids int64 ``(B, T)`` and mask bool ``(B, T)`` (True on real tokens)."""

    positions: np.ndarray
    ids: np.ndarray
    mask: np.ndarray


def batches(sentences: Sequence[str], size: int = BATCH_SENTENCES) -> list[Batch]:
    """``sentences`` sorted by length (in characters, a proxy for tokens that needs no
    tokenizing), in batches of ``size`` (the last may be smaller)."""
    if isinstance(sentences, str) or not sentences:
        raise XnnquantError(f"sentences must be a non-empty sequence of strings: got {sentences!r}")
    if not isinstance(size, int) or size < 1:
        raise XnnquantError(f"batch size must be a positive integer: got {size!r}")
    order = np.argsort([len(s) for s in sentences], kind="stable")
    out = []
    for start in range(0, len(order), size):
        positions = order[start:start + size]
        ids, mask = minilm.tokenize_batch([sentences[i] for i in positions])
        out.append(Batch(positions, ids, mask))
    return out


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, activations: str) -> np.ndarray:
    """``x @ weight.T + bias``, on per-token int8 ``x`` when ``activations == "runtime"``."""
    if activations == "runtime":
        x = quantize_per_token(x).dequantize()
    return minilm.linear(x, weight, bias)


def quantize_minilm(sentences: Sequence[str], quantize: Quantize, *, weights: minilm.Weights | None = None,
                    activations: Literal["float", "runtime"] = "float", runtime_quantized: bool = False,
                    batch_size: int = BATCH_SENTENCES) -> dict[str, QuantizedTensor]:
    """Quantize the 36 encoder linears of all-MiniLM-L6-v2 sequentially (module doc).

    ``sentences``: calibration text.  ``quantize(name, w, calibration)``: e.g.
    ``lambda name, w, cal: xq.quantize_blockwise(w, 32, "gptq", calibration=cal)``.
    ``runtime_quantized``: passed to every ``Calibration``.  Returns
    ``{"encoder.layer.{i}.{linear}.weight": QuantizedTensor}``.
    """
    if activations not in ("float", "runtime"):
        raise XnnquantError(f"activations must be 'float' or 'runtime': got {activations!r}")
    weights = minilm_tensors() if weights is None else weights
    data = batches(sentences, batch_size)
    hidden = [minilm.embed(batch.ids, weights) for batch in data]
    quantized: dict[str, QuantizedTensor] = {}
    dequantized: dict[str, np.ndarray] = {}

    def run_quantized(name: str, x: np.ndarray) -> np.ndarray:
        return _linear(x, dequantized[name], weights[name + ".bias"], activations)

    for index in range(minilm.NUM_LAYERS):
        prefix = f"encoder.layer.{index}."
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        layers: list[minilm.LayerActivations] = []
        for stage in STAGES:
            first = prefix + stage[0]
            calibration = Calibration(weights[first + ".weight"].shape[1], runtime_quantized=runtime_quantized)
            last = stage is STAGES[-1]
            layers = [_run_layer(hidden[b], batch.mask, weights, index, outputs[b], run_quantized, first, calibration,
                                 stop=not last) for b, batch in enumerate(data)]
            for name in stage:
                qt = quantize(prefix + name + ".weight", weights[prefix + name + ".weight"], calibration)
                quantized[prefix + name + ".weight"] = qt
                dequantized[prefix + name] = qt.dequantize()
        # The last stage ran the whole layer with a float output.dense; redo only the
        # layer's last step, out = LayerNorm(attended + output.dense(hidden)), with the
        # quantized one (rather than the whole layer, GELU included, once more).
        down, up = minilm.LINEARS[5], minilm.LINEARS[4]
        gamma, beta = weights[prefix + "output.LayerNorm.weight"], weights[prefix + "output.LayerNorm.bias"]
        hidden = [minilm.layer_norm(layer.inputs[up] + run_quantized(prefix + down, layer.inputs[down]), gamma, beta)
                  for layer in layers]
    return quantized


def _run_layer(h: np.ndarray, mask: np.ndarray, weights: minilm.Weights, index: int, outputs: dict[str, np.ndarray],
               run_quantized: Callable[[str, np.ndarray], np.ndarray], record: str, calibration: Calibration,
               stop: bool) -> minilm.LayerActivations:
    """Layer ``index`` on one batch with the linears quantized so far (their outputs kept in
    ``outputs``); the input of ``record`` (real tokens only) goes to ``calibration``, and then
    the layer stops there (``stop``: the returned record is empty) or goes on with ``record``
    in float."""

    def linear_fn(name: str, x: np.ndarray) -> np.ndarray:
        if name == record:
            calibration.add(x, mask=mask)
            if stop:
                raise _InputSeen
            return minilm.linear(x, weights[name + ".weight"], weights[name + ".bias"])
        if name not in outputs:
            outputs[name] = run_quantized(name, x)
        return outputs[name]

    try:
        return minilm.encoder_layer(h, mask, weights, index, linear_fn)
    except _InputSeen:
        return minilm.LayerActivations(inputs={}, output=h)


def linear_calibrations(sentences: Sequence[str], *, weights: minilm.Weights | None = None,
                        runtime_quantized: bool = False, batch_size: int = BATCH_SENTENCES
                        ) -> dict[str, Calibration]:
    """``{"encoder.layer.{i}.{linear}.weight": Calibration}`` of the float model's inputs to
    each of the 36 linears (not sequential; query, key and value share one object)."""
    weights = minilm_tensors() if weights is None else weights
    out: dict[str, Calibration] = {}
    for batch in batches(sentences, batch_size):
        h = minilm.embed(batch.ids, weights)
        for index in range(minilm.NUM_LAYERS):
            layer = minilm.encoder_layer(h, batch.mask, weights, index)
            for stage in STAGES:
                x = layer.inputs[stage[0]]
                keys = [f"encoder.layer.{index}.{name}.weight" for name in stage]
                if keys[0] not in out:
                    shared = Calibration(x.shape[-1], runtime_quantized=runtime_quantized)
                    out.update(dict.fromkeys(keys, shared))
                out[keys[0]].add(x, mask=batch.mask)
            h = layer.output
    return out


def sentence_embeddings(sentences: Sequence[str], quantized: dict[str, QuantizedTensor], *,
                        weights: minilm.Weights | None = None, activations: Literal["float", "runtime"] = "float",
                        batch_size: int = BATCH_SENTENCES) -> np.ndarray:
    """``minilm.sentence_embeddings`` with the ``quantized`` linears: float32 ``(S, 384)``, in
    the order of ``sentences``.  ``activations="runtime"`` quantizes each linear's input per
    token to int8 first, as XNNPACK's dynamic fully connected does."""
    weights = minilm_tensors() if weights is None else weights
    dequantized = {name[: -len(".weight")]: qt.dequantize() for name, qt in quantized.items()}

    def linear_fn(name: str, x: np.ndarray) -> np.ndarray:
        if name not in dequantized:
            return minilm.linear(x, weights[name + ".weight"], weights[name + ".bias"])
        return _linear(x, dequantized[name], weights[name + ".bias"], activations)

    out = np.empty((len(sentences), minilm.HIDDEN), np.float32)
    for batch in batches(sentences, batch_size):
        h = minilm.embed(batch.ids, weights)
        for index in range(minilm.NUM_LAYERS):
            h = minilm.encoder_layer(h, batch.mask, weights, index, linear_fn).output
        out[batch.positions] = minilm.mean_pooled(h, batch.mask)
    return out


def dequantized_weights(quantized: dict[str, QuantizedTensor], weights: minilm.Weights | None = None
                        ) -> minilm.Weights:
    """The model's tensors with each quantized weight replaced by its dequantized value
    (float32), for ``minilm.sentence_embeddings(..., weights=...)``."""
    out = dict(minilm_tensors() if weights is None else weights)
    out.update({name: qt.dequantize() for name, qt in quantized.items()})
    return out
