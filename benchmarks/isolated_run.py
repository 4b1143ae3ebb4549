"""Cost of ``run(..., isolate=True)`` against ``run(...)`` in the calling process.

Prints: the time to start the worker process (a fresh Python importing torch and
executorch) and, for a tiny payload and for MiniLM-sized linears (128 tokens, qdint8 x
qbint4 g32, K x N = 384 x 1536 and 1536 x 384, one payload each, already loaded), the
best-of-N time of one call in process and isolated, and the difference: the price of
isolation per call (copying inputs and outputs through the memory-mapped file, two
pickled messages).  Also the time of a call that loads a new payload, both ways.
"""

from __future__ import annotations

import time

import numpy as np

import xnnquant as xq
from xnnquant.graph import Graph, run
from xnnquant.graph.worker import worker

REPEATS = 30


def best_of(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def tiny() -> tuple[Graph, list[np.ndarray]]:
    g = Graph()
    a, b = g.input((2, 3)), g.input((2, 3))
    g.output(g.add(a, b))
    return g, [np.ones((2, 3), np.float32)] * 2


def linear(n: int, k: int, seed: int = 0) -> tuple[Graph, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input((128, k))
    w = xq.quantize_blockwise(rng.standard_normal((n, k)).astype(np.float32), group_size=32)
    g.output(g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(w)))
    return g, [rng.standard_normal((128, k)).astype(np.float32)]


def main() -> None:
    g, inputs = tiny()
    t = time.perf_counter()
    run(g, inputs, isolate=True)
    print(f"worker start + first call (import torch + executorch in a new process): "
          f"{time.perf_counter() - t:.2f} s")
    run(g, inputs)  # imports torch + executorch here too
    cases = {"tiny add (2 x 3)": tiny(), "qdint8 x qbint4 384 -> 1536": linear(1536, 384),
             "qdint8 x qbint4 1536 -> 384": linear(384, 1536)}
    print(f"{'payload':<30} {'in process':>12} {'isolated':>12} {'overhead':>12}   (best of {REPEATS})")
    for name, (g, inputs) in cases.items():
        payload = g.to_bytes()
        run(payload, inputs)
        run(payload, inputs, isolate=True)
        here = best_of(lambda: run(payload, inputs))
        there = best_of(lambda: run(payload, inputs, isolate=True))
        print(f"{name:<30} {here * 1e3:>9.3f} ms {there * 1e3:>9.3f} ms {(there - here) * 1e3:>9.3f} ms")
    for isolate in (False, True):
        g, inputs = linear(1536, 384, seed=1 + isolate)
        t = time.perf_counter()
        run(g, inputs, isolate=isolate)
        print(f"first call of a new payload ({'isolated' if isolate else 'in process'}): "
              f"{(time.perf_counter() - t) * 1e3:.0f} ms")
    print(f"worker processes started: {worker().starts}")


if __name__ == "__main__":
    main()
