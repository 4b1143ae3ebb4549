"""Which XNNPACK kernel each weight scheme gets on this CPU, and how fast it runs (issue 42).

For each scheme (fp32, qc8w, qc4w, qb4w g32) and each linear layer shape of two LLMs
(SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152; a Llama-3.2-1B-sized layer set:
hidden 2048, MLP 8192), one fully-connected layer is built as ExecuTorch builds it (a
Convert to qdint8, fused by XNNPACK into the GEMM, for the quantized schemes), and run
on the real XNNPACK with M = 1 (decode: a GEMV, bound by the weights' bytes) and M = 128
(a prompt chunk: a GEMM, bound by arithmetic), on 1 thread and on ExecuTorch's thread
pool with every core.  Printed per case: the operator the runtime ran (its profiler's
name), the kernel the model predicts for this CPU (``gemm_configs.runtime_config``),
the median time, the weights' bytes read per second (GEMV) and GFLOP/s (GEMM).

Weights are random codes (speed does not depend on their values).  Timing: each case
runs its variants interleaved, ``--repeat`` rounds of ``--inner`` invocations, median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from bench_xnnpack_bridge import weight as bridge_weight

from xnnquant import Datatype, QuantizedTensor
from xnnquant.constants import XNN_VALUE_FLAG_EXTERNAL_INPUT, XNN_VALUE_FLAG_EXTERNAL_OUTPUT
from xnnquant.packing.gemm_configs import runtime_config, select_f32_config
from xnnquant.xnnpack import _capi
from xnnquant.xnnpack.capture import cpu_features
from xnnquant.xnnpack.fully_connected import _define_weight
from xnnquant.xnnpack.subgraph import Runtime, Subgraph

SHAPES = {  # layer -> (N, K)
    "SmolLM2 up/gate 1536x576": (1536, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "SmolLM2 head 49152x576": (49152, 576),
    "1B attn 2048x2048": (2048, 2048),
    "1B up/gate 8192x2048": (8192, 2048),
    "1B down 2048x8192": (2048, 8192),
}
SCHEMES = ("fp32", "qc8w", "qc4w", "qb4w:32")


def make_weight(scheme: str, n: int, k: int, rng: np.random.Generator) -> QuantizedTensor | np.ndarray:
    """Random codes and scales of ``scheme`` (the bridge benchmark's weights)."""
    kind = {"fp32": "fp32", "qc8w": "qcint8", "qc4w": "qcint4", "qb4w:32": "qbint4g32"}[scheme]
    return bridge_weight(kind, n, k, rng)


def weight_bytes(scheme: str, n: int, k: int) -> int:
    """Bytes of the weights a GEMV reads: codes and scales."""
    return {"fp32": 4 * n * k, "qc8w": n * k + 4 * n, "qc4w": n * k // 2 + 4 * n,
            "qb4w:32": n * k // 2 + 2 * n * k // 32}[scheme]


class Layer:
    """One fully-connected layer on the real XNNPACK, set up for ``m`` rows."""

    def __init__(self, weight: QuantizedTensor | np.ndarray, m: int, threads: int) -> None:
        n, k = weight.shape
        with Subgraph(2) as sg:
            x_id = sg.tensor(Datatype.fp32, (m, k), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
            if isinstance(weight, QuantizedTensor):
                q_id = sg.dynamic_tensor((m, k), num_nonbatch_dims=1)
                sg.convert(x_id, q_id)
                x_id, w_id = q_id, _define_weight(sg, weight, False)
            else:
                w_id = sg.tensor(Datatype.fp32, (n, k), weight)
            y_id = sg.tensor(Datatype.fp32, (m, n), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
            sg.fully_connected(x_id, w_id, 0xFFFFFFFF, y_id)
            self.runtime = Runtime(sg, threads=threads)
        self.x = _capi.padded(np.random.default_rng(1).standard_normal((m, k)).astype(np.float32))
        self.y = np.zeros((m, n), np.float32)
        self.runtime.run({0: self.x, 1: self.y})  # reshape + setup + first run (packing happened at creation)
        self.invoke = self.runtime.lib.xnn_invoke_runtime
        self.operator = self.runtime.operator_names()[0]

    def time(self, inner: int) -> float:
        start = time.perf_counter()
        for _ in range(inner):
            self.invoke(self.runtime.handle)
        return (time.perf_counter() - start) / inner


def predicted(scheme: str, n: int) -> str:
    flags, uarch = cpu_features()
    if scheme == "fp32":
        config = select_f32_config(n, flags, uarch)
    else:
        config = runtime_config(scheme.split(":")[0], flags, uarch)
    if config is None:
        return "none"
    return f"{config.operator} {config.isa_name} {config.mr}x{config.nr}c{config.kr}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of each case (median)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), help="layers to run (default: all)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, len(os.sched_getaffinity(0))])
    args = parser.parse_args()
    one, five, _ = os.getloadavg()
    flags, uarch = cpu_features()
    print(f"load average {one:.2f} (1 min), {five:.2f} (5 min); {os.cpu_count()} CPUs; uarch {uarch or '-'}; "
          f"AVX-512 VNNI {'avx512_vnni' in flags}, AVX2 {'avx2' in flags}")
    rng = np.random.default_rng(0)
    print("| layer | M | threads | scheme | operator the runtime ran | model predicts | median | weights GB/s "
          "| GFLOP/s |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|")
    cases = [(name, m, threads) for threads in args.threads for name in args.shapes for m in (1, 128)]
    weights: dict[str, dict[str, QuantizedTensor | np.ndarray]] = {}
    for name, m, threads in cases:  # threads outermost: the pool is resized once per count
        n, k = SHAPES[name]
        if name not in weights:
            weights[name] = {s: make_weight(s, n, k, rng) for s in SCHEMES}
        layers = {s: Layer(w, m, threads) for s, w in weights[name].items()}
        inner = max(1, int(0.05 / max(layers["fp32"].time(1), 1e-6)))
        times: dict[str, list[float]] = {s: [] for s in SCHEMES}
        for _ in range(args.repeat):
            for s, layer in layers.items():
                times[s].append(layer.time(inner))
        for s in SCHEMES:
            t = statistics.median(times[s])
            gbs = weight_bytes(s, n, k) / t / 1e9
            flops = 2 * m * n * k / t / 1e9
            print(f"| {name} | {m} | {threads} | {s} | {layers[s].operator} | {predicted(s, n)} "
                  f"| {t * 1e6:.1f} us | {gbs:.1f} | {flops:.1f} |")
        for layer in layers.values():
            layer.runtime.close()


if __name__ == "__main__":
    main()
