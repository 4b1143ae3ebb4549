"""The module an LLM's program is exported from: ExecuTorch's LLM interface over one cache layout.

``Decoder(model, max_context)`` wraps a causal LM and holds its KV cache as buffers, which
``xq.export`` makes method state (``frontend/program.py``)::

    forward(tokens int64 [1, n], input_pos int64 [1]) -> logits float32 [1, vocab]
        n in [1, max_context]: a prompt (prefill) or one token (decode), at positions
        input_pos .. input_pos + n - 1; the logits of the last one

    cache       per attention layer l: cache_k{l}, cache_v{l} float32 [1, max_context, Hkv, D]
                (position-major, as ExecuTorch's llama:: kernels read them)
    per call    positions = arange(n) + input_pos
                k, v [1, Hkv, n, D] of layer l -> cache_k{l}[0, positions] = k (index_copy_:
                written in place in the program, ``aten::index_put_``, which fails the call
                for a position outside [0, max_context))
                attention: llama::custom_sdpa(q [1, n, Hq, D], cache_k{l}, cache_v{l},
                input_pos, causal, scale): query i attends to positions 0 .. input_pos + i,
                grouped-query heads read their shared key/value head

Adapters (one ``Family`` each) put a model's own computation around that cache:

* ``Transformers``: any ``transformers`` causal LM whose attention goes through
  transformers' attention interface (Llama, SmolLM, Qwen2/3, Mistral, Phi-3, Gemma, ...).
  While the model runs, its attention implementation is ``"xnnquant"`` (registered with
  ``AttentionInterface``; no mask function, so transformers builds no mask) and its cache
  a ``transformers.Cache`` whose layers write into the Decoder's buffers; ``Decoder.using``
  switches the implementation for the time of the export and puts the model's back.
* ``ExecuTorchLlama``: ExecuTorch's own llama ``Transformer`` built with ``use_kv_cache``:
  its cache is its own buffers, its attention its own (``forward(tokens, {"input_pos": ...})``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import XnnquantError, missing_extra

#: The name our attention function is registered under in transformers' ``AttentionInterface``.
ATTENTION = "xnnquant"
#: The KV cache layouts (``Decoder(kv_cache=)``).
KV_CACHES = ("fp32",)


@dataclass(frozen=True)
class Step:
    """What the cache and attention of one forward call need: the first position (a size the
    program reads from ``input_pos``), the positions written (int64 ``[n]``) and the Decoder
    whose buffers are the cache."""

    start: Any
    positions: torch.Tensor
    decoder: Decoder


#: The step being run (set by ``Decoder.forward`` in the thread that runs it).
_STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("xnnquant_llm_step")


def _load_llama_kernels() -> None:
    from ..pte.quantized import load_llama_kernels

    load_llama_kernels()  # torch's llama:: operators, and the runtime's kernels for them


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the Decoder's cache: ``key`` / ``value`` are the
    layer's cache buffers (``_Layer.update``), the query ``[1, Hq, n, D]``; returns
    ``[1, n, Hq, D]`` as transformers' own implementations do."""
    step = _STEP.get()
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise XnnquantError(f"{type(module).__name__} computes attention with {name}=: ExecuTorch's attention "
                                "kernel (llama::custom_sdpa) has no such term; expected plain causal attention")
    window = kwargs.get("sliding_window")
    if window is not None and window < step.decoder.max_context:
        raise XnnquantError(f"{type(module).__name__} attends to a sliding window of {window} positions, shorter "
                            f"than max_context={step.decoder.max_context}: expected max_context <= {window}")
    if dropout:
        raise XnnquantError(f"attention dropout {dropout} in {type(module).__name__}: export the model in eval mode")
    out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, step.start, None, 0.0, True, scaling)
    return out, None


@functools.cache
def _cache_classes() -> tuple[type, type]:
    """(the cache layer class, the cache class): a ``transformers.Cache`` over the Decoder's
    buffers, made once (transformers is imported on first use)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class XnnquantCacheLayer(CacheLayerMixin):
        """One layer: writes a call's keys and values into the Decoder's buffers."""

        is_compileable = True
        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.cache_k, self.cache_v = keys, values
            self.keys, self.values = keys, values
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            positions = _STEP.get().positions
            self.cache_k.index_copy_(1, positions, key_states.transpose(1, 2))
            self.cache_v.index_copy_(1, positions, value_states.transpose(1, 2))
            return self.cache_k, self.cache_v

        def get_seq_length(self) -> Any:
            return _STEP.get().start

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return int(self.cache_k.shape[1]), 0

        def get_max_length(self) -> int:
            return int(self.cache_k.shape[1])

    class XnnquantCache(Cache):
        def __init__(self, decoder: Decoder) -> None:
            layers: list[Any] = [XnnquantCacheLayer(getattr(decoder, f"cache_k{i}"), getattr(decoder, f"cache_v{i}"))
                      for i in range(decoder.layers)]
            super().__init__(layers=layers)
            self.max_context = decoder.max_context

        def get_seq_length(self, layer_idx: int = 0) -> Any:
            return _STEP.get().start

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.max_context, 0

    return XnnquantCacheLayer, XnnquantCache


def _cache(decoder: Decoder) -> Any:
    """A ``transformers.Cache`` over the Decoder's buffers."""
    return _cache_classes()[1](decoder)


class Family:
    """How one kind of model runs a step over the Decoder's cache."""

    name = "?"

    def cache_shapes(self, model: Any) -> list[tuple[int, int]]:
        """(key/value heads, head dim) of each attention layer (the Decoder's buffers)."""
        return []

    def logits(self, decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor,
               input_pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @contextlib.contextmanager
    def using(self, model: Any) -> Iterator[None]:
        """While exporting: the model set up to run over the Decoder's cache, put back after."""
        yield


class Transformers(Family):
    """A ``transformers`` causal LM (module docstring)."""

    name = "transformers"

    def __init__(self, model: Any) -> None:
        self.config = model.config.get_text_config()
        for name in ("attn_logit_softcapping", "final_attn_softcapping"):
            if getattr(self.config, name, None) is not None:
                raise XnnquantError(f"{type(model).__name__} caps its attention scores ({name}="
                                    f"{getattr(self.config, name)}): ExecuTorch's attention kernel "
                                    "(llama::custom_sdpa) has no such term; expected plain causal attention")

    def cache_shapes(self, model: Any) -> list[tuple[int, int]]:
        from transformers.configuration_utils import get_head_shapes

        layers = int(self.config.num_hidden_layers)
        try:
            heads, dim = get_head_shapes(self.config)
        except (AttributeError, TypeError):
            raise XnnquantError(f"{type(model).__name__}'s config does not give its attention heads "
                                "(num_attention_heads / num_key_value_heads / head_dim): expected a decoder whose "
                                "layers attend with a KV cache") from None
        per_heads = heads if isinstance(heads, list) else [heads] * layers
        per_dim = dim if isinstance(dim, list) else [dim] * layers
        return [(int(h), int(d)) for h, d in zip(per_heads, per_dim)]

    def logits(self, decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor,
               input_pos: torch.Tensor) -> torch.Tensor:
        every = decoder.full_logits  # logits_to_keep=0: every position's
        out = decoder.model(input_ids=tokens, position_ids=positions.unsqueeze(0), past_key_values=_cache(decoder),
                            use_cache=True, logits_to_keep=0 if every else 1)
        return out.logits if every else out.logits[:, -1, :]

    @contextlib.contextmanager
    def using(self, model: Any) -> Iterator[None]:
        from transformers import AttentionInterface

        _load_llama_kernels()
        AttentionInterface.register(ATTENTION, attention)
        before = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION)
        try:
            yield
        finally:
            model.set_attn_implementation(before)


class ExecuTorchLlama(Family):
    """ExecuTorch's llama ``Transformer`` (examples/models/llama) with its own KV cache."""

    name = "executorch llama"

    def logits(self, decoder: Decoder, tokens: torch.Tensor, positions: torch.Tensor,
               input_pos: torch.Tensor) -> torch.Tensor:
        out = decoder.model(tokens, {"input_pos": input_pos})
        logits = out[0] if isinstance(out, tuple) else out
        return logits if logits.dim() == 2 else logits[:, -1, :]


def family_of(model: Any) -> Family:
    """The ``Family`` of ``model``, or ``XnnquantError`` saying what is expected."""
    cls = type(model)
    if any(c.__module__.startswith("executorch.examples.models.llama") and c.__name__ == "Transformer"
           for c in cls.__mro__):
        if not getattr(model, "use_kv_cache", False):
            raise XnnquantError("ExecuTorch's llama Transformer was built without a KV cache: build it with "
                                "ModelArgs(use_kv_cache=True, enable_dynamic_shape=True)")
        return ExecuTorchLlama()
    try:
        from transformers import PreTrainedModel
    except ImportError:
        raise missing_extra("models", "transformers", "exporting a transformers model") from None
    if not isinstance(model, PreTrainedModel):
        raise XnnquantError(f"model must be a transformers causal LM (AutoModelForCausalLM.from_pretrained(...)) or "
                            f"ExecuTorch's llama Transformer: got {cls.__name__}")
    if model.get_output_embeddings() is None or not hasattr(model.config, "num_hidden_layers"):
        raise XnnquantError(f"{cls.__name__} has no language-model head (get_output_embeddings() is None): expected "
                            "a causal LM such as LlamaForCausalLM, not the bare decoder or an encoder")
    if not getattr(model, "_supports_attention_backend", False):
        raise XnnquantError(f"{cls.__name__} does not compute its attention through transformers' attention "
                            "interface, so its cache cannot be ExecuTorch's: expected a model family with "
                            "AttentionInterface support (Llama, Qwen2/3, Mistral, Phi-3, Gemma, ...)")
    if getattr(model.config, "is_encoder_decoder", False):
        raise XnnquantError(f"{cls.__name__} is an encoder-decoder model: expected a decoder-only causal LM")
    return Transformers(model)


class Decoder(torch.nn.Module):
    """``forward(tokens, input_pos) -> logits`` over a KV cache of ``max_context`` positions
    (module docstring)."""

    def __init__(self, model: torch.nn.Module, family: Family, max_context: int, *, max_seq_len: int | None = None,
                 kv_cache: str = "fp32", full_logits: bool = False) -> None:
        super().__init__()
        self.full_logits = full_logits  # forward returns [1, n, vocab], every position's (Transformers only)
        self.model = model
        self.family = family
        self.max_context = max_context
        self.max_seq_len = max_context if max_seq_len is None else max_seq_len
        if kv_cache not in KV_CACHES:
            raise XnnquantError(f"kv_cache must be one of {', '.join(map(repr, KV_CACHES))}: got {kv_cache!r}")
        self.kv_cache = kv_cache
        shapes = family.cache_shapes(model)
        self.layers = len(shapes)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))  # meta: streamed, zeros
        for i, (heads, dim) in enumerate(shapes):
            self.register_buffer(f"cache_k{i}", torch.zeros(1, max_context, heads, dim, device=device),
                                 persistent=False)
            self.register_buffer(f"cache_v{i}", torch.zeros(1, max_context, heads, dim, device=device),
                                 persistent=False)
        self.training = False  # the model's own flag is the model's (export refuses training mode)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check_is_size(start)
        torch._check(start + n <= self.max_context)
        torch._check(n <= self.max_seq_len)
        positions = torch.arange(n, dtype=torch.int64, device=input_pos.device) + input_pos
        token = _STEP.set(Step(start, positions, self))
        try:
            return self.family.logits(self, tokens, positions, input_pos)
        finally:
            _STEP.reset(token)
