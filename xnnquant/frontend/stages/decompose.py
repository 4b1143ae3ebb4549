"""Stage ``decompose``: torch.export's program in ops that XNNPACK or ExecuTorch's portable kernels run.

Takes the traced ``ExportedProgram`` (``trace.py``) and ``strict``; gives the program after
``run_decompositions`` to core ATen, keeping the ops that have a lowering of their own
(``linear``, ``layer_norm``, ``gelu``, ...), and the decomposition tables applied, in order
(the calibration programs traced at other shapes apply the same ones:
``batches.CalibrationData.programs_for``).  Skipped when every op already has a lowering, a
pass that removes it, or a portable kernel (``needs_decomposition``): decomposing would then
give the same graph, and takes seconds.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from .trace import torch_or_refuse


def decomposition_table() -> dict[Any, Any]:
    """torch.export's default decompositions, minus every op lowered or removed as it is (a
    new dict each call, of a table made once: making it took 20 to 70 ms)."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict[Any, Any]:
    from ..lowering import load_lowerings
    from ..passes import HANDLED, load_passes

    torch = torch_or_refuse()
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
    return dict(torch_or_refuse()._decomp.core_aten_decompositions())


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

    from ..functional import buffer_updates, fresh, is_grad_wrapper, out_of_place
    from ..lowering import load_lowerings
    from ..passes import HANDLED, load_passes
    from ..passes.masks import rescued
    from ..passes.partition import is_size, portable_refusal
    from ..program import node_dtype

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
        if any(node_dtype(v) not in ("float32", "") for v in values) and portable_refusal(node) is None:
            continue
        if op not in _decomposition_table() and portable_refusal(node) is None:
            continue  # no decomposition would change it (ExecuTorch's llama:: kernels), and it runs as it is
        return True
    return False


def decomposed(program: Any, strict: bool) -> tuple[Any, tuple[dict[Any, Any], ...]]:
    """``program`` after the ``decompose`` stage, and the decomposition tables it applied in
    order (module docstring)."""
    with warnings.catch_warnings():
        # torch 2.13's own run_decompositions copies a tree spec the way it deprecates (FutureWarning
        # "isinstance(treespec, LeafSpec) is deprecated"): nothing the caller did or can change
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return _decomposed(program, strict)


def _decomposed(program: Any, strict: bool) -> tuple[Any, tuple[dict[Any, Any], ...]]:
    tables = []
    table = decomposition_table()
    extra = {op: fn for op, fn in unrunnable(program, strict).items() if op not in table}
    if needs_decomposition(program) or extra or _mutates(program):
        tables.append({**extra, **table})
        program = program.run_decompositions(tables[-1])
    for _ in range(2):  # a decomposition may give ops that need one too
        extra = unrunnable(program, strict)
        if not extra:
            break
        tables.append(extra)
        program = program.run_decompositions(extra)
    return program, tuple(tables)


def _mutates(program: Any) -> bool:
    """True when a node writes into one of its arguments in a way only torch's decomposition
    makes functional; the in-place updates of buffers ``functional.py`` handles do not count."""
    from ..functional import buffer_updates

    return buffer_updates(program) is None


#: Lowered ops without a portable kernel whose decomposition is one op that has one: when
#: the lowering's check refuses a node (and the export is not ``strict``), the op is
#: decomposed so that the node can run on the portable kernels (``unrunnable``).
#: ``max_pool2d`` -> ``max_pool2d_with_indices`` (ceil mode over a dynamic H or W).
ONE_OP_DECOMPOSITIONS = ("aten.max_pool2d.default",)


def unrunnable(program: Any, strict: bool = False) -> dict[Any, Any]:
    """torch's core ATen decompositions of the ops in ``program`` that neither XNNPACK nor
    ExecuTorch's portable kernels run: ops without a lowering that torch.export's default
    decompositions keep, and (unless ``strict``) the ``ONE_OP_DECOMPOSITIONS`` whose
    lowering's check refuses a node, and the ops whose lowering is composed at the sizes
    seen at export (check ``static_shapes``) over dynamic dims: ``group_norm``,
    ``log_softmax``, ``instance_norm`` then run as ``native_group_norm``, ``_log_softmax``,
    ``_native_batch_norm_legit`` on the portable kernels."""

    from ..functional import buffer_updates
    from ..lowering import load_lowerings
    from ..passes.partition import is_size, portable_refusal

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
