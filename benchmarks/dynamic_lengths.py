"""One program for every sentence length (issue 22's goals): all-MiniLM-L6-v2 whole (token
ids and attention mask in, sentence embedding out, ``minilm_torch.sentence_encoder()``),
``xq.export``-ed once with the number of tokens dynamic (1..128, the main job's
``dynamic_shapes``), qb4w:32 ``mse`` weights (the default), batch 1.

1. **Equality.**  At every length L from 1 to 128 (the first L tokens of the held-out
   sentences' token stream, mask all ones) the dynamic program's embedding against the
   program exported with the same weights at the fixed shape ``(1, L)``: the largest
   absolute difference over the 384 values (embeddings are unit length) and lengths, and
   the float module's cosine for scale.
2. **Latency.**  The 116 held-out sentences (``evaluation_sentences``, 5 to 25 tokens):
   the dynamic program at each sentence's own length, the program fixed at ``(1, 32)`` on
   the sentence padded to 32 tokens with the mask (the main job before dynamic shapes), and
   ExecuTorch's own dynamic program (torchao int4 g32, ``to_edge_transform_and_lower`` with
   ``XnnpackPartitioner``, the same ``dynamic_shapes``; ``main_job.executorch_flow``).  In
   one fresh process, each sentence given to every program in turn, ``--repeat`` rounds
   after an untimed one (``main_job.run_rounds``); per program the mean over the sentences
   of each sentence's median wall time (the runtime's threads), and the same for CPU time
   with the runtime on one thread.  The same for fp32 weights (dynamic against padded).
3. **Memory.**  One fresh process per line (``--memory FILE LENGTH``): VmRSS before the
   program is loaded (its bytes already read), after loading its method, and after one
   call at LENGTH, with the peak (VmHWM, reset before the call).  From bytes (the figures in
   docs/benchmarks.md were taken so, before programs held their constants as named data, when an
   xnnquant program loaded by path crashed).  The dynamic program at 128 against the
   program fixed at ``(1, 128)``; at 16 tokens against the fixed ``(1, 32)`` one; ExecuTorch's
   dynamic program at both.  Beside each, what the program asks the runtime to plan:
   ``non_const_buffer_sizes`` (read with ExecuTorch's own deserializer).

Run: ``python benchmarks/dynamic_lengths.py [--repeat N] [--no-executorch] [--only SECTION ...]``
(sections ``equality latency memory``; all: about 10 minutes on 2 cores, 132 exports and
one ExecuTorch export of a minute or more).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MAX_TOKENS = 128
PADDED = 32
MEMORY_SHORT = 16


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def _status() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields


def memory_child(path: str, length: int) -> None:
    """Print, as JSON, VmRSS (MiB) before loading ``path``, after loading its method, after one
    call at ``length`` tokens, and the peak during the call."""
    import torch
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    ids = torch.arange(1000, 1000 + length, dtype=torch.int64).reshape(1, length)
    mask = torch.ones(1, length, dtype=torch.int64)
    data = Path(path).read_bytes()  # the runtime reads the program in place (counted in ``before``)
    before = _status()["VmRSS"]
    program = runtime.load_program(data)
    method = program.load_method("forward")
    loaded = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak (VmHWM) starts again from the current RSS
    method.execute([ids, mask])
    after = _status()
    print(json.dumps({"before": before, "loaded": loaded, "called": after["VmRSS"], "peak": after["VmHWM"]}))


def _memory(path: Path, length: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--memory", str(path), str(length)], capture_output=True,
                          text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _planned(pte: bytes) -> list[int]:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte)
    program = getattr(program, "program", program)  # 1.4.1 wraps it with its named data
    return list(program.execution_plan[0].non_const_buffer_sizes)


def _stream() -> np.ndarray:
    """The held-out sentences' token ids, one after the other (each with its [CLS] and [SEP])."""
    from xnnquant.models import minilm
    from xnnquant.models.sentences import evaluation_sentences

    rows = []
    for sentence in evaluation_sentences():
        ids, _ = minilm.tokenize_batch([sentence])
        rows.append(ids[0])
    return np.concatenate(rows).astype(np.int64)


def equality(module: Any, dynamic: bytes, export: Callable[..., bytes],
             at: Callable[[int], tuple[Any, Any]]) -> None:
    """Section 1: the dynamic program against the fixed-shape export at every length."""
    import torch
    from executorch.runtime import Runtime

    from xnnquant.cli import main_job

    runtime = Runtime.get()
    program = runtime.load_program(dynamic)
    method = program.load_method("forward")
    worst = (0.0, 0)
    exact = 0
    cos_module = []
    start = time.perf_counter()
    for length in range(1, MAX_TOKENS + 1):
        inputs = at(length)
        got = method.execute(list(inputs))[0].numpy().copy()
        fixed = export(inputs, check=False)  # the self-check only compares; the bytes are the same
        fixed_program = runtime.load_program(fixed)
        want = fixed_program.load_method("forward").execute(list(inputs))[0].numpy().copy()
        del fixed_program
        error = float(np.abs(got - want).max())
        exact += error == 0
        worst = max(worst, (error, length))
        with torch.no_grad():
            reference = module(*inputs).numpy()
        cos_module.append(float(main_job.cosines(got, reference)[0]))
    print(f"1. equality, lengths 1..{MAX_TOKENS} ({time.perf_counter() - start:.0f} s): dynamic vs fixed-shape "
          f"export at the same length: max |difference| {worst[0]:.3g}"
          f"{f' (at {worst[1]} tokens)' if worst[0] else ''}, bit-identical at "
          f"{exact} of {MAX_TOKENS} lengths; cosine to the float module {min(cos_module):.4f} worst, "
          f"{np.mean(cos_module):.4f} mean", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-executorch", action="store_true")
    parser.add_argument("--only", nargs="+", choices=("equality", "latency", "memory"),
                        default=("equality", "latency", "memory"))
    parser.add_argument("--memory", nargs=2, metavar=("FILE", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory is not None:
        memory_child(args.memory[0], int(args.memory[1]))
        return

    import torch

    import xnnquant as xq
    from xnnquant.cli import main_job
    from xnnquant.models import minilm_torch
    from xnnquant.models.sentences import evaluation_sentences

    print(f"xnnquant {xq.__version__}; {load_note()}", flush=True)
    module = minilm_torch.sentence_encoder()
    stream = _stream()
    main_job._warm_up(module, main_job.examples()[1], not args.no_executorch)

    def export(example: tuple[torch.Tensor, ...], weights: str = "qb4w:32", dynamic: bool = False,
               check: bool = True) -> bytes:
        return xq.export(module, example, weights=weights, progress=False, check=check,
                         dynamic_shapes=main_job.dynamic_shapes() if dynamic else None).to_pte()

    def at(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(stream[:length].reshape(1, length)), torch.ones(1, length, dtype=torch.int64)

    start = time.perf_counter()
    dynamic = export(at(16), dynamic=True)
    print(f"dynamic qb4w:32 export: {time.perf_counter() - start:.2f} s, {main_job._delegates(dynamic)} delegate(s)",
          flush=True)

    # 1. equality with the fixed-shape export at every length
    if "equality" in args.only:
        equality(module, dynamic, export, at)
    fixed_128 = export(at(MAX_TOKENS), check=False) if "memory" in args.only else b""

    # 2. latency on the held-out sentences
    sentences = evaluation_sentences()
    padded32 = export(minilm_torch.sentence_inputs(sentences[:1], PADDED))
    programs = {"xnnquant qb4w:32 dynamic": dynamic, f"xnnquant qb4w:32 padded to {PADDED}": padded32}
    if "latency" in args.only:
        programs["xnnquant fp32 dynamic"] = export(at(16), "fp32", dynamic=True)
        programs[f"xnnquant fp32 padded to {PADDED}"] = export(minilm_torch.sentence_inputs(sentences[:1], PADDED),
                                                               "fp32")
    if not args.no_executorch:
        start = time.perf_counter()
        programs["ExecuTorch int4 g32 dynamic"] = main_job.executorch_flow(module, at(16), main_job.dynamic_shapes())
        print(f"ExecuTorch's dynamic program: export {time.perf_counter() - start:.1f} s, "
              f"{main_job._delegates(programs['ExecuTorch int4 g32 dynamic'])} delegates", flush=True)
    inputs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for i, sentence in enumerate(sentences):
        own = minilm_torch.sentence_inputs([sentence])
        pad = minilm_torch.sentence_inputs([sentence], PADDED)
        inputs[f"own.{i}"] = (own[0].numpy(), own[1].numpy())
        inputs[f"pad.{i}"] = (pad[0].numpy(), pad[1].numpy())
    own_names = [f"own.{i}" for i in range(len(sentences))]
    pad_names = [f"pad.{i}" for i in range(len(sentences))]
    plan = [(f"{k}.pte", pad_names if "padded" in label else own_names) for k, label in enumerate(programs)]
    if "latency" in args.only:
        tokens = np.mean([inputs[n][1].sum() for n in own_names])
        print(f"2. latency, {len(sentences)} held-out sentences ({tokens:.1f} tokens on average), "
              f"{args.repeat} rounds; {load_note()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="xnnquant-dynamic-") as temporary:
        directory = Path(temporary)
        main_job.save_inputs(directory, inputs)
        for k, pte in enumerate(programs.values()):
            (directory / f"{k}.pte").write_bytes(pte)
        if "latency" in args.only:
            wall, _, outputs = main_job.run_rounds(directory, plan, None, args.repeat)
            _, cpu, _ = main_job.run_rounds(directory, plan, 1, args.repeat)
            mean_wall = [1e3 * float(np.median(w, axis=0).mean()) for w in wall]
            mean_cpu = [1e3 * float(np.median(c, axis=0).mean()) for c in cpu]
            for k, label in enumerate(programs):
                names = plan[k][1]
                embeddings = np.concatenate([outputs[f"{k}.{n}"] for n in names])
                with torch.no_grad():
                    reference = np.concatenate([module(*(torch.from_numpy(a) for a in inputs[n])).numpy()
                                                for n in own_names])
                cos = main_job.cosines(embeddings, reference)
                print(f"   {label:34s} {mean_wall[k]:6.2f} ms wall  {mean_cpu[k]:6.2f} ms CPU 1 thread  "
                      f"cos mean {cos.mean():.4f}", flush=True)
            print(f"   padded/dynamic qb4w:32: {mean_wall[1] / mean_wall[0]:.2f}x wall, "
                  f"{mean_cpu[1] / mean_cpu[0]:.2f}x CPU; fp32: {mean_wall[3] / mean_wall[2]:.2f}x wall, "
                  f"{mean_cpu[3] / mean_cpu[2]:.2f}x CPU", flush=True)
            if not args.no_executorch:
                print(f"   ExecuTorch/xnnquant dynamic (int4 g32 vs qb4w:32): "
                      f"{mean_wall[4] / mean_wall[0]:.2f}x wall, {mean_cpu[4] / mean_cpu[0]:.2f}x CPU; {load_note()}",
                      flush=True)

        if "memory" in args.only:
            memory(directory, programs, fixed_128)
    print(f"done; {load_note()}")


def memory(directory: Path, programs: dict[str, bytes], fixed_128: bytes) -> None:
    """Section 3: resident memory, one fresh process per program and length (``programs``
    are in ``directory`` as ``K.pte``, in their order)."""
    (directory / "fixed128.pte").write_bytes(fixed_128)
    names = list(programs)
    dynamic, padded = names[0], names[1]
    lines = [(dynamic, "0.pte", programs[dynamic], MAX_TOKENS),
             (f"xnnquant qb4w:32 fixed (1, {MAX_TOKENS})", "fixed128.pte", fixed_128, MAX_TOKENS),
             (dynamic, "0.pte", programs[dynamic], MEMORY_SHORT),
             (padded, "1.pte", programs[padded], PADDED)]
    et = "ExecuTorch int4 g32 dynamic"
    if et in programs:
        file = f"{names.index(et)}.pte"
        lines += [(et, file, programs[et], MAX_TOKENS), (et, file, programs[et], MEMORY_SHORT)]
    print("3. resident memory (MiB; one fresh process per line; growth from before the load)")
    for label, file, pte, length in lines:
        m = _memory(directory / file, length)
        planned = _planned(pte)
        print(f"   {label:38s} at {length:3d} tokens: planned {planned[-1] / 2**20:6.2f} MiB; "
              f"RSS {m['before']:.1f} -> loaded +{m['loaded'] - m['before']:.1f} -> called "
              f"+{m['called'] - m['before']:.1f} (the call +{m['called'] - m['loaded']:.1f}, "
              f"peak +{m['peak'] - m['before']:.1f})", flush=True)


if __name__ == "__main__":
    main()
