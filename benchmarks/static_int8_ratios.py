"""The static int8 time estimate's ratios (``static_int8/mixed.py``) against this machine, layer by layer.

For each single-layer module (a 3x3 convolution, a fully connected layer, a 3x3 depthwise
convolution), exported in fp32 and in static int8 (converts at the graph's edges included):
the median CPU time of one call on one XNNPACK thread of each program, their ratio, and the
ratio ``mixed.estimate`` predicts for the same two graphs with the ratios of this machine's CPU
class and of every other class.  The programs run in this process, interleaved call by call
(the machine's load falls on both alike); CPU time (``time.thread_time``) with XNNPACK's pool of
one thread, which runs on the calling thread.

    python benchmarks/static_int8_ratios.py [--repeats 30]

The classes' ratios besides ``avx512vnni`` are derived, not measured (``mixed.py``): run this on
a CPU of another class to measure them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def layers() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """name -> (module, example input)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return {
        "conv 3x3 64->64, 56x56": (nn.Conv2d(64, 64, 3, padding=1).eval(), (torch.randn(1, 64, 56, 56),)),
        "fully connected 1024->1024, 64 rows": (nn.Linear(1024, 1024).eval(), (torch.randn(64, 1024),)),
        "depthwise 3x3, 128 channels, 56x56": (nn.Conv2d(128, 128, 3, padding=1, groups=128).eval(),
                                               (torch.randn(1, 128, 56, 56),)),
    }


def cpu_times(ptes: list[bytes], example: tuple[Any, ...], repeats: int) -> list[float]:
    """Median CPU seconds of one call of each program, the programs called in turn."""
    from executorch.runtime import Runtime

    programs = [Runtime.get().load_program(p) for p in ptes]
    methods = [p.load_method("forward") for p in programs]
    for m in methods:
        m.execute(list(example))
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(repeats):
        for i, m in enumerate(methods):
            start = time.thread_time()
            m.execute(list(example))
            times[i].append(time.thread_time() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    import torch
    from executorch.extension.pybindings import portable_lib

    import xnnquant as xq
    from xnnquant.frontend.static_int8.mixed import cost_model, estimate
    from xnnquant.xnnpack.cpu import CLASS_NAMES, this_cpu

    portable_lib._unsafe_reset_threadpool(1)  # before any program loads: a delegate keeps the pool it was built with
    torch.set_num_threads(1)
    here = this_cpu()
    print(f"this machine: {here.label}; one XNNPACK thread, median CPU time of {args.repeats} calls")
    classes = [here.int8_class] + [c for c in CLASS_NAMES if c != here.int8_class and c != "sse"]
    print(f"{'layer':40} {'fp32 ms':>8} {'int8 ms':>8} {'ratio':>6}  estimated ratio: "
          + ", ".join(f"{c}{' (here)' if c == here.int8_class else ''}" for c in classes))
    for name, (module, example) in layers().items():
        calibration = [tuple(t + 0.1 * torch.randn_like(t) for t in example) for _ in range(4)]
        floats = xq.export(module, example, weights="fp32", progress=False)
        ints = xq.export(module, example, weights="qc8w", calibration=calibration, progress=False,
                         activations=xq.StaticInt8(ranges="minmax"))
        f_ms, i_ms = (1e3 * t for t in cpu_times([floats.to_pte(), ints.to_pte()], example, args.repeats))
        graph = ints.static_int8.float_graph
        everything = set(range(len(graph.nodes)))
        predicted = [estimate(graph, set(), cost_model(c)) / estimate(graph, everything, cost_model(c))
                     for c in classes]
        print(f"{name:40} {f_ms:8.3f} {i_ms:8.3f} {i_ms / f_ms:6.2f}  " + ", ".join(f"{p:.2f}" for p in predicted))


if __name__ == "__main__":
    main()
