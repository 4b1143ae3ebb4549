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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import XnnquantError

#: SmoothQuant's migration strength for the equalization (see the module docstring).
EQUALIZATION_ALPHA = 0.5


@dataclass
class LinearStatistics:
    """Per linear module path: input channel maxima, and ``Calibration``s when asked."""

    absmax: dict[str, np.ndarray] = field(default_factory=dict)
    grams: dict[str, Any] = field(default_factory=dict)
    batches: int = 0


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
    for path, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            if calibration_type is not None:
                stats.grams[path] = calibration_type(layer.in_features)

            def hook(_: Any, args: tuple[Any, ...], path: str = path) -> None:
                rows = args[0].detach().reshape(-1, args[0].shape[-1])
                top = rows.abs().amax(dim=0)
                maxima[path] = top if path not in maxima else torch.maximum(maxima[path], top)
                if path in stats.grams:
                    stats.grams[path].add(rows)

            hooks.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                inputs = batch if isinstance(batch, (tuple, list)) else (batch,)
                if not all(isinstance(x, torch.Tensor) for x in inputs):
                    raise XnnquantError(f"calibration batch {i} must be a tuple of tensors: got {type(batch).__name__}")
                module(*inputs)
                stats.batches += 1
    finally:
        for handle in hooks:
            handle.remove()
    if stats.batches == 0:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    stats.absmax = {path: top.float().numpy() for path, top in maxima.items()}
    return stats


def equalization_scales(absmax: np.ndarray, weights: list[np.ndarray], alpha: float = EQUALIZATION_ALPHA) -> np.ndarray:
    """Per input channel ``s`` (float32 ``(K,)``) for inputs with channel maxima ``absmax``
    read by ``weights`` (each ``[N_i, K]``); see the module docstring."""
    column = np.max([np.abs(w).max(axis=0) for w in weights], axis=0)
    floor = np.float32(1e-5)  # dead channels (all-zero input or weight) keep a usable scale
    s = np.maximum(absmax, floor) ** alpha / np.maximum(column, floor) ** (1 - alpha)
    return np.maximum(s, floor).astype(np.float32)
