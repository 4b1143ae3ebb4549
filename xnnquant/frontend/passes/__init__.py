"""Rewrites of the ATen graph before lowering, each with the guard that says when it is exact.

A pass is a function ``fn(program, options)`` over an ``AtenProgram`` (its own copy of the
exported graph), registered with ``@rewrite(name)``; ``run_passes`` runs them in the order
of ``ORDER``.  An export with calibration runs them in two parts: ``BEFORE_CALIBRATION``,
then the calibration batches through the program so far (``calibration.py``), then
``AFTER_CALIBRATION``, which reads the statistics.  A pass either rewrites the graph
(removing a node, folding constants into a new constant placeholder) or notes a decision
on a node for its lowering (``node.meta[key]``, read through ``LoweringContext.annotation``).
Each pass that can refuse to rewrite has a guard returning the reason
(``batch_norm.can_fold``), and tests pin its refusals.  Lowerings then see a graph in
which every rewrite is already done, so no lowering needs to know about another.

=================  =================================================================
``cleanup``        drops the nodes that compute nothing: runtime checks
                   (``_assert_tensor_metadata``, ``_assert_scalar``, ...), copies and
                   aliases, eval-mode dropout, conversions to the dtype already held;
                   other ``to`` conversions become ``_to_copy``; in-place activations
                   nothing else reads become functional
``constants``      computes every node whose inputs are all constants, with torch
                   (a transposed weight, a mask built from constants)
``batch_norm``     folds an eval-mode batch norm (either ATen op) into the convolution
                   before it
``rotation``       with ``rotation="hadamard"``: a rotation of a decoder's residual
                   stream folded into its weights, the writers' inputs rotated in blocks
``equalization``   with calibration statistics: per-channel scales for the linears
                   that read a layer norm (SmoothQuant's rule, ``calibration.py``)
``masks``          a boolean attention mask the program computes becomes the float
                   mask it stands for, so the attention stays in XNNPACK (mixed programs)
``embeddings``     with ``embeddings=``: a lookup in a constant table becomes a lookup in
                   the table quantized for ExecuTorch's quantized embedding kernels
``partition``      which nodes run in XNNPACK delegates (and which delegate), which on
                   ExecuTorch's portable kernels
=================  =================================================================

Ops a pass removes (``HANDLED``) count as handled when deciding whether the program needs
torch's decompositions (``stages.decompose.needs_decomposition``).  What a pass reads of the
export's options is a ``PassOptions``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..program import AtenProgram

PassFn = Callable[[AtenProgram, Any], None]

#: The passes, in the order they run (module names in this package).
ORDER = ("cleanup", "constants", "batch_norm", "rotation", "equalization", "masks", "embeddings", "partition")
#: The passes whose program the calibration batches run on, and those that use the statistics.
BEFORE_CALIBRATION = ORDER[:4]
AFTER_CALIBRATION = ORDER[4:]


class PassOptions:
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


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn


PASSES: dict[str, Pass] = {}
#: ATen ops the passes remove from every graph (so they need no lowering).
HANDLED: set[Any] = set()


def rewrite(name: str, handles: tuple[Any, ...] = ()) -> Callable[[PassFn], PassFn]:
    """Register the decorated function as pass ``name`` (one of ``ORDER``); ``handles``: ops
    it always removes.  A second registration of a name is refused."""
    if name not in ORDER:
        raise RuntimeError(f"pass {name!r} is not in ORDER {ORDER}")

    def register(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise RuntimeError(f"pass {name!r} is already registered by {PASSES[name].fn.__qualname__}")
        PASSES[name] = Pass(name, fn)
        HANDLED.update(handles)
        return fn

    return register


def load_passes() -> dict[str, Pass]:
    for name in ORDER:
        importlib.import_module(f"{__name__}.{name}")
    return PASSES


def run_passes(program: AtenProgram, options: Any, names: tuple[str, ...] = ORDER) -> None:
    """Run the passes ``names`` (default: every pass) over ``program``, in ``ORDER``."""
    load_passes()
    for name in ORDER:
        if name in names:
            PASSES[name].fn(program, options)
    program.graph.lint()


def replace_uses(node: Any, by: Any) -> None:
    """Every use of ``node`` reads ``by`` instead, and ``node`` (now unused) is erased."""
    node.replace_all_uses_with(by)
    node.graph.erase_node(node)
