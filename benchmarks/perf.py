"""Performance and scale of xnnquant (issue 13), in one run: ``make bench``.

Sections (``--only`` picks some; all run by default):

* ``quantize``: quantize + ``to_bytes`` of qb4w g32, qc4w and qc8w ``minmax`` weights of
  4096 x 4096 and 11008 x 4096 float32, with every kernel thread and with one, against a
  numpy copy of the same input (into a buffer made once: memory speed; ``w.copy()``, which
  also maps fresh pages, is printed beside it) and against torchao's path
  (``choose_qparams_affine`` + ``quantize_affine`` + nibble packing in torch); then the
  compute alone (the compiled loops, one thread, one piece of the kernels in cache)
  against the copy from memory per value, and the fixed cost of a call.  Goal for qb4w
  g32 (issue 42): within 1.5x the copy, at least 8x faster than torchao, and the compute
  in cache at most a third of the copy's time per value, so that a slower core (or two
  threads sharing one) still keeps up with memory.
* ``mse``: ``method="mse"`` (qb4w g32) over all-MiniLM-L6-v2's 36 linears against
  torchao's ``hqq_scale_only``: wall time and pooled weight SQNR of each, with every
  thread and with one thread each.  Goal: at least as fast, at least 0.25 dB more accurate.
* ``graph``: building and writing (``Graph.to_bytes``) chains of 10k, 20k and 100k nodes
  with an external output every 32nd node (as ``xq.verify`` exposes values): time per
  node, which must not grow with the graph.
* ``export``: ``xq.export`` of the all-MiniLM-L6-v2 encoder to a ``.pte`` against
  ExecuTorch's own flow (torchao ``Int8DynamicActivationIntxWeightConfig(int4,
  PerGroup(32))``, ``to_edge_transform_and_lower`` with ``XnnpackPartitioner``,
  ``to_executorch``), int4 group 32 weights with dynamic int8 activations in both: wall
  time of each.  Goal: ours at least 10x faster.
* ``stream``: streaming export (``xq.export(..., state_dict=)``, then ``save`` to a
  ``.pte``; ``.xnn`` too, which needs no ExecuTorch import) of a 1.07-billion-parameter
  Llama-shaped decoder (``xnnquant.models.llama``, 16 layers, hidden 2048, MLP 8192) from
  a float32 safetensors file of 4.3 GB that this script writes into a temporary directory
  (in ``$XNNQUANT_BENCH_TMP``, else the system's) and deletes at the end, each export in
  a child process: wall time, peak resident memory, and the time of one read of the
  input file, with the file's pages dropped from the page cache first (cold: the disk,
  as for a file larger than memory) or cached (warm).  Goal: peak RSS under 1.5 GB, wall
  time within 3x one read.

Timing: the variants of one case run interleaved, ``--repeat`` rounds, and the median
of each is printed (other processes share the cores; interleaving spreads their noise
over all variants alike).  The 1-minute load average is printed with each section.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import xnnquant as xq
from xnnquant.compute.parallel import num_threads

SECTIONS = ("quantize", "mse", "graph", "export", "stream")


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


def one_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with one kernel thread (``XNNQUANT_NUM_THREADS=1``)."""
    def run() -> object:
        before = os.environ.get("XNNQUANT_NUM_THREADS")
        os.environ["XNNQUANT_NUM_THREADS"] = "1"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["XNNQUANT_NUM_THREADS"]
            else:
                os.environ["XNNQUANT_NUM_THREADS"] = before
    return run


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The least wall time of ``repeat`` calls after one: a step's cost with its data in cache."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_quantize(repeat: int) -> None:
    from xnnquant.compute import jit
    from xnnquant.schemes.kernels import CHUNK_ELEMENTS

    print(f"\n== quantize + to_bytes, minmax, medians of {repeat} interleaved runs; {load_note()}")
    print(f"{'scheme':9} {'shape':>12} {'copy':>8} {'w.copy()':>8} {'ours':>8} {'ours/copy':>9} {'1 thread':>8} "
          f"{'1T/copy':>7} {'torchao':>8} {'speed-up':>8}")
    rng = np.random.default_rng(0)
    schemes = {
        "qb4w g32": (lambda w: xq.quantize_blockwise(w, 32).to_bytes(), lambda k: (1, 32), 4),
        "qc4w": (lambda w: xq.quantize_per_channel(w, 4).to_bytes(), lambda k: (1, k), 4),
        "qc8w": (lambda w: xq.quantize_per_channel(w, 8).to_bytes(), lambda k: (1, k), 8),
    }
    copy_per_value = 0.0
    for shape in [(4096, 4096), (11008, 4096)]:
        w = rng.standard_normal(shape, dtype=np.float32)
        buffer = np.empty_like(w)
        for name, (ours, block, bits) in schemes.items():
            med = interleaved({
                "copy": lambda: np.copyto(buffer, w),
                "w.copy()": lambda: w.copy(),
                "ours": lambda: ours(w),
                "ours, 1 thread": one_thread(lambda: ours(w)),
                "torchao": torchao_path(w, block(shape[1]), bits),
            }, repeat)
            if name == "qb4w g32" and shape == (4096, 4096):
                copy_per_value = med["copy"] / w.size
            print(f"{name:9} {'x'.join(map(str, shape)):>12} {1e3 * med['copy']:6.1f}ms {1e3 * med['w.copy()']:6.1f}ms "
                  f"{1e3 * med['ours']:6.1f}ms {med['ours'] / med['copy']:8.2f}x "
                  f"{1e3 * med['ours, 1 thread']:6.1f}ms {med['ours, 1 thread'] / med['copy']:6.2f}x "
                  f"{1e3 * med['torchao']:6.1f}ms {med['torchao'] / med['ours']:7.1f}x", flush=True)
    # the compute alone: the compiled loops on one piece of the kernels (CHUNK_ELEMENTS
    # values) in cache, one thread; a core that does it in a third of the copy's time per
    # value keeps up with memory, even with two threads sharing it (SMT)
    loops = jit.loops()
    if loops is not None:
        blocks = rng.standard_normal((CHUNK_ELEMENTS // 32, 32), dtype=np.float32)
        codes = np.empty(blocks.shape, np.int8)
        scales = np.empty(len(blocks), np.float32)
        inv = np.empty(len(blocks), np.float32)
        packed = np.empty(blocks.size // 2, np.uint8)
        steps = {
            "scales and codes": best_seconds(lambda: loops.minmax_codes(blocks, np.float32(7.5), True, np.float32(7),
                                                                        codes, scales, inv), 20 * repeat),
            "nibble packing": best_seconds(lambda: loops.pack_nibbles(codes.reshape(-1), packed), 20 * repeat),
        }
        per_value = {k: 1e9 * v / blocks.size for k, v in steps.items()}
        compute = sum(per_value.values())
        tiny = rng.standard_normal((8, 64), dtype=np.float32)
        fixed = best_seconds(lambda: xq.quantize_blockwise(tiny, 32).to_bytes(), 20 * repeat)
        print(f"qb4w g32 compute, one thread, {blocks.size:,} values in cache: "
              + ", ".join(f"{k} {v:.3f}" for k, v in per_value.items())
              + f" ns/value; the 4096 x 4096 copy from memory {1e9 * copy_per_value:.3f} ns/value, "
              f"{1e9 * copy_per_value / compute:.1f}x the compute; a call's fixed cost {1e6 * fixed:.0f} us")
    print(f"goal (qb4w g32): ours within 1.5x the copy, torchao at least 8x slower, the copy from memory at least 3x "
          f"the compute in cache; {load_note()}")


# ------------------------------------------------------------------ mse vs hqq


def sqnr_db(weights: list[np.ndarray], approx: list[np.ndarray]) -> float:
    signal = sum(float(np.sum(w.astype(np.float64) ** 2)) for w in weights)
    noise = sum(float(np.sum((w.astype(np.float64) - a) ** 2)) for w, a in zip(weights, approx))
    return 10 * np.log10(signal / noise)


def bench_mse(repeat: int) -> None:
    import torch
    from torchao.quantization import quant_primitives as qp

    from xnnquant.models.weights import minilm_linears
    from xnnquant.rounding import to_bf16

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
    # the same on one thread each: what each does per core, whatever else shares the machine
    # (torch's threads wait for each other at every op, which other processes can stall)
    threads = torch.get_num_threads()
    os.environ["XNNQUANT_NUM_THREADS"], before = "1", os.environ.get("XNNQUANT_NUM_THREADS")
    torch.set_num_threads(1)
    try:
        one = interleaved({"mse": ours, "hqq_scale_only": hqq}, repeat)
    finally:
        torch.set_num_threads(threads)
        if before is None:
            del os.environ["XNNQUANT_NUM_THREADS"]
        else:
            os.environ["XNNQUANT_NUM_THREADS"] = before
    print(f"one thread each: mse {one['mse']:.3f}s, hqq_scale_only {one['hqq_scale_only']:.3f}s: "
          f"{one['hqq_scale_only'] / one['mse']:.2f}x its speed; {load_note()}")


# ------------------------------------------------------------------ graph scaling


def bench_graph(repeat: int) -> None:
    from xnnquant.graph import Graph

    def chain(n: int) -> Graph:
        g = Graph()
        x = g.input((1, 8))
        for i in range(n):
            x = g.negate(x) if i % 2 else g.add(x, g.constant(np.full((1, 8), i, np.float32)))
            if i % 32 == 31:  # 3,125 outputs at 100k nodes (the runtime takes up to 4,096 externals)
                g.output(x)
                x = g.negate(x)
        g.output(x)
        return g

    print(f"\n== Graph: build and write a chain of n nodes (an output every 32nd); {load_note()}")
    per_node = {}
    for n in (10_000, 20_000, 100_000):
        start = time.perf_counter()
        g = chain(n)
        built = time.perf_counter() - start
        payload = g.to_bytes()
        written = time.perf_counter() - start - built
        nodes = len(g.nodes)
        per_node[n] = (built + written) / nodes
        print(f"{nodes:7d} nodes: build {built:6.2f}s, write {written:6.2f}s ({len(payload) / 1e6:.1f} MB), "
              f"{1e6 * per_node[n]:.0f} us per node", flush=True)
    print(f"time per node, 20k / 10k: {per_node[20_000] / per_node[10_000]:.2f}, 100k / 10k: "
          f"{per_node[100_000] / per_node[10_000]:.2f} (linear: about 1); {load_note()}")


# ------------------------------------------------------------------ MiniLM export


def bench_export(repeat: int) -> None:
    import torch

    from xnnquant.models.minilm import SAMPLE_SENTENCES
    from xnnquant.models.minilm_torch import encoder, encoder_inputs

    rounds = max(1, min(repeat, 3))  # ExecuTorch's flow takes tens of seconds a round
    print(f"\n== export of the all-MiniLM-L6-v2 encoder to a .pte, int4 group 32 weights, dynamic int8 "
          f"activations; medians of {rounds} interleaved runs; {load_note()}")
    inputs = encoder_inputs(SAMPLE_SENTENCES[:4], tokens=32)

    def ours(method: str) -> Callable[[], bytes]:
        def run() -> bytes:
            return xq.export(encoder(), inputs, weights="qb4w:32", method=method, progress=False).to_pte()
        return run

    def executorch_flow() -> bytes:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        model = encoder()
        quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(32)))
        program = torch.export.export(model, inputs, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        return bytes(edge.to_executorch().buffer)

    med = interleaved({"xq.export minmax": ours("minmax"), "xq.export mse": ours("mse"),
                       "ExecuTorch flow": executorch_flow}, rounds)
    for name, seconds in med.items():
        print(f"{name:18} {seconds:7.2f}s")
    print(f"ExecuTorch's flow / xq.export: {med['ExecuTorch flow'] / med['xq.export minmax']:.1f}x (minmax), "
          f"{med['ExecuTorch flow'] / med['xq.export mse']:.1f}x (mse); goal >= 10x; {load_note()}")


# ------------------------------------------------------------------ streaming export


def read_seconds(path: Path, cold: bool) -> float:
    """Wall time of reading the whole file once, 16 MiB at a time; ``cold``: after asking
    the kernel to drop the file's pages from its cache (``posix_fadvise(DONTNEED)``)."""
    if cold:
        drop_cache(path)
    buffer = bytearray(16 << 20)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


def drop_cache(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first: dirty pages stay)."""
    with open(path, "rb") as f:
        os.fdatasync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def stream_child(source: str, out: str, method: str) -> None:
    """The export, in a process of its own so that its peak RSS is its own."""

    import torch

    from xnnquant.models.llama import LlamaConfig, decoder

    config = LlamaConfig.large()
    module = decoder(config, "meta")
    start = time.perf_counter()
    exported = xq.export(module, (torch.empty(1, config.seq, config.hidden, device="meta"),),
                         weights="qb4w:32", method=method, state_dict=source, progress=False)
    lowered = time.perf_counter() - start
    exported.save(out)
    wall = time.perf_counter() - start
    # VmHWM: this process image's own peak (ru_maxrss keeps the forking parent's across exec)
    with open("/proc/self/status") as f:
        peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"wall": wall, "trace": exported.timings["export"], "save": wall - lowered,
                      "peak_rss_bytes": peak_kib * 1024, "size": os.path.getsize(out)}))


def bench_stream(repeat: int) -> None:
    from xnnquant.models.llama import LlamaConfig, write_random_safetensors

    config = LlamaConfig.large()
    rounds = max(1, min(repeat, 2))  # an export takes tens of seconds on a loaded machine
    print(f"\n== streaming export of a {config.num_parameters / 1e9:.2f}e9-parameter Llama-shaped decoder "
          f"({config.layers} layers, hidden {config.hidden}, MLP {config.intermediate}), qb4w:32, float32 "
          f"safetensors input; medians of {rounds} interleaved runs; {load_note()}")
    parent = os.environ.get("XNNQUANT_BENCH_TMP") or tempfile.gettempdir()
    need = 4 * config.num_parameters + (1 << 30)
    free = shutil.disk_usage(parent).free
    if free < need:
        print(f"skipped: {free / 1e9:.1f} GB free in {parent}, {need / 1e9:.1f} GB needed")
        return
    with tempfile.TemporaryDirectory(prefix="xnnquant-bench-", dir=parent) as directory:
        source = Path(directory) / "llama-1b-f32.safetensors"
        start = time.perf_counter()
        write_random_safetensors(source, config)
        print(f"wrote the input: {source.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.1f}s "
              f"(deleted at the end)", flush=True)
        # (method, output suffix, input cold or warm): .pte (what users run) and .xnn (the
        # payload alone: no ExecuTorch import, 6 s of Python here); minmax, and mse (the
        # default: its search over 1e9 weights is the mse section's speed)
        cases = [("minmax", ".pte", "cold"), ("minmax", ".pte", "warm"), ("minmax", ".xnn", "cold"),
                 ("minmax", ".xnn", "warm"), ("mse", ".pte", "cold")]
        results: dict[tuple[str, str, str], list[dict]] = {case: [] for case in cases}
        reads: dict[str, list[float]] = {"cold": [], "warm": []}
        for _ in range(rounds):
            for cache in ("cold", "warm"):
                if cache == "warm":
                    read_seconds(source, cold=False)  # every page cached
                reads[cache].append(read_seconds(source, cold=cache == "cold"))
            for method, suffix, cache in cases:
                if cache == "cold":
                    drop_cache(source)
                else:
                    read_seconds(source, cold=False)
                out = Path(directory) / f"out{suffix}"
                start = time.perf_counter()
                child = subprocess.run([sys.executable, __file__, "--stream-child", str(source), str(out), method],
                                       capture_output=True, text=True, check=False)
                out.unlink(missing_ok=True)
                if child.returncode:
                    print(f"streaming export ({method}, {suffix}, {cache}) failed:\n{child.stderr[-3000:]}")
                    return
                process = time.perf_counter() - start
                results[(method, suffix, cache)].append(dict(json.loads(child.stdout.strip().splitlines()[-1]),
                                                             process=process))
    read = {cache: statistics.median(ts) for cache, ts in reads.items()}
    print(f"one read of the input file (16 MiB at a time): cold (from the disk) {read['cold']:.1f}s, "
          f"warm (page cache) {read['warm']:.1f}s")
    print(f"{'method':6} {'out':4} {'input':5} {'wall':>6} {'trace':>6} {'lower':>6} {'save':>6} {'process':>7} "
          f"{'peak RSS':>9} {'output':>8} {'wall/cold read':>14} {'wall/warm read':>14}")
    for (method, suffix, cache), runs in results.items():
        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)
        wall = med("wall")
        print(f"{method:6} {suffix:4} {cache:5} {wall:5.1f}s {med('trace'):5.1f}s "
              f"{wall - med('trace') - med('save'):5.1f}s {med('save'):5.1f}s {med('process'):6.1f}s "
              f"{max(r['peak_rss_bytes'] for r in runs) / 2**30:6.2f}GiB {runs[0]['size'] / 1e9:6.2f}GB "
              f"{wall / read['cold']:13.1f}x {wall / read['warm']:13.1f}x", flush=True)
    print("(wall: xq.export + Exported.save; trace: torch.export of the meta module; lower: the rest of xq.export; "
          "save: read + quantize + write, for a .pte with ExecuTorch's import; process: the child process, "
          "python and torch imports included; peak RSS: the largest of the runs)")
    print(f"goal: peak RSS < 1.5 GB, wall <= 3x one read; {load_note()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--repeat", type=int, default=7, help="interleaved timed rounds per case")
    parser.add_argument("--stream-child", nargs=3, metavar=("SOURCE", "OUT", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_child:
        stream_child(*args.stream_child)
        return
    print(f"xnnquant {xq.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}, "
          f"{num_threads()} kernel threads; {load_note()}")
    for section in SECTIONS:
        if section in args.only:
            globals()[f"bench_{section}"](args.repeat)


if __name__ == "__main__":
    main()
