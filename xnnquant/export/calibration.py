"""Calibration for activation-aware methods: every linear's real inputs, as statistics.

``linear_calibrations(module, batches)`` runs the float module on each batch (a tuple of
its positional inputs) with a forward pre-hook on every ``torch.nn.Linear``, and adds the
rows each one receives to a ``Calibration`` (``xnnquant.schemes``), which keeps ``X^T X``
in float64 rather than the activations.  The result maps module paths (the names
``Exported.report`` shows) to their ``Calibration``.

The inputs are the float model's (not the inputs that earlier quantized layers would
produce); sequential calibration is the next step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import XnnquantError


def linear_calibrations(module: Any, batches: Iterable[Any]) -> dict[str, Any]:
    """``{module path: Calibration}`` for every ``nn.Linear`` of ``module`` (see the module docstring)."""
    import torch

    try:
        from ..schemes import Calibration  # type: ignore[attr-defined]
    except ImportError:
        raise XnnquantError("calibration needs xnnquant.schemes.Calibration, which this version lacks") from None
    if not isinstance(module, torch.nn.Module):
        raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
    stats: dict[str, Any] = {}
    hooks = []
    for path, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear):
            stats[path] = Calibration(layer.in_features)

            def hook(_: Any, args: tuple[Any, ...], path: str = path) -> None:
                stats[path].add(args[0].detach().reshape(-1, args[0].shape[-1]))

            hooks.append(layer.register_forward_pre_hook(hook))
    count = 0
    try:
        with torch.no_grad():
            for i, batch in enumerate(batches):
                inputs = batch if isinstance(batch, (tuple, list)) else (batch,)
                if not all(isinstance(x, torch.Tensor) for x in inputs):
                    raise XnnquantError(f"calibration batch {i} must be a tuple of tensors: got {type(batch).__name__}")
                module(*inputs)
                count += 1
    finally:
        for handle in hooks:
            handle.remove()
    if count == 0:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    return stats
