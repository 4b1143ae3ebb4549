"""The per-weight report of an export: one row per layer weight, printed as a table; and
``stage``, which times each stage of an export into its ``timings``."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any


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
