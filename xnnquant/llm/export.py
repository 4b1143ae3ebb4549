"""``xq.export_llm``: a causal LM with a KV cache to one ``.pte`` that ExecuTorch's LLM runners run.

The program (``decoder.py`` draws ``forward`` and its cache)::

    forward(tokens int64 [1, n], input_pos int64 [1]) -> logits float32 [1, vocab]
        n in [1, max_context]: prefill and decode in one method; state: the KV cache
    get_max_seq_len        Int   max_context (tokens one call takes)
    get_max_context_len    Int   max_context (positions the cache holds)
    get_vocab_size         Int   the model's vocabulary
    get_n_layers           Int   its layers
    get_bos_id             Int   (when the model has one)
    get_eos_ids            Int x k, one output each
    use_kv_cache           Bool  true
    use_sdpa_with_kv_cache Bool  false (the cache update and attention are separate calls)
    enable_dynamic_shape   Bool  true (a prompt is one call)

Each metadata method is ExecuTorch's constant method: no inputs, no instructions, its
outputs constant values (``exir/emit/_emitter.py``'s ``_emit_prim_getters``), read by
``TextLLMRunner`` (``extension/llm/runner/llm_runner_helper.cpp``) and ``llama_main``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import arguments
from ..errors import XnnquantError

if TYPE_CHECKING:
    from .decoder import Decoder, Family

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

    def methods(self) -> dict[str, Any]:
        """Metadata method name -> its value (an int, a bool, or a tuple of ints)."""
        found: dict[str, Any] = {"get_max_seq_len": self.max_context, "get_max_context_len": self.max_context,
                                 "get_vocab_size": self.vocab_size, "get_n_layers": self.n_layers}
        if self.bos_id is not None:
            found["get_bos_id"] = self.bos_id
        if self.eos_ids:
            found["get_eos_ids"] = self.eos_ids
        found.update({"use_kv_cache": True, "use_sdpa_with_kv_cache": False, "enable_dynamic_shape": True})
        return found

    def __str__(self) -> str:
        return (f"LLM program: forward(tokens [1, 1..{self.max_context}], input_pos [1]) -> logits [1, "
                f"{self.vocab_size}]; KV cache of {self.max_context} positions x {self.n_layers} layers; bos "
                f"{self.bos_id}, eos {list(self.eos_ids)}")


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
                                f"1 <= n <= max_context={max_context}: got {arguments.shown(ids)}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise XnnquantError(f"calibration[{k}] holds token ids outside the vocabulary [0, {vocab}): "
                                f"{int(ids.min())} .. {int(ids.max())}")
        batches.append((ids.to(torch.int64), torch.tensor([0])))
    if not batches:
        raise XnnquantError("calibration holds no batch: give token-id tensors, or calibration=None")
    return batches


def export_llm(model: Any, *, max_context: int, weights: Any = "qb4w:32", embeddings: Any = "int8",
               method: str = "mse", calibration: Iterable[Any] | None = None, progress: bool = True,
               state_dict: str | os.PathLike[str] | None = None, rotation: Any = None, fallback: Any = "auto",
               check: bool = True, bos_id: Any = None, eos_ids: Any = None) -> Any:
    """A causal LM as one ``.pte`` with ExecuTorch's LLM interface and a KV cache (module docstring).

    ``model``: a ``transformers`` causal LM in eval mode (any family whose attention goes
    through transformers' attention interface), or ExecuTorch's llama ``Transformer`` built
    with ``use_kv_cache=True``; float32.  ``max_context``: the positions the cache holds
    (and the most tokens one call takes).  ``weights``: the scheme of every linear layer,
    the LM head included (tied to the embedding table or not), as for ``xq.export``.
    ``embeddings``: the token table's (``"int8"``, ``"int4:G"``, or None for float32).
    ``method``: how scales are chosen; the activation-aware methods (``"gptq"``, ...) take
    ``calibration``, an iterable of token-id tensors ``[1, n]`` (each run as a prompt at
    position 0).  ``state_dict``: a safetensors file (or index) holding the weights of a
    model built on the meta device (a streaming export, as for ``xq.export``).
    ``rotation``: None, or ``"hadamard"``: the residual stream rotated, folded into the
    weights (``frontend/passes/rotation.py``), for int4 groups with fewer outliers.
    ``bos_id`` / ``eos_ids``: the runner's start and stop tokens (default: the model's
    generation config).  ``check``: the export's self-check, then the program run step by
    step (a prefill, two decode steps) against the module.

    Returns an ``Exported`` (``save``, ``to_pte``, its report) with ``llm``, an ``LLMInfo``.
    """
    import torch

    from ..frontend.api import export
    from .decoder import Decoder, family_of

    family = family_of(model)
    if getattr(model, "training", False):
        raise XnnquantError(f"{type(model).__name__} is in training mode: call model.eval() before exporting")
    vocab, limit, configured_eos, configured_bos = _model_facts(model, family)
    max_context = _check_max_context(max_context, limit, type(model).__name__)
    bos = None if bos_id is None and configured_bos is None else _ids(
        configured_bos if bos_id is None else bos_id, "bos_id", vocab)
    if bos is not None and len(bos) != 1:
        raise XnnquantError(f"bos_id must be one token id: got {list(bos)}")
    eos = () if eos_ids is None and configured_eos is None else _ids(
        configured_eos if eos_ids is None else eos_ids, "eos_ids", vocab)
    batches = _calibration_batches(calibration, vocab, max_context)
    decoder = Decoder(model, family, max_context)
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    example = (torch.tensor([[0, min(1, vocab - 1)]], dtype=torch.int64), torch.tensor([0]))
    with family.using(model):
        exported = export(decoder, example, weights=weights, method=method, calibration=batches,
                          fallback=fallback, progress=progress, state_dict=state_dict, check=check,
                          dynamic_shapes=({1: tokens}, None), embeddings=embeddings, rotation=rotation,
                          _weight_prefix="model.")  # a checkpoint names the model's own tensors
        info = LLMInfo(max_context, vocab, decoder.layers or int(getattr(model, "n_layers", 0)),
                       None if bos is None else bos[0], eos, family.name, tuple(family.cache_shapes(model)))
        add_metadata(exported.builder, info)
        exported._pte = None  # written again with the metadata methods
        exported.llm = info
        if check and state_dict is None:
            _check_steps(decoder, exported, vocab)
    return exported


#: (tokens, position) of the steps ``_check_steps`` runs: a prompt of 3, then 2 decode steps.
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
    """The program called step by step (``CHECK_STEPS``): its cache must carry the state from
    one call to the next.  A float program's logits are judged against the module's eager
    forward called so; a quantized program's against its own on the whole prompt at once,
    from a fresh load (``STEP_TOLERANCE``)."""
    import numpy as np
    import torch

    from ..errors import SelfCheckError
    from ..frontend.caller import buffers_kept
    from ..frontend.selfcheck import relative_error

    steps = [(n, pos) for n, pos in CHECK_STEPS if pos + n <= decoder.max_context]
    total = steps[-1][0] + steps[-1][1]
    ids = torch.randint(0, vocab, (1, total), generator=torch.Generator().manual_seed(0))
    session = exported.session()
    quantized = str(exported.weights) != "fp32" or exported.embeddings is not None
    caches = [buffer for name, buffer in decoder.named_buffers() if name.startswith("cache_")]
    with buffers_kept(tensors=caches), torch.no_grad():
        for buffer in caches:
            buffer.zero_()
        for n, pos in steps:
            (got,) = session.run(ids[:, pos:pos + n], torch.tensor([pos]))
            if quantized:
                (want,) = exported.session().run(ids[:, :pos + n], torch.tensor([0]))
                error = _relative_rms(got, want)
                bound = STEP_TOLERANCE
                how = "RMS, relative to the logits' RMS, from the same program on the whole prompt"
                if pos > 0:  # the control: the same step on a fresh load, whose cache holds no earlier token
                    (blind,) = exported.session().run(ids[:, pos:pos + n], torch.tensor([pos]))
                    bound = min(bound, BLIND_SHARE * _relative_rms(blind, want))
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
