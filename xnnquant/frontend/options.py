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
from enum import Enum
from pathlib import Path
from typing import Any

from .. import arguments
from ..errors import XnnquantError
from ..graph import Target
from ..schemes.checks import ACTIVATION_AWARE_METHODS, check_method
from .batches import CalibrationData
from .weights import EmbeddingScheme, WeightPolicy


class ActivationKind(str, Enum):
    """What ``activations=`` takes: per-token int8 quantized at run time (``"dynamic"``), or
    full-integer static int8 (``"qint8"``: every activation's scale and zero point fixed at
    export from calibration, ``static_int8/``)."""

    DYNAMIC = "dynamic"
    QINT8 = "qint8"

    def __str__(self) -> str:
        return self.value


#: The spellings of ``activations=``.
ACTIVATIONS = tuple(k.value for k in ActivationKind)
#: How a static int8 activation's range is chosen from its calibration histogram
#: (``static_int8/ranges.py``).
RANGE_METHODS = ("sensitivity", "minmax", "percentile", "mse", "output_mse")
#: How a static int8 filter's codes are rounded (``static_int8/rounding.py``).
ROUNDINGS = ("nearest", "learned")


@dataclass(frozen=True)
class StaticInt8:
    """``activations="qint8"`` with its choices spelled out (the string takes the defaults).

    ``ranges``: each activation's range: ``"sensitivity"`` (the grid of least first-order
    error at the graph's outputs, each element weighted by its own squared gradient,
    measured in torch on 8 calibration inputs: ``static_int8/sensitivity.py``; percentile
    where torch cannot compute the graph), or from its calibration histogram alone:
    ``"minmax"``, ``"percentile"`` (``percentile`` of the magnitudes on each side of zero),
    ``"mse"`` (the range of least expected squared error, clipping included) or
    ``"output_mse"`` (the same, each channel weighted by how much it moves its readers'
    outputs).  ``equalize``: cross-layer equalization of filtered pairs
    (``static_int8/rewrite.py``).  ``bias_correction``: each quantized layer's bias corrected
    for the mean shift its quantized filter causes on the calibration inputs
    (``static_int8/bias_correction.py``).  ``budget``: mixed precision: the nodes whose int8
    grids cost the outputs most stay fp32 while the program's estimated time stays within
    ``1 + budget`` times the all-int8 program's (``static_int8/mixed.py``; needs
    ``"sensitivity"``); ``Exported.static_int8.int8.kept`` lists them with their costs.
    ``rounding``: ``"nearest"`` codes, or ``"learned"``: each code rounded up or down for its
    layer's output on calibration inputs, AdaRound's choice made as GPTQ orders it
    (``static_int8/rounding.py``).
    ``cpu``: the class of CPU whose int8 and fp32 kernels the time estimate prices (it decides
    which int8 nodes between fp32 ones stay fp32, and what a budget buys: ``static_int8/mixed.py``):
    ``"avx512vnni"`` (the default: AMD Zen 4 and 5, Intel Ice Lake and Sapphire Rapids, the class
    its ratios were measured on), ``"avx512"`` (Intel Skylake-SP without VNNI), ``"avx2"`` (AMD
    Zen 1 to 3, Intel Haswell to Alder Lake), ``"sse"``, or ``"this"``: the exporting machine's
    class, so that the program depends on where it was exported (the report names both).  A
    named class exports the same program on any machine.

    Defaults by measurement (``benchmarks/static_int8.py``, ``notebooks/static_int8.ipynb``):
    on MobileNetV2's logits (held-out photo crops) ``sensitivity`` ranges gave 21.4 dB
    against 18.45 for ``percentile`` (``mse`` 18.2, ``output_mse`` 18.1, ``minmax`` 17.6),
    with equalization and bias correction; without either, ``percentile`` gives 16.5 dB and
    ``minmax`` 12.2 dB.
    """

    ranges: str = "sensitivity"
    percentile: float = 99.99
    equalize: bool = True
    bias_correction: bool = True
    budget: float = 0.0
    rounding: str = "nearest"
    cpu: str = "avx512vnni"

    def __post_init__(self) -> None:
        if arguments.spelling(self.ranges) in RANGE_METHODS:  # case and spaces ignored, as every option
            object.__setattr__(self, "ranges", arguments.spelling(self.ranges))
        if self.ranges not in RANGE_METHODS:
            raise XnnquantError(f"unknown activation range method: got {self.ranges!r}, expected one of "
                                f"{', '.join(map(repr, RANGE_METHODS))}")
        if not isinstance(self.percentile, (int, float)) or not 50 < float(self.percentile) <= 100:
            raise XnnquantError(f"percentile must be a number in (50, 100]: got {self.percentile!r}")
        for name in ("equalize", "bias_correction"):
            if not isinstance(getattr(self, name), bool):
                raise XnnquantError(f"{name} must be True or False: got {getattr(self, name)!r}")
        if arguments.spelling(self.rounding) in ROUNDINGS:  # case and spaces ignored, as ranges
            object.__setattr__(self, "rounding", arguments.spelling(self.rounding))
        if self.rounding not in ROUNDINGS:
            raise XnnquantError(f"unknown rounding: got {self.rounding!r}, expected one of "
                                f"{', '.join(map(repr, ROUNDINGS))}")
        from ..xnnpack.cpu import CLASS_NAMES

        spelled = arguments.spelling(self.cpu)
        if spelled not in (*CLASS_NAMES, "this"):
            raise XnnquantError(f"unknown CPU class for the time estimate: got cpu={self.cpu!r}, expected one of "
                                f"{', '.join(map(repr, CLASS_NAMES))} or 'this' (the exporting machine's)")
        object.__setattr__(self, "cpu", spelled)
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 <= self.budget < 10:
            raise XnnquantError(f"budget is the extra time mixed precision may spend, as a fraction of the int8 "
                                f"program's (0.3: up to 1.3 times): got {self.budget!r}, expected a number in [0, 10)")
        if self.budget and self.ranges != "sensitivity":  # it prices each grid by the sensitivity measurement
            raise XnnquantError(f"budget={self.budget!r} chooses the nodes to keep in fp32 by their measured cost to "
                                f"the outputs, which only ranges='sensitivity' measures: got ranges={self.ranges!r}; "
                                "use ranges='sensitivity' (the default) with a budget")

    def __str__(self) -> str:
        if self == StaticInt8():
            return "qint8"
        default = StaticInt8()
        same_ranges = (self.ranges, self.percentile) == (default.ranges, default.percentile)
        parts = [] if same_ranges else [
            f"ranges={self.ranges}" + (f"@{self.percentile:g}" if self.ranges == "percentile" else "")]
        parts += [f"{name}={getattr(self, name)}" for name in ("equalize", "bias_correction")
                  if getattr(self, name) != getattr(StaticInt8(), name)]
        parts += [f"budget={self.budget:g}"] if self.budget else []
        parts += [f"rounding={self.rounding}"] if self.rounding != "nearest" else []
        parts += [f"cpu={self.cpu}"] if self.cpu != default.cpu else []
        return f"qint8({', '.join(parts)})"


def parse_activations(activations: Any) -> tuple[ActivationKind, StaticInt8 | None]:
    """``activations=`` as (its kind, the static int8 choices or None)."""
    if isinstance(activations, StaticInt8):
        return ActivationKind.QINT8, activations
    if arguments.spelling(activations) in ACTIVATIONS:
        kind = ActivationKind(arguments.spelling(activations))
        return kind, (StaticInt8() if kind is ActivationKind.QINT8 else None)
    raise XnnquantError(f"unknown activations: got {arguments.shown(activations)}, expected one of "
                        f"{', '.join(map(repr, ACTIVATIONS))} or an xq.StaticInt8(...)")


@dataclass(frozen=True)
class ExportOptions:
    """Every option of one export, checked (see the module docstring)."""

    policy: WeightPolicy
    method: str
    target: Target
    activations: ActivationKind
    calibration: CalibrationData | None
    state_dict: Path | None
    check: bool
    progress: bool
    dynamic_shapes: Any = None
    strict: bool = False
    embeddings: EmbeddingScheme | None = None
    #: the static int8 choices (``activations="qint8"``), else None
    static_int8: StaticInt8 | None = None
    #: ``"hadamard"``: the residual stream rotated (``passes/rotation.py``); None: not
    rotation: str | None = None
    #: the target device's memory in bytes (``memory=``, ``pte.planned.memory_bytes``); None: this machine's
    memory: int | None = None
    #: what ends a planned-memory refusal (a wrapper's: ``xq.export_llm`` says the KV cache's share)
    memory_hint: str = ""

    @classmethod
    def parse(cls, *, weights: Any = "qb4w:32", method: Any = "mse", calibration: Any = None,
              fallback: Any = "auto", activations: Any = "dynamic", target: Any = "1.4.1",
              state_dict: Any = None, check: Any = True, progress: Any = True,
              dynamic_shapes: Any = None, calibration_mask: Any = None, strict: Any = False,
              embeddings: Any = None, rotation: Any = None, memory: Any = None) -> ExportOptions:
        from ..pte.planned import memory_bytes

        policy = WeightPolicy(weights, fallback)
        target_memory = memory_bytes(memory)
        tables = EmbeddingScheme.parse(embeddings)
        if not isinstance(method, str):
            raise XnnquantError(f"method must be a string: got {type(method).__name__} {method!r}")
        chosen = check_method(method)
        chosen_target = Target.parse(target)
        kind, static = parse_activations(activations)
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
        if static is not None:
            _check_static_int8(policy, chosen, calibration, calibration_mask, state_dict, dynamic_shapes, tables)
        path = None
        if state_dict is not None:
            if not isinstance(state_dict, (str, os.PathLike)):
                raise XnnquantError(f"state_dict must be the path of a safetensors file (or of a sharded "
                                    f"checkpoint's .json index): got "
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
        if dynamic_shapes is not None and not _names_a_dim(dynamic_shapes):
            raise XnnquantError(f"dynamic_shapes={dynamic_shapes!r} makes no dim dynamic: expected a torch.export.Dim "
                                "for each dynamic dim ({1: Dim('seq', max=512)} per input), or dynamic_shapes=None "
                                "for a program of the example inputs' shapes")
        if not quantized and tables is None and chosen in ACTIVATION_AWARE_METHODS:
            raise XnnquantError(f"method={chosen!r} chooses the scales of quantized weights from calibration "
                                "activations, and weights='fp32' quantizes none (nor embeddings=) and takes no "
                                "calibration: expected method='mse' (the default) with fp32 weights, or a quantized "
                                "scheme")
        rotated = _rotation(rotation, path, static)
        return cls(policy, chosen, chosen_target, kind,
                   None if calibration is None else CalibrationData.parse(calibration, calibration_mask), path, check,
                   progress, dynamic_shapes, strict, tables, static, rotated, target_memory)


#: The rotations ``rotation=`` names (``passes/rotation.py``).
ROTATIONS = ("hadamard",)


def _rotation(rotation: Any, state_dict: Any, static: Any) -> str | None:
    """``rotation=`` checked: None or ``"hadamard"`` (case and spaces ignored)."""
    if rotation is None:
        return None
    if not isinstance(rotation, str) or rotation.strip().lower() not in ROTATIONS:
        raise XnnquantError(f"rotation must be None or one of {', '.join(map(repr, ROTATIONS))}: got {rotation!r}")
    if state_dict is not None:
        raise XnnquantError("rotation= computes new weights from the module's: a streaming export (state_dict=) "
                            "does not hold them in memory; export with the weights in memory")
    if static is not None:
        raise XnnquantError("rotation= goes with dynamic activations (int4 and int8 weights), not activations='qint8'")
    return rotation.strip().lower()


def _names_a_dim(spec: Any) -> bool:
    """True when torch.export's ``dynamic_shapes`` spec (nested dicts, tuples and lists, with
    None for a static input or dim) holds anything else than None: a Dim, or one of torch's
    markers (``Dim.AUTO``)."""
    if isinstance(spec, dict):
        return any(_names_a_dim(v) for v in spec.values())
    if isinstance(spec, (list, tuple)):
        return any(_names_a_dim(v) for v in spec)
    return spec is not None


def _check_static_int8(policy: WeightPolicy, method: str, calibration: Any, calibration_mask: Any,
                       state_dict: Any, dynamic_shapes: Any, tables: EmbeddingScheme | None) -> None:
    """What ``activations="qint8"`` needs of the other options."""
    from .weights import SchemeKind

    if policy.weights.kind is not SchemeKind.QC8W:
        raise XnnquantError(f"activations='qint8' computes every layer in int8 with per-channel int8 filters: "
                            f"weights must be 'qc8w', got {str(policy.weights)!r}")
    if method in ACTIVATION_AWARE_METHODS:
        raise XnnquantError(f"activations='qint8' chooses its filters' scales with 'minmax' or 'mse': got method "
                            f"{method!r}")
    if calibration is None:
        raise XnnquantError("activations='qint8' fixes every activation's scale and zero point at export: pass "
                            "calibration= (an iterable of input tuples, e.g. 16 or more batches)")
    if state_dict is not None:
        raise XnnquantError("activations='qint8' needs the module's weights in memory to calibrate: a streaming "
                            "export (state_dict=) cannot")
    if dynamic_shapes is not None:
        raise XnnquantError("activations='qint8' calibrates the graph at the example inputs' shapes: dynamic_shapes= "
                            "is not supported with it (export one program per shape)")
    if calibration_mask is not None:
        raise XnnquantError("activations='qint8' calibrates every activation on every row of its batches: "
                            "calibration_mask= is not supported with it (calibrate on unpadded batches)")
    if tables is not None:
        raise XnnquantError(f"activations='qint8' keeps the whole program in one XNNPACK graph and "
                            f"embeddings={str(tables)!r} puts the tables on ExecuTorch's quantized embedding kernels: "
                            "expected embeddings=None with activations='qint8'")


