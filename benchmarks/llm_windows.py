"""Sliding windows at a long context: a Gemma-3-1B-shaped checkpoint folder (random weights)
through ``xnnquant export-llm --max-context 8192``, beside the same weights without windows.

The model is Gemma 3 1B's shape (``SHAPE``: 26 layers, 5 of every 6 attending to a window of
512 positions, hidden 1152, one key/value head of 256, vocabulary 262,144), its weights random
(transformers' initialization, seed 0) and saved in bfloat16 as the released checkpoint is.
"no windows" is the same folder's weights with every layer ``full_attention``: the program a
library that refuses windows, or ignores them, would make at this context.

Per program:

=================  ====================================================================
export s, RSS      ``xnnquant export-llm FOLDER -o model.pte --max-context 8192`` in a child
                   process (defaults otherwise): wall seconds and peak RSS (``ru_maxrss``)
cache MB           the KV cache's bytes (``cache_bytes``)
planned MB         the arenas ``forward`` plans, the cache included
decode RSS MB      peak RSS of a child that loads the program, fills its cache to position
                   ``FAR`` in calls of 128 tokens and decodes 8 tokens there, over its
                   RSS before the load (``llm_context.peak_since``)
decode ms @ p      one token at position p (64 and ``FAR``), cache filled: the median of
                   ``--rounds`` rounds of 4 calls, both programs in turn, one process
=================  ====================================================================

Usage: ``python benchmarks/llm_windows.py [--rounds 5] [--fresh] [--kv-cache int8]``
(``--kv-cache``: both programs with that cache, as ``export-llm --kv-cache``). The folder
(2 GB) and the programs are kept in ``<cache>/llm-windows/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm import timed_child
from llm_context import peak_since

from xnnquant.llm import evaluate
from xnnquant.models import smollm2
from xnnquant.pte.planned import planned_bytes

CACHE = smollm2.cache_dir() / "llm-windows"
MAX_CONTEXT, FAR = 8192, 8000
#: Gemma 3 1B's published config (google/gemma-3-1b-it), the shape only
SHAPE = dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
             max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
             query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
             layer_types=["full_attention" if (k + 1) % 6 == 0 else "sliding_attention" for k in range(26)])


def folders() -> dict[str, Path]:
    """The checkpoint folder with windows, and its twin without (same safetensors, linked)."""
    windowed, full = CACHE / "gemma3-1b-shaped", CACHE / "gemma3-1b-shaped-no-windows"
    if not (windowed / "model.safetensors").is_file():
        import torch
        import transformers as tf

        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SHAPE)).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        model.config.torch_dtype = torch.bfloat16
        model.save_pretrained(windowed)
        del model
    full.mkdir(parents=True, exist_ok=True)
    config = json.loads((windowed / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * SHAPE["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(config, indent=2))
    for name in os.listdir(windowed):
        if name != "config.json" and not (full / name).exists():
            (full / name).symlink_to(windowed / name)
    return {"windows": windowed, "no windows": full}


def export(name: str, folder: Path, fresh: bool, kv_cache: str) -> tuple[Path, dict]:
    out = CACHE / (name.replace(" ", "-") + ("" if kv_cache == "fp32" else f"-{kv_cache}"))
    out.mkdir(parents=True, exist_ok=True)
    pte, facts = out / "model.pte", out / "export.json"
    if fresh or not facts.is_file() or not pte.is_file():
        seconds, rss, cpu = timed_child([sys.executable, "-m", "xnnquant", "export-llm", str(folder), "-o", str(pte),
                                         "--max-context", str(MAX_CONTEXT), "--kv-cache", kv_cache, "--no-progress"],
                                        out, out / "export.log")
        facts.write_text(json.dumps({"seconds": seconds, "rss": rss, "cpu": cpu}))
    return pte, json.loads(facts.read_text())


def _filled(pte: Path) -> evaluate.ProgramStep:
    step = evaluate.llm_step(pte)
    ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], FAR, dtype=np.int64)
    step(ids[None], 0)
    return step


def cache_bytes(windows: bool, kv_cache: str) -> int:
    """The KV cache's bytes: each layer's slots (``llm/decoder.py``: a windowed layer's ring
    holds window + max_seq_len - 1) x key and value x heads x (head size x 4 bytes; int8: head
    size codes and a 4-byte scale)."""
    slots = sum(min(MAX_CONTEXT, SHAPE["sliding_window"] + 128 - 1) if windows and kind == "sliding_attention"
                else MAX_CONTEXT for kind in SHAPE["layer_types"])
    per_head = SHAPE["head_dim"] * 4 if kv_cache == "fp32" else SHAPE["head_dim"] + 4
    return slots * 2 * SHAPE["num_key_value_heads"] * per_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="export again")
    parser.add_argument("--kv-cache", default="fp32", choices=("fp32", "int8"), help="the programs' cache")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with peak_since() as peak:
            step = _filled(Path(args.child))
            for _ in range(8):
                step(np.ones((1, 1), np.int64), FAR)
        print(f"peak RSS {peak()} bytes over the imports'")
        return
    made = {name: export(name, folder, args.fresh, args.kv_cache) for name, folder in folders().items()}
    for name, (pte, facts) in made.items():
        print(f"{name}: {(pte.parent / 'export.log').read_text().splitlines()[0]}")
        planned = planned_bytes(pte.read_bytes())["forward"]
        print(f"  export {facts['seconds']:.0f} s, peak RSS {facts['rss'] / 1e9:.2f} GB; cache "
              f"{cache_bytes(name == 'windows', args.kv_cache) / 1e6:.1f} MB; planned {planned / 1e6:.1f} MB; "
              f"file {pte.stat().st_size / 1e6:.1f} MB", flush=True)
    for name, (pte, _) in made.items():
        timed_child([sys.executable, __file__, "--child", str(pte)], pte.parent, pte.parent / "decode.log")
        rss = int([x for x in (pte.parent / "decode.log").read_text().splitlines() if x.startswith("peak RSS")][-1]
                  .split()[2])
        print(f"{name}: decoding at {FAR}: peak RSS {rss / 1e6:.0f} MB over the imports'", flush=True)
    steps = {name: _filled(pte) for name, (pte, _) in made.items()}
    print(f"load average before timing: {os.getloadavg()[0]:.1f}", flush=True)
    times: dict[tuple[str, int], list[float]] = {}
    token = np.ones((1, 1), np.int64)
    for _ in range(args.rounds):
        for name, step in steps.items():
            for pos in (64, FAR):
                step(token, pos)
                start = time.perf_counter()
                for _ in range(4):
                    step(token, pos)
                times.setdefault((name, pos), []).append((time.perf_counter() - start) / 4 * 1e3)
    print(f"load average after timing: {os.getloadavg()[0]:.1f}")
    for (name, pos), t in times.items():
        print(f"{name}: decode at {pos}: {np.median(t):.1f} ms a token ({', '.join(f'{x:.1f}' for x in t)})")


if __name__ == "__main__":
    main()
