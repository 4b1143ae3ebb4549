"""Offline GEMM prepacking (xnnquant.packing.pack_gemm) beside XNNPACK's own packing.

For a 4096 x 4096 weight of every type this CPU has a kernel for, prints:
  ours     fastest wall time of pack_gemm with the configuration XNNPACK selects here
  cpu      the same in process CPU time (steadier than wall time on a shared machine)
  xnnpack  fastest wall time of xnn_create_fully_connected_nc_<op> without a weights cache
           (XNNPACK allocates and packs the weights; that is the load-time cost prepacking
           removes from the device)
  GB/s     packed bytes written per second, and input + output bytes moved per second
  prepacked  the same creation served our buffer through a weights cache (PrepackedCache):
           what loading costs once the packing is done offline
  equal    whether the two buffers are byte for byte the same (captured once)
A memcpy of the same number of bytes, timed in the same run, gives the machine's
bandwidth for reference (the machine may be shared: compare figures from one run).

Run: .venv/bin/python benchmarks/gemm_packing.py [--size 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

import xnnquant as xq
from xnnquant.packing import pack_gemm
from xnnquant.xnnpack.capture import capture_packed_weights, creation_seconds, selected_configs


def fastest(fn, repeat: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def weights(n: int, k: int, rng: np.random.Generator) -> list[tuple[str, str, object]]:
    """(label, operator, weight) for every weight type."""
    scale = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    q8 = xq.QuantizedTensor(xq.Datatype.qcint8, rng.integers(-128, 128, (n, k)).astype(np.int8), scale, channel_dim=0)
    q4 = xq.QuantizedTensor(xq.Datatype.qcint4, rng.integers(-8, 8, (n, k)).astype(np.int8), scale,
                            channel_dim=0)
    out: list[tuple[str, str, object]] = [("f32", "f32", rng.standard_normal((n, k)).astype(np.float32)),
                                          ("qc8w (qd8 input)", "qd8_f32_qc8w", q8),
                                          ("qc8w (qdu8 input)", "qdu8_f32_qc8w", q8),
                                          ("qc4w (qd8 input)", "qd8_f32_qc4w", q4),
                                          ("qc4w (qdu8 input)", "qdu8_f32_qc4w", q4)]
    for group in (32, 128):
        s = rng.uniform(1e-3, 1e-1, (n, k // group)).astype(ml_dtypes.bfloat16).astype(np.float32)
        qb = xq.QuantizedTensor(xq.Datatype.qbint4, rng.integers(-8, 8, (n, k)).astype(np.int8), s,
                                group_size=group)
        out += [(f"qb4w g{group} (qd8 input)", "qd8_f32_qb4w", qb),
                (f"qb4w g{group} (qdu8 input)", "qdu8_f32_qb4w", qb)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = k = args.size
    rng = np.random.default_rng(0)
    bias = rng.standard_normal(n).astype(np.float32)
    selected = selected_configs()
    print(f"GEMM weight packing, {n} x {k}, with bias; fastest of {args.repeat} runs")
    print(f"{'weights':24} {'tile (mr x nr, kr, sr, planes) [isa]':50} {'MB out':>7} {'ours ms':>8} {'cpu ms':>7} "
          f"{'GB/s out':>8} {'GB/s r+w':>8} {'xnnpack ms':>10} {'ratio':>6} {'prepacked ms':>12} {'equal':>5}")
    for label, operator, weight in weights(n, k, rng):
        config = selected[operator]
        if config is None:
            print(f"{label:24} no kernel on this CPU (xnn_status_unsupported_hardware)")
            continue
        ours = fastest(lambda: pack_gemm(weight, bias, config=config), args.repeat)
        cpu = fastest(lambda: pack_gemm(weight, bias, config=config), args.repeat, time.process_time)
        packed = pack_gemm(weight, bias, config=config)
        theirs = creation_seconds(weight, bias, operator=operator, repeat=args.repeat)
        served = creation_seconds(weight, bias, operator=operator, repeat=args.repeat, prepacked=packed)
        same = np.array_equal(packed, capture_packed_weights(weight, bias, operator=operator, deduce=False).data)
        source = weight.codes.nbytes if isinstance(weight, xq.QuantizedTensor) else weight.nbytes
        tile = f"{config.mr}x{config.nr}, kr {config.kr}, sr {config.sr}, planes {config.planes} [{config.isa}]"
        print(f"{label:24} {tile:50} {packed.nbytes / 1e6:7.1f} {ours * 1e3:8.1f} {cpu * 1e3:7.1f} "
              f"{packed.nbytes / ours / 1e9:8.2f} {(packed.nbytes + source) / ours / 1e9:8.2f} {theirs * 1e3:10.1f} "
              f"{ours / theirs:6.2f} {served * 1e3:12.2f} {same!s:>5}")
    block = np.ones(n * k * 4, np.uint8)
    target = np.empty_like(block)
    copy = fastest(lambda: np.copyto(target, block), args.repeat)
    copy_cpu = fastest(lambda: np.copyto(target, block), args.repeat, time.process_time)
    print(f"reference: memcpy of {block.nbytes / 1e6:.0f} MB takes {copy * 1e3:.1f} ms ({copy_cpu * 1e3:.1f} ms cpu), "
          f"{2 * block.nbytes / copy / 1e9:.2f} GB/s read + write")


if __name__ == "__main__":
    main()
