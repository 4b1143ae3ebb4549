"""The main job (``make run``, ``xnnquant minilm``): all-MiniLM-L6-v2's encoder through
``xq.export`` with each weight scheme, and through ExecuTorch's own flow, side by side.

For each flow and scheme: the ``.pte`` is built (timed from the float module to the
program bytes), loaded by ``executorch.runtime`` (the real XNNPACK), and run on each of
the sample sentences (``minilm.SAMPLE_SENTENCES``, one sentence of 32 tokens per call);
the table gives the ``.pte`` size, the export time, the median latency of one call, the
number of XNNPACK delegates in the program, and the sentence embeddings' cosine
similarity to the float model's (mean and worst over the sentences).

ExecuTorch's flow is its documented one: torchao's
``Int8DynamicActivationIntxWeightConfig(weight_dtype=int4, weight_granularity=PerGroup(32))``
with its default scale choice, ``torch.export``, ``to_edge_transform_and_lower`` with
``XnnpackPartitioner``, ``to_executorch``.  Importing ExecuTorch's XNNPACK backend in this
process does not change our programs: ``to_pte`` builds its ``LoweredBackendModule``
directly (tests/test_export_pte.py checks the bytes).

Both flows are timed after one untimed ``torch.export`` of the module, which pays the
one-off cost of torch's first export in a process (seconds of imports and set-up).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np

#: (weights, method) exported by xnnquant, in table order.
SCHEMES: tuple[tuple[str, str], ...] = (("fp32", "mse"), ("qc8w", "mse"), ("qb4w:32", "minmax"), ("qb4w:32", "mse"))
TOKENS = 32
REPEATS = 5  # timed calls per sentence, after one untimed call


@dataclass(frozen=True)
class Row:
    flow: str
    scheme: str
    pte_bytes: int
    export_s: float
    latency_ms: float
    delegates: int
    cos_mean: float
    cos_worst: float


def _delegates(pte: bytes) -> int:
    """XNNPACK delegate calls in a program (counted in its flatbuffer by backend id)."""
    return pte.count(b"XnnpackBackend")


def measure(pte: bytes, inputs: Sequence[tuple[Any, Any]], reference: np.ndarray, masks: np.ndarray,
            repeats: int = REPEATS) -> tuple[float, float, float]:
    """(median latency of one call in ms, mean cosine, worst cosine) of the program ``pte``
    on each ``(hidden, mask)`` pair; ``reference``: float sentence embeddings ``(S, 384)``."""
    from executorch.runtime import Runtime

    from .models.minilm import mean_pooled

    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    hidden = []
    times = []
    for h, m in inputs:
        (out,) = method.execute([h, m])
        hidden.append(np.array(out.numpy()))
        for _ in range(repeats):
            start = time.perf_counter()
            method.execute([h, m])
            times.append(time.perf_counter() - start)
    embeddings = mean_pooled(np.concatenate(hidden), masks)
    cos = np.sum(embeddings * reference, axis=1)
    return 1e3 * statistics.median(times), float(cos.mean()), float(cos.min())


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


def run(schemes: Sequence[tuple[str, str]] = SCHEMES, with_executorch: bool = True,
        progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every row of the table (see the module docstring)."""
    import torch

    import xnnquant as xq

    from .models import minilm, minilm_torch

    say = progress or (lambda _: None)
    say("loading all-MiniLM-L6-v2")
    module = minilm_torch.encoder()
    sentences = minilm.SAMPLE_SENTENCES
    hidden, mask = minilm_torch.encoder_inputs(sentences, TOKENS)
    with torch.no_grad():
        reference = minilm.mean_pooled(module(hidden, mask).numpy(), mask.numpy())
    inputs = [(hidden[i:i + 1], mask[i:i + 1]) for i in range(len(sentences))]
    example = inputs[0]
    say("warming up torch.export (not timed)")
    torch.export.export(module, example, strict=False)
    rows = []
    for weights, method in schemes:
        say(f"xnnquant: {weights} {method}")
        start = time.perf_counter()
        exported = xq.export(module, example, weights=weights, method=method, progress=False)
        pte = exported.to_pte()
        seconds = time.perf_counter() - start
        latency, cos_mean, cos_worst = measure(pte, inputs, reference, mask.numpy())
        rows.append(Row("xnnquant", f"{weights} {method}" if weights != "fp32" else weights, len(pte), seconds,
                        latency, _delegates(pte), cos_mean, cos_worst))
    if with_executorch:
        say("ExecuTorch: torchao int4 group 32, to_edge_transform_and_lower (tens of seconds)")
        start = time.perf_counter()
        pte = executorch_flow(module, example)
        seconds = time.perf_counter() - start
        latency, cos_mean, cos_worst = measure(pte, inputs, reference, mask.numpy())
        rows.append(Row("ExecuTorch", "int4 g32 (torchao)", len(pte), seconds, latency, _delegates(pte), cos_mean,
                        cos_worst))
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (pasted into the README as is)."""
    header = ("flow", "scheme", ".pte size", "export time", "latency", "delegates", "cos mean", "cos worst")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = (r.flow, r.scheme, f"{r.pte_bytes / 1e6:.2f} MB", f"{r.export_s:.2f} s", f"{r.latency_ms:.2f} ms",
                 str(r.delegates), f"{r.cos_mean:.4f}", f"{r.cos_worst:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(as_json: bool = False, with_executorch: bool = True, progress: TextIO | None = None) -> str:
    """The table (or JSON rows) of the main job; ``progress``: where to say what it is doing."""
    import os

    def say(text: str) -> None:
        if progress is not None:
            print(f"[{time.strftime('%H:%M:%S')}] {text}", file=progress, flush=True)

    rows = run(with_executorch=with_executorch, progress=say)
    if as_json:
        return json.dumps([asdict(r) for r in rows], indent=2)
    cores = os.cpu_count()
    note = (f"all-MiniLM-L6-v2 encoder, {TOKENS} tokens per sentence, one sentence per call, "
            f"{len(rows) and REPEATS} timed calls per sentence; latency = median; {cores} cores")
    return note + "\n\n" + format_rows(rows)
