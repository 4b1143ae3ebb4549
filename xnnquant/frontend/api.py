"""``xq.export`` and ``xq.check``: a ``torch.nn.Module`` (or a saved ``torch.export`` program)
to one XNNPACK graph, or a report of what that would do.

Stages, each timed in ``Exported.timings`` (seconds):

==============  ===============================================================
``export``      ``torch.export.export(module, example_inputs, strict=False)``
``decompose``   ``run_decompositions`` to core ATen, keeping the ops that have a
                lowering of their own (``linear``, ``layer_norm``, ``gelu``, ...);
                skipped when every op already has one (``needs_decomposition``)
``passes``      the rewrites before lowering (``passes/``), in two parts around
                ``calibrate``
``calibrate``   running the program (after the passes before calibration) on the
                ``calibration`` batches, node by node (when given); for an
                activation-aware method, quantizing each layer on the way
                (``calibration.statistics``); when the batches' shapes differ
                from the example's, the module runs them itself where it can
                stand in for the program (``eager.statistics``), else it is
                traced again at their shapes
                (``batches.CalibrationData.programs_for``)
``validate``    the program after the passes run by torch on the example inputs
                (``selfcheck.evaluate``): a node that cannot compute on them (an
                int64 input read by a float linear) is refused before lowering,
                whatever ``check=``; the self-check reuses the outputs
``lower``       lowering node by node, quantizing each weight on the way
``calibrate``   static int8 only: the float graph run on the real XNNPACK on the
                ``calibration`` batches (``static_int8``)
``quantize``    static int8 only: the float graph rewritten into int8, biases
                corrected (``static_int8``)
``write``       the payload bytes (``Graph.to_bytes``)
``check``       the self-check: the graph against the module (``selfcheck.py``)
==============  ===============================================================

torch is imported here, on first use; ``import xnnquant`` does not import it.
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import XnnquantError, missing_extra, warn_caller
from .caller import buffers_kept, mutated_inputs, refuse_parameter_writes
from .exported import Exported
from .options import ExportOptions, StaticInt8
from .prequantized import dequantized_for_export
from .program import AtenProgram
from .report import ReportRow, stage

if TYPE_CHECKING:
    from ..pte.planned import MemoryCheck


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise missing_extra("torch", "torch", "exporting a torch module") from None
    return torch


def decomposition_table() -> dict[Any, Any]:
    """torch.export's default decompositions, minus every op lowered or removed as it is (a
    new dict each call, of a table made once: making it took 20 to 70 ms)."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict[Any, Any]:
    from .lowering import load_lowerings
    from .passes import HANDLED, load_passes

    torch = _torch()
    table = dict(torch.export.default_decompositions())
    load_passes()
    for op in (*load_lowerings(), *HANDLED):
        if str(op) not in DECOMPOSED_WHEN_REFUSED:
            table.pop(op, None)
    return table


#: Lowered ops whose decomposition still makes the nodes their lowering refuses runnable
#: (``F.pad`` with ``mode="reflect"`` becomes gathers): left in the table, so that such a
#: node is decomposed, as is every node of the op whenever the program is decomposed.
DECOMPOSED_WHEN_REFUSED = frozenset({"aten.pad.default"})


@functools.cache
def _core_decompositions() -> dict[Any, Any]:
    """torch's core ATen decompositions (into core ATen ops, never into prims), made once;
    read, never changed."""
    return dict(_torch()._decomp.core_aten_decompositions())


def needs_decomposition(program: Any) -> bool:
    """True when some node's op has no lowering of its own (or one that refuses the node), no
    pass removes it, and it is not left to ExecuTorch's portable kernels as it is.

    Decomposing with ``decomposition_table()`` rewrites exactly those ops (and
    functionalizes in-place ones, which have no lowering either); when every op is
    handled as it is, it would return the same graph, and skipping it saves seconds.  An op
    on values other than float32 (token ids, masks, positions) that the portable kernels
    run is left as it is: XNNPACK could not run its pieces either.
    """
    import operator

    from .functional import buffer_updates, fresh, is_grad_wrapper, out_of_place
    from .lowering import load_lowerings
    from .passes import HANDLED, load_passes
    from .passes.masks import rescued
    from .passes.partition import is_size, portable_refusal

    lowerings = load_lowerings()
    load_passes()
    updates = set(buffer_updates(program) or ())
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node.target in HANDLED \
                or is_size(node) or is_grad_wrapper(node) or rescued(node):
            continue
        op = node.target
        if node in updates:
            if not fresh(node.args[0]):
                continue  # a buffer update, which AtenProgram.of makes functional
            op = out_of_place(op)  # an in-place op on an intermediate: lowered as its out-of-place op
        lowering = lowerings.get(op)
        if lowering is not None and (lowering.check is None or lowering.check(node) is None or
                                     portable_refusal(node) is None):
            continue  # lowered, or refused and left to the portable kernels (a training-mode batch norm is not)
        values = [node, *node.all_input_nodes]
        if any(_dtype(v) not in ("float32", "") for v in values) and portable_refusal(node) is None:
            continue
        if op not in _decomposition_table() and portable_refusal(node) is None:
            continue  # no decomposition would change it (ExecuTorch's llama:: kernels), and it runs as it is
        return True
    return False


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


#: dtypes a program input may have (float32 ones may feed XNNPACK directly; the others go
#: through ExecuTorch's portable kernels first).
INPUT_DTYPES = ("float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _check_inputs(torch: Any, example_inputs: Any) -> tuple[Any, ...]:
    """``example_inputs`` as a tuple of dense tensors of ``INPUT_DTYPES``, on the CPU or on
    ``meta`` (a module built on meta traces there; what needs values says so later)."""
    from ..arrays import check_plain_tensor

    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise XnnquantError(
            f"example_inputs must be a tuple of tensors, the module's positional inputs: got "
            f"{type(example_inputs).__name__}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise XnnquantError(f"example_inputs[{i}] must be a torch.Tensor: got {type(x).__name__}")
        check_plain_tensor(x, f"example_inputs[{i}]", meta=True)
        if str(x.dtype).removeprefix("torch.") not in INPUT_DTYPES:
            raise XnnquantError(f"example_inputs[{i}] is {x.dtype}: expected one of {', '.join(INPUT_DTYPES)}")
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


def _traced(module: Any, example_inputs: Any, options: ExportOptions,
            timings: dict[str, float]) -> tuple[Any, Any, tuple[dict[Any, Any], ...]]:
    """(the module or None for a saved program, its decomposed ``ExportedProgram``, the
    decomposition tables applied: ``_decomposed``)."""
    torch = _torch()
    with stage("export", timings):
        if isinstance(module, torch.export.ExportedProgram):
            if example_inputs is not None:
                raise XnnquantError("example_inputs= goes with a torch.nn.Module: a saved program (ExportedProgram) "
                                    "carries its own example inputs; pass none")
            if options.calibration is not None:
                raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
            program, eager = module, None
        else:
            from .evaluation import torch_threads

            with torch_threads(1):  # one small op a parameter: threads would only wait for each other
                _check_module(torch, module)
            inputs = _check_inputs(torch, example_inputs)
            if options.state_dict is not None:  # shapes and dtypes only: traced with the meta parameters
                inputs = tuple(x.to("meta") for x in inputs)
            if options.calibration is not None:
                options.calibration.check_fits(inputs)
            spec = options.dynamic_shapes
            if isinstance(spec, (list, tuple)) and len(spec) == len(inputs) and _takes_varargs(module):
                from .batches import by_signature

                spec = by_signature(module, list(spec))  # one spec per input, as the docstring says
            from .batches import without_stack_traces

            try:
                with without_stack_traces():  # nothing reads them: a third of the trace's time
                    program = torch.export.export(module, inputs, dynamic_shapes=spec, strict=False)
            except XnnquantError:  # the module's own refusal (xnnquant.llm's attention), as it is
                raise
            except Exception as exc:  # torch's tracing errors come in many types; say where they came from
                what = " with these dynamic_shapes" if options.dynamic_shapes is not None else ""
                raise XnnquantError(f"torch.export.export failed on {type(module).__name__}{what}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            eager = module
    with stage("decompose", timings):
        program, tables = _decomposed(program, options.strict)
    return eager, program, tables


def _takes_varargs(module: Any) -> bool:
    """True when ``module.forward`` takes ``*args``."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def _decomposed(program: Any, strict: bool) -> tuple[Any, tuple[dict[Any, Any], ...]]:
    """``program`` after the ``decompose`` stage, and the decomposition tables it applied in
    order (the calibration programs traced at other shapes apply the same ones:
    ``batches.CalibrationData.programs_for``)."""
    tables = []
    table = decomposition_table()
    extra = {op: fn for op, fn in _unrunnable(program, strict).items() if op not in table}
    if needs_decomposition(program) or extra or _mutates(program):
        tables.append({**extra, **table})
        program = program.run_decompositions(tables[-1])
    for _ in range(2):  # a decomposition may give ops that need one too
        extra = _unrunnable(program, strict)
        if not extra:
            break
        tables.append(extra)
        program = program.run_decompositions(extra)
    return program, tuple(tables)


def _mutates(program: Any) -> bool:
    """True when a node writes into one of its arguments in a way only torch's decomposition
    makes functional; the in-place updates of buffers ``functional.py`` handles do not count."""
    from .functional import buffer_updates

    return buffer_updates(program) is None


#: Lowered ops without a portable kernel whose decomposition is one op that has one: when
#: the lowering's check refuses a node (and the export is not ``strict``), the op is
#: decomposed so that the node can run on the portable kernels (``_unrunnable``).
#: ``max_pool2d`` -> ``max_pool2d_with_indices`` (ceil mode over a dynamic H or W).
ONE_OP_DECOMPOSITIONS = ("aten.max_pool2d.default",)


def _unrunnable(program: Any, strict: bool = False) -> dict[Any, Any]:
    """torch's core ATen decompositions of the ops in ``program`` that neither XNNPACK nor
    ExecuTorch's portable kernels run: ops without a lowering that torch.export's default
    decompositions keep, and (unless ``strict``) the ``ONE_OP_DECOMPOSITIONS`` whose
    lowering's check refuses a node, and the ops whose lowering is composed at the sizes
    seen at export (check ``static_shapes``) over dynamic dims: ``group_norm``,
    ``log_softmax``, ``instance_norm`` then run as ``native_group_norm``, ``_log_softmax``,
    ``_native_batch_norm_legit`` on the portable kernels."""

    from .functional import buffer_updates
    from .lowering import load_lowerings
    from .passes.partition import is_size, portable_refusal

    lowerings = load_lowerings()
    table = _core_decompositions()
    found: dict[Any, Any] = {}
    asked: set[Any] = set()  # ops whose portable kernel was looked up (once: a failed lookup is not cached)
    updates = set(buffer_updates(program) or ())  # made functional by AtenProgram.of
    for node in program.graph.nodes:
        op = node.target
        if node.op != "call_function" or op in asked or op not in table or is_size(node) or node in updates:
            continue
        lowering = lowerings.get(op)
        decomposed = str(op) in ONE_OP_DECOMPOSITIONS or (lowering is not None and lowering.composed_at_export_sizes)
        if lowering is not None and (strict or not decomposed or lowering.check is None
                                     or lowering.check(node) is None):
            continue
        asked.add(op)
        if portable_refusal_of(op, portable_refusal) is not None:
            found[op] = table[op]
    return found


def portable_refusal_of(op: Any, refusal: Any) -> str | None:
    """``refusal`` (of a node) asked of an op alone."""

    class _Node:
        target = op

    return refusal(_Node())


def _statistics(module: Any, program: Any, decompositions: tuple[dict[Any, Any], ...], options: ExportOptions,
                timings: dict[str, float], exported: Any = None) -> Any:
    """Calibration statistics of the layers (None without ``calibration=``), from the batches
    run through ``program`` (after the passes before calibration) or, when their shapes
    differ from the example's, through the module itself (``eager.statistics``: the same
    statistics, without tracing) or, where it cannot stand in for the program, through the
    module traced on them and decomposed as ``program`` was (``decompositions``)."""
    if options.calibration is None or options.static_int8 is not None:
        return None  # static int8 calibrates the lowered graph itself (static_int8.calibrate)
    from . import eager
    from .calibration import statistics

    with stage("calibrate", timings):
        if not options.calibration.fits(program) and options.rotation is None:  # else traced again: run it
            found = eager.statistics(module, program, options.calibration, options.policy, options.method)
            if found is not None:
                return found
        programs = options.calibration.programs_for(module, program, decompositions, exported)
        return statistics(programs, options.calibration, options.policy, options.method)


@dequantized_for_export
def export(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", method: str = "mse",
           calibration: Iterable[Any] | None = None, fallback: Any = "auto", activations: str = "dynamic",
           progress: bool = True, target: Any = "1.4.1", state_dict: str | os.PathLike[str] | None = None,
           check: bool = True, dynamic_shapes: Any = None, calibration_mask: Any = None,
           strict: bool = False, embeddings: Any = None, rotation: Any = None, memory: Any = None,
           _weight_prefix: str = "") -> Exported:
    """Lower ``module`` to one XNNPACK graph with ``weights`` for its linear and convolution layers.

    ``module``: a ``torch.nn.Module`` in eval mode with float32 parameters, or a
    ``torch.export.ExportedProgram`` (e.g. from ``torch.export.load``).  ``example_inputs``:
    a tuple of float32 tensors (static shapes), the module's positional inputs.
    ``weights``: ``"fp32"``, ``"qc8w"``, ``"qc4w"`` or ``"qb4w:G"`` (see ``weights.py``).
    ``method``: how scales are chosen (``"minmax"``, ``"mse"``, or an activation-aware method).
    ``calibration``: an iterable of input tuples the module's program is run on; the
    inputs of every linear and convolution are kept as statistics (``calibration.py``):
    the activation-aware methods take them, each layer calibrated on what the
    already-quantized layers before it produce (sequential calibration), and with
    ``minmax`` / ``mse`` the quantized linears that read a layer norm are equalized
    (per-channel scales moved from their input to their weight).
    ``calibration_mask``: which rows of the batches count (padding tokens should not): one
    mask per batch (bool, or 0/1 numbers; True on real rows), shaped as the rows of every
    calibrated layer (``x.shape[:-1]`` of a linear's input: ``(batch, tokens)``), or the
    index of the input that is the mask (``1`` for an encoder called as
    ``module(hidden, mask)``).  See ``batches.py``.
    ``fallback``: what a layer that cannot take ``weights`` gets: ``"auto"`` (default: the
    most compact scheme XNNPACK computes right for it), None (refuse it), or the scheme(s)
    to try in order; the report names every fallback and its reason.
    ``activations``: ``"dynamic"`` (int8 per token, quantized at run time), or ``"qint8"``
    (full-integer static int8, with ``weights="qc8w"`` and ``calibration=``: every activation
    gets one scale and zero point chosen from the calibration batches, every node XNNPACK
    computes in int8 runs in int8, converts stand only at the graph's edges and around the
    nodes that have no int8 form, each listed in ``Exported.boundaries`` with its reason;
    ``xq.StaticInt8(ranges=..., equalize=..., bias_correction=...)`` spells out the
    choices, see ``static_int8``; the whole program must run in XNNPACK).
    ``target``: ``"1.4.1"`` (default; uses XNNGelu, XNNTanh, ...) or ``"xn01"`` (the XN01
    schema's node kinds only; ``"seed"`` is the same).
    ``state_dict``: a safetensors file holding the module's parameters and buffers (or the
    ``.json`` index of a checkpoint in several files), for a
    module built on the ``meta`` device (example inputs traced on ``meta`` too): a streaming
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
    ``strict``: one pure XNNPACK graph or a refusal listing every node XNNPACK cannot run.
    Otherwise (the default) nodes XNNPACK cannot run (embedding lookups on integer ids,
    comparisons, index arithmetic, ...) run on ExecuTorch's portable kernels in the same
    ``.pte``, and everything else goes into as few XNNPACK delegates as the graph allows
    (``passes/partition.py``); ``print(exported)`` says which op ran where and why.
    ``embeddings``: None (default: embedding tables stay float32), ``"int8"`` (int8 codes, one
    float32 scale per row) or ``"int4:G"`` (int4 codes, one bf16 scale per group of G values
    along the embedding dim): every lookup of a constant table (``aten.embedding``) then reads
    the table quantized so, on ExecuTorch's quantized embedding kernels
    (``passes/embeddings.py``; a device runtime must link ExecuTorch's ``quantized_ops_lib``).
    Scales by ``method`` (``"minmax"``, else ``"mse"``), symmetric as qc8w and qb4w; each table
    is a report row.  Refused with ``strict=True`` (the kernels run outside XNNPACK).
    ``check``: compare the lowered graph with the module on the example inputs before
    returning (``selfcheck.py``); a mismatch raises ``SelfCheckError`` naming the first
    diverging node.  A streaming export cannot run its module and skips it (the report
    says so).

    Raises ``UnsupportedConfigError`` listing every operator and layer that cannot be
    lowered, each with its module path; ``XnnquantError`` for bad arguments.

    ``rotation``: None, or ``"hadamard"``: a decoder's residual stream rotated by a
    randomized Hadamard matrix folded into its weights, and the inputs of the layers that
    write into it rotated in blocks in the program (``passes/rotation.py``): the same
    function, with outliers spread over the channels int4 groups and int8 activations
    quantize together; refused, with the reason, where it cannot be folded.

    ``memory``: the memory of the device the program is for (bytes, or ``"4GiB"``): a program
    whose planned memory (its arenas at its dynamic dims' upper bounds, which the runtime
    allocates when the method loads) exceeds it is refused.  None (the default) checks against
    this machine's physical memory instead, and the report says so (``Exported.memory_check``):
    give the target's to get the same answer on any exporting machine.  A mixed program's
    self-check loads it here, so with ``check=True`` it must also fit this machine.

    (``_weight_prefix``, for wrappers of this package such as ``xq.export_llm``'s: the path,
    within ``module``, of the module whose names ``state_dict``'s file holds.)
    """
    options = ExportOptions.parse(weights=weights, method=method, calibration=calibration, fallback=fallback,
                                  activations=activations, target=target, state_dict=state_dict, check=check,
                                  progress=progress, dynamic_shapes=dynamic_shapes,
                                  calibration_mask=calibration_mask, strict=strict, embeddings=embeddings,
                                  rotation=rotation, memory=memory)
    if not options.policy.weights.is_quantized and options.embeddings is None and options.method != "mse":
        _warn_unused(f"method={options.method!r} does nothing: weights='fp32' and no embeddings= quantize nothing")
    weight_file = None
    if options.state_dict is not None:
        from .streaming import WeightFile

        weight_file = WeightFile(options.state_dict)
    timings: dict[str, float] = {}
    if weight_file is not None and isinstance(module, _torch().nn.Module):  # before tracing on meta
        _check_streamed(module, weight_file.path)
    eager, traced, decompositions = _traced(module, example_inputs, options, timings)
    refuse_parameter_writes(traced)
    mutated = mutated_inputs(traced)
    from .lowering.context import WeightOptions
    from .lowering.walk import Lowered, lower
    from .passes import AFTER_CALIBRATION, BEFORE_CALIBRATION, run_passes
    from .passes.embeddings import embedding_rows

    with stage("passes", timings):
        program = AtenProgram.of(traced, weight_file, _weight_prefix)
        _check_state(program, options)
        if eager is not None:
            program.find_tied(eager, _weight_prefix)
        program.name_dims(options.dynamic_shapes, eager)
        run_passes(program, _PassOptions(None, options.strict, rotation=options.rotation,
                                         rotation_group=options.policy.weights.group_size), BEFORE_CALIBRATION)
    with buffers_kept(tensors=program.live.values()):
        statistics = _statistics(eager, program, decompositions, options, timings, traced)
    with stage("passes", timings):
        pass_options = _PassOptions(statistics, options.strict, options.embeddings, options.method)
        run_passes(program, pass_options, AFTER_CALIBRATION)
        partition = _partitioned(program, options, pass_options)
        partition.raise_problems()
        members = partition.delegates
    computed = None
    if eager is not None and weight_file is None:  # the program must run on its example inputs, whatever check=
        from .selfcheck import evaluate

        with stage("validate", timings):
            computed = evaluate(program, tuple(example_inputs))
    static = options.static_int8
    if static is not None and members is not None:
        _refuse_mixed_static(program)
    policy = options.policy if static is None else _float_policy()
    # a dynamic pure program may be lowered again after refusals: its filters' quantization is kept
    twice = members is None and options.dynamic_shapes is not None and not options.strict
    weights = WeightOptions(policy, options.method, statistics, memo={} if twice else None)
    bar = _progress(options.progress, f"export {options.policy.weights}")
    delegates: list[Lowered | None]
    with stage("lower", timings):
        if members is None:  # a pure program: one XNNPACK graph, the program's inputs and outputs its own
            lowered = lower(program, options.target, weights, bar, raise_refusals=False)
            members = _portable_after_refusals(program, lowered, options, pass_options, weight_file is not None)
            delegates = [lowered]
        if members is not None:
            rows: list[ReportRow] = []
            delegates = [None if group is None else lower(program, options.target, replace(weights, rows=rows),
                                                          members=group) for group in members]
        if weights.memo:
            weights.memo.clear()  # the float values it holds are needed no more
    if members is None:
        rows = lowered.rows
    tables = embedding_rows(program)
    rows[:0] = tables  # in place: a streaming export fills its rows in when it writes
    if options.embeddings is not None and not tables:
        _warn_unused(f"embeddings={str(options.embeddings)!r} does nothing: the module looks up no constant table "
                     "(aten.embedding); its program is what it would be without it")
    int8 = None
    if static is not None:
        assert options.calibration is not None  # ExportOptions.parse requires it
        result = _static_int8(lowered, options.calibration.batches, static, options.method, timings)
        int8 = result.int8
        exported = Exported(int8.graph, int8.rows, options.policy.weights, options.method, options.target,
                            lowered.inputs, lowered.outputs, timings, lowered.sources,
                            activations=str(static), boundaries=[str(b) for b in int8.boundaries])
        exported.static_int8 = result
    elif members is None:
        exported = Exported(lowered.graph, rows, options.policy.weights, options.method, options.target,
                            lowered.inputs, lowered.outputs, timings, lowered.sources)
    else:
        exported = _mixed(program, delegates, rows, options, timings)
    exported.embeddings = options.embeddings
    _name_mutated_inputs(exported, mutated)
    _warn_fallbacks(exported)
    if exported.static_int8 is not None:
        _warn_static(exported)
    if weight_file is None:  # a streaming export writes (and quantizes) when saved
        with stage("write", timings):
            exported.to_pte() if members is not None else exported.to_bytes()
        exported.memory_check = _check_planned(exported, options)
    if not options.check:
        exported.self_check = "skipped (check=False)"
    elif weight_file is not None or eager is None:
        exported.self_check = ("skipped: a streaming export's weights are not in memory" if weight_file is not None
                               else "skipped: a saved program has no module to compare with")
    else:
        from .evaluation import single_threaded
        from .selfcheck import self_check

        with stage("check", timings), single_threaded(), buffers_kept(tensors=program.live.values()):
            exported.self_check = self_check(eager, example_inputs, traced, program, delegates,
                                             exported if members is not None else None, int8, mutated, computed)
    exported.state = {program.origins[name]: tuple(program.state[name].shape) for name in program.state}
    return exported


def _check_state(program: AtenProgram, options: ExportOptions) -> None:
    """What a program with state (buffers the module updates) cannot be: one XNNPACK graph
    (``strict=True``: the updates run outside XNNPACK), or static int8.  The initial values
    of a state on the meta device come from the weight file of a streaming export, else are
    zeros (a cache, which no checkpoint holds); without a weight file it is refused."""
    if not program.state:
        return
    names = ", ".join(repr(program.origins[name]) for name in program.mutated)
    if options.strict:
        from ..errors import UnsupportedConfigError

        raise UnsupportedConfigError(
            f"strict=True asks for one pure XNNPACK graph, and the module updates its buffers ({names}): that "
            "state lives in the program around the XNNPACK delegates, which are stateless; export without "
            "strict=True")
    if options.static_int8 is not None:
        from ..errors import UnsupportedConfigError

        raise UnsupportedConfigError(f"activations='qint8' rewrites one XNNPACK graph into int8, and the module "
                                     f"updates its buffers ({names}), state that runs outside XNNPACK; expected "
                                     "activations='dynamic'")
    torch = _torch()
    for name, tensor in program.state.items():
        if tensor.device.type != "meta":
            continue
        stored = program.stored_tensor(name)  # a streaming export's weight file may hold it
        if stored is not None:
            program.state[name] = stored
        elif program.weight_file is not None:  # as ExecuTorch starts a buffer its program updates: no values
            program.state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
        else:
            raise XnnquantError(f"the buffer {program.origins[name]!r}, which the module updates, is on the meta "
                                "device: its values when exported are the program's initial state; give it data "
                                "(build it outside torch.device('meta')), or export with state_dict=")


def _name_mutated_inputs(exported: Exported, mutated: list[int]) -> None:
    """Name the outputs that carry the new values of the inputs the forward writes into
    (``caller.py``): ``Exported.mutated_inputs``, and each such output ``"x (written by forward)"``."""
    names = [exported.inputs[k].name for k in mutated]
    exported.mutated_inputs = names
    for k, name in enumerate(names):
        exported.outputs[k] = replace(exported.outputs[k], name=f"{name} (written by forward)")


def _check_planned(exported: Exported, options: ExportOptions) -> MemoryCheck:
    """Refuse a program whose planned memory (at its dynamic dims' bounds) the runtime could not
    allocate (``pte.planned``): a mixed program's arenas, a pure one's inputs and outputs (the
    runtime plans those; XNNPACK sizes its own memory at the sizes it runs); against
    ``memory=`` when given (and this machine's too when the self-check will load a mixed
    program here), else this machine's.  Returns the ``MemoryCheck``."""
    import numpy as np

    from ..pte.planned import check_fits, planned_bytes

    if exported.mixed:
        planned = planned_bytes(exported.to_pte())
    else:
        planned = {"forward": sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
                                  for t in exported.inputs + exported.outputs)}
    dims = sorted({str(d) for t in exported.inputs + exported.outputs for d in t.dynamic if d is not None})
    lower = (f" (its dynamic dims plan their memory at their upper bounds: {', '.join(dims)}; lower their max)"
             if dims else "")
    if options.memory is None:
        return check_fits(planned, "the exported program", lower + "; memory= checks against the target device's "
                          "memory instead of this machine's")
    done = check_fits(planned, "the exported program", lower, options.memory, target=True)
    if options.check and exported.mixed:
        check_fits(planned, "the exported program's self-check", lower + "; the self-check loads the program on "
                   "this machine: check=False skips it")
    return done


def _float_policy() -> Any:
    """Static int8 lowers every layer in fp32 first; its rewrite quantizes them (``static_int8``)."""
    from .weights import WeightPolicy

    return WeightPolicy("fp32", None)


def _refuse_mixed_static(program: AtenProgram) -> None:
    """Static int8 rewrites one XNNPACK graph: a program with nodes outside XNNPACK is refused."""
    from ..errors import UnsupportedConfigError
    from .lowering import op_name
    from .passes.partition import PARTITION, PORTABLE, WHY

    outside = [n for n in program.graph.nodes if n.op == "call_function" and n.meta.get(PARTITION) == PORTABLE]
    lines = "\n".join(f"  - {op_name(n.target)} ({n.meta.get(WHY, 'not lowered')}; module "
                      f"{AtenProgram.module_path(n) or '<top level>'})" for n in outside[:8])
    more = f"\n  ... and {len(outside) - 8} more" if len(outside) > 8 else ""
    raise UnsupportedConfigError(
        f"activations='qint8' rewrites one XNNPACK graph into int8, and {len(outside)} node(s) of this program "
        f"would run on ExecuTorch's portable kernels:\n{lines}{more}\nexpected a program XNNPACK runs whole "
        "(as strict=True requires), or activations='dynamic'")


def _static_int8(lowered: Any, calibration: Any, static: StaticInt8, method: str, timings: dict[str, float]) -> Any:
    """The float graph ``lowered`` as a static int8 graph (``static_int8``); stages ``calibrate`` and
    ``quantize``."""
    from . import static_int8

    batches, labels = static_int8.graph_batches(calibration, lowered.inputs)
    with stage("calibrate", timings):
        seen = static_int8.calibrate(lowered.graph, batches, lowered.sources, lowered.inputs, labels=labels)
    with stage("quantize", timings):
        result = static_int8.quantize(lowered.graph, lowered.sources, lowered.rows, lowered.filters, seen,
                                      ranges=static.ranges, percentile=static.percentile, method=method,
                                      bias_correction=static.bias_correction, equalize=static.equalize,
                                      budget=static.budget, rounding=static.rounding, cpu=static.cpu)
    return result


def _portable_after_refusals(program: AtenProgram, lowered: Any, options: ExportOptions,
                             pass_options: _PassOptions, streaming: bool) -> list[set[Any] | None] | None:
    """A pure program with dynamic dims whose lowering refused ``lowered.refusals``: the nodes
    its lowerings refused (a slice from a dynamic dim's end, a mean over one, ...) go to the
    portable kernels, and the program is partitioned again (returned: the delegates'
    members).  Every refusal is raised as ``lower`` raises it for a program of static shapes
    (its refusals are decided by the partition's checks), with ``strict=True``, for a
    streaming export (its weights are registered once), or when a refusal is about a
    layer's weights rather than the node (``Lowered.weight_refusals``)."""
    from ..errors import UnsupportedConfigError

    if not lowered.refusals:
        return None
    lines = "\n".join(f"  - {r}" for r in lowered.refusals)
    refusal = UnsupportedConfigError(f"export refused {len(lowered.refusals)} node(s) or layer(s):\n{lines}")
    if streaming or not _refused_go_portable(lowered, options):
        raise refusal
    partition = _repartitioned(program, lowered, options, pass_options)
    partition.raise_problems()
    if partition.delegates is None:
        raise refusal
    if options.static_int8 is not None:
        _refuse_mixed_static(program)
    return partition.delegates


def _refused_go_portable(lowered: Any, options: ExportOptions) -> bool:
    """True when the nodes a pure program's lowering refused go to the portable kernels
    (``_portable_after_refusals``, and ``check`` alike): with dynamic dims, without
    ``strict=True``, and no layer refused for its weights."""
    return bool(options.dynamic_shapes is not None and not options.strict and lowered.refused
                and not lowered.weight_refusals)


def _repartitioned(program: AtenProgram, lowered: Any, options: ExportOptions,
                   pass_options: _PassOptions) -> Partition:
    """The partition after sending the nodes ``lowered`` refused to the portable kernels."""
    from .passes import PASSES

    pass_options.portable.update(lowered.refused)
    PASSES["partition"].fn(program, pass_options)
    return _partitioned(program, options, pass_options)


#: Partition rounds: each sends the nodes a delegate's lowering refused to the portable kernels.
PARTITION_ROUNDS = 4


@dataclass
class Partition:
    """Where a program's nodes run: the members of each delegate by phase (None where a phase
    has none; ``delegates`` is None for a pure program: every node in XNNPACK, every input
    float32), and what cannot run anywhere (``problems``, one line each: nodes neither
    XNNPACK nor the portable kernels run, layers that cannot take their weights)."""

    delegates: list[set[Any] | None] | None
    problems: list[str]

    def raise_problems(self) -> None:
        from ..errors import UnsupportedConfigError

        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise UnsupportedConfigError(f"export refused {len(self.problems)} node(s) or layer(s):\n{lines}")


def _partitioned(program: AtenProgram, options: ExportOptions, pass_options: _PassOptions) -> Partition:
    """The ``Partition`` of a program after the passes (``passes/partition.py`` placed it).

    Lowering can refuse a node its check took: such nodes go to the portable kernels and
    the partition is made again (a dry run of the lowering, nothing quantized), until no
    delegate refuses a node.
    """
    from .lowering.context import WeightOptions
    from .lowering.walk import lower
    from .passes import PASSES
    from .passes.partition import PARTITION, PORTABLE, portable_refusal

    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    dry = WeightOptions(options.policy, dry_run=True)
    for _ in range(PARTITION_ROUNDS):
        portable = [n for n in calls if n.meta.get(PARTITION) == PORTABLE and n.target is not operator.getitem]
        phases = sorted({n.meta[PARTITION] for n in calls if n.meta.get(PARTITION, -1) >= 0})
        float_io = all(_dtype(n) == "float32" and not _empty(n) for n in program.graph.nodes if n.op == "placeholder"
                       and n.name in program.inputs)  # an empty input (a cat's) is no XNNPACK value
        if options.strict or (not portable and phases in ([], [0]) and float_io and not program.state):
            return Partition(None, list(pass_options.problems))
        groups: list[set[Any] | None] = [None] * (max(phases, default=-1) + 1)
        for phase in phases:
            groups[phase] = {n for n in calls if n.meta.get(PARTITION) == phase}
        refused: dict[str, str] = {}
        weight_refusals: list[str] = []
        for group in groups:
            if group is not None:
                dry_lowered = lower(program, options.target, dry, members=group, raise_refusals=False)
                refused.update(dry_lowered.refused)
                weight_refusals += dry_lowered.weight_refusals
        if not refused:
            problems = weight_refusals + [
                f"{n.target} (node {n.name}, module {AtenProgram.module_path(n) or '<top level>'}): neither XNNPACK "
                f"({n.meta.get('xnnquant_why_portable', '')}) nor ExecuTorch's portable kernels ({why}) run it"
                for n in portable if (why := portable_refusal(n)) is not None]
            problems = pass_options.problems + problems
            return Partition(groups, problems)
        pass_options.portable.update(refused)
        PASSES["partition"].fn(program, pass_options)
    raise AssertionError(f"the partition did not settle in {PARTITION_ROUNDS} rounds")


def _dtype(node: Any) -> str:
    return str(getattr(node.meta.get("val"), "dtype", "")).removeprefix("torch.")


def _empty(node: Any) -> bool:
    """True for a value with no elements (a static dim of 0)."""
    return any(isinstance(d, int) and d == 0 for d in getattr(node.meta.get("val"), "shape", ()))


def _mixed(program: AtenProgram, delegates: list[Any], rows: list[ReportRow], options: ExportOptions,
           timings: dict[str, float]) -> Exported:
    """The ``Exported`` of a mixed program: its delegates and the program that runs them."""
    from ..graph import named_payload
    from .emit import emit, input_specs, output_specs, placements

    inputs, outputs = input_specs(program), output_specs(program)
    with stage("emit", timings):
        builder = emit(program, delegates, [None if d is None else named_payload(d.graph, f"xnnquant.delegate{k}.")
                                            for k, d in enumerate(delegates)], inputs, outputs)
    graphs = [d for d in delegates if d is not None]
    first = graphs[0] if graphs else None
    exported = Exported(first.graph if first is not None else None, rows, options.policy.weights,  # type: ignore[arg-type]
                        options.method, options.target, inputs, outputs, timings,
                        first.sources if first is not None else [])
    exported.delegates = [d.graph for d in graphs]
    exported.delegate_sources = [d.sources for d in graphs]
    exported.placement = placements(program)
    exported.builder = builder
    return exported


class FallbackWarning(UserWarning):
    """Some layers of an export took another scheme than ``weights=`` (``fallback="auto"``)."""


class OptionWarning(UserWarning):
    """An option of ``xq.export`` is valid but does nothing here: ``embeddings=`` on a module
    without an embedding table, ``method="minmax"`` with nothing quantized.  An option that is
    malformed or contradicts another (a scheme twice in ``fallback=``, ``dynamic_shapes``
    without a Dim, ``calibration=`` or ``method="gptq"`` with ``weights="fp32"``) is refused
    instead (``ExportOptions.parse``)."""


def _warn_unused(message: str) -> None:
    warn_caller(message, OptionWarning)


def _warn_fallbacks(exported: Exported) -> None:
    """One warning for all the layers that fell back, by scheme (the report has each reason); not
    for the layers mixed precision chose to keep in fp32 (``StaticInt8.budget``: asked for)."""
    from collections import Counter

    fell = Counter(row.scheme for row in exported.report if row.fallback and "kept in fp32 by budget=" not in
                   row.fallback)
    if fell:
        took = ", ".join(f"{n} took {scheme}" for scheme, n in sorted(fell.items()))
        warn_caller(f"{sum(fell.values())} of {len(exported.report)} layers could not take "
                    f"weights={str(exported.weights)!r} ({took}); print(exported) gives each layer's reason",
                    FallbackWarning)


class AccuracyWarning(UserWarning):
    """A static int8 program keeps little of the module's accuracy: its outputs measured below
    ``ACCURACY_WARNING_DB`` against the float graph's on calibration inputs."""


class PerformanceWarning(UserWarning):
    """A static int8 program ran slower than its float graph on the exporting machine (more than
    ``SLOWER_WARNING`` times its time, the float graph taking at least ``TIMED_WARNING_MS``)."""


#: Outputs measured below this SQNR (noise a tenth of the signal's power) are warned of.
ACCURACY_WARNING_DB = 10.0
#: An int8 program measured this many times its float graph's run time is warned of, when the float
#: graph takes at least ``TIMED_WARNING_MS`` (shorter runs are mostly the runtime's fixed costs and noise).
SLOWER_WARNING = 1.2
TIMED_WARNING_MS = 0.5


def _warn_static(exported: Exported) -> None:
    """One ``OptionWarning`` for the static int8 choices not followed (``Int8Graph.notes``), one
    ``AccuracyWarning`` when the measured outputs are mostly error, one ``PerformanceWarning`` when
    the program ran slower than its float graph (``Int8Graph.measured``)."""
    int8 = exported.static_int8.int8
    if int8.notes:
        _warn_unused(f"activations={str(exported.activations)!r} was not followed in full: " + "; ".join(int8.notes))
    if int8.measured is not None and int8.measured.db < ACCURACY_WARNING_DB:
        db, inputs = int8.measured.db, int8.measured.inputs
        warn_caller(f"the static int8 program keeps little of the module's accuracy: its outputs measure {db:.1f} dB "
                    f"SQNR against the float graph's on {inputs} of its own calibration inputs (expected "
                    f">= {ACCURACY_WARNING_DB:g} dB). Per-tensor int8 grids cannot hold values of very different "
                    "magnitudes in one tensor (a transformer's outlier channels); StaticInt8(budget=0.3) keeps the "
                    "costliest nodes in fp32, activations='dynamic' quantizes each row at run time",
                    AccuracyWarning)
    timed = int8.measured
    if timed is not None and timed.float_ms >= TIMED_WARNING_MS and timed.int8_ms > SLOWER_WARNING * timed.float_ms:
        warn_caller(f"the static int8 program ran slower than its float graph on this machine, "
                    f"{timed.cpu or 'CPU unknown'}: {timed.int8_ms:.3g} ms against {timed.float_ms:.3g} ms "
                    f"(median of {timed.inputs} inputs x {timed.runs} runs); the "
                    f"converts around its {len(exported.boundaries)} fp32 <-> qint8 boundaries (print(exported) lists "
                    "them) cost more than its int8 nodes save. weights='qc8w' with activations='dynamic', or the fp32 "
                    "program, may serve better; time them where the program will run", PerformanceWarning)


class _PassOptions:
    """What the passes read of an export's options: the calibration statistics, ``strict``,
    ``embeddings`` (an ``EmbeddingScheme`` or None) and ``method``, ``dry_run`` (``xq.check``:
    nothing quantized), the nodes the partition must send to the portable kernels (name ->
    why), and the passes' refusals (``problems``, one line each, raised with the partition's)."""

    def __init__(self, statistics: Any, strict: bool = False, embeddings: Any = None, method: str = "mse",
                 dry_run: bool = False, rotation: str | None = None, rotation_group: int | None = None) -> None:
        self.statistics = statistics
        self.rotation = rotation
        self.rotation_group = rotation_group
        self.strict = strict
        self.embeddings = embeddings
        self.method = method
        self.dry_run = dry_run
        self.portable: dict[str, str] = {}
        self.problems: list[str] = []


def _check_streamed(module: Any, path: str) -> None:
    """A streaming export's module holds no weights of its own: every parameter is on
    ``meta``.  A buffer may hold data (one the file lacks: a non-persistent buffer such as a
    rotary ``inv_freq``, made outside ``torch.device('meta')``); its values are the module's."""
    for name, tensor in module.named_parameters():
        if tensor.device.type != "meta":
            raise XnnquantError(
                f"state_dict= (xnnquant export --weights-from) reads the module's tensors from {path!r}, but {name!r} "
                f"holds data of its own (on {tensor.device.type}): build the module on the meta device (with "
                "torch.device('meta'): ...), or export it without state_dict=")


@dequantized_for_export
def check(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", fallback: Any = "auto",
          target: Any = "1.4.1", dynamic_shapes: Any = None, strict: bool = False,
          embeddings: Any = None) -> CheckReport:
    """What ``xq.export`` would do with ``module``, without quantizing or writing anything.

    The module is traced, rewritten and partitioned as ``export`` does; each delegate's
    nodes are asked of their lowering (the registration's ``check``, then the lowering
    itself on stand-in filters) and each layer of the weight policy.  Returns a
    ``CheckReport``: the ops lowered onto XNNPACK, the nodes that would run on ExecuTorch's
    portable kernels and why, every refusal with its reason and module path, and every
    layer's scheme with the reason when it falls back.  Arguments as for ``export``.
    """
    options = ExportOptions.parse(weights=weights, fallback=fallback, target=target, check=False, progress=False,
                                  dynamic_shapes=dynamic_shapes, strict=strict, embeddings=embeddings)
    timings: dict[str, float] = {}
    eager, traced, _ = _traced(module, example_inputs, options, timings)
    refuse_parameter_writes(traced)
    from .emit import placements
    from .lowering.context import WeightOptions
    from .lowering.walk import lower
    from .passes import run_passes

    program = AtenProgram.of(traced)
    program.name_dims(options.dynamic_shapes, module)
    pass_options = _PassOptions(None, options.strict, options.embeddings, dry_run=True)
    run_passes(program, pass_options)
    if eager is not None:  # as export validates: the program must run on its example inputs
        from .selfcheck import evaluate

        try:
            evaluate(program, tuple(example_inputs))
        except XnnquantError as exc:
            pass_options.problems.append(str(exc))
    partition = _partitioned(program, options, pass_options)
    dry = WeightOptions(options.policy, dry_run=True)
    if partition.delegates is None:
        lowered = lower(program, options.target, dry, raise_refusals=False)
        if _refused_go_portable(lowered, options):  # as export sends them
            partition = _repartitioned(program, lowered, options, pass_options)
        if partition.delegates is None:
            return CheckReport(lowered.lowered_ops, partition.problems + lowered.refusals, lowered.rows, [])
    from .passes.embeddings import embedding_rows

    ops: list[str] = []
    refusals = list(partition.problems)
    rows: list[ReportRow] = embedding_rows(program)
    for group in partition.delegates:
        if group is not None:
            lowered = lower(program, options.target, replace(dry, rows=rows), members=group, raise_refusals=False)
            ops += lowered.lowered_ops
    portable = [p for p in placements(program) if p.where == "portable kernels"]
    return CheckReport(ops, refusals, rows, portable)


class CheckReport:
    """What ``xq.check`` found: ``lowered`` (the ATen ops lowered onto XNNPACK, one per node),
    ``portable`` (the nodes that would run on ExecuTorch's portable kernels: ``emit.Placement``,
    with why), ``refused`` (one line per node or layer that cannot run, with its reason and
    module path) and ``weights`` (one ``ReportRow`` per layer: its scheme and fallback reason;
    no SQNR, nothing was quantized)."""

    def __init__(self, lowered: list[str], refused: list[str], weights: list[Any], portable: list[Any]) -> None:
        self.lowered, self.refused, self.weights, self.portable = lowered, refused, weights, portable

    @property
    def ok(self) -> bool:
        """True when ``xq.export`` would lower everything."""
        return not self.refused

    def __str__(self) -> str:
        from collections import Counter

        ops = Counter(self.lowered)
        lines = [f"xnnquant check: {len(self.lowered)} nodes lowered onto XNNPACK ("
                 + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) + f"); {len(self.portable)} on "
                 f"ExecuTorch's portable kernels; {len(self.refused)} refused"]
        lines += [f"  portable: {p.op} (node {p.node}, module {p.module or '<top level>'}): {p.why}"
                  for p in self.portable]
        lines += [f"  refused: {r}" for r in self.refused]
        for row in self.weights:
            why = f" ({row.fallback})" if row.fallback else ""
            lines.append(f"  layer {row.path or '<top level>'}: {row.scheme}{why}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"CheckReport({len(self.lowered)} lowered, {len(self.portable)} portable, {len(self.refused)} refused, "
                f"{len(self.weights)} layers)")
