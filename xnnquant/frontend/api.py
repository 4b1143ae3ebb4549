"""``xq.export`` and ``xq.check``: a ``torch.nn.Module`` (or a saved ``torch.export`` program)
to an XNNPACK program, or a report of what that would do.

``export`` runs these stages in order, one module of ``stages/`` each (what it takes and
gives is its docstring), each timed in ``Exported.timings`` (seconds):

==============  =======================  =============================================================
stage           where                    what
==============  =======================  =============================================================
``export``      ``stages/trace.py``      the module and its inputs checked, then
                                         ``torch.export.export(module, example_inputs, strict=False)``
``decompose``   ``stages/decompose.py``  ``run_decompositions`` to core ATen, keeping the ops that have
                                         a lowering of their own; skipped when nothing would change
``passes``      ``stages/passes.py``     the rewrites before lowering (``passes/``), in two parts around
                                         ``calibrate``
``calibrate``   ``stages/calibrate.py``  the calibration batches through the program (after the passes
                                         before calibration) or the module, node by node, for the
                                         layers' input statistics (when given); for an activation-aware
                                         method, quantizing each layer on the way
(``passes``)    ``stages/partition.py``  the partition: which node runs in which XNNPACK delegate, which
                                         on ExecuTorch's portable kernels, settled against what the
                                         lowering refuses (timed with the passes)
``validate``    ``selfcheck.evaluate``   the program after the passes run by torch on the example
                                         inputs: a node that cannot compute on them (an int64 input
                                         read by a float linear) is refused before lowering, whatever
                                         ``check=``; the self-check reuses the outputs
``lower``       ``stages/lower.py``      lowering node by node (``lowering/``), quantizing each weight
                                         on the way (``weights.py``); a mixed program's ``emit``
                                         (``emit.py``) writes the program around its delegates
``calibrate``,  ``stages/quantize.py``   static int8 only: the float graph run on the real XNNPACK on
``quantize``                             the calibration batches, then rewritten into int8, biases
                                         corrected (``static_int8/``)
``write``       ``stages/write.py``      the bytes (``Graph.to_bytes``, or the ``.pte``), and the
                                         planned-memory check
``check``       ``selfcheck.py``         the self-check: the graph against the module
==============  =======================  =============================================================

Between ``lower`` and ``write``, the warnings of what the report says (``report.py``:
``FallbackWarning``, ``OptionWarning``, ``AccuracyWarning``, ``PerformanceWarning``), each at the
caller's line.  ``check`` runs the same stages up to the partition, then asks each delegate's
nodes of their lowering without quantizing (a dry run).

torch is imported by the stages, on first use; ``import xnnquant`` does not import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ..errors import XnnquantError
from .caller import buffers_kept, mutated_inputs, name_mutated_inputs, refuse_parameter_writes
from .exported import Exported
from .options import ExportOptions
from .passes import PassOptions, run_passes
from .prequantized import dequantized_for_export
from .program import AtenProgram
from .report import (
    AccuracyWarning,
    CheckReport,
    FallbackWarning,
    OptionWarning,
    PerformanceWarning,
    ReportRow,
    stage,
    warn_fallbacks,
    warn_static,
    warn_unused,
)
from .stages import calibrate, passes, trace
from .stages.decompose import decomposed
from .stages.lower import lower_program
from .stages.partition import partitioned, refused_go_portable, repartitioned
from .stages.quantize import quantized
from .stages.write import check_planned, write

#: ``export`` and ``check``, and the report and warning classes they give (``report.py``).
__all__ = ["AccuracyWarning", "CheckReport", "FallbackWarning", "OptionWarning", "PerformanceWarning", "check",
           "export"]


@dequantized_for_export
def export(module: Any, example_inputs: Any = None, *, weights: Any = "qb4w:32", method: str = "mse",
           calibration: Iterable[Any] | None = None, fallback: Any = "auto", activations: str = "dynamic",
           progress: bool = True, target: Any = "1.4.1", state_dict: str | os.PathLike[str] | None = None,
           check: bool = True, dynamic_shapes: Any = None, calibration_mask: Any = None,
           strict: bool = False, embeddings: Any = None, rotation: Any = None, memory: Any = None,
           _weight_prefix: str = "", _memory_hint: str = "") -> Exported:
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

    (For wrappers of this package such as ``xq.export_llm``: ``_weight_prefix``, the path,
    within ``module``, of the module whose names ``state_dict``'s file holds; ``_memory_hint``,
    what ends a planned-memory refusal, e.g. the KV cache's share.)
    """
    options = ExportOptions.parse(weights=weights, method=method, calibration=calibration, fallback=fallback,
                                  activations=activations, target=target, state_dict=state_dict, check=check,
                                  progress=progress, dynamic_shapes=dynamic_shapes,
                                  calibration_mask=calibration_mask, strict=strict, embeddings=embeddings,
                                  rotation=rotation, memory=memory)
    options = replace(options, memory_hint=_memory_hint)
    if not options.policy.weights.is_quantized and options.embeddings is None and options.method != "mse":
        warn_unused(f"method={options.method!r} does nothing: weights='fp32' and no embeddings= quantize nothing")
    weight_file = trace.weight_file(options, module)
    timings: dict[str, float] = {}
    eager, traced, decompositions = _traced(module, example_inputs, options, timings)
    refuse_parameter_writes(traced)
    mutated = mutated_inputs(traced)
    with stage("passes", timings):
        program = passes.before_calibration(traced, weight_file, _weight_prefix, eager, options)
    with buffers_kept(tensors=program.live.values()):
        statistics = calibrate.layer_statistics(eager, program, decompositions, options, timings, traced)
    with stage("passes", timings):
        pass_options = passes.after_calibration(program, statistics, options)
        partition = partitioned(program, options, pass_options)
        partition.raise_problems()
    computed = None
    if eager is not None and weight_file is None:  # the program must run on its example inputs, whatever check=
        from .selfcheck import evaluate

        with stage("validate", timings):
            computed = evaluate(program, tuple(example_inputs))
    lowering = lower_program(program, partition.delegates, options, pass_options, statistics, timings,
                             streaming=weight_file is not None)
    if options.static_int8 is not None:
        exported = quantized(lowering.pure, options, timings)
    else:
        exported = lowering.exported(program, options, timings)
    exported.embeddings = options.embeddings
    name_mutated_inputs(exported, mutated)
    warn_fallbacks(exported)
    if exported.static_int8 is not None:
        warn_static(exported)
    if weight_file is None:  # a streaming export writes (and quantizes) when saved
        write(exported, options, timings)
    elif options.memory is not None:  # the device's memory, checked when the bytes exist (no self-check loads them)
        later = replace(options, check=False)
        if exported.mixed:
            exported._check_at_save = later
        else:
            exported.memory_check = check_planned(exported, later)
    if not options.check:
        exported.self_check = "skipped (check=False)"
    elif weight_file is not None or eager is None:
        exported.self_check = ("skipped: a streaming export's weights are not in memory" if weight_file is not None
                               else "skipped: a saved program has no module to compare with")
    else:
        from .evaluation import single_threaded
        from .selfcheck import self_check

        int8 = exported.static_int8.int8 if exported.static_int8 is not None else None
        mixed = exported if lowering.members is not None else None
        with stage("check", timings), single_threaded(), buffers_kept(tensors=program.live.values()):
            exported.self_check = self_check(eager, example_inputs, traced, program, lowering.delegates, mixed, int8,
                                             mutated, computed)
    exported.state = {program.origins[name]: tuple(program.state[name].shape) for name in program.state}
    return exported


def _traced(module: Any, example_inputs: Any, options: ExportOptions,
            timings: dict[str, float]) -> tuple[Any, Any, tuple[dict[Any, Any], ...]]:
    """Stages ``export`` and ``decompose``: (the module or None for a saved program, its decomposed
    ``ExportedProgram``, the decomposition tables applied)."""
    with stage("export", timings):
        eager, program = trace.traced(module, example_inputs, options)
    with stage("decompose", timings):
        program, tables = decomposed(program, options.strict)
    return eager, program, tables


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

    program = AtenProgram.of(traced)
    program.name_dims(options.dynamic_shapes, module)
    pass_options = PassOptions(None, options.strict, options.embeddings, dry_run=True)
    run_passes(program, pass_options)
    if eager is not None:  # as export validates: the program must run on its example inputs
        from .selfcheck import evaluate

        try:
            evaluate(program, tuple(example_inputs))
        except XnnquantError as exc:
            pass_options.problems.append(str(exc))
    partition = partitioned(program, options, pass_options)
    dry = WeightOptions(options.policy, dry_run=True)
    if partition.delegates is None:
        lowered = lower(program, options.target, dry, raise_refusals=False)
        if refused_go_portable(lowered, options):  # as export sends them
            partition = repartitioned(program, lowered, options, pass_options)
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
