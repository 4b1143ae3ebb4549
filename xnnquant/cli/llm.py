"""``xnnquant export-llm`` and ``xnnquant generate``: an LLM to a ``.pte``, and text from one.

``export-llm MODEL -o model.pte --max-context N``: MODEL is a folder holding a transformers
checkpoint (``config.json`` and safetensors weights, one file or a sharded index), a
``.gguf`` file (read by transformers with the ``gguf`` package), or
``package.module:factory`` (a callable returning the model).  From a folder, the model is
built on the meta device and its weights are read from the safetensors files one at a
time while the program is written (``xq.export_llm(..., state_dict=...)``), so a model
larger than memory exports; its rotary tables, which checkpoints do not hold, are made on
the CPU from the config.  With ``--calibration`` or ``--rotation`` the folder is read into
memory instead (both compute from the weights before writing).

``generate model.pte --tokenizer tokenizer.json --prompt TEXT``: the prompt encoded with
the tokenizer (``tokenizers``' JSON format, as transformers saves it), the new text
printed as it comes, then the prefill and decode speeds on stderr, as llama.cpp's tools do.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import XnnquantError, missing_extra


def add_commands(sub: Any) -> None:
    """The two subcommands, on ``sub`` (the parser's subparsers)."""
    from . import _add_command

    export = _add_command(
        sub, "export-llm", "export a causal LM with a KV cache for ExecuTorch's runners",
        ("xnnquant export-llm path/to/checkpoint -o model.pte --max-context 256",
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
                        help="positions the KV cache holds (and the most tokens one call takes)")
    export.add_argument("--weights", default="qb4w:32", help="every linear layer and the LM head: fp32, qc8w, "
                                                             "qc4w or qb4w:G (default qb4w:32)")
    export.add_argument("--embeddings", default="int8", help="the token table: int8 (default), int4:G or fp32")
    export.add_argument("--method", default="mse", help="scale choice: minmax, mse (default), or an "
                                                        "activation-aware method with --calibration")
    export.add_argument("--calibration", default=None, metavar="TEXT_FILE",
                        help="text to calibrate on, cut into windows of --calibration-tokens tokens")
    export.add_argument("--calibration-windows", type=int, default=32, metavar="K",
                        help="how many windows of the text (default 32)")
    export.add_argument("--calibration-tokens", type=int, default=128, metavar="N",
                        help="tokens a window (default 128, at most --max-context)")
    export.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                        help="the tokenizer of --calibration (default: the model folder's tokenizer.json)")
    export.add_argument("--rotation", default=None, choices=("hadamard",),
                        help="rotate the residual stream (folded into the weights; the model is read into memory)")
    export.add_argument("--fallback", default="auto", help="schemes for layers that cannot take --weights (as for "
                                                           "xnnquant export)")
    export.add_argument("--json", action="store_true", help="print the report as JSON")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")
    export.set_defaults(func=_export_llm)
    generate = _add_command(
        sub, "generate", "generate text with an LLM .pte; print prefill/decode speed",
        ("xnnquant generate model.pte --tokenizer tokenizer.json --prompt 'Once upon'",
         "xnnquant generate model.pte --tokenizer tokenizer.json --prompt 'Hello' \\",
         "    --temperature 0.7 --seed 1"),
        "The prompt is encoded with the tokenizer (tokenizers' JSON, as transformers saves it), run as one "
        "call, then one call per new token on ExecuTorch's runtime; the text is printed as it comes, the "
        "speeds on stderr.")
    generate.add_argument("program", help="an LLM .pte (from xnnquant export-llm)")
    generate.add_argument("--tokenizer", required=True, metavar="tokenizer.json", help="the model's tokenizer")
    generate.add_argument("--prompt", default=None, help="the prompt (default: read from stdin)")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above: sampled")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    generate.add_argument("--seed", type=int, default=None, help="the sampling generator's seed")
    generate.add_argument("--bos", action="store_true", help="put the program's start token before the prompt")
    generate.set_defaults(func=_generate)
    for command in (export, generate):
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
    """A transformers model built on the meta device from ``folder``'s config, its rotary
    tables made on the CPU, and the safetensors file (or index) holding its weights."""
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
    for name, module in list(model.named_modules()):
        if any(b.device.type == "meta" for _, b in module.named_buffers(recurse=False)) and \
                name.rsplit(".", 1)[-1] == "rotary_emb":
            rebuilt = type(module)(config=module.config)  # the tables computed from the config, on the CPU
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], rebuilt)
    return model.eval(), str(weights)


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
    tokens = min(args.calibration_tokens, args.max_context)
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
        exported = xq.export_llm(model, max_context=args.max_context, weights=args.weights, embeddings=embeddings,
                                 method=args.method, calibration=_calibration(args), fallback=fallback,
                                 progress=not args.no_progress, state_dict=weights, rotation=args.rotation)
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
    print(f"prefill: {result.prompt_tokens} tokens in {result.prefill_seconds * 1e3:.1f} ms "
          f"({result.prefill_tokens_per_second:.1f} tokens/s); decode: {len(result.tokens)} tokens in "
          f"{result.decode_seconds * 1e3:.1f} ms ({result.decode_tokens_per_second:.1f} tokens/s); stopped: "
          f"{result.stop}", file=args.terminal)
