"""Where an LLM program's bytes lose accuracy: one factor at a time, emulated in torch, confirmed on programs.

Issue 44.  On SmolLM2-135M's real weights (``xnnquant.models.smollm2``) and a second decoder,
each factor of the program's numbers is changed alone, from xnnquant's defaults
(``qb4w:32`` ``mse`` linears with per-token int8 inputs, the LM head included; an int8
token table), and the perplexity measured on the same windows of held-out text
(``WINDOWS`` windows of 128 tokens, each from position 0, no BOS: the issue's):

==================  ===================================================================
head                the LM head (tied to the token table): qb4w:32 (default), qc8w (the
                    table's own int8 codes: one 8-bit table for both), fp32
table               the token table: int8 (default) or fp32
activations         every linear's input: per-token int8 as XNNPACK (``qd8``, default),
                    fp32 (weights-only kernels), llama.cpp's blocks of 32 (``q8_0``)
scales              qb4w's scales: bf16 (XNNPACK's), fp16 (llama.cpp's), fp32
method              minmax / mse / llama.cpp's Q4_0 rule (d = max / -8, fp16)
layer kinds         one kind (q, k, v, o, gate, up, down) at int4 and the rest float
layers              each linear alone at int4 (the rest float): its perplexity cost
==================  ===================================================================

Emulation (``xnnquant.llm.emulate``): the library's own quantizers give the codes, and
each linear's input goes through XNNPACK's per-token int8 exactly as
``xq.quantize_per_token`` computes it; whole windows run in one forward.  ``--programs``
exports the settings that matter as ``.pte`` files and measures them on ExecuTorch's
runtime (token by token through the KV cache), beside the emulation's figure.

``--llama-cpp`` scores llama.cpp's files on the same windows (``llamacpp.py``, which builds
``llama-cpp-python`` when it is missing: about 14 minutes on 2 cores).  The float model gives
35.99 on these windows in transformers and in llama.cpp alike (issue 44's 98.88 was measured
on other windows): compare gaps on the same windows.

``--second`` runs the one-factor table on a second decoder trained here (``second_decoder``).

Usage: ``python benchmarks/llm_accuracy.py [--factors] [--layers] [--second] [--programs] [--llama-cpp] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from xnnquant.frontend.weights import EmbeddingScheme, WeightScheme
from xnnquant.llm import emulate, evaluate
from xnnquant.models import smollm2

WINDOW = 128
#: The issue's windows (``held_out_windows``).
WINDOWS = 6



def held_out_windows(tokenizer: Any, count: int = WINDOWS) -> np.ndarray:
    """The issue's windows of the held-out text: int64 ``[count, WINDOW]``."""
    ids = evaluate.tokenize(evaluate.held_out_text(), tokenizer)
    return np.stack([ids[k * WINDOW:(k + 1) * WINDOW] for k in range(count)])


# ---------------------------------------------------------------- llama.cpp's rules, for comparison


def q4_0(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_0 (``quantize_row_q4_0_ref``), dequantized: blocks of 32, ``d = max / -8``
    (max: the value of largest magnitude), ``q = min(15, int(x / d + 8.5))``, d fp16."""
    blocks = w.reshape(-1, 32).astype(np.float32)
    idx = np.argmax(np.abs(blocks), axis=1)
    peak = blocks[np.arange(len(blocks)), idx]
    d = (peak / -8).astype(np.float16).astype(np.float32)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, peak / -8))
    q = np.minimum(15, (blocks * inv[:, None] + 8.5).astype(np.int8).astype(np.int32))
    return ((q - 8) * d[:, None]).reshape(w.shape).astype(np.float32)


def q8_0_weights(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0, dequantized: blocks of 32, ``d = fp16(max|x| / 127)``, ``q = round(x / d)``."""
    blocks = w.reshape(-1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=1) / 127
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))
    q = np.round(blocks * inv[:, None])
    return (q * d.astype(np.float16).astype(np.float32)[:, None]).reshape(w.shape).astype(np.float32)


def blockwise_other_scales(w: np.ndarray, group: int, scale_type: str, method: str) -> np.ndarray:
    """qb4w's numbers with scales of another float type (``"fp16"`` or ``"fp32"``), dequantized:
    the scales ``method`` chooses in float32, rounded to that type, the codes computed from them."""
    from xnnquant.schemes import blockwise

    scales = blockwise.choose_qparams(w, group, method, bf16=False)
    if scale_type == "fp16":
        scales = scales.astype(np.float16).astype(np.float32)
    codes = blockwise.quantize_codes(w, scales, group)
    return (codes.astype(np.float32).reshape(w.shape[0], -1, group) * scales[:, :, None]).reshape(w.shape)


# ---------------------------------------------------------------- stored weights, made once


@dataclass
class Stored:
    """Each layer's stored weight per spelling, quantized once (``weight``)."""

    model: Any
    method: str = "mse"
    cache: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def float_weight(self, name: str) -> np.ndarray:
        return emulate.linear_modules(self.model)[name].weight.detach().float().numpy()

    def weight(self, name: str, spelling: str) -> torch.Tensor:
        """Layer ``name``'s weight stored as ``spelling``: a ``WeightScheme`` (``"qb4w:32"``,
        ``"qc8w"``, ...; ``method`` from ``self``, or ``"qb4w:32@minmax"``), ``"q4_0"`` /
        ``"q8_0"`` (llama.cpp's), or ``"qb4w:32/fp16"`` (other scale types)."""
        key = (name, spelling)
        if key not in self.cache:
            w = self.float_weight(name)
            scheme, _, method = spelling.partition("@")
            method = method or self.method
            if scheme == "q4_0":
                out = q4_0(w)
            elif scheme == "q8_0":
                out = q8_0_weights(w)
            elif "/" in scheme:
                base, scale_type = scheme.split("/")
                out = blockwise_other_scales(w, int(base.split(":")[1]), scale_type, method)
            else:
                q = WeightScheme.parse(scheme).quantize(w, method)
                out = q if isinstance(q, np.ndarray) else q.dequantize()
            self.cache[key] = torch.from_numpy(np.ascontiguousarray(out, np.float32))
        return self.cache[key]

    def table(self, spelling: str) -> torch.Tensor | None:
        """The token table stored as ``spelling`` (``"int8"``, ``"int4:32"``, ``"q8_0"``), None for fp32."""
        if spelling == "fp32":
            return None
        key = ("<table>", spelling)
        if key not in self.cache:
            t = self.model.get_input_embeddings().weight.detach().float().numpy()
            out = q8_0_weights(t) if spelling == "q8_0" else \
                EmbeddingScheme.parse(spelling).quantize(t, self.method).dequantize()  # type: ignore[union-attr]
            self.cache[key] = torch.from_numpy(np.ascontiguousarray(out, np.float32))
        return self.cache[key]


@dataclass(frozen=True)
class Setting:
    """A program's numbers: each linear's spelling and activations (by module name; a default
    for the rest), the head's, and the table's."""

    linears: str = "qb4w:32"
    activations: str = "qd8"
    head: str = "qb4w:32"
    head_activations: str = "qd8"
    table: str = "int8"
    layers: tuple[tuple[str, str, str], ...] = ()  # (module name, spelling, activations) overrides

    def plan(self, stored: Stored) -> tuple[dict[str, emulate.LinearSetting], torch.Tensor | None]:
        head = emulate.head_name(stored.model)
        names = [n for n in emulate.linear_modules(stored.model) if n != head]
        chosen = dict.fromkeys(names, (self.linears, self.activations))
        chosen[head] = (self.head, self.head_activations)
        for name, spelling, acts in self.layers:
            chosen[name] = (spelling, acts)
        linears = {n: emulate.LinearSetting(stored.weight(n, s), a) for n, (s, a) in chosen.items() if
                   not (s == "fp32" and a == "fp32")}
        if emulate.is_tied(stored.model) and self.head == "fp32" and self.head_activations == "fp32" \
                and self.table != "fp32":
            linears[head] = emulate.LinearSetting(stored.weight(head, "fp32"), "fp32")  # untied: the table changes
        return linears, stored.table(self.table)


def perplexity(stored: Stored, setting: Setting, windows: np.ndarray) -> float:
    linears, table = setting.plan(stored)
    with emulate.emulated(stored.model, linears, table):
        nll = emulate.window_nll(stored.model, windows)
    return float(np.exp(nll.mean()))


def factor_table(stored: Stored, windows: np.ndarray, show: Callable[[str], None] = print) -> dict[str, float]:
    """The one-factor-at-a-time table (module docstring)."""
    default = Setting()
    rows: dict[str, Setting] = {
        "float": Setting("fp32", "fp32", "fp32", "fp32", "fp32"),
        "defaults (qb4w:32 mse, qd8, head qb4w:32, int8 table)": default,
        "head qc8w (the table's int8 codes)": Setting(head="qc8w"),
        "head fp32": Setting(head="fp32", head_activations="fp32"),
        "head qc8w, fp32 activations": Setting(head="qc8w", head_activations="fp32"),
        "table fp32": Setting(table="fp32"),
        "activations fp32 (weights-only), head qb4w:32": Setting(activations="fp32", head_activations="fp32"),
        "activations q8_0 (llama.cpp's blocks of 32)": Setting(activations="q8_0", head_activations="q8_0"),
        "scales fp16": Setting(linears="qb4w:32/fp16", head="qb4w:32/fp16"),
        "scales fp32": Setting(linears="qb4w:32/fp32", head="qb4w:32/fp32"),
        "method minmax": Setting(linears="qb4w:32@minmax", head="qb4w:32@minmax"),
        "linears Q4_0 rule (fp16), head and table Q8_0, q8_0 activations (llama.cpp Q4_0)":
            Setting("q4_0", "q8_0", "q8_0", "q8_0", "q8_0"),
        "linears Q4_0 rule, qd8; head qc8w, int8 table": Setting("q4_0", "qd8", "qc8w", "qd8", "int8"),
        "head qc8w, weights-only linears": Setting(activations="fp32", head="qc8w"),
        "linears qc8w, head qc8w": Setting(linears="qc8w", head="qc8w"),
        "linears qb4w:32, fp32 weights in the head and table (only the layers' int4)":
            Setting(head="fp32", head_activations="fp32", table="fp32"),
    }
    found = {}
    for name, setting in rows.items():
        start = time.perf_counter()
        found[name] = perplexity(stored, setting, windows)
        show(f"{found[name]:8.2f}  {name}  ({time.perf_counter() - start:.0f} s)")
    return found


KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def kind_table(stored: Stored, windows: np.ndarray, show: Callable[[str], None] = print) -> dict[str, float]:
    """One kind of linear at qb4w:32 (qd8), every other weight float (the head and table too)."""
    head = emulate.head_name(stored.model)
    names = [n for n in emulate.linear_modules(stored.model) if n != head]
    found = {}
    for kind in KINDS:
        layers = tuple((n, "qb4w:32", "qd8") for n in names if n.endswith(kind))
        found[kind] = perplexity(stored, Setting("fp32", "fp32", "fp32", "fp32", "fp32", layers), windows)
        show(f"{found[kind]:8.2f}  {kind} alone at qb4w:32 (qd8)")
    return found


def layer_table(stored: Stored, windows: np.ndarray, show: Callable[[str], None] = print) -> dict[str, float]:
    """Each linear alone at qb4w:32 (qd8), the rest float: its perplexity cost."""
    found = {}
    for name in emulate.linear_modules(stored.model):
        found[name] = perplexity(stored, Setting("fp32", "fp32", "fp32", "fp32", "fp32",
                                                 ((name, "qb4w:32", "qd8"),)), windows)
        show(f"{found[name]:8.2f}  {name}")
    return found


# ---------------------------------------------------------------- a second decoder


SECOND_VOCAB = 2048


def second_decoder(steps: int = 600, show: Callable[[str], None] = print) -> tuple[Any, np.ndarray]:
    """A small Llama trained here (seed 0) and the issue's windows in its vocabulary: 4 layers of
    width 256 (MLP 768, 4 heads, 2 key-value heads), a tied table of ``SECOND_VOCAB`` tokens
    (SmolLM2's token ids, the ``SECOND_VOCAB - 1`` most frequent of its training text kept, the
    others one token), trained ``steps`` steps of 16 windows of 128 tokens (AdamW, one-cycle
    learning rate to 3e-3) on the held-out text after the evaluated windows and the calibration
    text (80k tokens, about 12 passes): about 3.5 minutes on 2 cores."""
    import transformers as tf

    tokenizer = smollm2.tokenizer_json()
    held = evaluate.tokenize(evaluate.held_out_text(), tokenizer)
    text = np.concatenate([held[WINDOWS * WINDOW:], evaluate.tokenize(evaluate.calibration_text(), tokenizer)])
    ids, counts = np.unique(text, return_counts=True)
    remap = np.full(int(max(held.max(), text.max())) + 1, SECOND_VOCAB - 1, np.int64)
    remap[ids[np.argsort(-counts, kind="stable")][:SECOND_VOCAB - 1]] = np.arange(SECOND_VOCAB - 1)
    train = torch.from_numpy(remap[text])
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=SECOND_VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=WINDOW, tie_word_embeddings=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    draw = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(train) - WINDOW, (16,), generator=draw)
        batch = torch.stack([train[k:k + WINDOW] for k in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            show(f"second decoder: step {step}, training loss {loss.item():.3f}")
    return model.eval(), remap[held_out_windows(tokenizer)]


# ---------------------------------------------------------------- programs on ExecuTorch's runtime


def calibration_windows(tokenizer: Any, count: int = 8) -> list[torch.Tensor]:
    """``count`` windows of 128 tokens of the calibration text (disjoint from the held-out text)."""
    ids = evaluate.tokenize(evaluate.calibration_text(), tokenizer)
    return [torch.from_numpy(ids[k * WINDOW:(k + 1) * WINDOW][None]) for k in range(count)]


def program_configurations(tokenizer: Any) -> dict[str, dict[str, Any]]:
    """name -> ``xq.export_llm`` options of the programs measured (``--programs``)."""
    from xnnquant.frontend.weights import LayerPlan

    shared_head = LayerPlan.of("qb4w:32", {"model.lm_head": "qc8w@range"})
    return {
        "before: qb4w:32 mse, int4 head": dict(weights="qb4w:32", method="mse"),
        "range, head reads the int8 table": dict(weights=shared_head, method="range"),
        "defaults: auto (4.75 bits), range": dict(),
        "auto (4.75 bits), gptq, 8 calibration windows": dict(method="gptq",
                                                              calibration=calibration_windows(tokenizer)),
        "auto:5.6, range (no calibration)": dict(weights="auto:5.6"),
        "auto:5.7, range, 24 calibration windows": dict(weights="auto:5.7",
                                                         calibration=calibration_windows(tokenizer, 24)),
    }


def programs(model: Any, windows: np.ndarray, tokenizer: Any, folder: Any, only: list[str] | None = None,
             show: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Each configuration exported (max_context 256), its file's bytes, its perplexity on ``windows``
    token by token through its cache on ExecuTorch's runtime, then every program's decode time
    (``benchmarks/llm.py``'s interleaved rounds)."""
    import os
    import sys
    from pathlib import Path

    import xnnquant as xq

    sys.path.insert(0, str(Path(__file__).parent))
    from llm import interleaved_timing

    found: dict[str, dict[str, Any]] = {}
    paths = {}
    for k, (name, options) in enumerate(program_configurations(tokenizer).items()):
        if only and name not in only:
            continue
        start = time.perf_counter()
        exported = xq.export_llm(model, max_context=256, progress=False, **options)
        seconds = time.perf_counter() - start
        path = Path(folder) / f"program{k}.pte"
        exported.save(path)
        paths[name] = path
        step = evaluate.ProgramStep(path)
        ppl = evaluate.perplexity(step, windows.reshape(-1), window=WINDOW, windows=len(windows)).value
        kinds: dict[str, int] = {}
        for row in exported.report:
            kinds[row.scheme] = kinds.get(row.scheme, 0) + 1
        found[name] = {"bytes": os.path.getsize(path), "perplexity": ppl, "export_s": seconds, "schemes": kinds}
        show(f"{name}: {found[name]}")
    prompt = evaluate.tokenize(evaluate.calibration_text(), tokenizer)[:64]
    for name, timing in interleaved_timing(paths, prompt, rounds=10).items():
        found[name].update(decode_ms=timing.decode_ms, prefill_ms=timing.prefill_ms)
        show(f"{name}: decode {timing.decode_ms:.2f} ms a token, 64-token prefill {timing.prefill_ms:.1f} ms")
    return found


# ---------------------------------------------------------------- llama.cpp, optional


def llama_cpp(windows: np.ndarray, show: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    """llama.cpp's files (``llamacpp.py``: float, Q4_0, Q4_K_M, Q8_0, as issue 44 made them)
    on the same windows: bytes and perplexity."""
    import os
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import llamacpp as runner

    found = {}
    for kind in runner.KINDS:
        path = runner.gguf_file(kind)
        found[kind] = {"bytes": float(os.path.getsize(path)), "perplexity": runner.window_perplexity(path, windows)}
        show(f"llama.cpp {kind}: {found[kind]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", action="store_true", help="the one-factor table (default when nothing is asked)")
    parser.add_argument("--kinds", action="store_true", help="one kind of linear at int4 at a time")
    parser.add_argument("--layers", action="store_true", help="each linear alone at int4 (211 evaluations)")
    parser.add_argument("--programs", action="store_true", help="export the main settings, measure them on "
                        "ExecuTorch's runtime")
    parser.add_argument("--llama-cpp", action="store_true", help="measure llama.cpp's quantizations on the same "
                        "windows (llamacpp.py: builds llama-cpp-python, 15-19 minutes, if missing)")
    parser.add_argument("--second", action="store_true", help="the one-factor table on a second decoder, trained "
                        "here (second_decoder: about 3.5 minutes)")
    parser.add_argument("--windows", type=int, default=WINDOWS)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = smollm2.load_model()
    windows = held_out_windows(smollm2.tokenizer_json(), args.windows)
    stored = Stored(model)
    figures: dict[str, Any] = {}
    if args.factors or not (args.kinds or args.layers or args.programs or args.llama_cpp or args.second):
        figures["factors"] = factor_table(stored, windows)
    if args.second:
        second, second_windows = second_decoder()
        figures["second decoder"] = factor_table(Stored(second), second_windows)
    if args.kinds:
        figures["kinds"] = kind_table(stored, windows)
    if args.layers:
        figures["layers"] = layer_table(stored, windows)
    if args.programs:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            figures["programs"] = programs(model, windows, smollm2.tokenizer_json(), folder)
    if args.llama_cpp:
        figures["llama.cpp"] = llama_cpp(windows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
