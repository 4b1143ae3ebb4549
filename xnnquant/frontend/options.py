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
from .batches import CalibrationData
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
    calibration: CalibrationData | None
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
              dynamic_shapes: Any = None, calibration_mask: Any = None, strict: Any = False,
              embeddings: Any = None) -> ExportOptions:
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
        if calibration_mask is not None and calibration is None:
            raise XnnquantError("calibration_mask= goes with calibration=: got a mask and no calibration batches")
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
                   None if calibration is None else CalibrationData.parse(calibration, calibration_mask), path, check,
                   progress, dynamic_shapes, strict, tables)
