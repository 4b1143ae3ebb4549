"""Generating tokens with an LLM program (``export_llm``'s ``.pte``) on ExecuTorch's runtime.

``LLM(program)`` loads the program once, reads its metadata methods and loads ``forward``
(its XNNPACK delegates pack their weights then: a one-time cost, not a prefill's);
``generate`` runs the prompt at position 0 (prefill: one call, or calls of ``max_seq_len``
tokens for a longer prompt, the last one shorter, as ExecuTorch's ``TextPrefiller``), then
one call per new token (decode), each at the next position of the KV cache, until
``max_new_tokens``, an end-of-sequence token, or the context: as ``TextLLMRunner`` resolves
it, at most ``max_context - prompt`` new tokens (``GenerationConfig.resolve_max_new_tokens``),
and a prompt must leave room for one (fewer than ``max_context`` tokens).  A new
generation needs no reload: a prompt at position 0 overwrites what earlier calls wrote at
its positions, and the causal attention never reads a position beyond the current one, so
nothing of an earlier generation is read.

Times: ``prefill_seconds`` covers the prompt's calls and the choice of the first new token;
``decode_seconds`` the decode calls and the choice of the token each makes, not the time
the caller spends between tokens (``on_token``, printing).  Each rate counts the tokens of
its own phase: the first new token is the prefill's, every later one a decode call's.

Sampling: ``temperature=0`` takes the most likely token (greedy; the first of equal
logits, as ``argmax``); above 0, a token is drawn from ``softmax(logits / temperature)``,
restricted to the smallest set of most likely tokens whose probability reaches ``top_p``
(nucleus sampling), with a seeded generator.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import arguments
from ..errors import XnnquantError
from .export import METADATA, LLMInfo, call_bound

#: Why a generation stopped: an end-of-sequence token, ``max_new_tokens``, or the program's
#: context (the prompt and the new tokens fill it, as ``TextLLMRunner`` stops).
STOPS = ("eos", "length", "context")


@dataclass
class Generation:
    """What ``generate`` made: the new token ids (an end-of-sequence token that stopped it not
    among them), why it stopped (``STOPS``), the prompt's calls, and the time of each phase
    (module docstring).  ``decode_tokens``: the tokens decode calls made (an end-of-sequence
    token included), one a call."""

    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    stop: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_calls: int = 0
    decode_tokens: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens a second."""
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens made by decode calls a second (``decode_tokens / decode_seconds``)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _program_bytes(program: Any) -> Any:
    """What ``pte.run.Session`` reads: a path, bytes, or an ``Exported``'s ``.pte``."""
    if hasattr(program, "to_pte") and hasattr(program, "llm"):
        return program.to_pte()
    if isinstance(program, (str, os.PathLike, bytes, bytearray, memoryview)):
        return program
    raise XnnquantError(f"program must be an LLM .pte (a path or its bytes) or what export_llm returned: got "
                        f"{arguments.shown(program)}")


class LLM:
    """An LLM program loaded once on ExecuTorch's runtime (module docstring)."""

    def __init__(self, program: Any) -> None:
        from ..pte.run import Session
        from ..pte.runtime_log import quiet_imports

        quiet_imports()
        self.session = Session(_program_bytes(program))
        methods = self.session.program.methods
        if "forward" not in methods or "get_max_seq_len" not in methods:
            raise XnnquantError(f"the program is not an LLM program: it has methods {', '.join(methods)}; expected "
                                "forward and ExecuTorch's LLM metadata methods (get_max_seq_len, ...), as export_llm "
                                "writes them")
        found = {name: self._constant(name) for name in METADATA if name in methods}
        eos = found.get("get_eos_ids", ())
        max_context = int(found.get("get_max_context_len", found["get_max_seq_len"]))
        max_seq_len = min(int(found["get_max_seq_len"]), call_bound(self.session.input_sizes("forward", 0)))
        self.position = 0
        (loaded,) = self.session.run("forward", [_tokens([0]), _position(0)])  # loads the method
        self.info = LLMInfo(max_context, int(found.get("get_vocab_size", 0)), int(found.get("get_n_layers", 0)),
                            found.get("get_bos_id"), tuple(int(e) for e in eos),
                            max_seq_len=min(max_seq_len, max_context), kv_cache="",  # the file does not say
                            full_logits=np.ndim(loaded) == 3)

    def _constant(self, name: str) -> Any:
        outputs = self.session.run(name, [])
        values = [v.item() if isinstance(v, np.ndarray) else v for v in outputs]
        return tuple(values) if name == "get_eos_ids" else values[0]

    def reset(self) -> None:
        """Load the program again: the cache holds the file's values, the next call is at 0."""
        self.session.reset()
        self.position = 0
        self.forward([0], 0)

    def _calls(self, ids: Sequence[int], position: int) -> Iterator[np.ndarray]:
        """``forward`` on ``ids`` at ``position`` onwards in calls of at most ``max_seq_len``
        tokens: each call's logits, ``[1, vocab]`` or ``[1, n, vocab]``."""
        ids = [int(i) for i in ids]
        end = position + len(ids)
        if not ids or position < 0 or end > self.info.max_context:
            raise XnnquantError(f"positions {position}..{end - 1} are outside the program's context of "
                                f"{self.info.max_context} positions: expected 0 <= position and position + "
                                f"len(ids) <= {self.info.max_context}, with at least one id")
        step = self.info.seq_len
        for begin in range(0, len(ids), step):
            (logits,) = self.session.run("forward", [_tokens(ids[begin:begin + step]), _position(position + begin)])
            yield np.asarray(logits, np.float32)

    def forward(self, ids: Sequence[int], position: int) -> np.ndarray:
        """Logits float32 ``[vocab]`` of the last of ``ids``, written at ``position`` onwards
        (in calls of ``max_seq_len`` tokens when there are more)."""
        (logits,) = collections.deque(self._calls(ids, position), maxlen=1)  # the last call's
        return logits.reshape(-1, logits.shape[-1])[-1]

    def logits(self, ids: Sequence[int], position: int) -> np.ndarray:
        """Logits float32 ``[len(ids), vocab]`` of every one of ``ids``: a program exported with
        ``full_logits=True`` (``XnnquantError`` for one that returns the last position's only)."""
        if not self.info.full_logits:
            raise XnnquantError("the program returns the logits of each call's last position only: export it with "
                                "full_logits=True (xnnquant export-llm --full-logits) for every position's, or "
                                "call it one token at a time")
        return np.concatenate([c.reshape(-1, c.shape[-1]) for c in self._calls(ids, position)])

    def stream(self, prompt_ids: Any, max_new_tokens: int = 64, *, temperature: float = 0.0, top_p: float = 1.0,
               seed: int | None = None, eos_ids: Any = None, result: Generation | None = None) -> Iterator[int]:
        """Each new token id as soon as it is made (``generate`` collects them)."""
        prompt = self._prompt(prompt_ids)
        wanted = _positive_int(max_new_tokens, "max_new_tokens")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not 0 <= temperature < 1e6:
            raise XnnquantError(f"temperature must be a number >= 0 (0: greedy): got {arguments.shown(temperature)}")
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise XnnquantError(f"top_p must be a number in (0, 1]: got {arguments.shown(top_p)}")
        context = self.info.max_context
        if len(prompt) >= context:
            raise XnnquantError(f"the prompt's {len(prompt)} tokens fill the program's context of {context} "
                                f"positions: expected fewer than {context} (export with a larger max_context, or "
                                "shorten the prompt)")
        steps = min(wanted, context - len(prompt))  # TextLLMRunner's resolve_max_new_tokens
        stops = set(self.info.eos_ids if eos_ids is None else
                    [eos_ids] if arguments.is_plain_int(eos_ids) else list(eos_ids))
        rng = np.random.default_rng(seed)
        out = result if result is not None else Generation()
        out.prompt_tokens = len(prompt)
        out.prefill_calls = -(-len(prompt) // self.info.seq_len)
        begin = time.perf_counter()
        token = _sample(self.forward(prompt, 0), temperature, top_p, rng)
        out.prefill_seconds = time.perf_counter() - begin
        position = len(prompt)
        try:
            for step in range(steps):
                if token in stops:
                    out.stop = "eos"
                    return
                out.tokens.append(token)
                yield token
                if step + 1 == steps:
                    out.stop = "length" if steps == wanted else "context"
                    return
                begin = time.perf_counter()
                token = _sample(self.forward([token], position), temperature, top_p, rng)
                out.decode_seconds += time.perf_counter() - begin
                out.decode_tokens += 1
                position += 1
        finally:
            self.position = position

    def generate(self, prompt_ids: Any, max_new_tokens: int = 64, *, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, eos_ids: Any = None,
                 on_token: Callable[[int], None] | None = None) -> Generation:
        """Generate after ``prompt_ids`` (module docstring); ``on_token`` is called with each
        new token as it comes."""
        result = Generation()
        for token in self.stream(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 eos_ids=eos_ids, result=result):
            if on_token is not None:
                on_token(token)
        return result

    def _prompt(self, prompt_ids: Any) -> list[int]:
        try:
            import torch

            if isinstance(prompt_ids, torch.Tensor):
                prompt_ids = prompt_ids.reshape(-1).tolist() if prompt_ids.dim() <= 2 and \
                    (prompt_ids.dim() < 2 or prompt_ids.shape[0] == 1) else prompt_ids
        except ImportError:  # pragma: no cover
            pass
        if isinstance(prompt_ids, np.ndarray) and prompt_ids.dtype.kind in "iu":
            prompt_ids = prompt_ids.reshape(-1).tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids or \
                not all(arguments.is_plain_int(i) for i in prompt_ids):
            raise XnnquantError(f"prompt_ids must be a non-empty sequence of token ids (a list, or a tensor [1, n]): "
                                f"got {arguments.shown(prompt_ids)}")
        vocab = self.info.vocab_size
        bad = [int(i) for i in prompt_ids if not 0 <= int(i) < vocab]
        if bad:
            raise XnnquantError(f"prompt_ids hold {len(bad)} id(s) outside the vocabulary [0, {vocab}), first "
                                f"{bad[0]}: was the prompt encoded with this model's tokenizer?")
        return [int(i) for i in prompt_ids]


def _tokens(ids: Sequence[int]) -> Any:
    import torch

    return torch.tensor([list(ids)], dtype=torch.int64)


def _position(position: int) -> Any:
    import torch

    return torch.tensor([position], dtype=torch.int64)


def _positive_int(value: Any, name: str) -> int:
    if not arguments.is_plain_int(value) or isinstance(value, bool) or int(value) < 1:
        raise XnnquantError(f"{name} must be an int >= 1: got {arguments.shown(value)}")
    return int(value)


def _sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The next token from ``logits`` (module docstring)."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
    return int(rng.choice(kept, p=probs[kept] / probs[kept].sum()))


def generate(program: Any, prompt_ids: Any, max_new_tokens: int = 64, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos_ids: Any = None,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Load ``program`` (an LLM ``.pte``'s path or bytes, or ``export_llm``'s result) and
    generate after ``prompt_ids`` (``LLM.generate``)."""
    return LLM(program).generate(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 eos_ids=eos_ids, on_token=on_token)
