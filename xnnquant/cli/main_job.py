"""The main job (``make run``, ``xnnquant minilm``): all-MiniLM-L6-v2 whole (token ids and
attention mask in, sentence embedding out) through ``xq.export`` with each weight scheme,
and through ExecuTorch's own flow, side by side.

The module is ``minilm_torch.sentence_encoder()``::

    ids            int64 (B, T)   token ids
    attention_mask int64 (B, T)   1 on real tokens, 0 on padding
      -> float32 (B, 384)         the unit-length sentence embedding

Each row is two programs, both exported once with the number of tokens dynamic (``T`` in
1..``MAX_TOKENS``, the same ``dynamic_shapes`` for both flows): one for a batch of one
sentence, run at the sentence's own length with no padding, and one for a static batch of
``BATCH`` sentences padded to the longest of each batch, with the mask.  Not one program
with the batch dynamic too: its attention reshapes ``(batch, tokens, 384)`` to heads and
back, a reshape with two dynamic dims, and XNNPACK infers at most one dim of a reshape on
each call; ``xq.export`` refuses the program (the reshape has no portable kernel either),
and run on ExecuTorch's portable kernels as ``view_copy`` it cuts the graph into 15
delegates instead of 2.  So a service keeps one program per batch size it uses; the table's
``.pte size`` is one program's and a row's export time both exports' (a calibrated row
calibrates twice).

Every program is run by ``executorch.runtime`` (the real XNNPACK) on the held-out
sentences (``models.sentences.evaluation_sentences``: 116 sentences of 5 to 25 tokens):
the batch-1 program on each sentence at its own length, the batch-``BATCH`` program on
them in batches of ``BATCH`` (in order; the last 4 are left out), each padded to its
longest sentence.  The table gives the ``.pte size``, the export time, the wall time per
sentence at batch 1 and at batch ``BATCH`` (the median call's, divided by the batch), the
CPU time of one batch-1 call on one thread, the number of XNNPACK delegates in the two
programs, and the cosine of each sentence embedding to the float module's at the
sentence's own length (mean and worst at batch 1; worst at batch ``BATCH``, where the
padding must not count).

Latency is measured in a fresh process holding only these programs, each input given to
every program that takes it in turn (so a change of machine load falls on all of them
alike), twice:

* ``ms/sentence batch 1`` / ``batch 8``: the median wall-clock time of one call (over the
  inputs and the rounds) with the runtime's own threads (one per core), per sentence: what
  a user of the program waits;
* ``CPU 1 thread``: the median CPU time of one batch-1 call with the runtime set to one
  thread.  It counts only this process's work, so it stays put when other processes load
  the machine: the figure to compare programs by on a shared machine.

ExecuTorch's flow is its documented one: torchao's
``Int8DynamicActivationIntxWeightConfig(weight_dtype=int4, weight_granularity=PerGroup(32))``
with its default scale choice, ``torch.export`` (with the same ``dynamic_shapes``),
``to_edge_transform_and_lower`` with ``XnnpackPartitioner``, ``to_executorch``.  It needs
nothing for the int64 inputs or the mask: what its partitioner does not take (the
embedding lookups, the mask's conversion, views by the symbolic token count, layer norms)
runs on ExecuTorch's portable kernels between its delegates.  Importing ExecuTorch's
XNNPACK backend in this process does not change our programs: ``to_pte`` writes them with
xnnquant's own program writer (tests/test_export_pte.py checks the bytes).

Neither flow's export time includes the one-off costs of a process: before any timing,
one ``torch.export`` of the module is run, ExecuTorch's flow's modules (its serializer and
partitioner, torchao) are imported, xnnquant's compiled quantization loops are loaded
(numba's disk cache) and ExecuTorch's runtime is loaded (xnnquant's self-check runs each
program on it); xnnquant's flow imports no part of ``executorch.exir`` to write its programs.
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

#: The largest number of tokens the programs take (the dynamic dim's upper bound).
MAX_TOKENS = 128
#: Sentences per call of the batched program.
BATCH = 8
REPEATS = 5  # timed calls per program and input, after one untimed call
#: Held-out sentences (the first of ``models.sentences.calibration_sentences``: all 509) a
#: calibrated row runs the module's program on, in batches of ``CALIBRATION_BATCH``
#: (padding left out: the module's mask input is ``calibration_mask``).  GPTQ's mean cosine
#: on the evaluation sentences was 0.9887 with the first 128, 0.9901 with 256, 0.9907
#: with 384, 0.9916 with all (docs/benchmarks.md).
CALIBRATION_SENTENCES = 509
CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class Scheme:
    """One xnnquant row: ``xq.export(..., weights=, method=, embeddings=)``, with
    ``calibration=`` (the held-out sentences, timed as part of the export) when ``calibrated``."""

    weights: str
    method: str = "mse"
    calibrated: bool = False
    embeddings: str | None = None

    def __str__(self) -> str:
        text = self.weights if self.weights == "fp32" else f"{self.weights} {self.method}"
        text += ", calibrated" if self.calibrated else ""
        return text + (f", {self.embeddings} embeddings" if self.embeddings is not None else "")


#: xnnquant's rows, in table order: float, the default scheme, GPTQ calibrated on held-out
#: sentences (never the evaluation ones), the default with int8 embedding tables.
SCHEMES: tuple[Scheme, ...] = (Scheme("fp32"), Scheme("qb4w:32"), Scheme("qb4w:32", "gptq", calibrated=True),
                               Scheme("qb4w:32", embeddings="int8"))
#: ExecuTorch's row.
EXECUTORCH_SCHEME = "int4 g32 (torchao)"


@dataclass(frozen=True)
class Row:
    flow: str
    scheme: str
    pte_bytes: int  # the batch-1 program's
    export_s: float  # both programs'
    ms_per_sentence_1: float  # wall, the median batch-1 call
    ms_per_sentence_8: float  # wall, the median batch-8 call / BATCH
    cpu_ms: float  # CPU, the median batch-1 call on one thread
    delegates: tuple[int, int]  # (batch-1 program, batch-8 program)
    cos_mean: float  # batch 1
    cos_worst: float  # batch 1
    cos_worst_8: float  # batch 8, padded


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


def dynamic_shapes() -> tuple[dict[int, Any], dict[int, Any]]:
    """Both flows' ``dynamic_shapes``: dim 1 (tokens) of the ids and of the mask, 1..``MAX_TOKENS``."""
    import torch

    tokens = torch.export.Dim("tokens", min=1, max=MAX_TOKENS)
    return {1: tokens}, {1: tokens}


def examples() -> dict[int, tuple[Any, Any]]:
    """The example inputs of each program, by batch size: the first sentence, and the
    first ``BATCH`` sentences padded to the longest (``(ids, attention_mask)`` int64)."""
    from ..models import minilm, minilm_torch

    return {1: minilm_torch.sentence_inputs(minilm.SAMPLE_SENTENCES[:1]),
            BATCH: minilm_torch.sentence_inputs(minilm.SAMPLE_SENTENCES[:BATCH])}


def workload(sentences: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The timed inputs by name: ``"1.{i}"`` sentence i alone at its own length, ``"8.{j}"``
    the j-th batch of ``BATCH`` sentences padded to its longest (``(ids, mask)`` int64
    ``(B, T)``; a last batch of fewer sentences is left out), in that order."""
    from ..models import minilm_torch

    inputs = {}
    for i, sentence in enumerate(sentences):
        ids, mask = minilm_torch.sentence_inputs([sentence])
        inputs[f"1.{i}"] = (ids.numpy(), mask.numpy())
    for j in range(len(sentences) // BATCH):
        ids, mask = minilm_torch.sentence_inputs(sentences[j * BATCH:(j + 1) * BATCH])
        inputs[f"{BATCH}.{j}"] = (ids.numpy(), mask.numpy())
    return inputs


def _warm_up(module: Any, example: tuple[Any, ...], with_executorch: bool) -> None:
    """One untimed ``torch.export``, both flows' imports and xnnquant's compiled loops (see
    the module docstring)."""
    import torch

    import xnnquant as xq

    torch.export.export(module, example, strict=False)
    xq.quantize_blockwise(np.ones((4, 64), np.float32), 32, method="mse")  # loads the compiled loops
    from executorch.runtime import Runtime  # the self-check runs each program on it

    Runtime.get()
    if with_executorch:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401
        from executorch.exir import to_edge_transform_and_lower  # noqa: F401
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # noqa: F401


def _timed_rounds(directory: Path, plan: str, threads: int | None, repeats: int) -> None:
    """In a fresh process (``python -m xnnquant.cli.main_job DIR PLAN THREADS REPEATS``): run
    every program of ``DIR/PLAN`` (a JSON list of ``[file, [input names]]``) on its inputs of
    ``DIR/inputs.npz`` (``NAME.ids``, ``NAME.mask``), each input given to every program that
    takes it in turn, the inputs in the order they first appear in the plan; write
    ``DIR/times.npz`` (``wall.K``, ``cpu.K``: program K's seconds, ``(repeats, its inputs)``)
    and ``DIR/outputs.npz`` (``K.NAME``: program K's output on input NAME, from the untimed
    first round)."""
    from executorch.runtime import Runtime

    if threads is not None:
        # before any program is loaded: a loaded XNNPACK delegate keeps the pool it was built with
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(threads)
    import torch

    from ..pte.quantized import load_quantized_kernels

    load_quantized_kernels()  # the int8 embedding rows' lookups run on ExecuTorch's quantized kernels

    arrays = np.load(directory / "inputs.npz")
    programs_inputs: list[tuple[str, list[str]]] = json.loads((directory / plan).read_text())
    order = list(dict.fromkeys(name for _, names in programs_inputs for name in names))
    inputs = {name: [torch.from_numpy(arrays[f"{name}.ids"]), torch.from_numpy(arrays[f"{name}.mask"])]
              for name in order}
    programs = [Runtime.get().load_program((directory / file).read_bytes()) for file, _ in programs_inputs]
    methods = [p.load_method("forward") for p in programs]  # programs kept: methods need their program
    outputs = {f"{k}.{name}": methods[k].execute(inputs[name])[0].numpy().copy()
               for k, (_, names) in enumerate(programs_inputs) for name in names}
    takers = {name: [k for k, (_, names) in enumerate(programs_inputs) if name in names] for name in order}
    wall: list[list[float]] = [[] for _ in methods]
    cpu: list[list[float]] = [[] for _ in methods]
    for _ in range(repeats):
        for name in order:
            for k in takers[name]:
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                methods[k].execute(inputs[name])
                cpu[k].append(time.thread_time() - start_cpu)
                wall[k].append(time.perf_counter() - start_wall)
    np.savez(directory / "outputs.npz", **outputs)
    times: dict[str, Any] = {f"wall.{k}": np.array(w).reshape(repeats, -1) for k, w in enumerate(wall)}
    times.update({f"cpu.{k}": np.array(c).reshape(repeats, -1) for k, c in enumerate(cpu)})
    np.savez(directory / "times.npz", **times)


def run_rounds(directory: Path, plan: Sequence[tuple[str, Sequence[str]]], threads: int | None,
               repeats: int) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, np.ndarray]]:
    """``_timed_rounds`` of ``plan`` (``[(file in directory, [input names])]``, inputs in
    ``directory/inputs.npz``) in a child process: (wall seconds, CPU seconds per program,
    each ``(repeats, its inputs)``; outputs by ``"K.NAME"``)."""
    name = f"plan-{threads or 0}.json"
    (directory / name).write_text(json.dumps([[file, list(names)] for file, names in plan]))
    command = [sys.executable, "-m", __name__, str(directory), name, str(threads or 0), str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise XnnquantError(f"running the programs failed (exit {done.returncode}): {done.stderr[-2000:]}")
    times = np.load(directory / "times.npz")
    outputs = np.load(directory / "outputs.npz")
    return ([times[f"wall.{k}"] for k in range(len(plan))], [times[f"cpu.{k}"] for k in range(len(plan))],
            {key: outputs[key] for key in outputs.files})


def save_inputs(directory: Path, inputs: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """``inputs`` by name as ``directory/inputs.npz`` (``NAME.ids``, ``NAME.mask``), for ``run_rounds``."""
    arrays: dict[str, Any] = {f"{name}.{part}": array for name, pair in inputs.items()
                              for part, array in zip(("ids", "mask"), pair)}
    np.savez(directory / "inputs.npz", **arrays)


@dataclass(frozen=True)
class Measured:
    """What ``measure`` gives for one row's two programs."""

    ms_per_sentence_1: float
    ms_per_sentence_8: float
    cpu_ms: float
    embeddings_1: np.ndarray  # float32 (sentences, 384): the batch-1 program's, each sentence at its own length
    embeddings_8: np.ndarray  # float32 (BATCH * batches, 384): the batch-8 program's, in sentence order


def measure(rows: Sequence[tuple[bytes, bytes]], inputs: dict[str, tuple[np.ndarray, np.ndarray]],
            repeats: int = REPEATS) -> list[Measured]:
    """For each row's (batch-1, batch-``BATCH``) programs, on ``inputs`` (``workload``): the
    median wall ms per sentence of a call at batch 1 and at batch ``BATCH`` (the runtime's
    threads), the median CPU ms of one batch-1 call on one thread, and both programs'
    embeddings."""
    singles = [name for name in inputs if name.startswith("1.")]
    batches = [name for name in inputs if name.startswith(f"{BATCH}.")]
    with tempfile.TemporaryDirectory(prefix="xnnquant-main-job-") as temporary:
        directory = Path(temporary)
        save_inputs(directory, inputs)
        for r, (one, many) in enumerate(rows):
            (directory / f"{r}-1.pte").write_bytes(one)
            (directory / f"{r}-{BATCH}.pte").write_bytes(many)
        plan = [(f"{r}-{b}.pte", names) for r in range(len(rows)) for b, names in ((1, singles), (BATCH, batches))]
        wall, _, outputs = run_rounds(directory, plan, None, repeats)
        _, cpu, _ = run_rounds(directory, plan[::2], 1, repeats)  # the batch-1 programs only
    return [Measured(1e3 * float(statistics.median(wall[2 * r].ravel())),
                     1e3 * float(statistics.median(wall[2 * r + 1].ravel())) / BATCH,
                     1e3 * float(statistics.median(cpu[r].ravel())),
                     np.concatenate([outputs[f"{2 * r}.{name}"] for name in singles]),
                     np.concatenate([outputs[f"{2 * r + 1}.{name}"] for name in batches]))
            for r in range(len(rows))]


def cosines(embeddings: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Cosine of each row of ``embeddings`` to the same row of ``reference`` (both ``(S, D)``), float64."""
    a, b = embeddings.astype(np.float64), reference.astype(np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def executorch_flow(module: Any, example: tuple[Any, ...], shapes: Any = None) -> bytes:
    """The ``.pte`` of ExecuTorch's own flow for int4 weights in groups of 32 (module
    docstring); ``shapes``: torch.export's ``dynamic_shapes``."""
    import copy

    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    quantized = copy.deepcopy(module)
    quantize_(quantized, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(32)))
    program = torch.export.export(quantized, example, dynamic_shapes=shapes, strict=False)
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return bytes(edge.to_executorch().buffer)


def file_name(flow: str, label: str, batch: int = 1) -> str:
    """Where ``run(save=DIR)`` writes a row's program for ``batch``, e.g. ``xnnquant-qb4w_32-mse-b1.pte``."""
    words = label.replace(":", "_").replace(",", "").replace("(", "").replace(")", "").split()
    return "-".join([flow.lower(), *words, f"b{batch}"]) + ".pte"


def calibration_batches() -> list[tuple[Any, Any]]:
    """``(ids, attention_mask)`` batches of the held-out calibration sentences
    (``CALIBRATION_SENTENCES`` in batches of ``CALIBRATION_BATCH``, each padded to its longest)."""
    from ..models import minilm_torch
    from ..models.sentences import calibration_sentences

    text = calibration_sentences()[:CALIBRATION_SENTENCES]
    return [minilm_torch.sentence_inputs(text[i:i + CALIBRATION_BATCH])
            for i in range(0, len(text), CALIBRATION_BATCH)]


def reference_embeddings(module: Any, inputs: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The float module's embeddings of the batch-1 inputs (``"1.{i}"``), in order: ``(S, 384)`` float32."""
    import torch

    with torch.no_grad():
        return np.concatenate([module(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
                               for name, (ids, mask) in inputs.items() if name.startswith("1.")])


def run(schemes: Sequence[Scheme] = SCHEMES, with_executorch: bool = True,
        progress: Callable[[str], None] | None = None, save: str | os.PathLike[str] | None = None,
        repeats: int = REPEATS, module: Any = None, sentences: Sequence[str] | None = None,
        calibration: Sequence[tuple[Any, Any]] | None = None) -> list[Row]:
    """Build, time and run every row's programs (see the module docstring); ``save``: a
    directory to write them to (``file_name``).  ``module`` (default: the whole
    all-MiniLM-L6-v2, ``minilm_torch.sentence_encoder()``), ``sentences`` (default: the
    held-out ``evaluation_sentences()``) and ``calibration`` (``(ids, mask)`` batches;
    default: ``calibration_batches()``) are there for a smaller run (the tests)."""
    _check_extras(with_executorch)
    say = progress or (lambda _: None)
    say("importing torch")
    import xnnquant as xq

    from ..models import minilm_torch
    from ..models.sentences import evaluation_sentences

    say("loading all-MiniLM-L6-v2")
    if module is None:
        module = minilm_torch.sentence_encoder()
    inputs = workload(evaluation_sentences() if sentences is None else sentences)
    reference = reference_embeddings(module, inputs)
    example = examples()
    say("warming up torch.export, imports and compiled loops (not timed)")
    _warm_up(module, example[1], with_executorch)
    built: list[tuple[str, str, dict[int, bytes], float]] = []  # flow, scheme, .pte by batch, export seconds
    for scheme in schemes:
        say(f"xnnquant: {scheme} (2 programs)")
        ptes = {}
        start = time.perf_counter()
        for batch in (1, BATCH):
            batches = (calibration_batches() if calibration is None else calibration) if scheme.calibrated else None
            exported = xq.export(module, example[batch], weights=scheme.weights, method=scheme.method,
                                 calibration=batches,
                                 calibration_mask=1 if batches is not None else None,  # input 1: the mask
                                 dynamic_shapes=dynamic_shapes(), embeddings=scheme.embeddings, progress=False)
            ptes[batch] = exported.to_pte()
        built.append(("xnnquant", str(scheme), ptes, time.perf_counter() - start))
    if with_executorch:
        say("ExecuTorch: torchao int4 group 32, to_edge_transform_and_lower, 2 programs (over a minute each)")
        start = time.perf_counter()
        ptes = {batch: executorch_flow(module, example[batch], dynamic_shapes()) for batch in (1, BATCH)}
        built.append(("ExecuTorch", EXECUTORCH_SCHEME, ptes, time.perf_counter() - start))
    if save is not None:
        from ..files import write_atomic

        for flow, label, ptes, _ in built:
            for batch, pte in ptes.items():
                write_atomic(Path(save) / file_name(flow, label, batch), pte)
    say(f"running the {2 * len(built)} programs on XNNPACK ({repeats} rounds, then batch 1 again on one thread)")
    measured = measure([(ptes[1], ptes[BATCH]) for _, _, ptes, _ in built], inputs, repeats)
    rows = []
    for (flow, label, ptes, seconds), m in zip(built, measured):
        cos = cosines(m.embeddings_1, reference)
        cos_8 = cosines(m.embeddings_8, reference[:len(m.embeddings_8)])
        rows.append(Row(flow, label, len(ptes[1]), seconds, m.ms_per_sentence_1, m.ms_per_sentence_8, m.cpu_ms,
                        (_delegates(ptes[1]), _delegates(ptes[BATCH])), float(cos.mean()), float(cos.min()),
                        float(cos_8.min())))
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (pasted into docs/benchmarks.md as is)."""
    header = ("flow", "scheme", ".pte size", "export time", "ms/sentence batch 1", f"ms/sentence batch {BATCH}",
              "CPU 1 thread", "delegates", "cos mean", "cos worst", f"cos worst batch {BATCH}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        delegates = str(r.delegates[0]) if r.delegates[0] == r.delegates[1] else " / ".join(map(str, r.delegates))
        cells = (r.flow, r.scheme, f"{r.pte_bytes / 1e6:.2f} MB", f"{r.export_s:.2f} s", f"{r.ms_per_sentence_1:.2f}",
                 f"{r.ms_per_sentence_8:.2f}", f"{r.cpu_ms:.2f} ms", delegates, f"{r.cos_mean:.4f}",
                 f"{r.cos_worst:.4f}", f"{r.cos_worst_8:.4f}")
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

    loads = [os.getloadavg()[0]]
    try:
        rows = run(with_executorch=with_executorch, progress=say, save=save)
        if bar is not None:
            bar.update()
    finally:
        if bar is not None:
            bar.close()
    loads.append(os.getloadavg()[0])
    if as_json:
        return json.dumps({"cores": os.cpu_count(), "load_average_1min": loads, "rows": [asdict(r) for r in rows]},
                          indent=2)
    note = (f"all-MiniLM-L6-v2 whole (token ids and mask in, sentence embedding out), each flow's programs "
            f"exported once with tokens dynamic 1..{MAX_TOKENS}: one for batch 1, one for batch {BATCH}; the 116 "
            f"held-out sentences, {REPEATS} timed calls per program and input; ms/sentence: median wall time of a "
            f"call per sentence, the runtime's threads, batch 1: each sentence at its own length, batch {BATCH}: "
            f"padded to the longest of each batch, with the mask; CPU 1 thread: median CPU time of a batch-1 call "
            f"on one thread; cosines to the float module at each sentence's own length; {os.cpu_count()} cores, "
            f"load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end")
    return note + "\n\n" + format_rows(rows)


if __name__ == "__main__":  # the child process of ``run_rounds``
    _timed_rounds(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) or None, int(sys.argv[4]))
