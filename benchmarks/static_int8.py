"""Static int8 (``activations="qint8"``) against ExecuTorch's PT2E flow, technique by technique.

For each network: ExecuTorch's flow (``XNNPACKQuantizer`` with
``get_symmetric_quantization_config(is_per_channel=True)``, ``prepare_pt2e``, calibration,
``convert_pt2e``, ``to_edge_transform_and_lower`` with ``XnnpackPartitioner``,
``to_executorch``), our fp32 export (the latency baseline), our default static int8
(``xq.export(module, example, weights="qc8w", activations="qint8", calibration=...)``), ours
with one technique changed at a time (``VARIANTS``: the previous default's percentile ranges,
without equalization, without bias correction, with learned rounding), and ours at the mixed-precision budgets
(``StaticInt8(budget=...)``), all calibrated on the same batches.  Printed per program:

* logits SQNR against the float module (dB) and top-1 agreement with it, on every held-out
  input (the counts are printed: agreement over ``n`` inputs moves in steps of ``1 / n``);
* export time, module to ``.pte`` bytes, calibration included, after both flows' imports,
  one untimed run of each flow on a small network (their first-call costs) and one untimed
  ``torch.export`` of the network; PT2E's flow and our default are exported in turn
  ``--export-rounds`` times (default 3) and their median times printed, the other programs once;
* latency: every program loaded in a fresh process, each of ``TIMED`` held-out inputs given
  to every program in turn, in a shuffled order per input (interleaved, so that the
  machine's load and the caches' state fall on all alike); the median wall time of one
  call with the runtime's threads, and the median CPU time of one call on one thread.

Networks: ``residual`` and ``inverted`` (``xnnquant.models.cnn``, 16 random calibration
batches, 8 others to evaluate), ``mobilenet_v2`` (``xnnquant.models.mobilenet_v2``) and
``efficientnet_lite0`` (``xnnquant.models.efficientnet_lite``): ImageNet weights, 32 crops
of 9 photos to calibrate, ``--crops`` (default 144) crops of 9 other photos to evaluate.

    python benchmarks/static_int8.py [--only mobilenet_v2 ...] [--crops 144] [--repeats 10] [--export-rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

NETWORKS = ("residual", "inverted", "mobilenet_v2", "efficientnet_lite0")
#: Held-out inputs each program is timed on (every held-out input is scored).
TIMED = 16
#: Our programs besides the default: one technique changed at a time, then the mixed-precision budgets.
VARIANTS: dict[str, dict[str, Any]] = {
    "ranges=percentile": {"ranges": "percentile"},
    "no equalization": {"equalize": False},
    "no bias correction": {"bias_correction": False},
    "rounding=learned": {"rounding": "learned"},
    "budget=0.1": {"budget": 0.1},
    "budget=0.2": {"budget": 0.2},
    "budget=0.3": {"budget": 0.3},
}


def data(name: str, crops: int) -> tuple[Any, list[np.ndarray], list[np.ndarray]]:
    """(module, calibration inputs, evaluation inputs) of network ``name``."""
    from xnnquant.models import cnn, efficientnet_lite, mobilenet_v2

    if name == "mobilenet_v2":
        return (mobilenet_v2.build(), mobilenet_v2.photo_batches("calibration", 32),
                mobilenet_v2.photo_batches("evaluation", crops))
    if name == "efficientnet_lite0":
        return (efficientnet_lite.build(), efficientnet_lite.photo_batches("calibration", 32),
                efficientnet_lite.photo_batches("evaluation", crops))
    module = cnn.residual() if name == "residual" else cnn.inverted_residual()
    return module, cnn.random_batches(16, 1), cnn.random_batches(8, 2)


def pt2e_flow(module: Any, example: tuple[Any, ...], calibration: list[tuple[Any, ...]]) -> bytes:
    """ExecuTorch's own static int8 flow (module docstring): the ``.pte`` bytes."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    captured = torch.export.export(copy.deepcopy(module), example).module()
    quantizer = XNNPACKQuantizer()
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(captured, quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    converted = convert_pt2e(prepared)
    lowered = to_edge_transform_and_lower(torch.export.export(converted, example),
                                          partitioner=[XnnpackPartitioner()])
    return bytes(lowered.to_executorch().buffer)


def ours(module: Any, example: tuple[Any, ...], calibration: list[tuple[Any, ...]] | None,
         choice: Any = "qint8") -> tuple[bytes, Any]:
    import xnnquant as xq

    if calibration is None:
        exported = xq.export(module, example, weights="fp32", progress=False)
    else:
        exported = xq.export(module, example, weights="qc8w", activations=choice, calibration=calibration,
                             progress=False)
    return exported.to_pte(), exported


def _timed_rounds(directory: Path, threads: int, repeats: int) -> None:
    """In a fresh process: run every ``DIR/N.pte`` on ``DIR/inputs.npz``, each input given to every
    program in turn; write ``DIR/times.npz`` (wall and CPU seconds) and ``DIR/outputs.npz``."""
    import torch
    from executorch.runtime import Runtime

    if threads:  # before any program is loaded: a loaded XNNPACK delegate keeps the pool it was built with
        from executorch.extension.pybindings import portable_lib

        portable_lib._unsafe_reset_threadpool(threads)
    # torch only copies the outputs here; its pool's threads would spin-wait on the cores XNNPACK's
    # pool runs the next call on (measured: a MobileNetV2-sized call 25x slower on 2 cores)
    torch.set_num_threads(1)
    arrays = np.load(directory / "inputs.npz")
    inputs = [torch.from_numpy(arrays[k]) for k in sorted(arrays.files, key=lambda k: int(k[4:]))]
    paths = sorted(directory.glob("*.pte"), key=lambda p: int(p.stem))
    programs = [Runtime.get().load_program(p.read_bytes()) for p in paths]  # kept: methods need their program
    methods = [p.load_method("forward") for p in programs]
    outputs = [np.concatenate([m.execute([x])[0].numpy() for x in inputs]) for m in methods]
    wall: list[list[float]] = [[] for _ in methods]
    cpu: list[list[float]] = [[] for _ in methods]
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for x in inputs[:TIMED]:
            for i in order.permutation(len(methods)):
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                methods[i].execute([x])
                cpu[i].append(time.thread_time() - start_cpu)
                wall[i].append(time.perf_counter() - start_wall)
    np.savez(directory / "outputs.npz", *outputs)
    np.savez(directory / "times.npz", wall=np.array(wall), cpu=np.array(cpu))


def measure(ptes: list[bytes], inputs: list[np.ndarray], repeats: int) -> tuple[list[float], list[float],
                                                                                 list[np.ndarray]]:
    """(median wall ms with the runtime's threads, median CPU ms on one thread, outputs) per program."""
    results = []
    with tempfile.TemporaryDirectory(prefix="xnnquant-int8-") as name:
        directory = Path(name)
        np.savez(directory / "inputs.npz", *inputs)
        for i, pte in enumerate(ptes):
            (directory / f"{i}.pte").write_bytes(pte)
        for threads in (0, 1):
            done = subprocess.run([sys.executable, __file__, "--rounds", str(directory), str(threads), str(repeats)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"running the programs failed: {done.stderr[-3000:]}")
            times = np.load(directory / "times.npz")
            outs = np.load(directory / "outputs.npz")
            results.append((times["wall"], times["cpu"], [outs[f"arr_{i}"] for i in range(len(ptes))]))
    (wall, _, outputs), (_, cpu, _) = results
    return ([1e3 * statistics.median(w) for w in wall], [1e3 * statistics.median(c) for c in cpu], outputs)


def sqnr_db(reference: np.ndarray, got: np.ndarray) -> float:
    r, g = reference.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10(np.sum(r * r) / np.sum((r - g) ** 2)))


def bench(name: str, repeats: int, crops: int, say: Any, export_rounds: int = 3) -> dict[str, Any]:
    import torch

    import xnnquant as xq

    module, calibration, evaluation = data(name, crops)
    cal = [(torch.from_numpy(x),) for x in calibration]
    example = cal[0]
    with torch.no_grad():
        reference = np.concatenate([module(torch.from_numpy(x)).numpy() for x in evaluation])
    torch.export.export(module, example, strict=False)  # untimed: torch.export's first-call costs
    programs: dict[str, tuple[bytes, float | None, Any]] = {}

    def timed(label: str, make: Any) -> None:
        say(f"{name}: exporting {label}")
        start = time.perf_counter()
        pte, exported = make()
        programs[label] = (pte, time.perf_counter() - start, exported)

    # the two flows whose export times the goal compares, in turn, ``export_rounds`` times each: the
    # median of each (one flow's export runs about a fifth slower right after the other's)
    times: dict[str, list[float]] = {"ExecuTorch PT2E": [], "xnnquant qint8": []}
    for _ in range(export_rounds):
        timed("ExecuTorch PT2E", lambda: (pt2e_flow(module, example, cal), None))
        timed("xnnquant qint8", lambda: ours(module, example, cal))
        for label in times:
            times[label].append(programs[label][1])
    for label, seconds in times.items():
        pte, _, exported = programs[label]
        programs[label] = (pte, statistics.median(seconds), exported)
    for label, change in VARIANTS.items():
        timed(label, lambda change=change: ours(module, example, cal, xq.StaticInt8(**change)))
    fp32_pte, _ = ours(module, example, None)
    programs["xnnquant fp32"] = (fp32_pte, None, None)
    labels = list(programs)
    say(f"{name}: running {len(labels)} programs on {len(evaluation)} inputs, timing {min(TIMED, len(evaluation))} "
        f"of them ({repeats} rounds, then again on one thread)")
    wall, cpu, outputs = measure([programs[k][0] for k in labels], evaluation, repeats)
    row: dict[str, Any] = {"network": name, "evaluation inputs": len(evaluation),
                           "calibration inputs": len(calibration), "flows": {}}
    for k, label in enumerate(labels):
        pte, seconds, exported = programs[label]
        out = outputs[k]
        same = reference.argmax(1) == out.argmax(1)
        entry = {"sqnr_db": round(sqnr_db(reference, out), 2), "top1_agreement": round(float(np.mean(same)), 4),
                 "top1_same": int(same.sum()),
                 "export_s": None if seconds is None or label == "xnnquant fp32" else round(seconds, 2),
                 "latency_ms": round(wall[k], 3), "cpu_1thread_ms": round(cpu[k], 3), "pte_bytes": len(pte)}
        if exported is not None:
            entry["timings"] = {t: round(v, 2) for t, v in exported.timings.items()}
            entry["kept fp32"] = list(exported.static_int8.int8.kept)
            entry["notes"] = list(exported.static_int8.int8.notes)
        row["flows"][label] = entry
    row["boundaries"] = programs["xnnquant qint8"][2].boundaries
    return row


def warm_up(say: Any) -> None:
    """One untimed run of each flow on a two-layer network (see the module docstring)."""
    import torch

    say("warming both flows up on a small network")
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                 torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    batches = [(torch.randn(1, 3, 16, 16),) for _ in range(4)]
    ours(module, batches[0], batches)
    pt2e_flow(module, batches[0], batches)


def format_row(row: dict[str, Any]) -> str:
    flows = row["flows"]
    n = row["evaluation inputs"]
    lines = [f"{row['network']} ({row['calibration inputs']} calibration, {n} evaluation inputs; top-1 agreement in "
             f"steps of 1/{n})",
             f"  {'flow':22s} {'SQNR dB':>8s} {'top-1':>12s} {'export s':>9s} {'latency ms':>11s} "
             f"{'CPU 1 thr ms':>13s} {'vs default':>10s}"]
    default = flows["xnnquant qint8"]
    for label, r in flows.items():
        export = "" if r["export_s"] is None else f"{r['export_s']:.2f}"
        top1 = f"{r['top1_agreement']:.3f} {r['top1_same']:>3d}"
        lines.append(f"  {label:22s} {r['sqnr_db']:8.2f} {top1:>12s} {export:>9s} {r['latency_ms']:11.3f} "
                     f"{r['cpu_1thread_ms']:13.3f} {r['cpu_1thread_ms'] / default['cpu_1thread_ms']:9.2f}x")
    a, b = default, flows["ExecuTorch PT2E"]
    lines.append(f"  default - PT2E: {a['sqnr_db'] - b['sqnr_db']:+.2f} dB; export "
                 f"{b['export_s'] / a['export_s']:.1f}x faster; latency {a['latency_ms'] / b['latency_ms']:.2f}x "
                 f"PT2E's (CPU 1 thread {a['cpu_1thread_ms'] / b['cpu_1thread_ms']:.2f}x)")
    lines.append(f"  default stages (s): {a.get('timings')}")
    for label, r in flows.items():
        for kept in r.get("kept fp32") or []:
            lines.append(f"  {label} keeps fp32: {kept}")
        for note in r.get("notes") or []:
            lines.append(f"  {label} note: {note}")
    lines += [f"  boundary: {b}" for b in row["boundaries"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=NETWORKS, default=list(NETWORKS))
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds over the timed inputs")
    parser.add_argument("--crops", type=int, default=144, help="held-out photo crops of the ImageNet networks")
    parser.add_argument("--export-rounds", type=int, default=3,
                        help="exports of PT2E's flow and of our default, in turn (their median export times)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rounds", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds:
        _timed_rounds(Path(args.rounds[0]), int(args.rounds[1]), int(args.rounds[2]))
        return
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # noqa: F401
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer  # noqa: F401
    from executorch.exir import to_edge_transform_and_lower  # noqa: F401
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e  # noqa: F401

    def say(text: str) -> None:
        print(f"# {text}", file=sys.stderr, flush=True)

    warm_up(say)
    rows = [bench(name, args.repeats, args.crops, say, args.export_rounds) for name in args.only]
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"rows": rows, "load_average": load}, indent=2))
        return
    for row in rows:
        print(format_row(row))
    print(f"{os.cpu_count()} cores, load average {load:.2f} at the end")


if __name__ == "__main__":
    main()
