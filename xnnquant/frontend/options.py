"""The options of ``xq.export`` and ``xq.check``, checked and parsed once, at the API edge.

``ExportOptions.parse`` takes the keyword arguments as the user gave them and either
returns frozen, typed options or raises ``XnnquantError`` saying which argument was
wrong, what it got and what it expects; nothing past this point checks an argument
again.  ``weights`` and ``fallback`` become the ``WeightPolicy`` (``weights.py``), ``embeddings``
an ``EmbeddingScheme`` or None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import arguments
from ..errors import XnnquantError
from ..graph import Target
from ..schemes.checks import ACTIVATION_AWARE_METHODS, check_method
from .weights import EmbeddingScheme, WeightPolicy

#: What ``activations=`` takes: per-token int8 quantized at run time, the only kind so far.
ACTIVATIONS = ("dynamic",)


@dataclass(frozen=True)
class ExportOptions:
    """Every option of one export, checked (see the module docstring)."""

    policy: WeightPolicy
    method: str
    target: Target
    activations: str
    calibration: tuple[tuple[Any, ...], ...] | None
    state_dict: Path | None
    check: bool
    progress: bool
    dynamic_shapes: Any = None
    strict: bool = False
    embeddings: EmbeddingScheme | None = None

    @classmethod
    def parse(cls, *, weights: Any = "qb4w:32", method: Any = "mse", calibration: Any = None,
              fallback: Any = "auto", activations: Any = "dynamic", target: Any = "1.4.1",
              state_dict: Any = None, check: Any = True, progress: Any = True,
              dynamic_shapes: Any = None, strict: Any = False, embeddings: Any = None) -> ExportOptions:
        policy = WeightPolicy(weights, fallback)
        tables = EmbeddingScheme.parse(embeddings)
        if not isinstance(method, str):
            raise XnnquantError(f"method must be a string: got {type(method).__name__} {method!r}")
        chosen = check_method(method)
        chosen_target = Target.parse(target)
        if not isinstance(activations, str) or activations not in ACTIVATIONS:
            raise XnnquantError(f"unknown activations: got {arguments.shown(activations)}, expected one of "
                                f"{', '.join(map(repr, ACTIVATIONS))}")
        for name, flag in (("check", check), ("progress", progress), ("strict", strict)):
            if not isinstance(flag, bool):
                raise XnnquantError(f"{name} must be True or False: got {type(flag).__name__} {flag!r}")
        if tables is not None and strict:
            raise XnnquantError(f"embeddings={str(tables)!r} stores the tables for ExecuTorch's quantized embedding "
                                "kernels, which run outside XNNPACK, and strict=True keeps one pure XNNPACK graph: "
                                "expected embeddings=None with strict=True, or strict=False")
        quantized = policy.weights.is_quantized
        if chosen in ACTIVATION_AWARE_METHODS and calibration is None and quantized:
            raise XnnquantError(f"method {chosen!r} chooses scales from activations: pass calibration= "
                                "(an iterable of input tuples)")
        if calibration is not None and not quantized:
            raise XnnquantError("calibration= has no use with fp32 weights: it calibrates quantized layers")
        path = None
        if state_dict is not None:
            if not isinstance(state_dict, (str, os.PathLike)):
                raise XnnquantError(f"state_dict must be the path of a safetensors file: got "
                                    f"{type(state_dict).__name__}")
            path = Path(os.fspath(state_dict))
            if chosen_target is not Target.ET_1_4_1:
                raise XnnquantError(f"a streaming export (state_dict=) writes its scales as constant data, which "
                                    f"ExecuTorch 1.4.1 reads: got target {str(chosen_target)!r}, expected '1.4.1'")
            if calibration is not None:
                raise XnnquantError("a streaming export (state_dict=) cannot calibrate: the module on the meta "
                                    "device cannot run; calibrate on the module with its weights instead")
        if dynamic_shapes is not None and not isinstance(dynamic_shapes, (dict, tuple, list)):
            raise XnnquantError(f"dynamic_shapes must be torch.export's spec (a tuple or dict of {{dim: "
                                f"torch.export.Dim}} per input): got {type(dynamic_shapes).__name__}")
        return cls(policy, chosen, chosen_target, str(activations),
                   None if calibration is None else calibration_batches(calibration), path, check, progress,
                   dynamic_shapes, strict, tables)


def calibration_batches(batches: Any) -> tuple[tuple[Any, ...], ...]:
    """``calibration=`` as a tuple of input tuples (torch tensors; numpy arrays are converted),
    at least one; ``XnnquantError`` naming the first batch that is not."""
    import numpy as np
    import torch

    if isinstance(batches, (str, bytes, torch.Tensor, np.ndarray)) or not hasattr(batches, "__iter__"):
        raise XnnquantError(f"calibration must be an iterable of input tuples (one tuple of the module's positional "
                            f"inputs per batch): got {type(batches).__name__}")
    out = []
    for i, batch in enumerate(batches):
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        converted = []
        for j, x in enumerate(inputs):
            if isinstance(x, np.ndarray):
                x = torch.from_numpy(np.ascontiguousarray(x))
            if not isinstance(x, torch.Tensor):
                raise XnnquantError(f"calibration batch {i}, input {j}: expected a torch tensor or a numpy array, "
                                    f"got {type(x).__name__}")
            converted.append(x)
        out.append(tuple(converted))
    if not out:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    return tuple(out)


def check_batches_fit(batches: tuple[tuple[Any, ...], ...], example: tuple[Any, ...]) -> None:
    """Each calibration batch has the example inputs' count, dtypes and ranks."""
    for i, batch in enumerate(batches):
        if len(batch) != len(example):
            raise XnnquantError(f"calibration batch {i} has {len(batch)} input(s): expected {len(example)}, as the "
                                "example inputs")
        for j, (x, e) in enumerate(zip(batch, example)):
            if x.dtype != e.dtype or x.dim() != e.dim():
                raise XnnquantError(f"calibration batch {i}, input {j} is {x.dtype} of shape {tuple(x.shape)}: "
                                    f"expected {e.dtype} of rank {e.dim()}, as example input {j} "
                                    f"{tuple(e.shape)}")
