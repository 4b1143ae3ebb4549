"""Stage ``partition``: where each node of the rewritten program runs, settled against the lowering.

Takes the ``AtenProgram`` after the passes (``passes/partition.py`` placed each node: an
XNNPACK delegate by phase, or ExecuTorch's portable kernels) and the options; gives a
``Partition``: the members of each delegate (None for a pure program: one XNNPACK graph whose
inputs and outputs are the program's own), and what runs nowhere (``problems``).  A lowering
can refuse a node its check took: such nodes go to the portable kernels and the program is
partitioned again (``partitioned``: a dry run of the lowering, nothing quantized; after the
real lowering of a dynamic pure program, ``portable_after_refusals``), at most
``PARTITION_ROUNDS`` times.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from ...errors import UnsupportedConfigError
from ..options import ExportOptions
from ..passes import PassOptions
from ..program import AtenProgram, has_no_elements, node_dtype

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
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise UnsupportedConfigError(f"export refused {len(self.problems)} node(s) or layer(s):\n{lines}")


def partitioned(program: AtenProgram, options: ExportOptions, pass_options: PassOptions) -> Partition:
    """The ``Partition`` of a program after the passes (``passes/partition.py`` placed it).

    Lowering can refuse a node its check took: such nodes go to the portable kernels and
    the partition is made again (a dry run of the lowering, nothing quantized), until no
    delegate refuses a node.
    """
    from ..lowering.context import WeightOptions
    from ..lowering.walk import lower
    from ..passes import PASSES
    from ..passes.partition import PARTITION, PORTABLE, portable_refusal

    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    dry = WeightOptions(options.policy, dry_run=True)
    for _ in range(PARTITION_ROUNDS):
        portable = [n for n in calls if n.meta.get(PARTITION) == PORTABLE and n.target is not operator.getitem]
        phases = sorted({n.meta[PARTITION] for n in calls if n.meta.get(PARTITION, -1) >= 0})
        float_io = all(node_dtype(n) == "float32" and not has_no_elements(n)  # an empty input (a cat's): not in XNNPACK
                       for n in program.graph.nodes if n.op == "placeholder" and n.name in program.inputs)
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


def repartitioned(program: AtenProgram, lowered: Any, options: ExportOptions, pass_options: PassOptions) -> Partition:
    """The partition after sending the nodes ``lowered`` refused to the portable kernels."""
    from ..passes import PASSES

    pass_options.portable.update(lowered.refused)
    PASSES["partition"].fn(program, pass_options)
    return partitioned(program, options, pass_options)


def refused_go_portable(lowered: Any, options: ExportOptions) -> bool:
    """True when the nodes a pure program's lowering refused go to the portable kernels
    (``portable_after_refusals``, and ``xq.check`` alike): with dynamic dims, without
    ``strict=True``, and no layer refused for its weights."""
    return bool(options.dynamic_shapes is not None and not options.strict and lowered.refused
                and not lowered.weight_refusals)


def portable_after_refusals(program: AtenProgram, lowered: Any, options: ExportOptions,
                            pass_options: PassOptions, streaming: bool) -> list[set[Any] | None] | None:
    """A pure program with dynamic dims whose lowering refused ``lowered.refusals``: the nodes
    its lowerings refused (a slice from a dynamic dim's end, a mean over one, ...) go to the
    portable kernels, and the program is partitioned again (returned: the delegates'
    members).  Every refusal is raised as ``lower`` raises it for a program of static shapes
    (its refusals are decided by the partition's checks), with ``strict=True``, for a
    streaming export (its weights are registered once), or when a refusal is about a
    layer's weights rather than the node (``Lowered.weight_refusals``)."""
    if not lowered.refusals:
        return None
    lines = "\n".join(f"  - {r}" for r in lowered.refusals)
    refusal = UnsupportedConfigError(f"export refused {len(lowered.refusals)} node(s) or layer(s):\n{lines}")
    if streaming or not refused_go_portable(lowered, options):
        raise refusal
    partition = repartitioned(program, lowered, options, pass_options)
    partition.raise_problems()
    if partition.delegates is None:
        raise refusal
    if options.static_int8 is not None:
        refuse_mixed_static(program)
    return partition.delegates


def refuse_mixed_static(program: AtenProgram) -> None:
    """Static int8 rewrites one XNNPACK graph: a program with nodes outside XNNPACK is refused."""
    from ..lowering import op_name
    from ..passes.partition import PARTITION, PORTABLE, WHY

    outside = [n for n in program.graph.nodes if n.op == "call_function" and n.meta.get(PARTITION) == PORTABLE]
    lines = "\n".join(f"  - {op_name(n.target)} ({n.meta.get(WHY, 'not lowered')}; module "
                      f"{AtenProgram.module_path(n) or '<top level>'})" for n in outside[:8])
    more = f"\n  ... and {len(outside) - 8} more" if len(outside) > 8 else ""
    raise UnsupportedConfigError(
        f"activations='qint8' rewrites one XNNPACK graph into int8, and {len(outside)} node(s) of this program "
        f"would run on ExecuTorch's portable kernels:\n{lines}{more}\nexpected a program XNNPACK runs whole "
        "(as strict=True requires), or activations='dynamic'")
