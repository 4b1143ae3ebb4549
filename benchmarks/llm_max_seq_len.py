"""SmolLM2-135M at a phone's context: planned memory and prefill speed against ``max_seq_len``.

Each program is ``xq.export_llm(model, max_context=2048, max_seq_len=N)`` with the defaults
otherwise (qb4w:32 mse, int8 embeddings, fp32 cache; ``--kv-cache int8`` for the int8 one),
for N in ``--sizes``; N = 2048 is the program before ``max_seq_len`` was a choice (a call as
long as the context).  Per program:

=================  ====================================================================
planned MB         the arenas ``forward`` plans (``pte.planned.planned_bytes``): what the
                   runtime allocates when it loads the method, the KV cache included
prefill tok/s      a prompt of ``--prompt`` tokens of held-out text at position 0, in calls
                   of N tokens (``xq.LLM.forward``, as ExecuTorch's ``TextPrefiller``);
                   median of ``--rounds`` rounds, the programs in turn in a shuffled order
                   each round, so that a neighbour's load falls on all of them alike
prefill CPU s      the process's CPU time (every thread's) over the same prefill: the work
                   done, which a neighbour's load changes less than the wall clock
decode ms          the 32 one-token calls after it (greedy), per token; median
=================  ====================================================================

Usage: ``python benchmarks/llm_max_seq_len.py [--sizes 32 64 128 256 512 2048] [--rounds 7]``.
Timings on a shared machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import xnnquant as xq
from xnnquant.llm import evaluate
from xnnquant.models import smollm2
from xnnquant.pte.planned import planned_bytes

MAX_CONTEXT = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 128, 256, 512, 2048])
    parser.add_argument("--kv-cache", default="fp32")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep the programs in DIR (and reuse those "
                                                                    "there)")
    args = parser.parse_args()
    ids = evaluate.tokenize(evaluate.held_out_text(), smollm2.tokenizer_json())
    prompt = [int(i) for i in ids[:args.prompt]]
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        planned, seconds = {}, {}
        model = None
        for size in args.sizes:
            path = folder / f"smollm2-{args.kv_cache}-seq{size}.pte"
            if path.is_file():
                planned[size] = planned_bytes(path.read_bytes())["forward"]
                print(f"max_seq_len {size}: {path} (kept), forward plans {planned[size] / 1e6:.1f} MB", flush=True)
                continue
            model = smollm2.load_model() if model is None else model
            begin = time.perf_counter()
            exported = xq.export_llm(model, max_context=MAX_CONTEXT, max_seq_len=size, kv_cache=args.kv_cache,
                                     progress=False)
            exported.save(path)
            seconds[size] = time.perf_counter() - begin
            planned[size] = planned_bytes(path.read_bytes())["forward"]
            print(f"max_seq_len {size}: exported in {seconds[size]:.0f} s, forward plans {planned[size] / 1e6:.1f} MB",
                  flush=True)
        llms = {size: xq.LLM(folder / f"smollm2-{args.kv_cache}-seq{size}.pte") for size in args.sizes}
        prefill: dict[int, list[float]] = {size: [] for size in args.sizes}
        cpu: dict[int, list[float]] = {size: [] for size in args.sizes}
        decode: dict[int, list[float]] = {size: [] for size in args.sizes}
        order = np.random.default_rng(0)
        for r in range(args.rounds + 1):
            for size in order.permutation(args.sizes):
                llm = llms[int(size)]
                begin, begin_cpu = time.perf_counter(), time.process_time()
                logits = llm.forward(prompt, 0)
                done, done_cpu = time.perf_counter(), time.process_time()
                for i in range(32):
                    logits = llm.forward([int(np.argmax(logits))], len(prompt) + i)
                end = time.perf_counter()
                if r:  # the first round warms up
                    prefill[int(size)].append(done - begin)
                    cpu[int(size)].append(done_cpu - begin_cpu)
                    decode[int(size)].append((end - done) / 32)
    load = os.getloadavg()
    print(f"\nSmolLM2-135M, max_context {MAX_CONTEXT}, kv_cache {args.kv_cache}, prompt {len(prompt)} tokens, "
          f"medians of {args.rounds} rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
          f"{os.cpu_count()} CPUs")
    print(f"{'max_seq_len':>11}  {'calls':>5}  {'planned MB':>10}  {'prefill ms':>10}  {'prefill tok/s':>13}  "
          f"{'prefill CPU s':>13}  {'decode ms':>9}")
    for size in args.sizes:
        p, c, d = (float(np.median(m[size])) for m in (prefill, cpu, decode))
        print(f"{size:>11}  {-(-len(prompt) // size):>5}  {planned[size] / 1e6:>10.1f}  {p * 1e3:>10.1f}  "
              f"{len(prompt) / p:>13.0f}  {c:>13.2f}  {d * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
