"""Stage ``calibrate`` (dynamic activations): the statistics of every linear and convolution input.

Takes the module (None for a saved program), the ``AtenProgram`` after the passes before
calibration (``passes.py``), the decomposition tables (``decompose.py``) and the options; gives
the layers' calibration statistics (``calibration.statistics``), or None without
``calibration=`` and for static int8, which calibrates its lowered graph instead
(``quantize.py``).  For an activation-aware method, each layer is quantized on the way.
"""

from __future__ import annotations

from typing import Any

from ..options import ExportOptions
from ..report import stage


def layer_statistics(module: Any, program: Any, decompositions: tuple[dict[Any, Any], ...], options: ExportOptions,
                     timings: dict[str, float], exported: Any = None) -> Any:
    """Calibration statistics of the layers (None without ``calibration=``), from the batches
    run through ``program`` (after the passes before calibration) or, when their shapes
    differ from the example's, through the module itself (``eager.statistics``: the same
    statistics, without tracing) or, where it cannot stand in for the program, through the
    module traced on them and decomposed as ``program`` was (``decompositions``)."""
    if options.calibration is None or options.static_int8 is not None:
        return None  # static int8 calibrates the lowered graph itself (static_int8.calibrate)
    from .. import eager
    from ..calibration import statistics

    with stage("calibrate", timings):
        if not options.calibration.fits(program) and options.rotation is None:  # else traced again: run it
            found = eager.statistics(module, program, options.calibration, options.policy, options.method)
            if found is not None:
                return found
        programs = options.calibration.programs_for(module, program, decompositions, exported)
        return statistics(programs, options.calibration, options.policy, options.method)
