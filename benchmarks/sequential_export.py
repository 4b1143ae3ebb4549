"""Activation-aware export in seconds: ``xq.export(..., method="gptq", calibration=...)`` of
all-MiniLM-L6-v2 against the numpy model's sequential GPTQ on the same sentences.

Both calibrate sequentially (each linear on what the already-quantized linears before it
produce) and quantize all 36 linears with GPTQ, qb4w group 32, on the first ``SENTENCES``
(128, issue 24's figure) held-out calibration sentences in batches of
``cli.main_job.CALIBRATION_BATCH``: 2 batches of 64, as the encoder's inputs, padding
excluded from the statistics in both:

* ``export``: ``xq.export(module, example, weights="qb4w:32", method="gptq",
  calibration=batches, calibration_mask=1)``, the whole call (tracing, calibration,
  lowering, writing, self-check);
* ``numpy``: ``models.sequential.quantize_minilm(sentences, gptq qb4w:32)``.

The two run interleaved, ``--repeat`` rounds (default 3), after a warm-up of each (torch's
and numba's first calls); the medians are compared.  Then one more export under cProfile
says where its time goes: the batches run through the module itself (``frontend/eager.py``:
the time the calling thread waits for them at each layer) or, where it cannot stand in for
the program, tracing the module at the batches' shapes (``batches.fx_traced``'s quick
traces, else torch.export's) and the torch ops of the program; the Gram matrices
(``Calibration.add``), GPTQ (with its inverse Cholesky and re-fit), the self-check.

Run: ``python benchmarks/sequential_export.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import numpy as np

import xnnquant as xq

#: Calibration sentences (the first of ``models.sentences.calibration_sentences``).
SENTENCES = 128


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


#: (label, substring of cProfile's function line) of the parts of an export
PARTS = (
    ("the module's run, waited for at each layer", "eager.py", "(_arrivals)"),
    ("trace the module at the batches' shapes", "batches.py", "(programs_for)"),
    ("  of which quick traces (make_fx)", "batches.py", "(fx_traced)"),
    ("torch ops of the program (both batches)", "evaluation.py", "(_compute)"),
    ("Gram matrices (Calibration.add)", "schemes/calibration.py", "(add)"),
    ("GPTQ (36 linears; q, k, v as one)", "schemes/gptq.py", "(gptq)"),
    ("  of which inverse Cholesky", "schemes/gptq.py", "(inverse_cholesky)"),
    ("  of which least-squares re-fit", "schemes/gptq.py", "(refit_scales)"),
    ("self-check", "selfcheck.py", "(self_check)"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from xnnquant.cli.main_job import CALIBRATION_BATCH
    from xnnquant.models import minilm_torch, sequential
    from xnnquant.models.sentences import calibration_sentences

    module, example = minilm_torch.example()
    sentences = calibration_sentences()[:SENTENCES]
    batches = [minilm_torch.encoder_inputs(sentences[i:i + CALIBRATION_BATCH])
               for i in range(0, len(sentences), CALIBRATION_BATCH)]
    tokens = int(sum(float(mask.sum()) for _, mask in batches))
    print(f"xnnquant {xq.__version__}; {SENTENCES} sentences in {len(batches)} batches "
          f"({', '.join(str(tuple(h.shape[:2])) for h, _ in batches)}; {tokens} real tokens); {load_note()}")

    def export() -> xq.Exported:
        return xq.export(module, example, weights="qb4w:32", method="gptq", calibration=batches,
                         calibration_mask=1, progress=False)

    def numpy_model() -> object:
        return sequential.quantize_minilm(
            sentences, lambda _, w, cal: xq.quantize_blockwise(w, 32, "gptq", calibration=cal))

    print("warming up (torch.export, numba) ...", flush=True)
    export()
    numpy_model()
    times: dict[str, list[float]] = {"export": [], "numpy": []}
    stages = ""
    for r in range(args.repeat):
        for name, fn in (("export", export), ("numpy", numpy_model)) if r % 2 == 0 else \
                (("numpy", numpy_model), ("export", export)):
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            if isinstance(result, xq.Exported):
                stages = ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items() if v >= 0.005)
        print(f"round {r + 1}: export {times['export'][-1]:.2f} s ({stages}), numpy model {times['numpy'][-1]:.2f} s; "
              f"{load_note()}", flush=True)
    ours, theirs = np.median(times["export"]), np.median(times["numpy"])
    print(f"\nmedians of {args.repeat}: xq.export gptq {ours:.2f} s, numpy model's sequential gptq {theirs:.2f} s: "
          f"the export takes {ours / theirs:.2f}x the numpy model's time (goal: <= 1x)")

    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    exported = export()
    profile.disable()
    total = time.perf_counter() - start
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats()
    lines = out.getvalue().splitlines()
    print(f"\none export under cProfile: {total:.2f} s; stages "
          + ", ".join(f"{k} {v:.2f} s" for k, v in exported.timings.items() if v >= 0.005))
    for label, where, name in PARTS:
        found = [line for line in lines if where in line and name in line]
        seconds = sum(float(line.split()[3]) for line in found[:1])
        print(f"  {label:42} {seconds:6.2f} s")
    print(load_note())


if __name__ == "__main__":
    main()
