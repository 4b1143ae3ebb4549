"""What an export reports, and the warnings it raises from what it reports.

* ``ReportRow``: one row per layer weight (``Exported.report``), printed as a table
  (``format_report``, ``totals``);
* ``CheckReport``: what ``xq.check`` found;
* the four warnings of ``xq.export``, each beside its rule: ``FallbackWarning`` (rows that took
  another scheme: ``warn_fallbacks``), ``OptionWarning`` (an option that does nothing here, or a
  static int8 choice not followed: ``warn_unused``, ``warn_static``), ``AccuracyWarning`` and
  ``PerformanceWarning`` (the static int8 program's measured outputs and run time, the
  ``Measured`` line of its report: ``warn_static``).  Each points at the caller's line
  (``errors.warn_caller``);
* ``stage``, which times each stage of an export into its ``timings``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..errors import warn_caller

if TYPE_CHECKING:
    from .exported import Exported


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the seconds the block takes to ``timings[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class ReportRow:
    """One weight: its module, the shape stored, the scheme it took, its bytes in the
    payload (data and scales), its SQNR against the float weight (dB, inf when exact), and
    why it took another scheme than the one requested ('' when it did not)."""

    path: str
    shape: tuple[int, ...]
    scheme: str
    nbytes: int
    sqnr_db: float
    fallback: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def as_dict(self) -> dict[str, Any]:
        row = asdict(self)
        row["shape"] = list(self.shape)
        row["sqnr_db"] = None if math.isinf(self.sqnr_db) else round(self.sqnr_db, 3)
        return row


def _sqnr(value: float) -> str:
    return "exact" if math.isinf(value) else f"{value:.2f}"


def totals(rows: Sequence[ReportRow]) -> dict[str, Any]:
    """Rows, parameters, bytes (and as float32), bits per weight, the mean and worst SQNR
    over the rows, and how many rows took a fallback."""
    numel = sum(r.numel for r in rows)
    nbytes = sum(r.nbytes for r in rows)
    finite = [r.sqnr_db for r in rows if not math.isinf(r.sqnr_db)]
    return {
        "rows": len(rows),
        "parameters": numel,
        "bytes": nbytes,
        "fp32_bytes": 4 * numel,
        "bits_per_weight": 8 * nbytes / numel if numel else 0.0,
        "mean_sqnr_db": sum(finite) / len(finite) if finite else None,
        "worst_sqnr_db": min(finite) if finite else None,
        "fallbacks": sum(1 for r in rows if r.fallback),
    }


def format_report(rows: Sequence[ReportRow]) -> str:
    """The rows as an aligned text table, then a totals line."""
    header = ("module", "shape", "scheme", "bytes", "SQNR dB", "fallback")
    body = [(r.path or "<top level>", "x".join(map(str, r.shape)), r.scheme, f"{r.nbytes:,}", _sqnr(r.sqnr_db),
             r.fallback) for r in rows]
    widths = [max(len(header[i]), *(len(b[i]) for b in body)) if body else len(header[i]) for i in range(5)]
    right = {3, 4}

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return ("  ".join(parts) + ("  " + cells[5] if cells[5] else "")).rstrip()

    t = totals(rows)
    lines = [line(header), line(tuple("-" * w for w in widths) + ("",))]
    lines += [line(b) for b in body]
    mean = "-" if t["mean_sqnr_db"] is None else f"{t['mean_sqnr_db']:.2f} dB"
    worst = "-" if t["worst_sqnr_db"] is None else f"{t['worst_sqnr_db']:.2f} dB"
    lines.append(
        f"total: {t['rows']} weights, {t['parameters']:,} parameters, {t['bytes']:,} bytes "
        f"({t['bits_per_weight']:.2f} bits per weight; fp32 {t['fp32_bytes']:,}), SQNR mean {mean}, "
        f"worst {worst}, {t['fallbacks']} fallback(s)")
    return "\n".join(lines)


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


# ------------------------------------------------------------------ warnings


class FallbackWarning(UserWarning):
    """Some layers of an export took another scheme than ``weights=`` (``fallback="auto"``)."""


class OptionWarning(UserWarning):
    """An option of ``xq.export`` is valid but does nothing here: ``embeddings=`` on a module
    without an embedding table, ``method="minmax"`` with nothing quantized.  An option that is
    malformed or contradicts another (a scheme twice in ``fallback=``, ``dynamic_shapes``
    without a Dim, ``calibration=`` or ``method="gptq"`` with ``weights="fp32"``) is refused
    instead (``ExportOptions.parse``)."""


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


def warn_unused(message: str) -> None:
    """One ``OptionWarning``: an option that does nothing here (the message says which and why)."""
    warn_caller(message, OptionWarning)


def warn_fallbacks(exported: Exported) -> None:
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


def warn_static(exported: Exported) -> None:
    """One ``OptionWarning`` for the static int8 choices not followed (``Int8Graph.notes``), one
    ``AccuracyWarning`` when the measured outputs are mostly error, one ``PerformanceWarning`` when
    the program ran slower than its float graph (``Int8Graph.measured``)."""
    int8 = exported.static_int8.int8
    if int8.notes:
        warn_unused(f"activations={str(exported.activations)!r} was not followed in full: " + "; ".join(int8.notes))
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
