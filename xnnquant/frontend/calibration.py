"""Calibration: every linear's real inputs, as statistics, for what uses them.

``linear_statistics(module, batches, grams=...)`` runs the float module on each batch (a
tuple of its positional inputs) with a forward pre-hook on every ``torch.nn.Linear`` and
keeps, per module path (the names ``Exported.report`` shows):

* ``absmax``: the largest |input| of each input channel, float32 ``(in_features,)``, for
  the equalization of layer-norm-fed linears (``equalization_scales``);
* ``grams``: when asked, a ``Calibration`` (``xnnquant.schemes``) accumulating ``X^T X`` in
  float64, for the activation-aware methods.

The inputs are the float model's (not the inputs that earlier quantized layers would
produce).

Sequential calibration (``sequential_statistics``, what the activation-aware methods get).
A deployed layer reads what the quantized layers before it produce, so each linear is
calibrated on those inputs, as ``models.sequential`` does for the numpy MiniLM: the batches
run through the module in stages, in the order the linears are called::

    stage     the next linear not yet quantized, with every other one reading the same
              input tensor (query, key, value), gathers X^T X over all batches; each
              forward stops (an exception from the hook) as soon as a linear outside the
              stage, not yet quantized, is reached
    quantize  each linear of the stage: ``quantize(path, weight, calibration)``; it then
              computes with the dequantized weight in the stages after

A model of ``S`` stages costs about ``S / 2`` full forwards over the batches.  The module's
own weights are swapped for the dequantized ones while it runs and put back afterwards;
the ``QuantizedTensor``s are kept (``LinearStatistics.quantized``) and stored by the
lowering as they are.  A linear that the forward never calls through its module (e.g.
``nn.MultiheadAttention``'s projections, called functionally) gets no statistics.

Equalization.  A layer norm's output often has a few channels far larger than the rest,
and per-token int8 quantization of such a row gives the small channels few levels.  For a
linear reading it, ``x W^T = (x / s) (W s)^T`` for any positive per-channel ``s``: the
input is divided by ``s`` (one XNNMultiply by a constant before the XNNConvert) and the
weight's columns multiplied by it before quantization.  With
``s_j = absmax_j^a / max_i |W_ij|^(1 - a)``, ``a = 0.5`` (SmoothQuant's rule, Xiao et al.
2023), activations and weights share the range.  Measured on all-MiniLM-L6-v2 with qc8w,
calibrated on the project's 509 calibration sentences: sentence-embedding cosine to float
0.99893 -> 0.99944 on the sample sentences, 0.99884 -> 0.99941 on 116 held-out ones
(a = 0.3: 0.99933; 0.6: 0.99944; equalizing every linear, not only layer-norm-fed ones:
0.99936).  Linears sharing one input (query, key, value) share ``s``, taken over all
their weights, so they keep sharing one conversion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import XnnquantError

#: SmoothQuant's migration strength for the equalization (see the module docstring).
EQUALIZATION_ALPHA = 0.5


@dataclass
class LinearStatistics:
    """Per linear module path: input channel maxima, ``Calibration``s when asked, and the
    weights quantized by sequential calibration."""

    absmax: dict[str, np.ndarray] = field(default_factory=dict)
    grams: dict[str, Any] = field(default_factory=dict)
    batches: int = 0
    quantized: dict[str, Any] = field(default_factory=dict)


#: ``quantize(module path, weight float32 [N, K], calibration)``: the weight's
#: ``QuantizedTensor``, or None to leave the layer float while calibrating.
Quantize = Callable[[str, np.ndarray, Any], Any]


class _StageDone(Exception):
    """Raised by a hook once the forward reaches a linear outside the stage."""


def _input_batches(batches: Iterable[Any]) -> list[tuple[Any, ...]]:
    import torch

    out = []
    for i, batch in enumerate(batches):
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if not all(isinstance(x, torch.Tensor) for x in inputs):
            raise XnnquantError(f"calibration batch {i} must be a tuple of tensors: got {type(batch).__name__}")
        out.append(inputs)
    if not out:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    return out


def run_batch(module: Any, inputs: tuple[Any, ...], index: int) -> Any:
    """``module(*inputs)``; an error of the module on it names calibration batch ``index``."""
    try:
        return module(*inputs)
    except (XnnquantError, _StageDone):
        raise
    except Exception as exc:  # the module's own error on a batch that does not fit it
        shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in inputs)
        raise XnnquantError(f"calibration batch {index} ({shapes}) does not run through the module: "
                            f"{type(exc).__name__}: {exc}") from None


def linear_statistics(module: Any, batches: Iterable[Any], *, grams: bool = False) -> LinearStatistics:
    """Run ``module`` on ``batches`` and gather ``LinearStatistics`` (module docstring)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
    calibration_type = None
    if grams:
        try:
            from ..schemes import Calibration
        except ImportError:
            raise XnnquantError("activation-aware methods need xnnquant.schemes.Calibration") from None
        calibration_type = Calibration
    stats = LinearStatistics()
    maxima: dict[str, Any] = {}
    hooks = []
    batches = _input_batches(batches)
    for path, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            if calibration_type is not None:
                stats.grams[path] = calibration_type(layer.in_features)

            def hook(_: Any, args: tuple[Any, ...], path: str = path) -> None:
                rows = args[0].detach().reshape(-1, args[0].shape[-1])
                if not bool(torch.isfinite(rows).all()):
                    raise XnnquantError(f"calibration batch {stats.batches}: the input of layer {path!r} is not "
                                        "finite (NaN or inf): expected finite activations")
                top = rows.abs().amax(dim=0)
                maxima[path] = top if path not in maxima else torch.maximum(maxima[path], top)
                if path in stats.grams:
                    stats.grams[path].add(rows)

            hooks.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for inputs in batches:
                run_batch(module, inputs, stats.batches)
                stats.batches += 1
    finally:
        for handle in hooks:
            handle.remove()
    stats.absmax = {path: top.float().numpy() for path, top in maxima.items()}
    return stats


def sequential_statistics(module: Any, batches: Iterable[Any], quantize: Quantize) -> LinearStatistics:
    """Calibrate and quantize ``module``'s linears stage by stage (module docstring):
    ``grams`` and ``quantized`` per module path (``absmax`` stays empty)."""
    import torch

    from ..schemes import Calibration

    if not isinstance(module, torch.nn.Module):
        raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
    inputs = _input_batches(batches)
    linears = {layer: path for path, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)}
    stats = LinearStatistics(batches=len(inputs))
    originals = {layer: layer.weight for layer in linears}
    stage: dict[Any, Any] = {}  # linear -> its Calibration, in call order
    seen: list[Any] = []  # the stage's input tensor in the current forward
    open_ = [True]  # members may still join (first batch only)

    current = [0]  # the batch being run

    def hook(layer: Any, args: tuple[Any, ...]) -> None:
        path = linears[layer]
        if path in stats.quantized or path in stats.grams:
            return
        x = args[0].detach()
        if not bool(torch.isfinite(x).all()):
            raise XnnquantError(f"calibration batch {current[0]}: the input of layer {path!r} is not finite (NaN or "
                                "inf): expected finite activations")
        if layer not in stage:
            if not (open_[0] and (not stage or (seen and x is seen[0]))):
                raise _StageDone
            stage[layer] = Calibration(layer.in_features)
        if not seen:
            seen.append(x)
        stage[layer].add(x.reshape(-1, x.shape[-1]))

    hooks = [layer.register_forward_pre_hook(hook) for layer in linears]
    try:
        with torch.no_grad():
            while True:
                stage.clear()
                open_[0] = True
                for i, batch in enumerate(inputs):
                    seen.clear()
                    current[0] = i
                    with contextlib.suppress(_StageDone):  # the stage's inputs are all seen
                        run_batch(module, batch, i)
                    open_[0] = False
                if not stage:
                    break
                for layer, calibration in stage.items():
                    path = linears[layer]
                    stats.grams[path] = calibration
                    weight = originals[layer].detach().numpy()
                    qt = quantize(path, weight, calibration)
                    if qt is not None:
                        stats.quantized[path] = qt
                        layer.weight = torch.nn.Parameter(torch.from_numpy(qt.dequantize()), requires_grad=False)
    finally:
        for handle in hooks:
            handle.remove()
        for layer, weight in originals.items():
            layer.weight = weight
    return stats


def equalization_scales(absmax: np.ndarray, weights: list[np.ndarray], alpha: float = EQUALIZATION_ALPHA) -> np.ndarray:
    """Per input channel ``s`` (float32 ``(K,)``) for inputs with channel maxima ``absmax``
    read by ``weights`` (each ``[N_i, K]``); see the module docstring."""
    column = np.max([np.abs(w).max(axis=0) for w in weights], axis=0)
    floor = np.float32(1e-5)  # dead channels (all-zero input or weight) keep a usable scale
    s = np.maximum(absmax, floor) ** alpha / np.maximum(column, floor) ** (1 - alpha)
    return np.maximum(s, floor).astype(np.float32)
