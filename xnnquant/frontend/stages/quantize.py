"""Stage ``quantize`` (static int8): the float graph rewritten into a full-integer int8 graph.

Takes the one float graph of a pure program (``lower.py`` lowered every layer in fp32:
``float_policy``), the options (the ``StaticInt8`` choices, the calibration batches); gives
the ``Exported`` of the int8 graph, whose ``static_int8`` is what the rewrite made
(``static_int8.StaticResult``).  Two timed stages: ``calibrate`` (the float graph run on the
real XNNPACK over the calibration batches) and ``quantize`` (the rewrite, bias correction and
the measurement of the finished graph); ``frontend/static_int8/`` does the work.
"""

from __future__ import annotations

from typing import Any

from ..exported import Exported
from ..options import ExportOptions
from ..report import stage


def float_policy() -> Any:
    """Static int8 lowers every layer in fp32 first; its rewrite quantizes them (``static_int8``)."""
    from ..weights import WeightPolicy

    return WeightPolicy("fp32", None)


def quantized(lowered: Any, options: ExportOptions, timings: dict[str, float]) -> Exported:
    """The ``Exported`` of the float graph ``lowered`` (``lowering.walk.Lowered``) rewritten into
    static int8 as ``options.static_int8`` asks."""
    from .. import static_int8

    static = options.static_int8
    assert static is not None and options.calibration is not None  # ExportOptions.parse requires it
    batches, labels = static_int8.graph_batches(options.calibration.batches, lowered.inputs)
    with stage("calibrate", timings):
        seen = static_int8.calibrate(lowered.graph, batches, lowered.sources, lowered.inputs, labels=labels)
    with stage("quantize", timings):
        result = static_int8.quantize(lowered.graph, lowered.sources, lowered.rows, lowered.filters, seen,
                                      ranges=static.ranges, percentile=static.percentile, method=options.method,
                                      bias_correction=static.bias_correction, equalize=static.equalize,
                                      budget=static.budget, rounding=static.rounding, cpu=static.cpu)
    int8 = result.int8
    exported = Exported(int8.graph, int8.rows, options.policy.weights, options.method, options.target,
                        lowered.inputs, lowered.outputs, timings, lowered.sources,
                        activations=str(static), boundaries=[str(b) for b in int8.boundaries])
    exported.static_int8 = result
    return exported
