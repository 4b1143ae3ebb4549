"""``xq.export_llm``: a causal LM with a KV cache to one ``.pte`` that ExecuTorch's LLM runners run.

The program (``decoder.py`` draws ``forward`` and its cache)::

    forward(tokens int64 [1, n], input_pos int64 [1]) -> logits float32 [1, vocab]
        n in [1, max_seq_len]: prefill and decode in one method; state: the KV cache
        (full_logits=True: logits float32 [1, n, vocab], every position's)
    get_max_seq_len        Int   max_seq_len (the most tokens one call takes)
    get_max_context_len    Int   max_context (positions the cache holds)
    get_vocab_size         Int   the model's vocabulary
    get_n_layers           Int   its layers
    get_bos_id             Int   (when the model has one)
    get_eos_ids            Int x k, one output each
    use_kv_cache           Bool  true
    use_sdpa_with_kv_cache Bool  false (the cache update and attention are separate calls)
    enable_dynamic_shape   Bool  true (a prompt of up to max_seq_len tokens is one call)

Each metadata method is ExecuTorch's constant method: no inputs, no instructions, its
outputs constant values (``exir/emit/_emitter.py``'s ``_emit_prim_getters``), read by
``TextLLMRunner`` (``extension/llm/runner/llm_runner_helper.cpp``) and ``llama_main``.

A prompt longer than ``max_seq_len`` is fed in calls of ``max_seq_len`` tokens, the last one
shorter (ExecuTorch 1.4.1's ``TextPrefiller::prefill``; ``xq.generate`` and the evaluation
helpers do the same), so the program's activations are planned for ``max_seq_len`` tokens,
not for the context: only the cache grows with ``max_context``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import arguments
from ..errors import XnnquantError

if TYPE_CHECKING:
    from .decoder import Decoder, Family

#: ``max_seq_len`` when none is given (capped at ``max_context``), ExecuTorch's own default.
#: Measured on SmolLM2-135M at ``max_context=2048`` (``benchmarks/llm_max_seq_len.py``,
#: ``docs/llm.md``): the activations it plans grow by 26 KB a token (128: 3.2 MB beside the
#: fp32 cache's 94.4 MB; 2048: 52 MB), while prefill speed is the same from 32 to 2048 tokens
#: a call (within 4%): nothing is gained by more, little memory saved by less.
DEFAULT_MAX_SEQ_LEN = 128
#: The metadata methods, in the order written (module docstring).
METADATA = ("get_max_seq_len", "get_max_context_len", "get_vocab_size", "get_n_layers", "get_bos_id", "get_eos_ids",
            "use_kv_cache", "use_sdpa_with_kv_cache", "enable_dynamic_shape")


@dataclass(frozen=True)
class LLMInfo:
    """What an LLM program says of itself (its metadata methods)."""

    max_context: int
    vocab_size: int
    n_layers: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    family: str = ""
    #: the cache's shape per layer: (key/value heads, head dim)
    cache: tuple[tuple[int, int], ...] = field(default=())
    #: the most tokens one call takes (None: ``max_context``, as programs before it was a choice)
    max_seq_len: int | None = None
    #: the cache's layout (``decoder.KV_CACHES``; "" where a program does not say)
    kv_cache: str = "fp32"
    #: ``forward`` returns every position's logits ``[1, n, vocab]``, not the last one's
    full_logits: bool = False
    #: the positions each layer's cache holds (a windowed layer's ring: fewer; () not known)
    slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_seq_len is None:
            object.__setattr__(self, "max_seq_len", self.max_context)

    @property
    def seq_len(self) -> int:
        """``max_seq_len`` as an int."""
        return int(self.max_seq_len or self.max_context)

    def methods(self) -> dict[str, Any]:
        """Metadata method name -> its value (an int, a bool, or a tuple of ints)."""
        found: dict[str, Any] = {"get_max_seq_len": self.seq_len, "get_max_context_len": self.max_context,
                                 "get_vocab_size": self.vocab_size, "get_n_layers": self.n_layers}
        if self.bos_id is not None:
            found["get_bos_id"] = self.bos_id
        if self.eos_ids:
            found["get_eos_ids"] = self.eos_ids
        found.update({"use_kv_cache": True, "use_sdpa_with_kv_cache": False, "enable_dynamic_shape": True})
        return found

    def cache_bytes(self) -> int | None:
        """The cache's bytes (keys and values; int8: with a float32 scale per position and head),
        None where the program does not say its layers' shapes."""
        if not self.slots or len(self.cache) != len(self.slots) or self.kv_cache not in ("fp32", "int8"):
            return None
        per_value = (lambda dim: 4 * dim) if self.kv_cache == "fp32" else (lambda dim: dim + 4)
        return sum(2 * n * heads * per_value(dim) for n, (heads, dim) in zip(self.slots, self.cache))

    def __str__(self) -> str:
        logits = f"[1, n, {self.vocab_size}]" if self.full_logits else f"[1, {self.vocab_size}]"
        cache = f"{self.kv_cache} KV cache" if self.kv_cache else "KV cache"
        held = f"of {self.max_context} positions x {self.n_layers} layers"
        if self.slots and min(self.slots) < self.max_context:  # rings of sliding-window layers
            counts = {n: self.slots.count(n) for n in sorted(set(self.slots), reverse=True)}
            held = "of " + ", ".join(f"{n} positions x {k} layers" for n, k in counts.items()) + " (sliding windows)"
        size = self.cache_bytes()
        held += "" if size is None else f", {size / 1e6:.1f} MB"
        return (f"LLM program: forward(tokens [1, 1..{self.seq_len}], input_pos [1]) -> logits {logits}; {cache} "
                f"{held}; bos {self.bos_id}, eos {list(self.eos_ids)}")


def call_bound(token_sizes: tuple[int, ...]) -> int:
    """The most tokens a call of ``forward`` takes, from its ``tokens`` input's sizes (``[1, n]``
    at its bound). Not always ``get_max_seq_len``: ExecuTorch 1.4.1's recipe bounds the tokens
    at ``max_seq_length - 1`` (``examples/models/llama/model.py``) and reports
    ``max_seq_length`` (measured: 127 against 128), so a caller chunking by the metadata fails
    at its first full chunk."""
    if len(token_sizes) != 2 or token_sizes[1] < 1:
        raise XnnquantError(f"forward's tokens input has sizes {list(token_sizes)}: expected [1, n], n >= 1 "
                            "(ExecuTorch's LLM interface)")
    return int(token_sizes[1])


def add_metadata(builder: Any, info: LLMInfo) -> None:
    """The metadata methods of ``info`` (module docstring) in ``builder`` (a ``pte.ProgramBuilder``)."""
    from ..pte.pytree import constant_spec

    for name, value in info.methods().items():
        m = builder.method(name)
        items = list(value) if isinstance(value, tuple) else [value]
        for item in items:
            m.output(m.bool_value(item) if isinstance(item, bool) else m.int_value(int(item)))
        m.container = ("", constant_spec(list(items) if isinstance(value, tuple) else value))


def _ids(value: Any, what: str, vocab: int) -> tuple[int, ...]:
    """Token ids given as an int or a sequence of ints, each in ``[0, vocab)``."""
    items = [value] if arguments.is_plain_int(value) else value
    if not isinstance(items, (list, tuple)) or not all(arguments.is_plain_int(i) for i in items):
        raise XnnquantError(f"{what} must be a token id or a list of them: got {arguments.shown(value)}")
    for i in items:
        if not 0 <= int(i) < vocab:
            raise XnnquantError(f"{what} {int(i)} is not a token of the vocabulary: expected an id in [0, {vocab})")
    return tuple(int(i) for i in items)


def _model_facts(model: Any, family: Family) -> tuple[int, int | None, Any, int | None]:
    """(vocab size, largest position count or None, its eos ids as configured, bos id)."""
    from .decoder import Transformers

    if isinstance(family, Transformers):
        config = family.config
        generation = getattr(model, "generation_config", None)
        bos = getattr(generation, "bos_token_id", None) if generation is not None else None
        eos = getattr(generation, "eos_token_id", None) if generation is not None else None
        bos = getattr(config, "bos_token_id", None) if bos is None else bos
        eos = getattr(config, "eos_token_id", None) if eos is None else eos
        return int(config.vocab_size), getattr(config, "max_position_embeddings", None), eos, bos
    params = model.params
    return int(params.vocab_size), int(params.max_context_len), None, None


def _check_max_context(max_context: Any, limit: int | None, name: str) -> int:
    if not arguments.is_plain_int(max_context) or isinstance(max_context, bool) or int(max_context) < 2:
        raise XnnquantError(f"max_context must be an int >= 2 (the positions the KV cache holds): got "
                            f"{arguments.shown(max_context)}")
    if limit is not None and int(max_context) > int(limit):
        raise XnnquantError(f"max_context={int(max_context)} is beyond the {int(limit)} positions {name} was made "
                            f"for (its rotary or position tables): expected max_context <= {int(limit)}")
    return int(max_context)


def _check_max_seq_len(max_seq_len: Any, max_context: int) -> int:
    if max_seq_len is None:
        return min(DEFAULT_MAX_SEQ_LEN, max_context)
    if not arguments.is_plain_int(max_seq_len) or not 2 <= int(max_seq_len) <= max_context:
        raise XnnquantError(f"max_seq_len must be an int in [2, max_context={max_context}] (the most tokens one "
                            f"forward call takes; a longer prompt is fed in calls of max_seq_len): got "
                            f"{arguments.shown(max_seq_len)}")
    return int(max_seq_len)


def _check_kv_cache(kv_cache: Any) -> str:
    from .decoder import KV_CACHES

    return str(arguments.choice(arguments.spelling(kv_cache) or kv_cache, "kv_cache", KV_CACHES))


def _calibration_batches(calibration: Any, vocab: int, max_context: int) -> list[tuple[Any, Any]] | None:
    """Token-id tensors ``[1, n]`` as the Decoder's inputs, each a prompt at position 0."""
    import torch

    if calibration is None:
        return None
    if isinstance(calibration, (torch.Tensor, str, bytes)) or not isinstance(calibration, Iterable):
        raise XnnquantError(f"calibration must be an iterable of token-id tensors [1, n]: got "
                            f"{arguments.shown(calibration)}")
    batches = []
    for k, ids in enumerate(calibration):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 \
                or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= max_context or ids.is_sparse \
                or ids.device.type != "cpu":
            raise XnnquantError(f"calibration[{k}] must be a CPU int64 tensor of token ids, shape [1, n] with "
                                f"1 <= n <= max_seq_len={max_context} (one call): got {arguments.shown(ids)}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise XnnquantError(f"calibration[{k}] holds token ids outside the vocabulary [0, {vocab}): "
                                f"{int(ids.min())} .. {int(ids.max())}")
        batches.append((ids.to(torch.int64), torch.tensor([0])))
    if not batches:
        raise XnnquantError("calibration holds no batch: give token-id tensors, or calibration=None")
    return batches


def export_llm(model: Any, *, max_context: int, max_seq_len: int | None = None, kv_cache: str = "fp32",
               weights: Any = "auto", embeddings: Any = "int8", method: str | None = None,
               calibration: Iterable[Any] | None = None, progress: bool = True,
               state_dict: str | os.PathLike[str] | None = None, rotation: Any = None, fallback: Any = "auto",
               check: bool = True, bos_id: Any = None, eos_ids: Any = None, full_logits: bool = False,
               memory: Any = None) -> Any:
    """A causal LM as one ``.pte`` with ExecuTorch's LLM interface and a KV cache (module docstring).

    ``model``: a ``transformers`` causal LM in eval mode (any family whose attention goes
    through transformers' attention interface), or ExecuTorch's llama ``Transformer`` built
    with ``use_kv_cache=True``; float32.  ``max_context``: the positions the cache holds.
    ``max_seq_len``: the most tokens one call takes (ExecuTorch's name; default
    ``DEFAULT_MAX_SEQ_LEN`` = 128, or ``max_context`` if smaller): longer prompts go in calls
    of ``max_seq_len`` tokens, and the program's activations are planned for that many, so
    a phone's context costs only its cache.  Why 128: on SmolLM2-135M at ``max_context=2048``
    a 512-token prompt prefills as fast in calls of 32 tokens as in one call of 512 (within
    4%), while each token a call can take plans 26 KB more (128: 97.6 MB in all, the fp32
    cache 94.4 of them; 2048, a call as long as the context: 146.8 MB; ``docs/llm.md``).
    ``kv_cache``: the cache's layout, one of ``decoder.KV_CACHES`` (``"fp32"``; ``"int8"``:
    a scale per position and head).  ``weights``: the scheme of every linear layer,
    the LM head included (tied to the embedding table or not), as for ``xq.export``; or
    ``"auto:B"`` (``"auto"``, the default: ``mixed.DEFAULT_BITS``): a scheme per layer from
    its measured effect under B bits a weight, a head tied to an int8 table reading the
    table's codes (``mixed.py``; ``exported.plan`` says per layer what it got and why); a
    streaming export or ExecuTorch's llama ``Transformer`` takes qb4w:32 for every layer.
    ``embeddings``: the token table's (``"int8"``, ``"int4:G"``, or None for float32).
    ``method``: how scales are chosen (None: ``"range"`` under ``weights="auto"``, no weight
    clipped, which on SmolLM2-135M keeps more than ``"mse"`` (``docs/llm.md``); ``"mse"``, as
    ``xq.export``'s, with a scheme given); the activation-aware methods (``"gptq"``, ...) take
    ``calibration``, an iterable of token-id tensors ``[1, n]`` (each run as a prompt at
    position 0).  ``state_dict``: a safetensors file (or index) holding the weights of a
    model built on the meta device (a streaming export, as for ``xq.export``).
    ``rotation``: None, or ``"hadamard"``: the residual stream rotated, folded into the
    weights (``frontend/passes/rotation.py``), for int4 groups with fewer outliers.
    ``bos_id`` / ``eos_ids``: the runner's start and stop tokens (default: the model's
    generation config).  ``check``: the export's self-check, then the program run step by
    step (a prefill, two decode steps) against the module.  ``full_logits``: ``forward``
    returns every position's logits ``[1, n, vocab]`` (ExecuTorch's ``generate_full_logits``),
    for evaluating a text in calls of ``max_seq_len`` tokens (``xnnquant perplexity``); it
    plans ``max_seq_len x vocab`` more floats (25 MB for SmolLM2 at 128) and the runners
    still sample from the last position.  ``memory``: the memory of the phone the program is
    for (bytes, or ``"4GiB"``), as for ``xq.export``: a program whose planned memory (the
    cache, and the activations of a ``max_seq_len`` call) exceeds it is refused
    (``PlannedMemoryError``, saying the cache's share); None checks against this machine's, and
    the report says which.  A streaming export is checked when ``save`` has its bytes, before
    writing, and only against ``memory=``.

    Returns an ``Exported`` (``save``, ``to_pte``, its report) with ``llm``, an ``LLMInfo``.
    """
    from ..pte import runtime_log
    from ..pte.planned import memory_bytes
    from .mixed import parse_auto

    runtime_log.quiet_imports()  # before anything imports executorch (and torchao)
    import torch

    from ..frontend.api import export
    from .decoder import Decoder, Transformers, family_of

    family = family_of(model)
    if getattr(model, "training", False):
        raise XnnquantError(f"{type(model).__name__} is in training mode: call model.eval() before exporting")
    vocab, limit, configured_eos, configured_bos = _model_facts(model, family)
    max_context = _check_max_context(max_context, limit, type(model).__name__)
    max_seq_len = _check_max_seq_len(max_seq_len, max_context)
    kv_cache = _check_kv_cache(kv_cache)
    memory_bytes(memory)  # a spelling it cannot read is refused before anything runs
    full_logits = arguments.flag(full_logits, "full_logits")
    if full_logits and not isinstance(family, Transformers):
        raise XnnquantError(f"full_logits=True needs a transformers causal LM: {family.name}'s model returns the "
                            "logits it was built to (ExecuTorch's ModelArgs(generate_full_logits=True))")
    bos = None if bos_id is None and configured_bos is None else _ids(
        configured_bos if bos_id is None else bos_id, "bos_id", vocab)
    if bos is not None and len(bos) != 1:
        raise XnnquantError(f"bos_id must be one token id: got {list(bos)}")
    eos = () if eos_ids is None and configured_eos is None else _ids(
        configured_eos if eos_ids is None else eos_ids, "eos_ids", vocab)
    batches = _calibration_batches(calibration, vocab, max_seq_len)
    if method is None:  # "range" with the per-layer plan it was measured with (mixed.py), else xq.export's
        method = "range" if parse_auto(weights) is not None else "mse"
    weights, plan = _planned(model, family, weights, method, batches, embeddings, state_dict)
    decoder = Decoder(model, family, max_context, max_seq_len=max_seq_len, kv_cache=kv_cache, full_logits=full_logits)
    tokens = torch.export.Dim("tokens", min=1, max=max_seq_len)
    example = (torch.tensor([[0, min(1, vocab - 1)]], dtype=torch.int64), torch.tensor([0]))
    with family.using(model), warnings.catch_warnings():
        # ExecuTorch's llama attention still calls torch._check_is_size (deprecated in torch 2.13)
        warnings.filterwarnings("ignore", message="_check_is_size will be removed", category=FutureWarning)
        runtime_log.quiet()  # the kernels' log lines a correct export makes (pte/runtime_log.py)
        exported = export(decoder, example, weights=weights, method=method, calibration=batches,
                          fallback=fallback, progress=progress, state_dict=state_dict, check=check,
                          dynamic_shapes=({1: tokens}, None), embeddings=embeddings, rotation=rotation,
                          memory=memory, _memory_hint=_memory_hint(decoder),
                          _weight_prefix="model.")  # a checkpoint names the model's own tensors
        info = LLMInfo(max_context, vocab, decoder.layers or int(getattr(model, "n_layers", 0)),
                       None if bos is None else bos[0], eos, family.name, tuple(family.cache_shapes(model)),
                       max_seq_len=max_seq_len, kv_cache=kv_cache, full_logits=full_logits,
                       slots=tuple(layer.size for layer in decoder.plans))
        add_metadata(exported.builder, info)
        exported._pte = None  # written again with the metadata methods
        exported.llm = info
        exported.plan = plan
        if check and state_dict is None:
            _check_steps(decoder, exported, vocab)
    return exported


def _memory_hint(decoder: Decoder) -> str:
    """What ends a refusal of an LLM program's planned memory: its KV cache's share (the cache
    buffers' bytes: keys, values and int8 scales; not said where the model keeps its own cache)
    and what to lower (``kv_cache='int8'`` too, where the cache is ours and float32)."""
    buffers = decoder.cache_buffers()
    cache = sum(b.numel() * b.element_size() for b in buffers)
    share = (f"the KV cache takes {cache / 2**20:.4g} MiB (max_context={decoder.max_context}, "
             f"kv_cache={decoder.kv_cache!r})" if buffers else f"the KV cache holds max_context={decoder.max_context} "
             "positions")
    int8 = ", or take kv_cache='int8'" if buffers and decoder.kv_cache == "fp32" else ""
    return (f"; of that, {share} and the activations are planned for a call of max_seq_len={decoder.max_seq_len} "
            f"tokens: lower either{int8}")


def _planned(model: Any, family: Family, weights: Any, method: str, batches: list[tuple[Any, Any]] | None,
             embeddings: Any, state_dict: Any) -> tuple[Any, list[Any] | None]:
    """``weights`` as the export takes it, and the plan's rows: ``weights="auto:B"`` becomes a
    ``LayerPlan`` (``mixed.plan_weights``, on the calibration batches' tokens or the model's
    own); any other value is kept, with no rows."""
    from ..frontend.weights import EmbeddingScheme
    from .decoder import Transformers
    from .emulate import is_tied
    from .mixed import CANDIDATES, parse_auto, plan_weights

    bits = parse_auto(weights)
    if bits is None:
        return weights, None
    if state_dict is not None or not isinstance(family, Transformers):  # no weights to measure, or no model to run
        if ":" in str(weights):  # a budget asked for, not the default's: say it is not followed
            from ..frontend.report import warn_unused

            why = "a streaming export has no weights in memory to measure" if state_dict is not None else \
                f"{type(model).__name__} is no transformers model to measure"
            warn_unused(f"weights={weights!r} is not followed: {why}; every linear layer takes {CANDIDATES[0]} "
                        "(load the model in memory to plan by measured effect)")
        return CANDIDATES[0], None
    table = EmbeddingScheme.parse(embeddings)
    tokens = None if batches is None else [ids for ids, _ in batches]
    return plan_weights(model, bits, method, tokens, prefix="model.",
                        head_reads_table=is_tied(model) and table is not None and table.bits == 8)


#: (tokens, position) of the steps ``_check_steps`` runs: a prompt of 3 (at most max_seq_len),
#: then 2 decode steps.
CHECK_STEPS = ((3, 0), (1, 3), (1, 4))
#: How far the logits of a quantized program called step by step may be from the same
#: program's on the whole prompt at once (RMS, relative to the logits' RMS).  Both quantize
#: each token's activations alone (per-token int8), so they differ only where float sums
#: taken in another order (other tiles, another attention length) move a code at a rounding
#: tie, and 30 layers carry that on: measured 0.02 to 0.053 on SmolLM2-135M at qb4w:32.  The
#: same steps with the cache not carried (a fresh program) were 0.34 and 0.76 off.
STEP_TOLERANCE = 0.2
#: ... and the step's error must be below this share of the error of the same step run on a
#: fresh load (its cache without the earlier tokens): a cache carried in part (some layers
#: only) falls between the two.
BLIND_SHARE = 0.5


def _relative_rms(got: Any, want: Any) -> float:
    """RMS of ``got - want`` relative to ``want``'s RMS (the SQNR's amplitude ratio)."""
    from ..metrics import sqnr_db

    return float(10.0 ** (-sqnr_db(want, got) / 20.0))


def _check_steps(decoder: Decoder, exported: Any, vocab: int) -> None:
    """The program called step by step (``CHECK_STEPS``, the prompt cut to ``max_seq_len``):
    its cache must carry the state from one call to the next.  A float program's logits are
    judged against the module's eager forward called so; a quantized program's against its
    own on the whole prompt (in calls of ``max_seq_len``), from a fresh load
    (``STEP_TOLERANCE``).  A ``full_logits`` program is judged on its last position."""
    import numpy as np
    import torch

    from ..errors import SelfCheckError
    from ..frontend.caller import buffers_kept
    from ..frontend.selfcheck import relative_error

    prompt = min(CHECK_STEPS[0][0], decoder.max_seq_len)
    planned = [(prompt, 0)] + [(n, pos - CHECK_STEPS[0][0] + prompt) for n, pos in CHECK_STEPS[1:]]
    steps = [(n, pos) for n, pos in planned if pos + n <= decoder.max_context]
    total = steps[-1][0] + steps[-1][1]
    ids = torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(0))
    session = exported.session()
    quantized = str(exported.weights) != "fp32" or exported.embeddings is not None

    def last(logits: Any) -> Any:
        return logits[:, -1] if logits.ndim == 3 else logits

    def whole(n: int) -> Any:  # ids[:, :n] from a fresh load, in calls of max_seq_len
        fresh = exported.session()
        for begin in range(0, n, decoder.max_seq_len):
            (out,) = fresh.run(ids[:, begin:min(n, begin + decoder.max_seq_len)], torch.tensor([begin]))
        return last(out)

    caches = decoder.cache_buffers()
    with buffers_kept(tensors=caches), torch.no_grad():
        for buffer in caches:
            buffer.zero_()
        for n, pos in steps:
            (got,) = session.run(ids[:, pos:pos + n], torch.tensor([pos]))
            if quantized:
                got = last(got)
                want = whole(pos + n)
                error = _relative_rms(got, want)
                bound = STEP_TOLERANCE
                how = "RMS, relative to the logits' RMS, from the same program on the whole prompt"
                if pos > 0:  # the control: the same step on a fresh load, whose cache holds no earlier token
                    (blind,) = exported.session().run(ids[:, pos:pos + n], torch.tensor([pos]))
                    bound = min(bound, BLIND_SHARE * _relative_rms(last(blind), want))
                    how += f", and below {BLIND_SHARE} of a fresh load's error on the same step"
            else:
                want = decoder(ids[:, pos:pos + n], torch.tensor([pos])).numpy()
                error = relative_error(got, want, float(np.max(np.abs(want))))
                bound, how = 1e-4, "relative to their largest magnitude, from the module's"
            if not error <= bound:
                raise SelfCheckError(
                    f"self-check failed: the program's logits at positions {pos}..{pos + n - 1}, called after the "
                    f"earlier steps, differ by {error:.3g} ({how}; bound {bound:g}): its KV cache does not carry "
                    "the state from one call to the next; please report it")
