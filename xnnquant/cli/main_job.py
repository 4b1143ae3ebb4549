"""The main job (``make run``, ``xnnquant minilm``): all-MiniLM-L6-v2's encoder through
``xq.export`` with each weight scheme, and through ExecuTorch's own flow, side by side.

For each flow and scheme the ``.pte`` is built, timed from the float module to the
program bytes.  Then every program is run by ``executorch.runtime`` (the real XNNPACK) on
each of the sample sentences (``minilm.SAMPLE_SENTENCES``, one sentence of 32 tokens per
call); the table gives the ``.pte`` size, the export time, the latency of one call, the
number of XNNPACK delegates in the program, and the sentence embeddings' cosine
similarity to the float model's (mean and worst over the sentences).

Latency is measured in a fresh process holding only these programs, each input given to
every program in turn (so a change of machine load falls on all of them alike), twice:

* ``latency``: the median wall-clock time of one call with the runtime's own threads
  (one per core), what a user of the program waits;
* ``CPU 1 thread``: the median CPU time of one call with the runtime set to one thread.
  It counts only this process's work, so it stays put when other processes load the
  machine: the figure to compare programs by on a shared machine.

ExecuTorch's flow is its documented one: torchao's
``Int8DynamicActivationIntxWeightConfig(weight_dtype=int4, weight_granularity=PerGroup(32))``
with its default scale choice, ``torch.export``, ``to_edge_transform_and_lower`` with
``XnnpackPartitioner``, ``to_executorch``.  Importing ExecuTorch's XNNPACK backend in this
process does not change our programs: ``to_pte`` writes them with xnnquant's own program
writer (tests/test_export_pte.py checks the bytes).

Neither flow's export time includes the one-off costs of a process: before any timing,
one ``torch.export`` of the module is run and ExecuTorch's flow's modules (its
serializer and partitioner, torchao) are imported; xnnquant's flow imports no part of
executorch to write its programs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..errors import XnnquantError, missing_extra

TOKENS = 32
REPEATS = 5  # timed calls per program and sentence, after one untimed call
#: Held-out sentences (``models.sentences.calibration_sentences``) a calibrated row runs
#: the module's program on, in batches of ``CALIBRATION_BATCH`` (padding left out: the
#: encoder's mask input is ``calibration_mask``).
CALIBRATION_SENTENCES = 128
CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class Scheme:
    """One xnnquant row: ``xq.export(..., weights=, method=)``, with ``calibration=`` (the
    held-out sentences, timed as part of the export) when ``calibrated``."""

    weights: str
    method: str = "mse"
    calibrated: bool = False

    def __str__(self) -> str:
        text = self.weights if self.weights == "fp32" else f"{self.weights} {self.method}"
        return text + (", calibrated" if self.calibrated else "")


#: xnnquant's rows, in table order.  Activation-aware methods (``gptq``) join as
#: ``Scheme(weights, "gptq", calibrated=True)``.
SCHEMES: tuple[Scheme, ...] = (Scheme("fp32"), Scheme("qc8w"), Scheme("qc8w", calibrated=True),
                               Scheme("qb4w:32", "minmax"), Scheme("qb4w:32"))


@dataclass(frozen=True)
class Row:
    flow: str
    scheme: str
    pte_bytes: int
    export_s: float
    latency_ms: float
    cpu_ms: float
    delegates: int
    cos_mean: float
    cos_worst: float


def _delegates(pte: bytes) -> int:
    """XNNPACK delegate calls in a program (counted in its flatbuffer by backend id)."""
    return pte.count(b"XnnpackBackend")


def _check_extras(with_executorch: bool) -> None:
    """``MissingExtraError`` naming the extra to install for what the job imports."""
    import importlib.util

    needed = [("torch", "torch"), ("xnnpack", "executorch"), ("models", "safetensors"), ("models", "tokenizers")]
    if with_executorch:
        needed.append(("torchao", "torchao"))
    for extra, package in needed:
        if importlib.util.find_spec(package) is None:
            raise missing_extra(extra, package, "the main job (xnnquant minilm)")


def _warm_up(module: Any, example: tuple[Any, ...], with_executorch: bool) -> None:
    """One untimed ``torch.export``, and both flows' imports (see the module docstring)."""
    import torch

    torch.export.export(module, example, strict=False)
    if with_executorch:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401
        from executorch.exir import to_edge_transform_and_lower  # noqa: F401
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # noqa: F401


def _timed_rounds(directory: Path, threads: int | None, repeats: int) -> None:
    """In a fresh process (``python -m xnnquant.cli.main_job DIR THREADS REPEATS``): run every
    ``DIR/N.pte`` on ``DIR/inputs.npz``, each input given to every program in turn; write ``DIR/times.npz``
    (wall and CPU seconds per program, ``(repeats * sentences,)``) and ``DIR/outputs.npz``
    (each program's outputs from the untimed first round)."""
    from executorch.runtime import Runtime

    if threads is not None:
        # before any program is loaded: a loaded XNNPACK delegate keeps the pool it was built with
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(threads)
    arrays = np.load(directory / "inputs.npz")
    hidden, mask = arrays["hidden"], arrays["mask"]
    import torch

    inputs = [(torch.from_numpy(hidden[i:i + 1]), torch.from_numpy(mask[i:i + 1])) for i in range(len(hidden))]
    paths = sorted(directory.glob("*.pte"), key=lambda p: int(p.stem))
    programs = [Runtime.get().load_program(p.read_bytes()) for p in paths]  # kept: methods need their program
    methods = [p.load_method("forward") for p in programs]
    outputs = [np.concatenate([m.execute(list(x))[0].numpy() for x in inputs]) for m in methods]
    wall: list[list[float]] = [[] for _ in methods]
    cpu: list[list[float]] = [[] for _ in methods]
    for _ in range(repeats):
        for x in inputs:
            for i, method in enumerate(methods):
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                method.execute(list(x))
                cpu[i].append(time.thread_time() - start_cpu)
                wall[i].append(time.perf_counter() - start_wall)
    np.savez(directory / "outputs.npz", *outputs)
    np.savez(directory / "times.npz", wall=np.array(wall), cpu=np.array(cpu))


def _run_rounds(directory: Path, threads: int | None, repeats: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``_timed_rounds`` in a child process: (wall, CPU seconds, outputs per program)."""
    command = [sys.executable, "-m", __name__, str(directory), str(threads or 0), str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise XnnquantError(f"running the programs failed (exit {done.returncode}): {done.stderr[-2000:]}")
    times = np.load(directory / "times.npz")
    outputs = np.load(directory / "outputs.npz")
    return times["wall"], times["cpu"], [outputs[f"arr_{i}"] for i in range(len(outputs.files))]


def measure(ptes: Sequence[bytes], hidden: np.ndarray, mask: np.ndarray, reference: np.ndarray,
            repeats: int = REPEATS) -> list[tuple[float, float, float, float]]:
    """For each program: (median wall ms, runtime's threads; median CPU ms, one thread;
    mean cosine; worst cosine) on the sentences ``hidden`` float32 ``(S, T, 384)``, ``mask``
    float32 ``(S, T)``; ``reference``: float sentence embeddings ``(S, 384)``."""
    from ..models.minilm import mean_pooled

    with tempfile.TemporaryDirectory(prefix="xnnquant-main-job-") as name:
        directory = Path(name)
        np.savez(directory / "inputs.npz", hidden=hidden, mask=mask)
        for i, pte in enumerate(ptes):
            (directory / f"{i}.pte").write_bytes(pte)
        wall, _, outputs = _run_rounds(directory, None, repeats)
        _, cpu, _ = _run_rounds(directory, 1, repeats)
    results = []
    for i, out in enumerate(outputs):
        cos = np.sum(mean_pooled(out, mask) * reference, axis=1)
        results.append((1e3 * statistics.median(wall[i]), 1e3 * statistics.median(cpu[i]), float(cos.mean()),
                        float(cos.min())))
    return results


def executorch_flow(module: Any, example: tuple[Any, ...]) -> bytes:
    """The ``.pte`` of ExecuTorch's own flow for int4 weights in groups of 32 (module docstring)."""
    import copy

    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    quantized = copy.deepcopy(module)
    quantize_(quantized, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(32)))
    program = torch.export.export(quantized, example, strict=False)
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return bytes(edge.to_executorch().buffer)


def file_name(flow: str, label: str) -> str:
    """Where ``run(save=DIR)`` writes a row's program, e.g. ``xnnquant-qb4w_32-mse.pte``."""
    words = label.replace(":", "_").replace(",", "").replace("(", "").replace(")", "").split()
    return "-".join([flow.lower(), *words]) + ".pte"


def calibration_batches() -> list[tuple[Any, Any]]:
    """``(hidden, mask)`` batches of the held-out calibration sentences (``CALIBRATION_SENTENCES``)."""
    from ..models import minilm_torch
    from ..models.sentences import calibration_sentences

    text = calibration_sentences()[:CALIBRATION_SENTENCES]
    return [minilm_torch.encoder_inputs(text[i:i + CALIBRATION_BATCH]) for i in range(0, len(text), CALIBRATION_BATCH)]


def run(schemes: Sequence[Scheme] = SCHEMES, with_executorch: bool = True,
        progress: Callable[[str], None] | None = None, repeats: int = REPEATS,
        save: str | os.PathLike[str] | None = None) -> list[Row]:
    """Every row of the table (see the module docstring).  ``progress`` is called with what
    each step is about to do; ``save``: a directory to write every program to (``file_name``)."""
    _check_extras(with_executorch)
    say = progress or (lambda _: None)
    say("importing torch")
    import torch

    import xnnquant as xq

    from ..models import minilm, minilm_torch

    say("loading all-MiniLM-L6-v2")
    module = minilm_torch.encoder()
    hidden, mask = minilm_torch.encoder_inputs(minilm.SAMPLE_SENTENCES, TOKENS)
    with torch.no_grad():
        reference = minilm.mean_pooled(module(hidden, mask).numpy(), mask.numpy())
    example = (hidden[:1], mask[:1])
    say("warming up torch.export and imports (not timed)")
    _warm_up(module, example, with_executorch)
    built: list[tuple[str, str, bytes, float]] = []  # flow, scheme, .pte, export seconds
    for scheme in schemes:
        say(f"xnnquant: {scheme}")
        start = time.perf_counter()
        calibration = calibration_batches() if scheme.calibrated else None
        exported = xq.export(module, example, weights=scheme.weights, method=scheme.method, calibration=calibration,
                             calibration_mask=1 if calibration is not None else None,  # input 1: the padding mask
                             progress=False)
        pte = exported.to_pte()
        built.append(("xnnquant", str(scheme), pte, time.perf_counter() - start))
    if with_executorch:
        say("ExecuTorch: torchao int4 group 32, to_edge_transform_and_lower (tens of seconds)")
        start = time.perf_counter()
        pte = executorch_flow(module, example)
        built.append(("ExecuTorch", "int4 g32 (torchao)", pte, time.perf_counter() - start))
    if save is not None:
        from ..files import write_atomic

        for flow, label, pte, _ in built:
            write_atomic(Path(save) / file_name(flow, label), pte)
    say(f"running the {len(built)} programs on XNNPACK ({repeats} rounds, then again on one thread)")
    measured = measure([pte for _, _, pte, _ in built], hidden.numpy(), mask.numpy(), reference, repeats)
    return [Row(flow, label, len(pte), seconds, latency, cpu, _delegates(pte), cos_mean, cos_worst)
            for (flow, label, pte, seconds), (latency, cpu, cos_mean, cos_worst) in zip(built, measured)]


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (pasted into the README as is)."""
    header = ("flow", "scheme", ".pte size", "export time", "latency", "CPU 1 thread", "delegates", "cos mean",
              "cos worst")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = (r.flow, r.scheme, f"{r.pte_bytes / 1e6:.2f} MB", f"{r.export_s:.2f} s", f"{r.latency_ms:.2f} ms",
                 f"{r.cpu_ms:.2f} ms", str(r.delegates), f"{r.cos_mean:.4f}", f"{r.cos_worst:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(as_json: bool = False, with_executorch: bool = True, progress: TextIO | None = None,
         save: str | os.PathLike[str] | None = None) -> str:
    """The table (or JSON rows) of the main job; ``progress``: where its progress bar goes;
    ``save``: a directory to write the programs to."""
    steps = 4 + len(SCHEMES) + with_executorch
    bar = None
    if progress is not None:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # no bar: one line per step
            pass
        else:
            bar = tqdm(total=steps, file=progress, unit="step", leave=False,
                       bar_format="{l_bar}{bar:20}| {n}/{total} [{elapsed}]")

    def say(text: str) -> None:
        if bar is not None:
            bar.update(bar.desc != "")
            bar.set_description_str(text)
        elif progress is not None:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=progress, flush=True)

    try:
        rows = run(with_executorch=with_executorch, progress=say, save=save)
        if bar is not None:
            bar.update()
    finally:
        if bar is not None:
            bar.close()
    load = os.getloadavg()[0]
    if as_json:
        return json.dumps({"cores": os.cpu_count(), "load_average_1min": load, "rows": [asdict(r) for r in rows]},
                          indent=2)
    note = (f"all-MiniLM-L6-v2 encoder, {TOKENS} tokens per sentence, one sentence per call, {REPEATS} timed calls "
            f"per program and sentence; latency: median, the runtime's threads; CPU 1 thread: median CPU time "
            f"on one thread; {os.cpu_count()} cores, load average {load:.2f} at the end")
    return note + "\n\n" + format_rows(rows)


if __name__ == "__main__":  # the child process of ``measure``
    _timed_rounds(Path(sys.argv[1]), int(sys.argv[2]) or None, int(sys.argv[3]))
