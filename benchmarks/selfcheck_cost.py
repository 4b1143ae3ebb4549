"""What the self-check costs: ``Exported.timings["check"]`` against the whole export.

    python benchmarks/selfcheck_cost.py [--rounds 2] [--skip-large]

Rows: all-MiniLM-L6-v2 (the encoder on 32 tokens, and the whole sentence encoder, token ids
and mask in, a mixed program) at fp32 and qb4w:32; the 1.07e9-weight Llama-shaped decoder of
the streaming benchmark held in memory (its in-memory cousin: random weights, 4.3 GB of
float32, about 12 GB at peak), qb4w:32 with ``minmax``.  Each export runs twice, with
``check=True`` and ``check=False``; the table gives the check stage's time, its share of the
checked export, and the difference of the two wall times (what a user waits for it).
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any


def _row(name: str, make: Any, weights: str, method: str, rounds: int) -> None:
    import xnnquant as xq

    module, inputs = make()
    best: dict[bool, tuple[float, float]] = {}
    for _ in range(rounds):
        for check in (True, False):
            start = time.perf_counter()
            exported = xq.export(module, inputs, weights=weights, method=method, check=check, progress=False)
            wall = time.perf_counter() - start
            stage = float(exported.timings.get("check", 0.0))
            if check not in best or wall < best[check][0]:
                best[check] = (wall, stage)
            del exported
            gc.collect()
    (checked, stage), (unchecked, _) = best[True], best[False]
    print(f"| {name} | {weights} | {checked:.2f} s | {stage:.2f} s | {stage / checked:.0%} | "
          f"{unchecked:.2f} s | {checked - unchecked:+.2f} s |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="exports per row and setting; the fastest is kept")
    parser.add_argument("--skip-large", action="store_true", help="leave out the 1.07e9-weight decoder")
    args = parser.parse_args()

    import torch

    from xnnquant.models import minilm_torch
    from xnnquant.models.llama import LlamaConfig, decoder

    def encoder() -> Any:
        return minilm_torch.example()

    def sentence() -> Any:
        module = minilm_torch.sentence_encoder()
        return module, minilm_torch.sentence_inputs(["a sentence to embed, of a dozen tokens or so"], tokens=32)

    def large() -> Any:
        config = LlamaConfig.large()
        return decoder(config, "cpu", seed=0), (torch.randn(1, config.seq, config.hidden),)

    import xnnquant as xq

    for make in (encoder, sentence):  # untimed: torch's and the runtime's first-call costs
        xq.export(*make(), weights="fp32", progress=False)
    print("| model | weights | export, checked | check stage | share | export, check=False | difference |")
    print("|---|---|---|---|---|---|---|")
    for weights in ("fp32", "qb4w:32"):
        _row("all-MiniLM-L6-v2 encoder (32 tokens)", encoder, weights, "mse", args.rounds)
        _row("all-MiniLM-L6-v2 sentence encoder (ids + mask, mixed)", sentence, weights, "mse", args.rounds)
    if not args.skip_large:
        _row("Llama-shaped decoder, 1.07e9 weights in memory", large, "qb4w:32", "minmax", 1)


if __name__ == "__main__":
    main()
