"""``xq.export`` and ``xq.check``: a ``torch.nn.Module`` (or a saved ``torch.export`` program)
to one XNNPACK graph, or a report of what that would do.

Stages, each timed in ``Exported.timings`` (seconds):

==============  ===============================================================
``export``      ``torch.export.export(module, example_inputs, strict=False)``
``decompose``   ``run_decompositions`` to core ATen, keeping the ops that have a
                lowering of their own (``linear``, ``layer_norm``, ``gelu``, ...);
                skipped when every op already has one (``needs_decomposition``)
``calibrate``   running the module on ``calibration`` batches (when given); for an
                activation-aware method, sequentially, quantizing each linear on
                the way (``calibration.sequential_statistics``); for static int8,
                running the float graph on the real XNNPACK (``static_int8``)
``passes``      the rewrites before lowering (``passes/``)
``lower``       lowering node by node, quantizing each weight on the way
``quantize``    static int8 only: the float graph rewritten into int8, biases
                corrected (``static_int8``)
``write``       the payload bytes (``Graph.to_bytes``)
``check``       the self-check: the graph against the module (``selfcheck.py``)
==============  ===============================================================

torch is imported here, on first use; ``import xnnquant`` does not import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import XnnquantError, missing_extra
from .exported import Exported
from .options import ExportOptions, StaticInt8, check_batches_fit
from .report import stage


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise missing_extra("torch", "torch", "exporting a torch module") from None
    return torch


def decomposition_table() -> dict[Any, Any]:
    """torch.export's default decompositions, minus every op lowered or removed as it is."""
    from .lowering import load_lowerings
    from .passes import HANDLED, load_passes

    torch = _torch()
    table = dict(torch.export.default_decompositions())
    load_passes()
    for op in (*load_lowerings(), *HANDLED):
        table.pop(op, None)
    return table


def needs_decomposition(program: Any) -> bool:
    """True when some node's op has no lowering of its own and no pass removes it.

    Decomposing with ``decomposition_table()`` rewrites exactly those ops (and
    functionalizes in-place ones, which have no lowering either); when every op is
    handled as it is, it would return the same graph, and skipping it saves seconds.
    """
    import operator

    from .lowering import load_lowerings
    from .passes import HANDLED, load_passes

    lowerings = load_lowerings()
    load_passes()
    return any(node.op == "call_function" and node.target is not operator.getitem and node.target not in lowerings
               and node.target not in HANDLED for node in program.graph.nodes)


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
            real = tensor.dtype.is_floating_point and tensor.device.type != "meta"
            if real and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).nonzero()[0].tolist()[0]) if tensor.dim() else 0
                raise XnnquantError(f"{kind} {name!r} is not finite (NaN or inf, first at flat index {bad}): a program "
                                    "computed from it would be too; expected finite values")


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
        if x.numel() == 0:
            raise XnnquantError(f"example_inputs[{i}] has no elements (shape {tuple(x.shape)}): XNNPACK cannot run "
                                "a value of size 0; expected every dim >= 1")
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


def _traced(module: Any, example_inputs: Any, options: ExportOptions, timings: dict[str, float]) -> tuple[Any, Any]:
    """(the module or None for a saved program, its decomposed ``ExportedProgram``)."""
    torch = _torch()
    with stage("export", timings):
        if isinstance(module, torch.export.ExportedProgram):
            if options.calibration is not None:
                raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
            program, eager = module, None
        else:
            _check_module(torch, module)
            inputs = _check_inputs(torch, example_inputs)
            if options.calibration is not None:
                check_batches_fit(options.calibration, inputs)
            try:
                program = torch.export.export(module, inputs, dynamic_shapes=options.dynamic_shapes, strict=False)
            except Exception as exc:  # torch's tracing errors come in many types; say where they came from
                what = " with these dynamic_shapes" if options.dynamic_shapes is not None else ""
                raise XnnquantError(f"torch.export.export failed on {type(module).__name__}{what}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            eager = module
    with stage("decompose", timings):
        if needs_decomposition(program):
            program = program.run_decompositions(decomposition_table())
    return eager, program


def _statistics(module: Any, options: ExportOptions, timings: dict[str, float]) -> Any:
    """Calibration statistics of the linears (None without ``calibration=``)."""
    if options.calibration is None or options.static_int8 is not None:
        return None  # static int8 calibrates the lowered graph itself (static_int8.calibrate)
    from ..schemes.checks import ACTIVATION_AWARE_METHODS
    from . import calibration as calibrating

    policy, method = options.policy, options.method
    with stage("calibrate", timings):
        if method not in ACTIVATION_AWARE_METHODS:
            return calibrating.linear_statistics(module, options.calibration)

        from .weights import Layer, LayerKind

        def quantize(path: str, weight: Any, calibration: Any) -> Any:
            choice = policy.choose(Layer(LayerKind.LINEAR, int(weight.shape[1])))
            if isinstance(choice, str) or not choice.scheme.is_quantized:
                return None
            return choice.scheme.quantize(weight, method, calibration)

        return calibrating.sequential_statistics(module, options.calibration, quantize)


def export(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", method: str = "mse",
           calibration: Iterable[Any] | None = None, fallback: Any = "auto", activations: str = "dynamic",
           progress: bool = True, target: Any = "1.4.1", state_dict: str | os.PathLike[str] | None = None,
           check: bool = True, dynamic_shapes: Any = None) -> Exported:
    """Lower ``module`` to one XNNPACK graph with ``weights`` for its linear and convolution layers.

    ``module``: a ``torch.nn.Module`` in eval mode with float32 parameters, or a
    ``torch.export.ExportedProgram`` (e.g. from ``torch.export.load``).  ``example_inputs``:
    a tuple of float32 tensors (static shapes), the module's positional inputs.
    ``weights``: ``"fp32"``, ``"qc8w"``, ``"qc4w"`` or ``"qb4w:G"`` (see ``weights.py``).
    ``method``: how scales are chosen (``"minmax"``, ``"mse"``, or an activation-aware method).
    ``calibration``: an iterable of input tuples the module is run on; the inputs of
    every linear are kept as statistics (``calibration.py``): the activation-aware methods
    take them, each linear calibrated on what the already-quantized linears before it
    produce (sequential calibration), and with ``minmax`` / ``mse`` the quantized linears
    that read a layer norm are equalized (per-channel scales moved from their input to
    their weight).
    ``fallback``: what a layer that cannot take ``weights`` gets: ``"auto"`` (default: the
    most compact scheme XNNPACK computes right for it), None (refuse it), or the scheme(s)
    to try in order; the report names every fallback and its reason.
    ``activations``: ``"dynamic"`` (int8 per token, quantized at run time), or ``"qint8"``
    (full-integer static int8, with ``weights="qc8w"`` and ``calibration=``: every activation
    gets one scale and zero point chosen from the calibration batches, every node XNNPACK
    computes in int8 runs in int8, converts stand only at the graph's edges and around the
    nodes that have no int8 form, each listed in ``Exported.boundaries`` with its reason;
    ``xq.StaticInt8(ranges=..., equalize=..., bias_correction=...)`` spells out the
    choices, see ``static_int8``).
    ``target``: ``"1.4.1"`` (default; uses XNNGelu, XNNTanh, ...) or ``"xn01"`` (the XN01
    schema's node kinds only; ``"seed"`` is the same).
    ``state_dict``: a safetensors file holding the module's parameters and buffers, for a
    module built on the ``meta`` device (example inputs on ``meta`` too): a streaming
    export (``streaming.py``).  Layer weights are then read and quantized only when the
    result is written (``Exported.save``, one weight at a time), so neither the float
    model nor the payload is ever whole in memory; the bytes are those of the same module
    exported with its weights in memory.  Needs target 1.4.1; no calibration.  The
    module's own parameters must then all be on the meta device.
    ``dynamic_shapes``: torch.export's own spec (``{1: torch.export.Dim("seq", max=512)}`` per
    input): the program then takes every size in each dim's range, its memory planned at
    the upper bound (every dynamic dim needs a max).  Ops whose result XNNPACK cannot
    recompute at other sizes (a reshape to two dynamic dims, a slice from the end of a
    dynamic dim, a mean over one) are refused naming the dim.
    ``check``: compare the lowered graph with the module on the example inputs before
    returning (``selfcheck.py``); a mismatch raises ``SelfCheckError`` naming the first
    diverging node.  A streaming export cannot run its module and skips it (the report
    says so).

    Raises ``UnsupportedConfigError`` listing every operator and layer that cannot be
    lowered, each with its module path; ``XnnquantError`` for bad arguments.
    """
    options = ExportOptions.parse(weights=weights, method=method, calibration=calibration, fallback=fallback,
                                  activations=activations, target=target, state_dict=state_dict, check=check,
                                  progress=progress, dynamic_shapes=dynamic_shapes)
    weight_file = None
    if options.state_dict is not None:
        from .streaming import WeightFile

        weight_file = WeightFile(options.state_dict)
    timings: dict[str, float] = {}
    eager, traced = _traced(module, example_inputs, options, timings)
    if weight_file is not None and eager is not None:
        _check_streamed(eager)
    statistics = _statistics(eager, options, timings)
    from .lowering.context import WeightOptions
    from .lowering.walk import lower
    from .passes import run_passes
    from .program import AtenProgram

    static = options.static_int8
    with stage("passes", timings):
        program = AtenProgram.of(traced, weight_file)
        program.name_dims(options.dynamic_shapes, eager)
        run_passes(program, _PassOptions(statistics))
    policy = options.policy if static is None else _float_policy()
    with stage("lower", timings):
        lowered = lower(program, options.target, WeightOptions(policy, options.method, statistics),
                        _progress(options.progress, f"export {options.policy.weights}"))
    int8 = None
    if static is not None:
        assert options.calibration is not None  # ExportOptions.parse requires it
        result = _static_int8(lowered, options.calibration, static, options.method, timings)
        int8 = result.int8
        exported = Exported(int8.graph, int8.rows, options.policy.weights, options.method, options.target,
                            lowered.inputs, lowered.outputs, timings, lowered.sources,
                            activations=str(static), boundaries=[str(b) for b in int8.boundaries])
        exported.static_int8 = result
    else:
        exported = Exported(lowered.graph, lowered.rows, options.policy.weights, options.method, options.target,
                            lowered.inputs, lowered.outputs, timings, lowered.sources)
    if weight_file is None:  # a streaming export writes (and quantizes) when saved
        with stage("write", timings):
            exported.to_bytes()
    if not options.check:
        exported.self_check = "skipped (check=False)"
    elif weight_file is not None or eager is None:
        exported.self_check = ("skipped: a streaming export's weights are not in memory" if weight_file is not None
                               else "skipped: a saved program has no module to compare with")
    else:
        from .selfcheck import self_check
        from .static_int8.observe import one_torch_thread

        with stage("check", timings), one_torch_thread():  # numpy's BLAS threads need the cores torch's spin on
            exported.self_check = self_check(eager, example_inputs, traced, program, lowered, int8)
    return exported


def _float_policy() -> Any:
    """Static int8 lowers every layer in fp32 first; its rewrite quantizes them (``static_int8``)."""
    from .weights import WeightPolicy

    return WeightPolicy("fp32", None)


def _static_int8(lowered: Any, calibration: Any, static: StaticInt8, method: str, timings: dict[str, float]) -> Any:
    """The float graph ``lowered`` as a static int8 graph (``static_int8``); stages ``calibrate`` and
    ``quantize``."""
    from . import static_int8

    batches = static_int8.graph_batches(calibration, lowered.inputs)
    with stage("calibrate", timings):
        seen = static_int8.calibrate(lowered.graph, batches, lowered.sources, lowered.inputs)
    with stage("quantize", timings):
        result = static_int8.quantize(lowered.graph, lowered.sources, lowered.rows, lowered.filters, seen,
                                      ranges=static.ranges, percentile=static.percentile, method=method,
                                      bias_correction=static.bias_correction, equalize=static.equalize)
    return result


class _PassOptions:
    """What the passes read of an export's options."""

    def __init__(self, statistics: Any) -> None:
        self.statistics = statistics


def _check_streamed(module: Any) -> None:
    """A streaming export's module holds no data of its own: every parameter is on ``meta``."""
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if tensor.device.type != "meta":
            raise XnnquantError(
                f"state_dict= reads the module's tensors from the file, but {name!r} holds data of its own (on "
                f"{tensor.device.type}): build the module on the meta device (with torch.device('meta'): ...), or "
                "export it without state_dict=")


def check(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", fallback: Any = "auto",
          target: Any = "1.4.1", dynamic_shapes: Any = None) -> CheckReport:
    """What ``xq.export`` would do with ``module``, without quantizing or writing anything.

    The module is traced and rewritten as ``export`` does; then each node is asked of its
    lowering (the registration's ``check``, then the lowering itself on stand-in filters)
    and each layer of the weight policy.  Returns a ``CheckReport``: the ops that would be
    lowered, every refusal with its reason and module path, and every layer's scheme with
    the reason when it falls back.  Arguments as for ``export``.
    """
    options = ExportOptions.parse(weights=weights, fallback=fallback, target=target, check=False, progress=False,
                                  dynamic_shapes=dynamic_shapes)
    timings: dict[str, float] = {}
    _, traced = _traced(module, example_inputs, options, timings)
    from .lowering.context import WeightOptions
    from .lowering.walk import lower
    from .passes import run_passes
    from .program import AtenProgram

    program = AtenProgram.of(traced)
    program.name_dims(options.dynamic_shapes, module)
    run_passes(program, _PassOptions(None))
    lowered = lower(program, options.target, WeightOptions(options.policy, dry_run=True), raise_refusals=False)
    return CheckReport(lowered.lowered_ops, lowered.refusals, lowered.rows)


class CheckReport:
    """What ``xq.check`` found: ``lowered`` (the ATen ops lowered, one per node), ``refused``
    (one line per node or layer that cannot be, with its reason and module path) and
    ``weights`` (one ``ReportRow`` per layer: its scheme and fallback reason; no SQNR, nothing
    was quantized)."""

    def __init__(self, lowered: list[str], refused: list[str], weights: list[Any]) -> None:
        self.lowered, self.refused, self.weights = lowered, refused, weights

    @property
    def ok(self) -> bool:
        """True when ``xq.export`` would lower everything."""
        return not self.refused

    def __str__(self) -> str:
        from collections import Counter

        ops = Counter(self.lowered)
        lines = [f"xnnquant check: {len(self.lowered)} nodes lowered onto XNNPACK ("
                 + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) + f"); {len(self.refused)} refused"]
        lines += [f"  refused: {r}" for r in self.refused]
        for row in self.weights:
            why = f" ({row.fallback})" if row.fallback else ""
            lines.append(f"  layer {row.path or '<top level>'}: {row.scheme}{why}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CheckReport({len(self.lowered)} lowered, {len(self.refused)} refused, {len(self.weights)} layers)"
