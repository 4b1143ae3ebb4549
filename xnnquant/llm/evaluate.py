"""Measuring a causal LM behind ExecuTorch's LLM interface: perplexity, decode speed, calls per token.

Everything here drives a model through one function, a *step*::

    step(tokens int64 [1, n], start_pos) -> float32 [vocab]
        the logits of the last of n tokens placed at positions start_pos .. start_pos + n - 1,
        the tokens of earlier calls (positions < start_pos) kept as context (a KV cache)

A call at ``start_pos = 0`` starts a new sequence, as in ExecuTorch's LLM interface: the
runners restart a program at position 0 and do not clear its cache, since a causal model
never reads a cache position beyond the one it writes.  ``ProgramStep`` steps a ``.pte``'s
``forward`` on ``executorch.runtime`` (its ``reset`` loads the program again, so its state is
the file's); ``TransformersStep`` an eager ``transformers`` causal LM (float32 reference).

* ``perplexity``: non-overlapping windows of the token stream, each from position 0,
  fed one token per call; each window's first token is context, every later one predicted
  (``transformers_perplexity``: the same for an eager model, a window a call)::

      window w = t[wW : (w+1)W]           calls  step(t[wW + i], i)   for i = 0 .. W-2
      NLL = mean over predictions of  logsumexp(logits_i) - logits_i[t[wW + i + 1]]
      perplexity = exp(NLL)               (float64 arithmetic on float32 logits)

* ``decode_timing``: a 64-token prompt in one call (prefill), then 48 one-token calls fed
  the previous call's most likely token (decode); median over 8 rounds.
* ``count_calls``: the instructions of a program method (delegate calls, kernel calls) and
  the XNNPACK nodes inside its delegates: what one call, one decoded token, runs.
* ``runner_rate``: tokens a second of ExecuTorch's own ``TextLLMRunner`` (C++).

Text (``held_out_text``, ``calibration_text``): English news paragraphs of the Lee corpus
(Lee, Pincombe & Welsh 2005: ABC news articles) that the ``gensim`` package ships as test
data (``pip install --no-deps gensim==4.4.0``; only the two files are read, gensim is never
imported).  Held out: ``lee_background.cor`` (300 paragraphs, 59,890 words); calibration:
``lee.cor`` (50 other paragraphs, 3,983 words).  No paragraph is in both, and neither is
xnnquant's own sentence sets (``xnnquant.models.sentences``, written for the project).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .. import arguments
from ..errors import MissingExtraError, ProgramError, XnnquantError, missing_extra

#: step(tokens int64 [1, n], start_pos) -> logits float32 [vocab] of the last token.
Step = Callable[[np.ndarray, int], np.ndarray]

TEXT_PACKAGE = "gensim"
TEXT_PACKAGE_VERSION = "4.4.0"
HELD_OUT_FILE = "test/test_data/lee_background.cor"
CALIBRATION_FILE = "test/test_data/lee.cor"


# ---------------------------------------------------------------- text


@cache
def _paragraphs(name: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            f"the evaluation text comes from the {TEXT_PACKAGE!r} package (its test data), which is not "
            f"installed: pip install --no-deps {TEXT_PACKAGE}=={TEXT_PACKAGE_VERSION}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        install = f"pip install --no-deps {TEXT_PACKAGE}=={TEXT_PACKAGE_VERSION}"
        raise MissingExtraError(f"{TEXT_PACKAGE} is installed but has no {path}: expected version "
                                f"{TEXT_PACKAGE_VERSION} ({install})")
    text = path.read_text(encoding="utf-8", errors="replace")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def held_out_paragraphs() -> tuple[str, ...]:
    """The 300 held-out paragraphs (``lee_background.cor``), in file order."""
    return _paragraphs(HELD_OUT_FILE)


def calibration_paragraphs() -> tuple[str, ...]:
    """The 50 calibration paragraphs (``lee.cor``), in file order; none is held out."""
    return _paragraphs(CALIBRATION_FILE)


def held_out_text() -> str:
    """The held-out paragraphs, one per line (``"\\n"`` between them)."""
    return "\n".join(held_out_paragraphs())


def calibration_text() -> str:
    """The calibration paragraphs, one per line; disjoint from ``held_out_text``."""
    return "\n".join(calibration_paragraphs())


def tokenize(text: str, tokenizer_json: str | os.PathLike[str]) -> np.ndarray:
    """``text`` as token ids of a ``tokenizer.json`` (the ``tokenizers`` package; no special tokens
    added): ``(n,) int64``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise missing_extra("llm", "tokenizers", "tokenizing evaluation text") from None
    path = arguments.path(tokenizer_json, "tokenizer_json")
    if not path.is_file():
        raise XnnquantError(f"tokenizer_json: no file {path}: expected a tokenizer.json")
    ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------- perplexity


@dataclass(frozen=True)
class Perplexity:
    """``value = exp(nll)``; ``nll``: mean negative log-likelihood per predicted token (nats);
    ``tokens``: predictions (``windows * (window - 1)``); ``window_nll``: each window's mean."""

    value: float
    nll: float
    tokens: int
    windows: int
    window_nll: tuple[float, ...] = field(repr=False)


def _token_ids(token_ids: Any) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise XnnquantError(f"token_ids: expected a 1-D array of integer token ids, got {ids.dtype} "
                            f"of shape {ids.shape}")
    return ids.astype(np.int64)


def _logits(step: Step, tokens: np.ndarray, start_pos: int) -> np.ndarray:
    logits = np.asarray(step(tokens, start_pos))
    if logits.ndim != 1 or not np.issubdtype(logits.dtype, np.floating):
        raise XnnquantError(f"step must return the last token's logits, float [vocab]: got {logits.dtype} "
                            f"of shape {logits.shape} at start_pos={start_pos}")
    return logits


def _windows(token_ids: Any, window: int, windows: int | None) -> tuple[np.ndarray, int, int]:
    """(ids, window, count): ``perplexity``'s arguments checked."""
    ids = _token_ids(token_ids)
    window = arguments.integer(window, "window", low=2)
    available = len(ids) // window
    count = available if windows is None else arguments.integer(windows, "windows", low=1)
    if count > available or count == 0:
        raise XnnquantError(f"perplexity needs {max(count, 1)} window(s) of {window} tokens: got {len(ids)} tokens "
                            f"({available} whole window(s))")
    return ids, window, count


def _nll(logits: np.ndarray, target: int) -> float:
    """``logsumexp(logits) - logits[target]`` in float64."""
    logits = logits.astype(np.float64)
    if not 0 <= target < logits.shape[0]:
        raise XnnquantError(f"token id {target} is outside the model's vocabulary of {logits.shape[0]}")
    peak = logits.max()
    return float(peak + np.log(np.exp(logits - peak).sum()) - logits[target])


def _result(window_nll: list[float], window: int) -> Perplexity:
    nll = float(np.mean(window_nll))
    return Perplexity(float(np.exp(nll)), nll, len(window_nll) * (window - 1), len(window_nll), tuple(window_nll))


def perplexity(step: Step, token_ids: Any, window: int = 128, windows: int | None = None, *,
               reset: Callable[[], None] | None = None) -> Perplexity:
    """Perplexity of ``step``'s model on ``token_ids`` (``(N,)`` ints), token by token (module docstring).

    ``window``: tokens per window (>= 2); ``windows``: how many, from the start (``None``: every
    whole window, ``N // window``).  ``reset``, when given, is called before each window (for a
    step whose state must be put back; otherwise position 0 starts a new sequence).
    """
    ids, window, count = _windows(token_ids, window, windows)
    window_nll = []
    for w in range(count):
        if reset is not None:
            reset()
        chunk = ids[w * window:(w + 1) * window]
        total = sum(_nll(_logits(step, chunk[None, i:i + 1], i), int(chunk[i + 1])) for i in range(window - 1))
        window_nll.append(total / (window - 1))
    return _result(window_nll, window)


def transformers_perplexity(model: Any, token_ids: Any, window: int = 128, windows: int | None = None) -> Perplexity:
    """``perplexity`` of an eager ``transformers`` causal LM (the float reference), each window in
    one call: a causal model's logits at position ``i`` read the tokens up to ``i`` alone, so
    they are those of ``TransformersStep`` token by token up to float rounding (a test), at a
    fraction of the time (SmolLM2-135M: 4 windows in 1 s instead of 45 s)."""
    try:
        import torch
    except ImportError:
        raise missing_extra("llm", "torch", "evaluating a transformers model") from None
    config = getattr(model, "config", None)
    vocab, positions = (getattr(config, name, None) for name in ("vocab_size", "max_position_embeddings"))
    if not callable(model) or not isinstance(vocab, int):
        raise XnnquantError(f"model must be a transformers causal LM (its config giving vocab_size): got "
                            f"{type(model).__name__}")
    ids, window, count = _windows(token_ids, window, windows)
    used = ids[:count * window]
    if used.min() < 0 or used.max() >= vocab:
        bad = int(used[(used < 0) | (used >= vocab)][0])
        raise XnnquantError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    if isinstance(positions, int) and window > positions:
        raise XnnquantError(f"window of {window} tokens is longer than the model's {positions} positions: expected "
                            f"window <= {positions}")
    window_nll = []
    for w in range(count):
        chunk = ids[w * window:(w + 1) * window]
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(chunk[None].astype(np.int64)), use_cache=False).logits[0]
        rows = logits.float().numpy()
        window_nll.append(sum(_nll(rows[i], int(chunk[i + 1])) for i in range(window - 1)) / (window - 1))
    return _result(window_nll, window)


# ---------------------------------------------------------------- steps


def register_kernels(pte: str | os.PathLike[str]) -> None:
    """Register with this process's ExecuTorch runtime the kernel libraries a program calls beyond
    the portable ones: ExecuTorch's quantized kernels (``quantized_decomposed::``, e.g. its int8
    embedding) and its LLM kernels (``llama::``, e.g. ``sdpa_with_kv_cache``; importing
    ``executorch.extension.llm.custom_ops.custom_ops`` loads them).  ``TextLLMRunner`` shares the
    registry."""
    from ..pte import read_pte
    from ..pte.quantized import load_kernels

    load_kernels(read_pte(pte, need_delegate=False).operators)


class ProgramStep:
    """A ``.pte``'s LLM method (``forward(tokens int64 [1, n], input_pos int64 [1]) -> logits
    [1, vocab]``) on ``executorch.runtime``, as a step; ``reset()`` loads the program again
    (its state, the KV cache, from the file)."""

    def __init__(self, pte: str | os.PathLike[str], method: str = "forward") -> None:
        try:
            import torch
            from executorch.runtime import Runtime
        except ImportError:
            raise missing_extra("xnnpack", "executorch", "running a .pte") from None
        self._torch, self._runtime = torch, Runtime.get()
        self.path = arguments.path(pte, "pte")
        self.method_name = method
        self.program: Any = None
        self.method: Any = None
        register_kernels(self.path)
        self.reset()

    def reset(self) -> None:
        """Load the program again: ``executorch.runtime`` keeps one Method per loaded program, its
        state carried from call to call; a new program's Method starts from the file's values."""
        self.method = self.program = None  # let go of the old Method's memory first
        self.program = self._runtime.load_program(self.path)
        if self.method_name not in self.program.method_names:
            raise XnnquantError(f"{self.path} has no method {self.method_name!r}: it has "
                                f"{sorted(self.program.method_names)}")
        self.method = self.program.load_method(self.method_name)

    def metadata(self, name: str) -> Any:
        """The value of a constant method (``get_max_seq_len``, ``get_eos_ids``, ...): a number or a tuple."""
        values = self.program.load_method(name).execute([])
        return values[0] if len(values) == 1 else tuple(values)

    def __call__(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        torch = self._torch
        outputs = self.method.execute([torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
                                       torch.tensor([start_pos], dtype=torch.int64)])
        return outputs[0].reshape(-1).numpy().copy()


class TransformersStep:
    """An eager ``transformers`` causal LM as a step, its own KV cache (``DynamicCache``) between calls;
    a call at ``start_pos = 0`` starts a new cache, a call elsewhere must continue the sequence."""

    def __init__(self, model: Any) -> None:
        try:
            import torch
            from transformers import DynamicCache
        except ImportError:
            raise missing_extra("llm", "transformers", "stepping a transformers model") from None
        self._torch, self._cache_type = torch, DynamicCache
        self.model = model
        self.cache: Any = None
        self.position = 0

    def reset(self) -> None:
        self.cache, self.position = None, 0

    def __call__(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        torch = self._torch
        if start_pos == 0:
            self.reset()
            self.cache = self._cache_type(config=self.model.config)
        elif start_pos != self.position or self.cache is None:
            raise XnnquantError(f"start_pos {start_pos} does not continue the sequence: the cache holds "
                                f"{self.position} token(s) (start a new one at 0)")
        ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        positions = torch.arange(start_pos, start_pos + ids.shape[1])[None]
        with torch.no_grad():
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
        self.position = start_pos + ids.shape[1]
        return out.logits[0, -1].float().numpy().copy()


# ---------------------------------------------------------------- timing


@dataclass(frozen=True)
class DecodeTiming:
    """Medians over rounds: ``prefill_ms`` (the prompt in one call), ``decode_ms`` (per one-token
    call); ``rounds``: each round's ``(prefill ms, decode ms per token)``."""

    prefill_ms: float
    decode_ms: float
    prefill_tokens: int
    decode_tokens: int
    rounds: tuple[tuple[float, float], ...] = field(repr=False)


def decode_timing(step: Step, prompt: Any, *, prefill: int = 64, decode: int = 48, rounds: int = 8,
                  warmup: int = 1, reset: Callable[[], None] | None = None) -> DecodeTiming:
    """Time ``step`` as a generator runs it: ``prompt[:prefill]`` in one call at position 0, then
    ``decode`` one-token calls at the next positions, each fed the previous call's most likely
    token (greedy; the ``argmax`` is inside the timed loop).  ``warmup`` untimed rounds first;
    ``reset`` (when given) before every round.  Wall clock, ``time.perf_counter``."""
    ids = _token_ids(prompt)
    prefill = arguments.integer(prefill, "prefill", low=1)
    decode = arguments.integer(decode, "decode", low=1)
    rounds = arguments.integer(rounds, "rounds", low=1)
    warmup = arguments.integer(warmup, "warmup", low=0)
    if len(ids) < prefill:
        raise XnnquantError(f"prompt: {prefill} tokens needed for the prefill, got {len(ids)}")
    measured = []
    for r in range(warmup + rounds):
        if reset is not None:
            reset()
        start = time.perf_counter()
        logits = _logits(step, ids[None, :prefill], 0)
        prefilled = time.perf_counter()
        for i in range(decode):
            logits = _logits(step, np.array([[int(np.argmax(logits))]], dtype=np.int64), prefill + i)
        done = time.perf_counter()
        if r >= warmup:
            measured.append(((prefilled - start) * 1e3, (done - prefilled) * 1e3 / decode))
    return DecodeTiming(statistics.median(p for p, _ in measured), statistics.median(d for _, d in measured),
                        prefill, decode, tuple(measured))


@dataclass(frozen=True)
class RunnerRate:
    """ExecuTorch ``TextLLMRunner`` figures, medians over runs: ``decode_tokens_per_second`` =
    generated tokens / (end of generation - end of prompt), ``prefill_tokens_per_second`` =
    prompt tokens / (end of prompt - start), as ExecuTorch's stats report computes them
    (millisecond clock)."""

    decode_tokens_per_second: float
    prefill_tokens_per_second: float
    prompt_tokens: int
    generated_tokens: int
    text: str = field(repr=False)


def runner_rate(pte: str | os.PathLike[str], tokenizer_json: str | os.PathLike[str], prompt: str, *,
                max_new_tokens: int = 64, runs: int = 3) -> RunnerRate:
    """Generate ``max_new_tokens`` after ``prompt`` (greedy, no BOS added: ``GenerationConfig``'s
    default; fewer at an end-of-sequence token) ``runs`` times with ExecuTorch's ``TextLLMRunner``,
    after one untimed run."""
    try:
        from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    except (ImportError, RuntimeError):
        raise missing_extra("xnnpack", "executorch", "running ExecuTorch's TextLLMRunner") from None
    path = arguments.path(pte, "pte")
    runs = arguments.integer(runs, "runs", low=1)
    register_kernels(path)
    runner = TextLLMRunner(str(path), str(arguments.path(tokenizer_json, "tokenizer_json")))
    stats: list[Any] = []
    pieces: list[str] = []
    for r in range(runs + 1):
        pieces.clear()
        runner.reset()
        config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, echo=False)
        runner.generate(prompt, config, token_callback=pieces.append,
                        stats_callback=(stats.append if r else None))
    decode = [s.num_generated_tokens * 1e3 / max(s.inference_end_ms - s.prompt_eval_end_ms, 1) for s in stats]
    prefill = [s.num_prompt_tokens * 1e3 / max(s.prompt_eval_end_ms - s.inference_start_ms, 1) for s in stats]
    return RunnerRate(statistics.median(decode), statistics.median(prefill), int(stats[-1].num_prompt_tokens),
                      int(stats[-1].num_generated_tokens), "".join(pieces))


# ---------------------------------------------------------------- calls per token


@dataclass(frozen=True)
class CallCount:
    """What one call of a program method runs: ``kernels`` (operator ``name.overload`` -> calls),
    ``delegates`` (backend id -> calls), ``xnnpack_nodes`` (the nodes of every XNNPACK delegate
    called, once per call), ``other`` (move, jump and free instructions)."""

    kernels: dict[str, int]
    delegates: dict[str, int]
    xnnpack_nodes: int
    other: int

    @property
    def kernel_calls(self) -> int:
        return sum(self.kernels.values())

    @property
    def delegate_calls(self) -> int:
        return sum(self.delegates.values())

    @property
    def calls(self) -> int:
        """Kernel calls + delegate calls."""
        return self.kernel_calls + self.delegate_calls


def count_calls(pte: Any, method: str = "forward") -> CallCount:
    """Count the instructions of ``method`` in a program (a path, bytes, or ``read_pte``'s result).

    Every instruction of the method's chains is counted once: what one call runs when the
    method has no jumps (``other`` counts them; programs from ``torch.export`` have none)."""
    from ..pte import PteProgram, read_pte
    from ..pte import program_generated as fb

    program = pte if isinstance(pte, PteProgram) else read_pte(pte, need_delegate=False)
    if method not in program.methods:
        raise XnnquantError(f"no method {method!r} in the program: it has {', '.join(program.methods)}")
    nodes = {d.index: len(d.graph.nodes) for d in program.method_delegates(method)}
    data = program.data
    try:
        root = fb.Program.GetRootAs(data, 0)
        plan = next(root.ExecutionPlan(p) for p in range(root.ExecutionPlanLength())
                    if (root.ExecutionPlan(p).Name() or b"").decode() == method)
        operators = []
        for k in range(plan.OperatorsLength()):
            op = plan.Operators(k)
            overload = (op.Overload() or b"").decode()
            operators.append(op.Name().decode() + (f".{overload}" if overload else ""))
        backends = [(plan.Delegates(j).Id() or b"").decode() for j in range(plan.DelegatesLength())]
        kernels: dict[str, int] = {}
        delegates: dict[str, int] = {}
        xnnpack_nodes = other = 0
        for c in range(plan.ChainsLength()):
            chain = plan.Chains(c)
            for i in range(chain.InstructionsLength()):
                instruction = chain.Instructions(i)
                kind = instruction.InstrArgsType()
                if kind == fb.InstructionArguments.KernelCall:
                    call = fb.KernelCall()
                    call.Init(instruction.InstrArgs().Bytes, instruction.InstrArgs().Pos)
                    name = operators[call.OpIndex()]
                    kernels[name] = kernels.get(name, 0) + 1
                elif kind == fb.InstructionArguments.DelegateCall:
                    call = fb.DelegateCall()
                    call.Init(instruction.InstrArgs().Bytes, instruction.InstrArgs().Pos)
                    index = call.DelegateIndex()
                    delegates[backends[index]] = delegates.get(backends[index], 0) + 1
                    xnnpack_nodes += nodes.get(index, 0)
                else:
                    other += 1
    except (IndexError, StopIteration, UnicodeDecodeError, AttributeError) as exc:
        raise ProgramError(f"the program's method {method!r} is corrupt ({type(exc).__name__}: {exc})") from None
    return CallCount(kernels, delegates, xnnpack_nodes, other)


def format_calls(count: CallCount, top: int = 6) -> str:
    """One line: ``"31 delegate (1,234 XNNPACK nodes) + 62 kernel calls: llama::sdpa... x30, ..."``."""
    ranked = sorted(count.kernels.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    listed = ", ".join(f"{name} x{n}" for name, n in ranked)
    return (f"{count.delegate_calls} delegate ({count.xnnpack_nodes} XNNPACK nodes) + "
            f"{count.kernel_calls} kernel calls" + (f": {listed}" if listed else ""))

