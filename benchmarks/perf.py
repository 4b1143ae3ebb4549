"""Performance and scale of xnnquant (issue 13), in one run: ``make bench``.

Sections (``--only`` picks some; all run by default):

* ``quantize``: quantize + ``to_bytes`` of qb4w g32, qc4w and qc8w ``minmax`` weights of
  4096 x 4096 and 11008 x 4096 float32, against a numpy copy of the same input and
  against torchao's path (``choose_qparams_affine`` + ``quantize_affine`` + nibble
  packing in torch).  Goal for qb4w g32: within 4x the copy, at least 8x faster than
  torchao.
* ``mse``: ``method="mse"`` (qb4w g32) over all-MiniLM-L6-v2's 36 linears against
  torchao's ``hqq_scale_only``: wall time and pooled weight SQNR of each.  Goal: at
  least as fast, at least 0.25 dB more accurate.

Timing: the variants of one case run interleaved, ``--repeat`` rounds, and the median
of each is printed (other processes share the cores; interleaving spreads their noise
over all variants alike).  The 1-minute load average is printed with each section.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

import xnnquant as xq
from xnnquant.parallel import num_threads

SECTIONS = ("quantize", "mse")


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def interleaved(variants: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median wall seconds of each variant, the variants run in turn ``repeat`` times."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm-up: imports, first-touch of the inputs
        fn()
    for _ in range(repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


# ------------------------------------------------------------------ quantize + pack


def torchao_path(w: np.ndarray, block: tuple[int, int], bits: int) -> Callable[[], bytes]:
    """torchao's symmetric min-max scales and codes, packed two nibbles a byte in torch."""
    import torch
    from torchao.quantization import quant_primitives as qp

    t = torch.from_numpy(w)
    qmin, qmax = (-8, 7) if bits == 4 else (-128, 127)

    def run() -> bytes:
        scale, zero = qp.choose_qparams_affine(t, qp.MappingType.SYMMETRIC, block, torch.int8, qmin, qmax)
        q = qp.quantize_affine(t, block, scale, zero, torch.int8, qmin, qmax)
        if bits == 8:
            return q.numpy().tobytes()
        u = (q + 8).to(torch.uint8)
        return (u[:, 0::2] | (u[:, 1::2] << 4)).numpy().tobytes()

    return run


def bench_quantize(repeat: int) -> None:
    print(f"\n== quantize + to_bytes, minmax, medians of {repeat} interleaved runs; {load_note()}")
    print(f"{'scheme':9} {'shape':>12} {'copy':>8} {'ours':>8} {'ours/copy':>9} {'torchao':>8} {'speed-up':>8}")
    rng = np.random.default_rng(0)
    schemes = {
        "qb4w g32": (lambda w: xq.quantize_blockwise(w, 32).to_bytes(), lambda k: (1, 32), 4),
        "qc4w": (lambda w: xq.quantize_per_channel(w, 4).to_bytes(), lambda k: (1, k), 4),
        "qc8w": (lambda w: xq.quantize_per_channel(w, 8).to_bytes(), lambda k: (1, k), 8),
    }
    for shape in [(4096, 4096), (11008, 4096)]:
        w = rng.standard_normal(shape, dtype=np.float32)
        for name, (ours, block, bits) in schemes.items():
            med = interleaved({
                "copy": lambda: w.copy(),
                "ours": lambda: ours(w),
                "torchao": torchao_path(w, block(shape[1]), bits),
            }, repeat)
            print(f"{name:9} {'x'.join(map(str, shape)):>12} {1e3 * med['copy']:6.1f}ms {1e3 * med['ours']:6.1f}ms "
                  f"{med['ours'] / med['copy']:8.2f}x {1e3 * med['torchao']:6.1f}ms "
                  f"{med['torchao'] / med['ours']:7.1f}x", flush=True)
    print(f"goal (qb4w g32): ours within 4x the copy, torchao at least 8x slower; {load_note()}")


# ------------------------------------------------------------------ mse vs hqq


def sqnr_db(weights: list[np.ndarray], approx: list[np.ndarray]) -> float:
    signal = sum(float(np.sum(w.astype(np.float64) ** 2)) for w in weights)
    noise = sum(float(np.sum((w.astype(np.float64) - a) ** 2)) for w, a in zip(weights, approx))
    return 10 * np.log10(signal / noise)


def bench_mse(repeat: int) -> None:
    import torch
    from torchao.quantization import quant_primitives as qp

    from xnnquant.rounding import to_bf16
    from xnnquant.weights import minilm_linears

    weights = list(minilm_linears().values())
    tensors = [torch.from_numpy(w) for w in weights]
    print(f"\n== mse vs torchao hqq_scale_only, qb4w g32, all-MiniLM-L6-v2's {len(weights)} linears "
          f"({sum(w.size for w in weights):,} weights), medians of {repeat} interleaved runs; {load_note()}")
    results: dict[str, list] = {}

    def ours() -> None:
        results["ours"] = [xq.quantize_blockwise(w, 32, method="mse") for w in weights]

    def hqq() -> None:
        results["hqq"] = [qp._choose_qparams_and_quantize_scale_only_hqq(t, [1, 32], -8, 7) for t in tensors]

    def minmax() -> None:
        results["minmax"] = [xq.quantize_blockwise(w, 32) for w in weights]

    med = interleaved({"mse": ours, "hqq_scale_only": hqq, "minmax": minmax}, repeat)

    def hqq_dequantized(bf16: bool) -> list[np.ndarray]:
        out = []
        for (codes, scale), w in zip(results["hqq"], weights):
            s = scale.float().numpy()
            s = to_bf16(s).values if bf16 else s  # ExecuTorch 1.4.1 stores bf16 (RNE) scales
            out.append((codes.numpy().reshape(w.shape[0], -1, 32) * s[..., None]).reshape(w.shape))
        return out

    ours_db = sqnr_db(weights, [q.dequantize() for q in results["ours"]])
    hqq_db = sqnr_db(weights, hqq_dequantized(bf16=True))
    print(f"{'method':16} {'time':>8} {'SQNR':>9}")
    print(f"{'minmax':16} {med['minmax']:7.3f}s {sqnr_db(weights, [q.dequantize() for q in results['minmax']]):7.3f}dB")
    print(f"{'mse (ours)':16} {med['mse']:7.3f}s {ours_db:7.3f}dB")
    print(f"{'hqq_scale_only':16} {med['hqq_scale_only']:7.3f}s {hqq_db:7.3f}dB  (bf16 scales as ExecuTorch "
          f"stores them; {sqnr_db(weights, hqq_dequantized(bf16=False)):.3f} dB with its fp32 scales)")
    print(f"mse: {med['hqq_scale_only'] / med['mse']:.2f}x the speed of hqq_scale_only, {ours_db - hqq_db:+.3f} dB; "
          f"goal: >= 1x and >= +0.25 dB; {load_note()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeat", type=int, default=7, help="interleaved timed rounds per case")
    args = parser.parse_args()
    print(f"xnnquant {xq.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}, "
          f"{num_threads()} kernel threads; {load_note()}")
    for section in SECTIONS:
        if section in args.only:
            globals()[f"bench_{section}"](args.repeat)


if __name__ == "__main__":
    main()
