"""``xnnquant export-llm``, ``generate`` and ``perplexity``: an LLM to a ``.pte``, text from one, its perplexity.

``export-llm MODEL -o model.pte --max-context N``: MODEL is a folder holding a transformers
checkpoint (``config.json`` and safetensors weights, one file or a sharded index), a
``.gguf`` file (read by transformers with the ``gguf`` package), or
``package.module:factory`` (a callable returning the model).  From a folder, the model is
built on the meta device and its weights are read from the safetensors files one at a
time while the program is written (``xq.export_llm(..., state_dict=...)``), so a model
larger than memory exports; the buffers it builds itself, which checkpoints do not hold
(rotary tables, Gemma's embedding scale), are computed on the CPU as ``from_pretrained``
computes them.  With ``--calibration`` or ``--rotation`` the folder is read into
memory instead (both compute from the weights before writing).

``generate model.pte --tokenizer tokenizer.json --prompt TEXT``: the prompt encoded with
the tokenizer (``tokenizers``' JSON format, as transformers saves it), the new text
printed as it comes, then the prefill and decode speeds on stderr, as llama.cpp's tools do.

``perplexity model.pte --tokenizer tokenizer.json --text FILE``: llama.cpp's
``llama-perplexity`` job on ExecuTorch's runtime (``evaluate.program_perplexity``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..arguments import spelling
from ..errors import XnnquantError, missing_extra
from ..llm.export import DEFAULT_MAX_SEQ_LEN

#: ``--kv-cache`` values: ``llm.decoder.KV_CACHES`` (a test keeps them equal), here without
#: importing torch to build the parser.
KV_CACHE_CHOICES = ("fp32", "int8")


def add_commands(sub: Any) -> None:
    """The three subcommands, on ``sub`` (the parser's subparsers)."""
    from . import _add_command

    export = _add_command(
        sub, "export-llm", "export a causal LM with a KV cache for ExecuTorch's runners",
        ("xnnquant export-llm path/to/checkpoint -o model.pte --max-context 256",
         "xnnquant export-llm path/to/checkpoint -o model.pte --max-context 2048 \\",
         "    --kv-cache int8",
         "xnnquant export-llm model.gguf -o m.pte --max-context 512 --weights qb4w:128",
         "xnnquant export-llm path/to/checkpoint -o model.pte --max-context 256 \\",
         "    --method gptq --calibration text.txt --calibration-windows 32"),
        "MODEL is a transformers checkpoint folder (config.json and safetensors weights, read one tensor "
        "at a time while the program is written), a .gguf file, or package.module:factory returning the "
        "model.  The program has forward(tokens, input_pos) -> logits over a KV cache, and the metadata "
        "methods TextLLMRunner and llama_main read.")
    export.add_argument("model", help="a transformers checkpoint folder (config.json + safetensors), a .gguf file, "
                                      "or package.module:factory returning the model")
    export.add_argument("-o", "--output", required=True, help="the .pte to write")
    export.add_argument("--max-context", type=int, required=True, metavar="N",
                        help="positions the KV cache holds")
    export.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help="the most tokens one call takes; longer prompts go in calls of N (default "
                             f"{DEFAULT_MAX_SEQ_LEN}, or --max-context if smaller)")
    export.add_argument("--kv-cache", default="fp32", type=spelling, choices=KV_CACHE_CHOICES,
                        help="the cache's layout: fp32 (default) or int8 (a scale per position and head)")
    export.add_argument("--full-logits", action="store_true",
                        help="forward returns every position's logits, for xnnquant perplexity in calls of "
                             "--max-seq-len tokens (plans max-seq-len x vocab more floats)")
    export.add_argument("--weights", default="auto", help="the linear layers and the LM head: auto or auto:BITS (a "
                                                          "scheme per layer under a bits-per-weight budget, as "
                                                          "xq.export_llm's default; default auto), or one scheme for "
                                                          "all: fp32, qc8w, qc4w or qb4w:G")
    export.add_argument("--embeddings", default="int8", help="the token table: int8 (default), int4:G or fp32")
    export.add_argument("--method", default=None, help="scale choice: minmax, mse, range, or an activation-aware "
                                                       "method with --calibration (default: range under auto, else "
                                                       "mse)")
    export.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                        help="text to calibrate on, cut into windows of --calibration-tokens tokens")
    export.add_argument("--calibration-windows", type=int, default=32, metavar="K",
                        help="how many windows of the text (default 32)")
    export.add_argument("--calibration-tokens", type=int, default=128, metavar="N",
                        help="tokens a window (default 128, at most --max-seq-len)")
    export.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                        help="the tokenizer of --calibration (default: the model folder's tokenizer.json)")
    export.add_argument("--rotation", default=None, choices=("hadamard",),
                        help="rotate the residual stream (folded into the weights; the model is read into memory)")
    export.add_argument("--fallback", default="auto", help="schemes for layers that cannot take --weights (as for "
                                                           "xnnquant export)")
    export.add_argument("--memory", default=None, metavar="SIZE",
                        help="the memory of the device the program is for (e.g. 4GiB): a program whose planned memory "
                        "exceeds it is refused (default: this machine's)")
    export.add_argument("--json", action="store_true", help="print the report as JSON")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(func=_export_llm)
    generate = _add_command(
        sub, "generate", "generate text with an LLM .pte; print prefill/decode speed",
        ("xnnquant generate model.pte --tokenizer tokenizer.json --prompt 'Once upon'",
         "xnnquant generate model.pte --tokenizer tokenizer.json --prompt 'Hello' \\",
         "    --temperature 0.7 --seed 1"),
        "The prompt is encoded with the tokenizer (tokenizers' JSON, as transformers saves it), run in calls "
        "of the program's max_seq_len tokens, then one call per new token on ExecuTorch's runtime, until "
        "--max-new-tokens, an end-of-sequence token or the program's context; the text is printed as it "
        "comes, the speeds on stderr.")
    generate.add_argument("program", help="an LLM .pte (from xnnquant export-llm)")
    generate.add_argument("--tokenizer", required=True, metavar="tokenizer.json", help="the model's tokenizer")
    generate.add_argument("--prompt", default=None, help="the prompt (default: read from stdin)")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                          help="at most N new tokens (default 64; fewer where the context ends)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampled")
    generate.add_argument("--top-p", type=float, default=1.0,
                          help="nucleus sampling's probability mass (default 1.0: every token)")
    generate.add_argument("--seed", type=int, default=None,
                          help="the sampling generator's seed (default: a fresh one each run)")
    generate.add_argument("--bos", action="store_true", help="put the program's start token before the prompt")
    generate.set_defaults(func=_generate)
    perplexity = _add_command(
        sub, "perplexity", "perplexity of an LLM .pte on a text, with its spread",
        ("xnnquant perplexity model.pte --tokenizer tokenizer.json --text wiki.test.raw",
         "xnnquant perplexity model.pte --tokenizer tokenizer.json --text t.txt \\",
         "    --window 1536 --windows 8",
         "xnnquant perplexity model.pte --tokenizer tokenizer.json --text t.txt \\",
         "    --window 512 --stride 256 --json"),
        "The text is encoded with the tokenizer and cut into windows of --window tokens, each run from "
        "position 0 (llama.cpp's llama-perplexity, whose chunks are its context): every token from the "
        "second on is predicted once (with --stride S < --window, windows start every S tokens and each "
        "predicts its last S).  A program exported with --full-logits is fed in calls of its max_seq_len "
        "tokens; any other one token a call (--token-by-token asks for that).  Printed: the perplexity "
        "with its standard error over tokens (llama.cpp's +/-), a 95% interval, and the spread over "
        "windows.")
    perplexity.add_argument("program", help="an LLM .pte (from xnnquant export-llm)")
    perplexity.add_argument("--tokenizer", required=True, metavar="tokenizer.json", help="the model's tokenizer")
    perplexity.add_argument("--text", required=True, metavar="FILE", help="the text to evaluate (UTF-8)")
    perplexity.add_argument("--window", type=int, default=None, metavar="N",
                            help="tokens a window (default 512, or the program's context if smaller)")
    perplexity.add_argument("--stride", type=int, default=None, metavar="S",
                            help="tokens between window starts (default: --window, windows side by side)")
    perplexity.add_argument("--windows", type=int, default=None, metavar="K",
                            help="evaluate the first K windows only (default: every whole window)")
    perplexity.add_argument("--token-by-token", action="store_true",
                            help="one token a call even where the program gives every position's logits")
    perplexity.add_argument("--json", action="store_true", help="print the figures as JSON")
    perplexity.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    perplexity.set_defaults(func=_perplexity)
    for command in (export, generate, perplexity):
        command.add_argument("-v", "--verbose", action="store_true",
                             help="also show what torch, executorch and the runtime log")


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise missing_extra("torch", "torch", "exporting an LLM") from None
    return torch


def load_llm(spec: str, stream: bool = True) -> tuple[Any, str | None]:
    """(model, safetensors file or index to stream its weights from, or None) for ``spec``; a
    checkpoint folder is read into memory instead of streamed when not ``stream`` (calibration
    and rotation need the weights in memory)."""
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise XnnquantError(f"no GGUF file {spec!r}")
        from transformers import AutoModelForCausalLM

        torch = _torch()
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        except ImportError as exc:
            raise XnnquantError(f"reading {spec!r} needs transformers' GGUF support: {exc}") from None
        return model.eval(), None
    if path.is_dir():
        if not stream:
            from transformers import AutoModelForCausalLM

            torch = _torch()
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), None
        return _streamed(path)
    if ":" in spec:
        import importlib

        name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(name), attr)
        except (ImportError, AttributeError) as exc:
            raise XnnquantError(f"MODEL {spec!r} does not resolve: {exc}") from None
        model = factory()
        return (model[0] if isinstance(model, tuple) else model), None
    raise XnnquantError(f"MODEL {spec!r} is neither a checkpoint folder, a .gguf file nor package.module:factory")


def _streamed(folder: Path) -> tuple[Any, str]:
    """A transformers model built on the meta device from ``folder``'s config, the buffers it
    builds itself made on the CPU (``_built_buffers``), and the safetensors file (or index)
    holding its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch = _torch()
    weights = next((folder / name for name in ("model.safetensors", "model.safetensors.index.json")
                    if (folder / name).is_file()), None)
    if weights is None:
        raise XnnquantError(f"{str(folder)!r} holds no model.safetensors or model.safetensors.index.json: expected a "
                            "transformers checkpoint folder (save_pretrained's)")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _built_buffers(model)
    return model.eval(), str(weights)


def _built_buffers(model: Any) -> None:
    """Give the buffers a checkpoint does not hold (non-persistent: rotary tables, Gemma's
    embedding scale, ...) their values, as ``from_pretrained`` does: each is made on the CPU
    and the model's ``_init_weights`` is run on the module owning it (transformers computes
    them there: ``_move_missing_keys_from_meta_to_device`` then ``_initialize_missing_keys``).
    The owner's parameters stay on the meta device (``_init_weights`` leaves them so; the
    weight file gives them).  A float buffer ``_init_weights`` leaves unset (still NaN) is
    refused."""
    torch = _torch()
    owners: dict[str, Any] = {}
    for name, buffer in list(model.named_non_persistent_buffers()):
        if buffer.device.type != "meta":
            continue
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        fill = float("nan") if buffer.dtype.is_floating_point else 0
        owner.register_buffer(attr, torch.full(buffer.shape, fill, dtype=buffer.dtype), persistent=False)
        owners[parent] = owner
    with torch.no_grad():
        for owner in owners.values():
            model._init_weights(owner)
    unset = [name for name, buffer in model.named_non_persistent_buffers()
             if buffer.device.type == "meta" or (buffer.dtype.is_floating_point and bool(torch.isnan(buffer).any()))]
    if unset:
        raise XnnquantError(f"{type(model).__name__} builds the buffers {', '.join(unset)} itself and its "
                            "_init_weights does not compute them, so a streaming export cannot give them values: "
                            "export it with --calibration or --rotation, which read the folder with from_pretrained, "
                            "or from "
                            "Python (xq.export_llm on AutoModelForCausalLM.from_pretrained(folder))")


def _tokenizer(path: str | None) -> Any:
    if path is None:
        raise XnnquantError("--calibration needs the model's tokenizer: give --tokenizer tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise missing_extra("models", "tokenizers", "encoding text") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own exception types
        raise XnnquantError(f"cannot read the tokenizer {path!r}: {exc}") from None


def _calibration(args: argparse.Namespace) -> Any:
    torch = _torch()
    if args.calibration is None:
        return None
    tokens = min(args.calibration_tokens, args.max_seq_len or DEFAULT_MAX_SEQ_LEN, args.max_context)  # one call
    if tokens < 1 or args.calibration_windows < 1:
        raise XnnquantError("--calibration-tokens and --calibration-windows must be >= 1")
    folder_tokenizer = Path(args.model) / "tokenizer.json"
    tokenizer = _tokenizer(args.tokenizer or (str(folder_tokenizer) if folder_tokenizer.is_file() else None))
    ids = tokenizer.encode(Path(args.calibration).read_text(encoding="utf-8")).ids
    windows = [ids[k:k + tokens] for k in range(0, len(ids) - tokens + 1, tokens)][:args.calibration_windows]
    if not windows:
        raise XnnquantError(f"{args.calibration!r} holds {len(ids)} tokens: fewer than one window of {tokens}")
    return [torch.tensor([w], dtype=torch.int64) for w in windows]


def _export_llm(args: argparse.Namespace) -> None:
    import contextlib

    import xnnquant as xq

    model, weights = load_llm(args.model, stream=args.calibration is None and args.rotation is None)
    begin = time.perf_counter()
    with contextlib.redirect_stderr(args.terminal):
        embeddings = None if args.embeddings.strip().lower() in ("fp32", "none") else args.embeddings
        fallback = None if args.fallback.strip().lower() == "none" else args.fallback
        exported = xq.export_llm(model, max_context=args.max_context, max_seq_len=args.max_seq_len,
                                 kv_cache=args.kv_cache, weights=args.weights, embeddings=embeddings,
                                 method=args.method, calibration=_calibration(args), fallback=fallback,
                                 progress=not args.no_progress, state_dict=weights, rotation=args.rotation,
                                 full_logits=args.full_logits, memory=args.memory)
        path = exported.save(args.output)
    if args.json:
        print(exported.to_json())
        return
    print(f"{exported}\nwrote {path} ({Path(path).stat().st_size:,} bytes), exported in "
          f"{time.perf_counter() - begin:.1f} s")


def _generate(args: argparse.Namespace) -> None:
    from ..llm import LLM

    tokenizer = _tokenizer(args.tokenizer)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = LLM(args.program)
    vocab = tokenizer.get_vocab_size()
    if vocab > llm.info.vocab_size:
        raise XnnquantError(f"the tokenizer {args.tokenizer!r} has {vocab} tokens, the program's vocabulary "
                            f"{llm.info.vocab_size}: it is not this model's tokenizer")
    ids = tokenizer.encode(prompt).ids
    if args.bos and llm.info.bos_id is not None:
        ids = [llm.info.bos_id, *ids]
    shown = ""
    made: list[int] = []

    def show(token: int) -> None:
        nonlocal shown
        made.append(token)
        text = tokenizer.decode(made)
        if not text.endswith("\ufffd"):  # a character whose bytes are not all there yet waits
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text

    result = llm.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                          on_token=show)
    print()
    print(speeds(result), file=args.terminal)
    if result.stop == "context":
        print(f"note: stopped at the program's context of {llm.info.max_context} positions after "
              f"{len(result.tokens)} new tokens (--max-new-tokens {args.max_new_tokens} asked for more)",
              file=args.terminal)


def _perplexity(args: argparse.Namespace) -> None:
    import json

    import numpy as np

    from ..llm import evaluate

    text_path = Path(args.text)
    if not text_path.is_file():
        raise XnnquantError(f"--text {args.text!r}: no such file: expected a UTF-8 text file")
    if not Path(args.program).is_file():
        raise XnnquantError(f"no file {args.program!r}: expected an LLM program (.pte)")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise XnnquantError(f"--text {args.text!r} is not UTF-8 text: {exc}") from None
    tokenizer = _tokenizer(args.tokenizer)
    step = evaluate.llm_step(args.program)
    if tokenizer.get_vocab_size() > int(step.vocab_size or 0):
        raise XnnquantError(f"the tokenizer {args.tokenizer!r} has {tokenizer.get_vocab_size()} tokens, the program's "
                            f"vocabulary {step.vocab_size}: it is not this model's tokenizer")
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    result = evaluate.program_perplexity(step, ids, window=args.window, stride=args.stride,
                                         windows=args.windows, chunked=False if args.token_by_token else None,
                                         progress=False if args.quiet else args.terminal)
    if args.json:
        print(json.dumps({"program": args.program, "text": args.text, "text_tokens": len(ids), **result.as_dict()},
                         indent=2))
        return
    low, high = result.interval()
    how = "one token a call" if result.mode == "token" else "in calls of max_seq_len"
    apart = "side by side" if result.stride == result.window else f"{result.stride} apart"
    spread = (f"; over windows +/- {result.window_stderr:.4f}" if result.windows > 1 else "")
    print(f"{args.program}: {len(ids):,} tokens of {args.text}, {result.windows} windows of {result.window} tokens "
          f"({apart}), {result.tokens:,} predictions, {how}\n"
          f"estimated PPL = {result.value:.4f} +/- {result.stderr:.5f} (95%: {low:.4f} .. {high:.4f}){spread}\n"
          f"mean NLL = {result.nll:.5f} +/- {result.nll_stderr:.5f} nats per token")


def speeds(result: Any) -> str:
    """The line ``generate`` ends with: each phase's tokens, time and rate (the first new token
    is the prefill's, each later one a decode call's), and why it stopped."""
    calls = f" in {result.prefill_calls} calls" if result.prefill_calls > 1 else ""
    decode = (f"{result.decode_tokens} tokens in {result.decode_seconds * 1e3:.1f} ms "
              f"({result.decode_tokens_per_second:.1f} tokens/s)" if result.decode_tokens else "no call")
    return (f"prefill: {result.prompt_tokens} tokens{calls} in {result.prefill_seconds * 1e3:.1f} ms "
            f"({result.prefill_tokens_per_second:.1f} tokens/s); decode: {decode}; {len(result.tokens)} new "
            f"tokens, stopped: {result.stop}")
