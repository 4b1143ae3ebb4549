"""``xq.export``: a ``torch.nn.Module`` (or a saved ``torch.export`` program) to one XNNPACK graph.

Stages, each timed in ``Exported.timings`` (seconds):

==============  ===============================================================
``export``      ``torch.export.export(module, example_inputs, strict=False)``
``decompose``   ``run_decompositions`` to core ATen, keeping the ops that have a
                lowering of their own (``linear``, ``layer_norm``, ``gelu``, ...);
                skipped when every op already has one (``needs_decomposition``)
``calibrate``   running the module on ``calibration`` batches (when given); for an
                activation-aware method, sequentially, quantizing each linear on
                the way (``calibration.sequential_statistics``)
``lower``       lowering node by node, quantizing each weight on the way
``write``       the payload bytes (``Graph.to_bytes``)
==============  ===============================================================

torch is imported here, on first use; ``import xnnquant`` does not import it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import XnnquantError, missing_extra
from ..graph import Target
from ..schemes import checks
from .exported import Exported
from .options import WeightScheme

#: The op family modules; importing them fills ``registry.LOWERINGS``.
FAMILIES = ("linear", "conv", "pooling", "elementwise", "activations", "normalization", "shape")


def load_lowerings() -> dict[Any, Any]:
    """Import every op family module and return the registry they filled."""
    import importlib

    for family in FAMILIES:
        importlib.import_module(f"{__package__}.{family}")
    from .registry import LOWERINGS

    return LOWERINGS


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise missing_extra("torch", "torch", "exporting a torch module") from None
    return torch


def decomposition_table() -> dict[Any, Any]:
    """torch.export's default decompositions, minus every op lowered as it is."""
    torch = _torch()
    table = dict(torch.export.default_decompositions())
    for op in load_lowerings():
        table.pop(op, None)
    return table


def parse_fallback(fallback: Any) -> tuple[WeightScheme, ...]:
    """``fallback=`` as schemes to try in order: None, one scheme, a sequence of them, or a
    comma-separated string (``"qc8w,fp32"``)."""
    if fallback is None:
        return ()
    items = fallback.split(",") if isinstance(fallback, str) else \
        [fallback] if isinstance(fallback, WeightScheme) else list(fallback)
    return tuple(WeightScheme.parse(item, "fallback") for item in items)


def needs_decomposition(program: Any) -> bool:
    """True when some node's op has no lowering of its own.

    Decomposing with ``decomposition_table()`` rewrites exactly those ops (and
    functionalizes in-place ones, which have no lowering either); when every op is
    lowered as it is, it would return the same graph, and skipping it saves seconds.
    """
    import operator

    lowerings = load_lowerings()
    return any(node.op == "call_function" and node.target is not operator.getitem and node.target not in lowerings
               for node in program.graph.nodes)


def _check_module(torch: Any, module: Any) -> None:
    if not isinstance(module, torch.nn.Module):
        raise XnnquantError(f"module must be a torch.nn.Module or an ExportedProgram: got {type(module).__name__}")
    if module.training:
        raise XnnquantError(
            f"{type(module).__name__} is in training mode: call module.eval() before exporting (batch norm and "
            "dropout compute differently in training)")
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in items:
            if tensor.dtype.is_floating_point and tensor.dtype != torch.float32:
                raise XnnquantError(
                    f"{kind} {name!r} is {tensor.dtype}: xnnquant exports float32 modules (call module.float())")
            if kind == "parameter" and not tensor.dtype.is_floating_point:
                raise XnnquantError(f"parameter {name!r} is {tensor.dtype}: expected a float32 module")


def _check_inputs(torch: Any, example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise XnnquantError(
            f"example_inputs must be a tuple of tensors, the module's positional inputs: got "
            f"{type(example_inputs).__name__}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise XnnquantError(f"example_inputs[{i}] must be a torch.Tensor: got {type(x).__name__}")
        if x.dtype != torch.float32:
            raise XnnquantError(
                f"example_inputs[{i}] is {x.dtype}: XNNPACK's external values are float32 here; pass float32 "
                "inputs (cast masks and ids-derived tensors to float in the module's caller)")
    return tuple(example_inputs)


def _progress(enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None

    def bar(items: Iterator[Any], total: int) -> Iterator[Any]:
        return iter(tqdm(items, total=total, desc=desc, unit="node", leave=False))

    return bar


def _linear_quantizer(scheme: WeightScheme, fallback: tuple[WeightScheme, ...], method: str) -> Any:
    """What sequential calibration quantizes a linear with: the scheme the lowering will
    give it (None for a float or refused layer)."""
    from .quantize import linear_scheme, quantize_weight

    def quantize(path: str, weight: Any, calibration: Any) -> Any:
        chosen = linear_scheme(scheme, fallback, weight.shape[1])
        if chosen is None or not chosen.is_quantized:
            return None
        return quantize_weight(weight, chosen, method, calibration)

    return quantize


def export(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", method: str = "mse",
           calibration: Iterable[Any] | None = None, fallback: Any = None, progress: bool = True,
           target: Any = "1.4.1", state_dict: str | os.PathLike[str] | None = None) -> Exported:
    """Lower ``module`` to one XNNPACK graph with ``weights`` for its linear and convolution layers.

    ``module``: a ``torch.nn.Module`` in eval mode with float32 parameters, or a
    ``torch.export.ExportedProgram`` (e.g. from ``torch.export.load``).  ``example_inputs``:
    a tuple of float32 tensors (static shapes), the module's positional inputs.
    ``weights``: ``"fp32"``, ``"qc8w"``, ``"qc4w"`` or ``"qb4w:G"`` (see ``options``).
    ``method``: how scales are chosen (``"minmax"``, ``"mse"``, or an activation-aware method).
    ``calibration``: an iterable of input tuples the module is run on; the inputs of
    every linear are kept as statistics (``calibration.py``): the activation-aware methods
    take them, each linear calibrated on what the already-quantized linears before it
    produce (sequential calibration; the batches are kept in a list and run once per
    stage), and with ``minmax`` / ``mse`` the quantized linears that read a layer norm are
    equalized (per-channel scales moved from their input to their weight).
    ``fallback``: the scheme (or schemes, tried in order) for layers that cannot take
    ``weights``; such layers are refused otherwise, and the report names every fallback.
    ``target``: ``"1.4.1"`` (default; uses XNNGelu, XNNTanh, ...) or ``"xn01"`` (the XN01
    schema's node kinds only; ``"seed"`` is the same).
    ``state_dict``: a safetensors file holding the module's parameters and buffers, for a
    module built on the ``meta`` device (example inputs on ``meta`` too): a streaming
    export (``streaming.py``).  Layer weights are then read and quantized only when the
    result is written (``Exported.save``, one weight at a time), so neither the float
    model nor the payload is ever whole in memory; the bytes are those of the same module
    exported with its weights in memory.  Needs target 1.4.1; no calibration.

    Raises ``UnsupportedConfigError`` listing every operator and layer that cannot be
    lowered, each with its module path; ``XnnquantError`` for bad arguments.
    """
    scheme = WeightScheme.parse(weights)
    fallback_schemes = parse_fallback(fallback)
    chosen_target = Target.parse(target)
    chosen_method = checks.check_method(method)
    aware = getattr(checks, "ACTIVATION_AWARE_METHODS", ())
    if chosen_method in aware and calibration is None and scheme.is_quantized:
        raise XnnquantError(f"method {chosen_method!r} chooses scales from activations: pass calibration= "
                            "(an iterable of input tuples)")
    if calibration is not None and not scheme.is_quantized:
        raise XnnquantError("calibration= has no use with fp32 weights: it calibrates quantized layers")
    weight_file = None
    if state_dict is not None:
        if chosen_target is not Target.ET_1_4_1:
            raise XnnquantError(f"a streaming export (state_dict=) writes its scales as constant data, which "
                                f"ExecuTorch 1.4.1 reads: got target {str(chosen_target)!r}, expected '1.4.1'")
        if calibration is not None:
            raise XnnquantError("a streaming export (state_dict=) cannot calibrate: the module on the meta "
                                "device cannot run; calibrate on the module with its weights instead")
        from .streaming import WeightFile

        weight_file = WeightFile(state_dict)
    torch = _torch()
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if isinstance(module, torch.export.ExportedProgram):
        program = module
    else:
        _check_module(torch, module)
        inputs = _check_inputs(torch, example_inputs)
        try:
            program = torch.export.export(module, inputs, strict=False)
        except Exception as exc:  # torch's tracing errors come in many types; say where they came from
            raise XnnquantError(f"torch.export.export failed on {type(module).__name__}: "
                                f"{type(exc).__name__}: {exc}") from exc
    timings["export"] = time.perf_counter() - start
    start = time.perf_counter()
    if needs_decomposition(program):
        program = program.run_decompositions(decomposition_table())
    timings["decompose"] = time.perf_counter() - start
    statistics = None
    if calibration is not None:
        from . import calibration as calibrating

        start = time.perf_counter()
        if chosen_method in aware:
            statistics = calibrating.sequential_statistics(
                module, calibration, _linear_quantizer(scheme, fallback_schemes, chosen_method))
        else:
            statistics = calibrating.linear_statistics(module, calibration)
        timings["calibrate"] = time.perf_counter() - start
    from .lowering import Lowerer

    start = time.perf_counter()
    lowerer = Lowerer(program, weights=scheme, fallback=fallback_schemes, method=chosen_method, target=chosen_target,
                      statistics=statistics, progress=_progress(progress, f"export {scheme}"), weight_file=weight_file)
    graph = lowerer.run()
    timings["lower"] = time.perf_counter() - start
    exported = Exported(graph, lowerer.rows, scheme, chosen_method, chosen_target, lowerer.input_specs,
                        lowerer.output_specs, timings, lowerer.sources)
    if weight_file is None:  # a streaming export writes (and quantizes) when saved
        start = time.perf_counter()
        exported.to_bytes()
        timings["write"] = time.perf_counter() - start
    return exported

