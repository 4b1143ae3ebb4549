"""Measuring a causal LM behind ExecuTorch's LLM interface: perplexity, decode speed, calls per token.

Everything here drives a model through one function, a *step*::

    step(tokens int64 [1, n], start_pos) -> float32 [vocab]
        the logits of the last of n tokens placed at positions start_pos .. start_pos + n - 1,
        the tokens of earlier calls (positions < start_pos) kept as context (a KV cache)

A call at ``start_pos = 0`` starts a new sequence, as in ExecuTorch's LLM interface: the
runners restart a program at position 0 and do not clear its cache, since a causal model
never reads a cache position beyond the one it writes.  ``ProgramStep`` steps a ``.pte``'s
``forward`` on ``executorch.runtime`` (its ``reset`` loads the program again, so its state is
the file's), feeding more tokens than the program's ``max_seq_len`` in calls of
``max_seq_len`` as ExecuTorch's ``TextPrefiller`` does; ``TransformersStep`` an eager
``transformers`` causal LM (float32 reference).  Both also give every position's logits
(``step.logits(tokens, start_pos) -> [n, vocab]``; a program exported with
``full_logits=True``).

* ``perplexity``: windows of W tokens of the token stream, each from position 0, starting
  every S tokens (``stride``; S = W: non-overlapping, llama.cpp's chunks of ``n_ctx``);
  every token of the stream from the second on is predicted once: the first window's
  W - 1, then each window's last min(S, W - 1), with at least W - S tokens of context (the
  sliding windows of transformers' perplexity guide, llama.cpp's ``--ppl-stride``).  Token
  by token (one token a call, as a runner decodes) or in calls of ``max_seq_len`` with
  every position's logits (``chunked``); ``transformers_perplexity``: a window a call::

      window w = t[wS : wS + W]           calls  step(t[wS + i], i)   for i = 0 .. W-2
      NLL_i = logsumexp(logits_i) - logits_i[t[wS + i + 1]]            (the predicted i)
      perplexity = exp(mean NLL)          (float64 arithmetic on float32 logits)
      spread: the standard error of the mean NLL over predictions, sqrt(var / (N - 1)),
      and PPL +/- PPL * that (llama.cpp's "estimated PPL = X +/- Y"); over windows too
      (tokens of one window are not independent, so the windows' spread is the honest one
      when there are enough of them)

* ``program_perplexity``: ``perplexity`` of a ``.pte`` (``xnnquant perplexity``), checked
  against the program's vocabulary and context.

* ``decode_timing``: a 64-token prompt (prefill: one call, or calls of ``max_seq_len`` where
  the step takes fewer), then 48 one-token calls fed the previous call's most likely token
  (decode); median over 8 rounds.
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
from .export import call_bound

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
    ``tokens``: predictions; ``windows``: windows of ``window`` tokens, ``stride`` apart;
    ``window_nll``: each window's mean; ``token_nll``: every prediction's, float64, in order
    (module docstring)."""

    value: float
    nll: float
    tokens: int
    windows: int
    window_nll: tuple[float, ...] = field(repr=False)
    window: int = 0
    stride: int = 0
    token_nll: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    #: how the windows were fed: "token" (one token a call) or "chunked" (every position's logits)
    mode: str = "token"

    @property
    def nll_stderr(self) -> float:
        """Standard error of ``nll`` over predictions: ``sqrt(var / (N - 1))`` (llama.cpp's)."""
        n = len(self.token_nll)
        return float(np.std(self.token_nll) / np.sqrt(n - 1)) if n > 1 else float("nan")

    @property
    def stderr(self) -> float:
        """The perplexity's standard error, ``value * nll_stderr`` (llama.cpp's ``+/-``)."""
        return self.value * self.nll_stderr

    @property
    def window_stderr(self) -> float:
        """The perplexity's standard error from the spread of the windows' mean NLLs (NaN for
        one window)."""
        k = len(self.window_nll)
        return float(self.value * np.std(self.window_nll, ddof=1) / np.sqrt(k)) if k > 1 else float("nan")

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """``exp(nll -/+ z * nll_stderr)``: a 95% interval of the perplexity for ``z = 1.96``."""
        return float(np.exp(self.nll - z * self.nll_stderr)), float(np.exp(self.nll + z * self.nll_stderr))

    def as_dict(self) -> dict[str, Any]:
        """The figures as JSON holds them (``xnnquant perplexity --json``)."""
        low, high = self.interval()
        return {"perplexity": self.value, "stderr": self.stderr, "interval_95": [low, high], "nll": self.nll,
                "nll_stderr": self.nll_stderr, "window_stderr": _finite(self.window_stderr), "tokens": self.tokens,
                "windows": self.windows, "window": self.window, "stride": self.stride, "mode": self.mode,
                "window_perplexities": [float(np.exp(w)) for w in self.window_nll]}


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


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


@dataclass(frozen=True)
class Windows:
    """Where ``perplexity`` reads: ``count`` windows of ``window`` tokens starting every
    ``stride``; window k predicts its tokens ``first(k)`` .. ``window - 1``."""

    ids: np.ndarray
    window: int
    stride: int
    count: int

    def first(self, k: int) -> int:
        """The first token of window ``k`` that it predicts (module docstring)."""
        return 1 if k == 0 else self.window - min(self.stride, self.window - 1)

    def tokens(self, k: int) -> np.ndarray:
        return self.ids[k * self.stride:k * self.stride + self.window]

    @property
    def predictions(self) -> int:
        return sum(self.window - self.first(k) for k in range(self.count))


def _windows(token_ids: Any, window: int, windows: int | None, stride: int | None = None) -> Windows:
    """``perplexity``'s arguments checked."""
    ids = _token_ids(token_ids)
    window = arguments.integer(window, "window", low=2)
    stride = window if stride is None else arguments.integer(stride, "stride", low=1, high=window)
    available = (len(ids) - window) // stride + 1 if len(ids) >= window else 0
    count = available if windows is None else arguments.integer(windows, "windows", low=1)
    if count > available or count == 0:
        apart = "" if stride == window else f", {stride} apart"
        raise XnnquantError(f"perplexity needs {max(count, 1)} window(s) of {window} tokens{apart}: got {len(ids)} "
                            f"tokens ({available} whole window(s))")
    return Windows(ids, window, stride, count)


def _nll(logits: np.ndarray, target: int) -> float:
    """``logsumexp(logits) - logits[target]`` in float64."""
    logits = logits.astype(np.float64)
    if not 0 <= target < logits.shape[0]:
        raise XnnquantError(f"token id {target} is outside the model's vocabulary of {logits.shape[0]}")
    peak = logits.max()
    return float(peak + np.log(np.exp(logits - peak).sum()) - logits[target])


def _nlls(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``_nll`` of each row of ``rows`` ``[n, vocab]`` and its target: ``(n,) float64``."""
    rows = np.asarray(rows, np.float64)
    if rows.ndim != 2 or rows.shape[0] != len(targets):
        raise XnnquantError(f"step.logits must return one row of logits per token, [{len(targets)}, vocab]: got "
                            f"shape {rows.shape}")
    bad = targets[(targets < 0) | (targets >= rows.shape[1])]
    if bad.size:
        raise XnnquantError(f"token id {int(bad[0])} is outside the model's vocabulary of {rows.shape[1]}")
    peak = rows.max(axis=1)
    total = peak + np.log(np.exp(rows - peak[:, None]).sum(axis=1))
    return total - rows[np.arange(len(targets)), targets]


def _result(per_window: list[np.ndarray], window: int, stride: int | None = None, mode: str = "token") -> Perplexity:
    every = np.concatenate(per_window) if per_window else np.zeros(0)
    nll = float(np.mean(every))
    return Perplexity(float(np.exp(nll)), nll, len(every), len(per_window),
                      tuple(float(np.mean(w)) for w in per_window), window, window if stride is None else stride,
                      every, mode)


def perplexity(step: Step, token_ids: Any, window: int = 128, windows: int | None = None, *,
               reset: Callable[[], None] | None = None, stride: int | None = None, chunked: bool = False,
               progress: Callable[[int], None] | None = None) -> Perplexity:
    """Perplexity of ``step``'s model on ``token_ids`` (``(N,)`` ints), with its spread (module
    docstring).

    ``window``: tokens per window (>= 2); ``stride``: tokens between window starts (default
    ``window``: non-overlapping); ``windows``: how many, from the start (``None``: every
    whole window).  ``chunked``: each window in one ``step.logits(tokens, 0)`` (every
    position's logits; a ``ProgramStep`` makes calls of ``max_seq_len``), instead of one
    token a call.  ``reset``, when given, is called before each window (for a step whose
    state must be put back; otherwise position 0 starts a new sequence).  ``progress``,
    when given, is called with the number of tokens fed after each call.
    """
    where = _windows(token_ids, window, windows, stride)
    every_position = getattr(step, "logits", None) if chunked else None
    if chunked and every_position is None:
        raise XnnquantError(f"chunked=True needs a step with a logits(tokens, start_pos) method giving every "
                            f"position's logits: got {type(step).__name__}")
    piece = int(getattr(step, "max_seq_len", 0) or where.window)  # tokens a chunked call takes
    per_window = []
    for k in range(where.count):
        if reset is not None:
            reset()
        chunk, first = where.tokens(k), where.first(k)
        nll = np.empty(where.window - first)
        if every_position is not None:
            for begin in range(0, len(chunk) - 1, piece):
                end = min(begin + piece, len(chunk) - 1)  # predicts tokens begin + 1 .. end
                rows = np.asarray(every_position(chunk[None, begin:end], begin))
                low = max(begin, first - 1)
                if low < end:
                    nll[low - first + 1:end - first + 1] = _nlls(rows[low - begin:], chunk[low + 1:end + 1])
                if progress is not None:
                    progress(end - begin)
        else:
            for i in range(len(chunk) - 1):
                logits = _logits(step, chunk[None, i:i + 1], i)
                if i >= first - 1:
                    nll[i - first + 1] = _nll(logits, int(chunk[i + 1]))
                if progress is not None:
                    progress(1)
        per_window.append(nll)
    return _result(per_window, where.window, where.stride, "chunked" if chunked else "token")


#: ``program_perplexity``'s window when none is given (or the program's context, if shorter):
#: llama.cpp's ``llama-perplexity`` default context.
DEFAULT_WINDOW = 512


def llm_step(pte: str | os.PathLike[str]) -> ProgramStep:
    """``ProgramStep`` of an LLM program: ``XnnquantError`` for a file that is none (no
    ``forward``, no ``get_max_seq_len`` / ``get_vocab_size``)."""
    step = ProgramStep(pte)
    names = step.program.method_names
    if "get_max_seq_len" not in names or step.vocab_size is None:
        raise XnnquantError(f"{step.path} is not an LLM program: it has methods {', '.join(sorted(names))}; expected "
                            "forward and ExecuTorch's LLM metadata methods (get_max_seq_len, get_vocab_size, ...)")
    return step


def program_perplexity(pte: str | os.PathLike[str] | ProgramStep, token_ids: Any, *, window: int | None = None,
                       stride: int | None = None, windows: int | None = None, chunked: bool | None = None,
                       progress: Any = False, fresh: bool = False) -> Perplexity:
    """``perplexity`` of an LLM program (``xnnquant perplexity``; module docstring).

    ``window``: tokens a window (default ``DEFAULT_WINDOW``, at most the program's context);
    ``stride``, ``windows``: as ``perplexity``'s.  ``chunked``: the windows fed in calls of the
    program's ``max_seq_len`` with every position's logits (``full_logits`` programs; their
    default), else one token a call (the others' default; ``chunked=False`` asks for it).
    ``progress``: a progress bar (tqdm, on ``sys.stderr`` for True or on the stream given;
    off where that stream is not a terminal).  ``fresh``: the program loaded again before
    each window (its cache from the file), not needed for a causal program whose windows
    start at position 0.
    """
    step = pte if isinstance(pte, ProgramStep) else llm_step(pte)
    assert step.vocab_size is not None  # llm_step's check
    context = int(step.max_context or step.max_seq_len or 0)
    window = min(DEFAULT_WINDOW, context) if window is None else arguments.integer(window, "window", low=2)
    if window > context:
        raise XnnquantError(f"window of {window} tokens is longer than the program's context of {context} positions: "
                            f"expected window <= {context}")
    chunked = step.full_logits if chunked is None else arguments.flag(chunked, "chunked")
    if chunked and not step.full_logits:
        step.logits(np.zeros((1, 1), np.int64), 0)  # raises: the program gives the last position's logits only
    where = _windows(token_ids, window, windows, stride)
    used = where.ids[:(where.count - 1) * where.stride + where.window]
    outside = used[(used < 0) | (used >= step.vocab_size)]
    if outside.size:
        raise XnnquantError(f"token id {int(outside[0])} is outside the program's vocabulary of {step.vocab_size}: was "
                            "the text encoded with this model's tokenizer?")
    bar = _progress_bar(progress, where.count * (where.window - 1))
    try:
        return perplexity(step, where.ids, where.window, where.count, stride=where.stride, chunked=chunked,
                          reset=step.reset if fresh else None, progress=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(progress: Any, total: int) -> Any:
    """A tqdm bar of ``total`` tokens on ``sys.stderr`` (True) or the stream given; None for
    False, or where the stream is not a terminal."""
    import sys

    if progress is False or progress is None:
        return None
    stream = sys.stderr if progress is True else progress
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", file=stream, desc="perplexity", dynamic_ncols=True, leave=False)


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
    where = _windows(token_ids, window, windows)
    used = where.ids[:where.count * where.window]
    if used.min() < 0 or used.max() >= vocab:
        bad = int(used[(used < 0) | (used >= vocab)][0])
        raise XnnquantError(f"token id {bad} is outside the model's vocabulary of {vocab}")
    if isinstance(positions, int) and where.window > positions:
        raise XnnquantError(f"window of {where.window} tokens is longer than the model's {positions} positions: "
                            f"expected window <= {positions}")
    per_window = []
    for k in range(where.count):
        chunk = where.tokens(k)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(chunk[None].astype(np.int64)), use_cache=False).logits[0]
        per_window.append(_nlls(logits.float().numpy()[:-1], chunk[1:]))
    return _result(per_window, where.window, mode="chunked")


# ---------------------------------------------------------------- steps


def register_kernels(pte: str | os.PathLike[str]) -> None:
    """Register with this process's ExecuTorch runtime the kernel libraries a program calls beyond
    the portable ones: ExecuTorch's quantized kernels (``quantized_decomposed::``, e.g. its int8
    embedding) and its LLM kernels (``llama::``, e.g. ``sdpa_with_kv_cache``; importing
    ``executorch.extension.llm.custom_ops.custom_ops`` loads them).  ``TextLLMRunner`` shares the
    registry."""
    from ..pte import read_pte
    from ..pte.quantized import load_kernels
    from ..pte.runtime_log import quiet

    load_kernels(read_pte(pte, need_delegate=False).operators)
    quiet()


class ProgramStep:
    """A ``.pte``'s LLM method (``forward(tokens int64 [1, n], input_pos int64 [1]) -> logits
    [1, vocab]``, or ``[1, n, vocab]`` from ``full_logits=True``) on ``executorch.runtime``, as
    a step; more tokens than the program's ``max_seq_len`` go in calls of ``max_seq_len``
    (ExecuTorch's ``TextPrefiller``).  ``reset()`` loads the program again (its state, the KV
    cache, from the file).  ``max_seq_len``, ``max_context``, ``vocab_size``: its metadata
    (None where it has no such method); ``full_logits``: it returns every position's."""

    program: Any  # executorch.runtime's Program and Method (None while reset loads them)
    method: Any

    def __init__(self, pte: str | os.PathLike[str], method: str = "forward") -> None:
        from ..pte.runtime_log import quiet_imports

        quiet_imports()
        try:
            import torch
            from executorch.runtime import Runtime
        except ImportError:
            raise missing_extra("xnnpack", "executorch", "running a .pte") from None
        self._torch, self._runtime = torch, Runtime.get()
        self.path = arguments.path(pte, "pte")
        if not self.path.is_file():
            raise XnnquantError(f"no file {self.path}: expected an LLM program (.pte)")
        self.method_name = method
        register_kernels(self.path)
        self.reset()
        names = set(self.program.method_names)
        tokens = tuple(int(d) for d in self.method.metadata.input_tensor_meta(0).sizes())
        self.max_seq_len = min(int(self.metadata("get_max_seq_len")), call_bound(tokens)) \
            if "get_max_seq_len" in names else None
        self.max_context = int(self.metadata("get_max_context_len")) if "get_max_context_len" in names else \
            self.max_seq_len
        self.vocab_size = int(self.metadata("get_vocab_size")) if "get_vocab_size" in names else None
        self.full_logits = len(self.method.metadata.output_tensor_meta(0).sizes()) == 3

    def reset(self) -> None:
        """Load the program again: ``executorch.runtime`` keeps one Method per loaded program, its
        state carried from call to call; a new program's Method starts from the file's values."""
        self.method = self.program = None  # let go of the old Method's memory first
        try:
            self.program = self._runtime.load_program(self.path)
        except (RuntimeError, ValueError) as exc:
            raise XnnquantError(f"{self.path} is not a program ExecuTorch's runtime loads: {exc}") from None
        if self.method_name not in self.program.method_names:
            raise XnnquantError(f"{self.path} has no method {self.method_name!r}: it has "
                                f"{sorted(self.program.method_names)}")
        self.method = self.program.load_method(self.method_name)

    def metadata(self, name: str) -> Any:
        """The value of a constant method (``get_max_seq_len``, ``get_eos_ids``, ...): a number or a tuple."""
        values = self.program.load_method(name).execute([])
        return values[0] if len(values) == 1 else tuple(values)

    def _calls(self, tokens: np.ndarray, start_pos: int) -> Any:
        """The program's output ``[1, vocab]`` or ``[1, n, vocab]`` for each call of at most
        ``max_seq_len`` of ``tokens`` ``[1, n]``, at ``start_pos`` onwards."""
        torch = self._torch
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        step = self.max_seq_len or tokens.shape[1]
        for begin in range(0, tokens.shape[1], step):
            piece = torch.from_numpy(np.ascontiguousarray(tokens[:, begin:begin + step]))
            yield self.method.execute([piece, torch.tensor([start_pos + begin], dtype=torch.int64)])[0]

    def __call__(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        for out in self._calls(tokens, start_pos):
            last = out[0, -1] if out.dim() == 3 else out.reshape(-1)
        return last.numpy().copy()

    def logits(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        """Every position's logits ``[n, vocab]`` float32 (a ``full_logits`` program)."""
        if not self.full_logits:
            raise XnnquantError(f"{self.path} returns the logits of each call's last position only: export it with "
                                "full_logits=True (xnnquant export-llm --full-logits) to evaluate in chunks, or "
                                "evaluate one token a call")
        return np.concatenate([out[0].numpy() for out in self._calls(tokens, start_pos)])


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
        return self.logits(tokens, start_pos)[-1]

    def logits(self, tokens: np.ndarray, start_pos: int) -> np.ndarray:
        """Every position's logits ``[n, vocab]`` float32."""
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
        return out.logits[0].float().numpy().copy()


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

