"""SmolLM2-135M at a phone's context (issue 43's goals): decode time against the position,
planned memory and peak RSS, for the float and the int8 KV cache, beside ExecuTorch's recipe.

Every program is ``max_context=2048, max_seq_len=128`` on SmolLM2's real weights:

==================================  =======================================================
xnnquant-fp32-cache                 ``xnnquant export-llm FOLDER --max-context 2048``
                                    (the defaults)
xnnquant-int8-cache                 the same with ``--kv-cache int8`` (a streamed folder:
                                    qb4w:32 for every linear, issue 44's plan needs the weights)
xnnquant-auto-int8-cache            ``xnnquant export-llm SMOLLM2.gguf ... --kv-cache int8``:
                                    the model in memory, so ``weights="auto"`` plans its layers
                                    and the head reads the int8 table (issue 44's defaults)
executorch-recipe                   ``export_llama`` as ``benchmarks/llm.py`` runs it, with
                                    ``--max_seq_length 128 --max_context_length 2048``
executorch-recipe-quantized-cache   the same with ``--quantize_kv_cache`` (``--recipe``
                                    adds both: each export takes 11-13 minutes)
==================================  =======================================================

Per program:

=================  ====================================================================
planned MB         the arenas ``forward`` plans (``pte.planned.planned_bytes``), cache included
peak RSS MB        a child process that loads the program, fills its cache to position
                   1899 in calls of 128 tokens and decodes 16 tokens there: its peak
                   RSS over the process's RSS before the load (``peak_since``)
decode ms @ p      one token at position p (64, 1024, 1899) with the cache filled to 1899:
                   the median of ``--rounds`` rounds of 8 calls, every program and position
                   in turn each round, all in one process (a neighbour's load falls on all)
perplexity         ``--windows`` windows of 1536 tokens of held-out text, token by token
                   (``evaluate.program_perplexity``), with its standard error
=================  ====================================================================

Usage: ``python benchmarks/llm_context.py [--recipe] [--rounds 5] [--windows 1] [--fresh]``.
Exports are kept in ``<cache>/llm-context/<name>/`` and reused. The load average is printed:
timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm as base

from xnnquant.llm import evaluate
from xnnquant.models import smollm2
from xnnquant.pte.planned import planned_bytes

MAX_CONTEXT, MAX_SEQ_LEN, FAR = 2048, 128, 1899
POSITIONS = (64, 1024, FAR)
CACHE = smollm2.cache_dir() / "llm-context"


def _ours(*options: str, in_memory: bool = False):
    def run(out: Path) -> Path:
        pte = out / "model.pte"
        source = smollm2.gguf_path() if in_memory else base.checkpoint_folder()  # a .gguf is read whole
        command = [sys.executable, "-m", "xnnquant", "export-llm", str(source), "-o", str(pte),
                   "--max-context", str(MAX_CONTEXT), "--max-seq-len", str(MAX_SEQ_LEN), "--no-progress", *options]
        base.timed_child(command, out, out / "export.log")
        return pte
    return run


def _recipe(*options: str):
    return lambda out: _recipe_command(out, options)


def _recipe_command(out: Path, options: tuple[str, ...]) -> Path:
    import tempfile

    info = smollm2.info()
    with tempfile.TemporaryDirectory(dir=out) as work:
        checkpoint, params = base.checked_meta_checkpoint(Path(work))
        command = [
            sys.executable, "-m", "executorch.examples.models.llama.export_llama", "--model", "smollm2",
            "--checkpoint", str(checkpoint), "--params", str(params),
            "-kv", "--use_sdpa_with_kv_cache", "-X", "--xnnpack-extended-ops",
            "-qmode", "8da4w", "-G", "32", "-E", "8,0", "-d", "fp32",
            "--max_seq_length", str(MAX_SEQ_LEN), "--max_context_length", str(MAX_CONTEXT), *options,
            "--metadata", json.dumps({"get_bos_id": info.bos_id, "get_eos_ids": list(info.eos_ids)}),
            "--output-dir", work, "--output_name", "model",
        ]
        base.timed_child(command, Path(work), out / "export.log")
        os.replace(Path(work) / "model.pte", out / "model.pte")
    return out / "model.pte"


PROGRAMS = {
    "xnnquant-fp32-cache": _ours(),
    "xnnquant-int8-cache": _ours("--kv-cache", "int8"),
    "xnnquant-auto-int8-cache": _ours("--kv-cache", "int8", in_memory=True),
    "executorch-recipe": _recipe(),
    # not "...-int8": ExecuTorch's model.py takes a checkpoint whose path holds "int8" for an int8 one
    "executorch-recipe-quantized-cache": _recipe("--quantize_kv_cache"),
}


def export(name: str, fresh: bool) -> Path:
    out = CACHE / name
    pte = out / "model.pte"
    if fresh or not pte.is_file():
        out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        PROGRAMS[name](out)
        print(f"{name}: exported in {time.perf_counter() - start:.0f} s", flush=True)
    return pte


def _filled(pte: Path, ids: np.ndarray) -> evaluate.ProgramStep:
    """The program with its cache written at positions 0..FAR-1 (in calls of max_seq_len)."""
    step = evaluate.llm_step(pte)
    step(ids[None, :FAR], 0)
    return step


def child_peak(pte: Path, ids_file: Path) -> None:
    """(In a child process, its imports done) fill to FAR, decode 16 tokens there; prints the
    process's peak RSS from the moment the program starts loading (``peak_since``)."""
    ids = np.load(ids_file)
    with peak_since() as peak:
        step = _filled(pte, ids)
        token = np.ones((1, 1), np.int64)
        for _ in range(16):
            step(token, FAR)
    print(f"peak RSS {peak()} bytes over the imports'")


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


@contextlib.contextmanager
def peak_since():
    """The process's peak RSS from now on, over its RSS now: Linux resets ``VmHWM`` to the
    current RSS when "5" is written to ``/proc/self/clear_refs``, so neither the imports' own
    peak (1.1 GB of torch and transformers, larger than any program here) nor what they keep
    resident is counted: what loading and running the program adds."""
    Path("/proc/self/clear_refs").write_text("5")
    start = _status("VmRSS")
    yield lambda: _status("VmHWM") - start


def peak_rss(pte: Path, ids_file: Path) -> int:
    """``child_peak``'s figure: the program's load, fill and decode, without the imports."""
    command = [sys.executable, __file__, "--child", str(pte), str(ids_file)]
    base.timed_child(command, pte.parent, pte.parent / "peak.log")
    line = [x for x in (pte.parent / "peak.log").read_text().splitlines() if x.startswith("peak RSS ")][-1]
    return int(line.split()[2])


def decode_times(paths: dict[str, Path], ids: np.ndarray, rounds: int) -> dict[str, dict[int, float]]:
    """Median ms a token at each of POSITIONS, programs and positions interleaved."""
    steps = {name: _filled(path, ids) for name, path in paths.items()}
    token = np.ones((1, 1), np.int64)
    times: dict[str, dict[int, list[float]]] = {n: {p: [] for p in POSITIONS} for n in paths}
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for name in order.permutation(sorted(paths)):
            step = steps[str(name)]
            for pos in POSITIONS:
                step(token, pos)  # warm: the position's cache lines
                start = time.perf_counter()
                for _ in range(8):
                    step(token, pos)
                times[str(name)][pos].append((time.perf_counter() - start) / 8 * 1e3)
    return {n: {p: float(np.median(v)) for p, v in t.items()} for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="store_true", help="ExecuTorch's recipe too (about 13 minutes an export)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=1, help="perplexity windows of 1536 tokens (0: none)")
    parser.add_argument("--fresh", action="store_true", help="export again")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_peak(Path(args.child[0]), Path(args.child[1]))
        return
    names = [n for n in PROGRAMS if args.recipe or n.startswith("xnnquant")]
    paths = {name: export(name, args.fresh) for name in names}
    held_out = evaluate.tokenize(evaluate.held_out_text(), smollm2.tokenizer_json())
    ids_file = CACHE / "ids.npy"
    np.save(ids_file, held_out[:FAR])
    print(f"load average before timing: {os.getloadavg()[0]:.1f}", flush=True)
    times = decode_times(paths, held_out, args.rounds)
    print(f"load average after timing: {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for name, path in paths.items():
        row = {"program": name, "planned MB": planned_bytes(path.read_bytes())["forward"] / 1e6,
               "peak RSS MB": peak_rss(path, ids_file) / 1e6, **{f"decode ms @ {p}": t for p, t in times[name].items()}}
        if args.windows:
            ppl = evaluate.program_perplexity(path, held_out, window=1536, windows=args.windows, chunked=False)
            row["perplexity"] = f"{ppl.value:.3f} +/- {ppl.stderr:.3f}"
        rows.append(row)
        print(row, flush=True)
    heads = list(rows[0])
    print("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads))
    for row in rows:
        print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
