"""Hugging Face ``transformers`` architectures: ``xq.export`` beside ExecuTorch's flow.

For each architecture of ``tests/hf_models.py`` (small seeded configurations) and each
attention implementation it has (transformers' eager one and torch's SDPA), as users feed
it (token ids and a mask for text models: a mixed program), three programs are built:

* ExecuTorch's flow at fp32: ``torch.export``, ``to_edge_transform_and_lower`` with
  ``XnnpackPartitioner``, ``to_executorch``;
* ``xq.export(weights="fp32").to_pte()``;
* ``xq.export(weights="qb4w:32").to_pte()`` (the default ``fallback="auto"``).

Printed per case: export time of each (wall clock, from the module to the ``.pte`` bytes;
one untimed export of each flow first, so imports are not counted), the number of XNNPACK
delegates, the largest error against the module in eager torch relative to the output's
largest magnitude (fp32 programs), the cosine to it (qb4w:32), and latency: the median
wall-clock time of one call of each fp32 program, run interleaved in this process (each
call of one program followed by one of the other, so machine load falls on both).

Usage: ``python benchmarks/transformers_models.py [--repeats N] [NAME ...]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hf_models

import xnnquant as xq
from xnnquant.pte import read_pte

REPEATS = 50


def executorch_flow(module: Any, example: tuple[Any, ...]) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module, example, strict=False)
    return bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)


def ours(module: Any, example: tuple[Any, ...], weights: str) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback warnings: the benchmark reports the result
        return xq.export(module, example, weights=weights, progress=False).to_pte()


def timed(build: Any) -> tuple[bytes, float]:
    start = time.perf_counter()
    pte = build()
    return pte, time.perf_counter() - start


def delegates(pte: bytes) -> int:
    return len(read_pte(pte).delegates)


def load(pte: bytes) -> Any:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    method.program = program  # keep the program alive beside its method
    return method


def errors(method: Any, example: tuple[Any, ...], reference: np.ndarray) -> tuple[float, float]:
    got = method.execute(list(example))[0].numpy().astype(np.float64)
    error = float(np.abs(got - reference).max() / np.abs(reference).max())
    cosine = float((got * reference).sum() / np.linalg.norm(got) / np.linalg.norm(reference))
    return error, cosine


def latencies(methods: list[Any], example: tuple[Any, ...], repeats: int) -> list[float]:
    times: list[list[float]] = [[] for _ in methods]
    for method in methods:
        method.execute(list(example))
    for _ in range(repeats):
        for i, method in enumerate(methods):
            start = time.perf_counter()
            method.execute(list(example))
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def cases(names: list[str]) -> list[tuple[str, str]]:
    return [(name, attention) for name in names or list(hf_models.ARCHITECTURES)
            for attention in (("eager", "sdpa") if name in hf_models.WITH_ATTENTION else ("eager",))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", choices=[[], *hf_models.ARCHITECTURES], metavar="NAME")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    torch.manual_seed(0)
    warm, warm_inputs = hf_models.ARCHITECTURES["bert"]("eager")
    executorch_flow(warm, warm_inputs)
    ours(warm, warm_inputs, "fp32")
    header = ("model", "attention", "ExecuTorch export", "xq fp32 export", "speed-up", "delegates ET/xq",
              "error ET", "error xq fp32", "xq qb4w:32 export", "cos qb4w:32", "latency ET", "latency xq", "ratio")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    speedups, ratios = [], []
    for name, attention in cases(args.names):
        module, example = hf_models.ARCHITECTURES[name](attention)
        with torch.no_grad():
            reference = module(*example).numpy().astype(np.float64)
        theirs, t_theirs = timed(lambda: executorch_flow(module, example))
        fp32, t_fp32 = timed(lambda: ours(module, example, "fp32"))
        int4, t_int4 = timed(lambda: ours(module, example, "qb4w:32"))
        methods = [load(theirs), load(fp32), load(int4)]
        (e_theirs, _), (e_fp32, _), (_, cos_int4) = (errors(m, example, reference) for m in methods)
        lat_theirs, lat_fp32 = latencies(methods[:2], example, args.repeats)
        speedups.append(t_theirs / t_fp32)
        ratios.append(lat_fp32 / lat_theirs)
        cells = (name, attention, f"{t_theirs:.2f} s", f"{t_fp32:.2f} s", f"{t_theirs / t_fp32:.1f}x",
                 f"{delegates(theirs)}/{delegates(fp32)}", f"{e_theirs:.1e}", f"{e_fp32:.1e}", f"{t_int4:.2f} s",
                 f"{cos_int4:.4f}", f"{lat_theirs:.3f} ms", f"{lat_fp32:.3f} ms", f"{lat_fp32 / lat_theirs:.2f}")
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\nexport speed-up (ExecuTorch / xq fp32): min {min(speedups):.1f}x, "
          f"median {statistics.median(speedups):.1f}x; latency ratio (xq / ExecuTorch): max {max(ratios):.2f}, "
          f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
