"""Cost of reaching the real XNNPACK through xnnquant.xnnpack, on MiniLM-sized layers.

Prints, for each weight type and path: the wall time of one ``fully_connected`` call
(subgraph build, weight packing, one run, teardown), the XNNPACK operator time of that
(first, cold) run as its profiler reports it, both the best of a few calls, and the
operator that ran; then ``convert_f32_qd8``
and ``static_fully_connected`` figures.  Weights are random (shapes of
all-MiniLM-L6-v2: hidden 384, intermediate 1536, 128 tokens).  One thread.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

import xnnquant.xnnpack as xx
from xnnquant import Datatype, QuantizedTensor

TOKENS = 128
LAYERS = [(384, 384), (1536, 384), (384, 1536)]  # (N, K)
REPEATS = 5


def weight(kind: str, n: int, k: int, rng: np.random.Generator) -> QuantizedTensor | np.ndarray:
    if kind == "fp32":
        return rng.standard_normal((n, k)).astype(np.float32)
    if kind == "qcint8":
        return QuantizedTensor(Datatype.qcint8, rng.integers(-127, 128, (n, k)).astype(np.int8),
                               rng.uniform(1e-3, 1e-2, n).astype(np.float32), channel_dim=0)
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    if kind == "qcint4":
        return QuantizedTensor(Datatype.qcint4, codes, rng.uniform(1e-2, 1e-1, n).astype(np.float32), channel_dim=0)
    g = int(kind.split("g")[1])
    scales = rng.uniform(1e-2, 1e-1, (n, k // g)).astype(ml_dtypes.bfloat16).astype(np.float32)
    return QuantizedTensor(Datatype.qbint4, codes, scales, group_size=g)


def best_of(fn, repeats: int = REPEATS) -> tuple[float, float]:
    """(best wall seconds of ``fn()``, best XNNPACK operator milliseconds of those calls)."""
    best, best_op = float("inf"), float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        best_op = min(best_op, sum(xx.last_timings_us()) / 1e3)
    return best, best_op


def main() -> None:
    rng = np.random.default_rng(0)
    xx.load_library()
    print(f"fully_connected, M={TOKENS} tokens, best of {REPEATS} calls")
    print(f"{'weight':10} {'path':11} {'N x K':>11} {'call ms':>8} {'op ms':>7} {'GOP/s':>6}  operator")
    cases = [("qcint8", True), ("qcint4", True), ("qbint4-g32", True), ("qbint4-g128", True),
             ("qcint8", False), ("qcint4", False), ("fp32", False)]
    for kind, dynamic in cases:
        for n, k in LAYERS:
            w = weight(kind, n, k, rng)
            x = rng.standard_normal((TOKENS, k)).astype(np.float32)
            seconds, op_ms = best_of(lambda: xx.fully_connected(x, w, dynamic=dynamic))
            gops = 2 * TOKENS * n * k / max(op_ms, 1e-3) / 1e6
            path = "dynamic" if dynamic else "weight-only"
            print(f"{kind:10} {path:11} {n:>5} x {k:<5} {seconds * 1e3:8.2f} {op_ms:7.2f} {gops:6.1f}  "
                  f"{', '.join(xx.last_operators())}")

    print("\nconvert_f32_qd8 (convert_nc_f32_qd8)")
    for m, k in [(128, 384), (128, 1536), (4096, 384)]:
        x = rng.standard_normal((m, k)).astype(np.float32)
        seconds, _ = best_of(lambda: xx.convert_f32_qd8(x))
        print(f"  {m:5} x {k:<5} {seconds * 1e3:7.2f} ms  {m * k * 4 / seconds / 1e9:5.2f} GB/s of fp32 input")

    print("\nstatic_fully_connected (qint8 x qcint8 -> qint8)")
    for n, k in LAYERS:
        x = QuantizedTensor(Datatype.qint8, rng.integers(-128, 128, (TOKENS, k)).astype(np.int8), 0.02, 3)
        w = weight("qcint8", n, k, rng)
        seconds, op_ms = best_of(lambda: xx.static_fully_connected(x, w, output_scale=0.5))
        print(f"  {n:5} x {k:<5} call {seconds * 1e3:7.2f} ms, op {op_ms:6.2f} ms  {', '.join(xx.last_operators())}")


if __name__ == "__main__":
    main()
