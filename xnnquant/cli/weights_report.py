"""The main job of ``make run``: every scheme on all-MiniLM-L6-v2's linear weights.

Quantizes the 36 encoder linears with each scheme and prints what the weights cost in
bytes (codes plus scales, as XNNPACK stores them) and what they keep of the signal
(weight SQNR over all linears, and the worst single linear).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np

import xnnquant as xq

from ..metrics import bits_per_weight, sqnr_db
from ..schemes.checks import Method
from ..tensor import QuantizedTensor

#: The weight-only scale choices the report compares.
SCALE_METHODS: tuple[Method, ...] = ("minmax", "mse")


@dataclass(frozen=True)
class Scheme:
    """One row of the report: a label and how to quantize one weight."""

    label: str
    method: str
    quantize: Callable[[np.ndarray], QuantizedTensor]


def default_schemes(group_sizes: Iterable[int] = (32, 64, 128)) -> list[Scheme]:
    """Every scheme the library offers, with both scale choices where there is one."""
    schemes = [Scheme("qint8 per-tensor", "minmax", lambda w: xq.quantize_per_tensor(w, dtype=xq.Datatype.qint8))]
    for method in SCALE_METHODS:
        schemes.append(Scheme("qcint8 per-channel", method, partial(xq.quantize_per_channel, bits=8, method=method)))
    for method in SCALE_METHODS:
        schemes.append(Scheme("qcint4 per-channel", method, partial(xq.quantize_per_channel, bits=4, method=method)))
    for g in group_sizes:
        for method in SCALE_METHODS:
            schemes.append(Scheme(f"qbint4 group {g}", method,
                                  partial(xq.quantize_blockwise, group_size=g, method=method)))
    return schemes


@dataclass(frozen=True)
class Row:
    scheme: Scheme
    nbytes: int
    bits_per_weight: float
    sqnr_all: float
    sqnr_worst: float
    seconds: float


def measure(weights: dict[str, np.ndarray], schemes: list[Scheme]) -> list[Row]:
    """Quantize every weight with every scheme; sizes include the scales."""
    numel = sum(w.size for w in weights.values())
    reference = np.concatenate([w.ravel() for w in weights.values()])
    rows = []
    for scheme in schemes:
        start = time.perf_counter()
        tensors = {name: scheme.quantize(w) for name, w in weights.items()}
        seconds = time.perf_counter() - start
        bits = sum(bits_per_weight(qt) * qt.codes.size for qt in tensors.values())
        approx = np.concatenate([qt.dequantize().ravel() for qt in tensors.values()])
        worst = min(sqnr_db(weights[n], qt.dequantize()) for n, qt in tensors.items())
        rows.append(Row(scheme, round(bits / 8), bits / numel, sqnr_db(reference, approx), worst, seconds))
    return rows


def format_table(rows: list[Row], numel: int) -> str:
    header = f"{'scheme':<20} {'scales':<7} {'bytes':>12} {'bits/w':>7} {'SQNR dB':>8} {'worst dB':>9} {'time s':>7}"
    lines = [header, "-" * len(header),
             f"{'fp32 (reference)':<20} {'-':<7} {numel * 4:>12,} {32.0:>7.2f} {'inf':>8} {'inf':>9} {'-':>7}"]
    for r in rows:
        lines.append(f"{r.scheme.label:<20} {r.scheme.method:<7} {r.nbytes:>12,} {r.bits_per_weight:>7.2f} "
                     f"{r.sqnr_all:>8.2f} {r.sqnr_worst:>9.2f} {r.seconds:>7.2f}")
    return "\n".join(lines)


def main(group_sizes: Iterable[int] = (32, 64, 128)) -> str:
    from ..models.weights import minilm_linears

    weights = minilm_linears()
    numel = sum(w.size for w in weights.values())
    rows = measure(weights, default_schemes(group_sizes))
    title = (f"all-MiniLM-L6-v2: {len(weights)} encoder linear weights, {numel:,} parameters\n"
             "bytes = codes + scales as XNNPACK stores them; SQNR over all weights, worst = lowest single layer\n")
    return title + format_table(rows, numel)
