"""How much the "mse" scale search gains over min-max, and how long it takes.

Weights: the 36 encoder linears of all-MiniLM-L6-v2 (``xnnquant.models.weights.minilm_linears``).
SQNR is pooled over all of them: ``10 log10(sum w**2 / sum (w - dequantize(quantize(w)))**2)``.

* blockwise int4, group 32: baseline is torchao's symmetric min-max (``bf16(max|g| / 7.5)``),
  searched is ``method="mse"``; the bar is a gain of at least 0.80 dB, and the searched
  quantization of all 36 linears in under 10 s;
* per-channel int4 and int8: min-max against mse;
* the exhaustive optimum over every bf16 scale in ``[1/32, 2] * max|g|`` per group, on a
  subset of the linears (``--exhaustive all`` for all of them, slow), to show how close
  the search comes.

Run: ``python benchmarks/mse_search.py [--exhaustive none|subset|all] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import xnnquant as xq
from xnnquant.models.weights import minilm_linears
from xnnquant.schemes import search

GAIN_BAR_DB = 0.80
TIME_BAR_S = 10.0


def sqnr_db(weights: list[np.ndarray], dequantized: list[np.ndarray]) -> float:
    signal = sum(float(np.sum(w.astype(np.float64) ** 2)) for w in weights)
    noise = sum(float(np.sum((w.astype(np.float64) - d) ** 2)) for w, d in zip(weights, dequantized))
    return 10 * np.log10(signal / noise)


def timed(quantize: Callable[[np.ndarray], xq.QuantizedTensor], weights: list[np.ndarray],
          repeat: int) -> tuple[list[xq.QuantizedTensor], list[float], list[float]]:
    """Quantize every weight ``repeat`` times: the last run's results, each run's wall-clock
    and CPU (this process) seconds.  Wall > CPU means other processes took the cores."""
    times, cpu_times = [], []
    for _ in range(repeat):
        start, cpu_start = time.perf_counter(), time.process_time()
        results = [quantize(w) for w in weights]
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    return results, times, cpu_times


def compare(name: str, weights: list[np.ndarray], baseline: Callable, searched: Callable,
            repeat: int) -> tuple[float, float, list[float]]:
    base, base_times, _ = timed(baseline, weights, 1)
    found, times, cpu_times = timed(searched, weights, repeat)
    base_db = sqnr_db(weights, [q.dequantize() for q in base])
    found_db = sqnr_db(weights, [q.dequantize() for q in found])
    print(f"{name:28s} min-max {base_db:7.3f} dB   mse {found_db:7.3f} dB   gain {found_db - base_db:+.3f} dB   "
          f"time min-max {base_times[0]:.2f} s, mse {min(times):.2f} s\n{'':28s} mse runs: wall "
          f"{', '.join(f'{t:.2f}' for t in times)} s; CPU {', '.join(f'{t:.2f}' for t in cpu_times)} s")
    return base_db, found_db, times


def exhaustive(weights: list[np.ndarray], label: str) -> None:
    """Search gain against the exhaustive bf16 optimum (blockwise int4, g = 32) on ``weights``."""
    start = time.perf_counter()
    best = []
    for w in weights:
        blocks = w.reshape(-1, 32)
        scale = search.exhaustive_bf16_scales(blocks, -8, 7)
        best.append(xq.quantize_blockwise(w, 32, scale=scale.reshape(w.shape[0], -1)).dequantize())
    elapsed = time.perf_counter() - start
    base_db = sqnr_db(weights, [xq.quantize_blockwise(w, 32).dequantize() for w in weights])
    mse_db = sqnr_db(weights, [xq.quantize_blockwise(w, 32, method="mse").dequantize() for w in weights])
    best_db = sqnr_db(weights, best)
    share = (mse_db - base_db) / (best_db - base_db)
    print(f"exhaustive bf16 optimum on {label}: min-max {base_db:.3f} dB, mse {mse_db:.3f} dB "
          f"(gain {mse_db - base_db:+.3f}), exhaustive {best_db:.3f} dB (gain {best_db - base_db:+.3f}); "
          f"search reaches {100 * share:.1f}% of the exhaustive gain [{elapsed:.1f} s]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exhaustive", choices=["none", "subset", "all"], default="subset")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of the searched quantization")
    args = parser.parse_args()

    linears = minilm_linears()
    weights = list(linears.values())
    print(f"all-MiniLM-L6-v2: {len(weights)} encoder linears, {sum(w.size for w in weights):,} weights")

    base_db, found_db, times = compare(
        "blockwise int4, g=32", weights,
        lambda w: xq.quantize_blockwise(w, 32, method="minmax"),
        lambda w: xq.quantize_blockwise(w, 32, method="mse"), args.repeat,
    )
    gain = found_db - base_db
    print(f"  bar: gain {gain:+.3f} dB >= +{GAIN_BAR_DB:.2f} dB: {'PASS' if gain >= GAIN_BAR_DB else 'FAIL'};  "
          f"time {min(times):.2f} s (slowest run {max(times):.2f} s) < {TIME_BAR_S:.0f} s: "
          f"{'PASS' if max(times) < TIME_BAR_S else 'FAIL'}")

    compare("per-channel int4", weights,
            lambda w: xq.quantize_per_channel(w, 4, method="minmax"),
            lambda w: xq.quantize_per_channel(w, 4, method="mse"), args.repeat)
    compare("per-channel int8", weights,
            lambda w: xq.quantize_per_channel(w, 8, method="minmax"),
            lambda w: xq.quantize_per_channel(w, 8, method="mse"), 1)

    if args.exhaustive == "subset":
        names = list(linears)[::7]  # one linear of each kind, spread over the layers
        short = ", ".join(n.split(".", 2)[2] for n in names)
        exhaustive([linears[n] for n in names], f"{len(names)} linears ({short})")
    elif args.exhaustive == "all":
        exhaustive(weights, "all 36 linears")


if __name__ == "__main__":
    main()
