"""Stage ``lower``: the partitioned program lowered node by node, each weight quantized on the way.

Takes the ``AtenProgram`` after the passes, the delegates' members (``partition.py``; None
for a pure program), the calibration statistics (``calibrate.py``) and the options; gives a
``Lowering``: one ``lowering.walk.Lowered`` graph per delegate and the report rows, embedding
tables first.  Every layer's weights go through the one weight policy (``weights.py``),
except under static int8, which lowers every layer in fp32 for its rewrite to quantize
(``quantize.float_policy``).  A pure program with dynamic dims whose lowering refuses nodes
(a slice from a dynamic dim's end, a mean over one) becomes a mixed one
(``partition.portable_after_refusals``), its filters' quantization kept from the first
lowering.  ``Lowering.exported`` makes what ``xq.export`` returns of a float or dynamic int8
program; the static int8 one is ``quantize.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..exported import Exported
from ..options import ExportOptions
from ..passes import PassOptions
from ..program import AtenProgram
from ..report import ReportRow, stage, warn_unused
from .partition import portable_after_refusals, refuse_mixed_static
from .quantize import float_policy


@dataclass
class Lowering:
    """What the ``lower`` stage made: ``delegates``, one ``Lowered`` per phase (None where a phase
    has none; the one graph of a pure program), ``members``, each delegate's ATen nodes (None
    for a pure program), and ``rows``, the report rows (embedding tables first; a streaming
    export fills its rows in when it writes)."""

    delegates: list[Any]
    members: list[set[Any] | None] | None
    rows: list[ReportRow]

    @property
    def pure(self) -> Any:
        """The one ``Lowered`` graph of a pure program."""
        assert self.members is None, "a mixed program has a graph per delegate"
        return self.delegates[0]

    def exported(self, program: AtenProgram, options: ExportOptions, timings: dict[str, float]) -> Exported:
        """The ``Exported`` of a float or dynamic int8 program: its one graph, or its delegates and
        the program that runs them (``emit.py``)."""
        if self.members is None:
            lowered = self.pure
            return Exported(lowered.graph, self.rows, options.policy.weights, options.method, options.target,
                            lowered.inputs, lowered.outputs, timings, lowered.sources)
        from ...graph import named_payload
        from ..emit import emit, input_specs, output_specs, placements

        delegates = self.delegates
        inputs, outputs = input_specs(program), output_specs(program)
        with stage("emit", timings):
            builder = emit(program, delegates, [None if d is None else named_payload(d.graph, f"xnnquant.delegate{k}.")
                                                for k, d in enumerate(delegates)], inputs, outputs)
        graphs = [d for d in delegates if d is not None]
        first = graphs[0] if graphs else None
        exported = Exported(first.graph if first is not None else None, self.rows,  # type: ignore[arg-type]
                            options.policy.weights, options.method, options.target, inputs, outputs, timings,
                            first.sources if first is not None else [])
        exported.delegates = [d.graph for d in graphs]
        exported.delegate_sources = [d.sources for d in graphs]
        exported.placement = placements(program)
        exported.builder = builder
        return exported


def lower_program(program: AtenProgram, members: list[set[Any] | None] | None, options: ExportOptions,
                  pass_options: PassOptions, statistics: Any, timings: dict[str, float],
                  streaming: bool) -> Lowering:
    """The ``Lowering`` of ``program`` (module docstring); ``streaming``: a streaming export, whose
    weights are read and quantized when it is written."""
    from ..lowering.context import WeightOptions
    from ..lowering.walk import Lowered, lower
    from ..passes.embeddings import embedding_rows

    static = options.static_int8
    if static is not None and members is not None:
        refuse_mixed_static(program)
    policy = options.policy if static is None else float_policy()
    # a dynamic pure program may be lowered again after refusals: its filters' quantization is kept
    twice = members is None and options.dynamic_shapes is not None and not options.strict
    weights = WeightOptions(policy, options.method, statistics, memo={} if twice else None)
    bar = progress_bar(options.progress, f"export {options.policy.weights}")
    delegates: list[Lowered | None]
    with stage("lower", timings):
        if members is None:  # a pure program: one XNNPACK graph, the program's inputs and outputs its own
            lowered = lower(program, options.target, weights, bar, raise_refusals=False)
            members = portable_after_refusals(program, lowered, options, pass_options, streaming)
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
        warn_unused(f"embeddings={str(options.embeddings)!r} does nothing: the module looks up no constant table "
                    "(aten.embedding); its program is what it would be without it")
    return Lowering(delegates, members, rows)


def progress_bar(enabled: bool, desc: str) -> Any:
    """A progress bar over the nodes being lowered (tqdm's, when installed), or None."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None

    def bar(items: Iterator[Any], total: int) -> Iterator[Any]:
        return iter(tqdm(items, total=total, desc=desc, unit="node", leave=False))

    return bar
