"""The module an LLM's program is exported from: ExecuTorch's LLM interface over one cache layout.

``Decoder(model, family, max_context, max_seq_len=, kv_cache=)`` wraps a causal LM and holds
its KV cache as buffers, which ``xq.export`` makes method state (``frontend/program.py``)::

    forward(tokens int64 [1, n], input_pos int64 [1]) -> logits float32 [1, vocab]
        n in [1, max_seq_len]: a prompt chunk (prefill) or one token (decode), at positions
        input_pos .. input_pos + n - 1 (below max_context); the logits of the last one

Each attention layer l has a ``LayerCache`` plan: S positions, and the window W it attends
to (None: every earlier position)::

    full layer       S = max_context; position p in slot p
    windowed layer   S = min(max_context, W + max_seq_len - 1), a ring: position p in slot
                     p % S.  A call's n queries need the W - 1 positions before the first and
                     the n it writes: W + n - 1 <= S slots, so no write evicts a key that a
                     query of the same call reads

    kv_cache="fp32"  cache_k{l}, cache_v{l} float32 [1, S, Hkv, D] (position-major, as
                     ExecuTorch's llama:: kernels read them)
    kv_cache="int8"  cache_k{l}, cache_v{l} int8 [1, Hkv, S, D] (head-major: a head's
                     positions are one [S, D] matrix), and cache_k_scale{l},
                     cache_v_scale{l} float32 [1, Hkv, 1, S] (a head's scales, one row):
                     per position and head, scale = max(max|x|, FLT_MIN) / 127 over the
                     head's D values, code = round_half_even(x / scale), |code| <= 127

                         cache_k{l}[0, h]        cache_k_scale{l}[0, h, 0]
                         slot 0   c c c ... c    s0
                         slot 1   c c c ... c    s1     x[slot, d] = c[slot, d] * s[slot]
                         ...      (D codes)      ...
                         slot S-1 c c c ... c    sS-1

    per call         positions = arange(n) + input_pos; slots = positions (full) or
                     positions % S (ring); k, v [1, Hkv, n, D] -> cache[0, slots] = k
                     (fp32), cache[0, :, slots] = codes and scale[0, :, 0, slots] = scales
                     (int8) (index_copy_: written in place, ``aten::index_put_``)

Attention, query i at position q_i = input_pos + i::

    full layer       llama::custom_sdpa(q [1, n, Hq, D], K, V, input_pos, causal): keys
                     0 .. q_i (K, V: the cache)
    windowed layer   llama::custom_sdpa(q, K[:U], V[:U], mask [n, U]) over the U = min(input_pos
                     + n, S) slots written so far (all S once the ring wraps); slot s holds
                     position P(s) = last - ((last - s) mod S), last = input_pos + n - 1, and
                     mask[i, s] = 0 where P(s) >= 0 and 0 <= q_i - P(s) < W, else -inf
    soft-capped      (Gemma 2) computed with plain operators over the whole cache (full layers:
                     the positions not yet written masked), softmax(cap * tanh(q k^T *
                     scale / cap) + mask) v

    int8 cache       (every layer) in XNNPACK, over the L slots read (full: input_pos + n;
                     ring: as above; soft-capped: all S), the query heads of a group Q
                     [Hkv, rep, n, D] (rep = Hq / Hkv) against their key/value head:
                         scores = (Q @ float(codes_k)^T) * scale_k * scaling   [Hkv, rep, n, L]
                         out    = (softmax(scores + mask) * scale_v) @ float(codes_v)
                     (soft-capped: cap * tanh(. / cap) before the mask; mask [n, L] as above):
                     each call converts the codes it reads to float32 once and multiplies
                     them as batch matrix products; a scale multiplies a score or a weight,
                     not D values.  No llama:: kernel

    masks            a ring's: 0 or -inf as above, made once a call for the layers with that
                     ring (ExecuTorch's portable kernels compute it).  A full layer's (int8
                     cache, soft-capped): made in the layer's own delegate from two vectors
                     the layers share, rows = q_i * B [n, 1] and cols = j * B [1, L], B = 2**100:
                         mask = clamp(rows - cols, -B, 0)    0 where j <= q_i, else -B
                     exact (integers below 2**24 times a power of two), one XNNPACK subtract
                     a layer, not a float32 [n, L] held through every layer (1 MB at 128 x
                     2048).  -B wipes a score as -inf does on any CPU: every x86 variant of
                     XNNPACK's softmax exp (f32-raddstoreexpminusmax: scalar, SSE2, AVX2,
                     AVX256SKX, AVX-512) sets its result to +0 below -87.3

grouped-query heads read their shared key/value head.

Adapters (one ``Family`` each) put a model's own computation around that cache:

* ``Transformers``: any ``transformers`` causal LM whose attention goes through
  transformers' attention interface (Llama, SmolLM, Qwen2/3, Mistral, Phi-3, Gemma 1-3,
  StableLM, ...).  While the model runs, its attention implementation is ``"xnnquant"``
  (registered with ``AttentionInterface``; no mask function, so transformers builds no
  mask) and its cache a ``transformers.Cache`` whose layers write into the Decoder's
  buffers; ``Decoder.using`` switches the implementation for the time of the export and
  puts the model's back.
* ``Falcon``: transformers' Falcon, whose attention is its own code: its attention modules'
  ``forward`` is replaced for the time of the export by one that projects, rotates and
  calls the attention above (rotary Falcons; ALiBi ones are refused).
* ``ExecuTorchLlama``: ExecuTorch's own llama ``Transformer`` built with ``use_kv_cache``:
  its cache is its own buffers, its attention its own (``forward(tokens, {"input_pos": ...})``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..constants import FLT_MIN
from ..errors import XnnquantError, missing_extra

#: The name our attention function is registered under in transformers' ``AttentionInterface``.
ATTENTION = "xnnquant"
#: The KV cache layouts (``Decoder(kv_cache=)``, module docstring).
KV_CACHES = ("fp32", "int8")
#: Largest magnitude of an int8 cache code (symmetric: -127 .. 127).
INT8_CODE_MAX = 127


@dataclass(frozen=True)
class LayerCache:
    """The cache plan of one attention layer (module docstring): key/value heads, head dim,
    the positions it holds and the window it attends to (None: every earlier position)."""

    heads: int
    dim: int
    size: int
    window: int | None = None


def plan_layers(shapes: list[tuple[int, int]], windows: list[int | None], max_context: int,
                max_seq_len: int) -> list[LayerCache]:
    """One ``LayerCache`` per layer: full, or a ring of ``window + max_seq_len - 1`` positions
    for a layer whose window is shorter than the context."""
    plans = []
    for (heads, dim), window in zip(shapes, windows):
        if window is None or window >= max_context:
            plans.append(LayerCache(heads, dim, max_context))
        else:
            plans.append(LayerCache(heads, dim, min(max_context, window + max_seq_len - 1), window))
    return plans


@dataclass
class Step:
    """What the cache and attention of one forward call need: the first position (a size the
    program reads from ``input_pos``), the positions written (int64 ``[n]``), the Decoder
    whose buffers are the cache, and the keys and values the last cache update gave
    (``read``: layer index -> (K, V) float32 ``[1, L, Hkv, D]``; an int8 cache's (codes_k,
    scale_k, codes_v, scale_v), ``[1, Hkv, L, D]`` and ``[1, Hkv, 1, L]``), and the masks
    made so far (``masks``: a key of what they depend on -> mask, or the two vectors a full
    layer's int8-cache mask is made from; the layers of a model that attend alike share
    them)."""

    start: Any
    positions: torch.Tensor
    decoder: Decoder
    read: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    last_layer: int = -1
    masks: dict[tuple[Any, ...], Any] = field(default_factory=dict)


#: The step being run (set by ``Decoder.forward`` in the thread that runs it).
_STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("xnnquant_llm_step")


def _load_llama_kernels() -> None:
    from ..pte.quantized import load_llama_kernels

    load_llama_kernels()  # torch's llama:: operators, and the runtime's kernels for them


#: 1.5 * 2**23: a float32 |y| < 2**22 plus this, minus this, is y rounded half to even (the sum's
#: last bit is worth 1), computed by XNNPACK's add and subtract (its graph has no rounding node)
ROUNDER = 12582912.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 ``[..., D]`` -> (codes int8 ``[..., D]``, scales float32 ``[..., 1]``), one
    scale per vector of D (module docstring): scale = max(max|x|, FLT_MIN) / 127 (an all-zero
    vector: codes 0), code = round_half_even(x / scale)."""
    peak = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=float(FLT_MIN))
    scale = peak / INT8_CODE_MAX
    codes = torch.clamp((x / scale + ROUNDER) - ROUNDER, -INT8_CODE_MAX, INT8_CODE_MAX).to(torch.int8)
    return codes, scale


def ring_mask(step: Step, size: int, window: int, n: int, used: Any = None) -> torch.Tensor:
    """float32 ``[n, used]``: 0 where query i may read slot s (of the first ``used``, default
    all) of a ring of ``size`` slots with a window of ``window`` positions, -inf elsewhere
    (module docstring)."""
    last = step.start + n - 1
    slots = torch.arange(size if used is None else used, dtype=torch.int64,
                         device=step.positions.device)  # not the default device: meta
    held = last - torch.remainder(last - slots, size)  # the position in each slot
    queries = step.positions.unsqueeze(1)
    age = queries - held.unsqueeze(0)
    allowed = (held.unsqueeze(0) >= 0) & (age >= 0) & (age < window)
    return torch.where(allowed, 0.0, float("-inf")).to(torch.float32)


#: A full layer's mask value for a key after the query (int8 cache, or soft-capped; module docstring)
MASKED = 2.0**100


def causal_bias(step: Step, length: Any) -> torch.Tensor:
    """float32 ``[n, length]``: 0 where query i may read position j, -MASKED elsewhere, made
    from two vectors shared by the layers (module docstring)."""
    key = ("causal vectors",)  # one length for every full layer of a call: written so far, or all
    if key not in step.masks:
        keys = torch.arange(length, dtype=torch.int64, device=step.positions.device)
        step.masks[key] = (step.positions.unsqueeze(1).to(torch.float32) * MASKED,
                           keys.unsqueeze(0).to(torch.float32) * MASKED)
    rows, cols = step.masks[key]
    return torch.clamp(rows - cols, -MASKED, 0.0)


def shared_ring_mask(step: Step, plan: LayerCache, n: int, used: Any) -> torch.Tensor:
    """``ring_mask`` of ``plan``'s ring over the ``used`` slots read, made once a call for the
    layers with that ring and window (``used`` is the same for them: the slots written so far,
    or every slot for a soft-capped model)."""
    assert plan.window is not None  # a ring's plan
    key = ("ring", plan.size, plan.window)
    if key not in step.masks:
        step.masks[key] = ring_mask(step, plan.size, plan.window, n, used)
    return step.masks[key]


def plain_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scaling: float, softcap: float | None) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scaling / cap) + mask) v with plain operators.

    query ``[1, n, Hq, D]``, keys / values ``[1, L, Hkv, D]``, mask ``[n, L]``; returns
    ``[1, n, Hq, D]``.  Grouped heads: query head h reads key/value head h // (Hq / Hkv).
    """
    _, n, heads, dim = query.shape
    kv_heads = keys.shape[2]
    rep = heads // kv_heads
    q = query[0].reshape(n, kv_heads, rep, dim).permute(1, 2, 0, 3).reshape(kv_heads, rep * n, dim)
    k = keys[0].permute(1, 2, 0)  # [Hkv, D, L]
    v = values[0].permute(1, 0, 2)  # [Hkv, L, D]
    scores = torch.matmul(q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask.repeat(rep, 1).unsqueeze(0)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, rep * n, D]
    return out.reshape(kv_heads, rep, n, dim).permute(2, 0, 1, 3).reshape(1, n, heads, dim)


def int8_attention(query: torch.Tensor, codes_k: torch.Tensor, scale_k: torch.Tensor, codes_v: torch.Tensor,
                   scale_v: torch.Tensor, mask: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Attention over an int8 cache's L slots as batch matrix products (module docstring).

    query ``[1, n, Hq, D]``; codes ``[1, Hkv, L, D]`` int8, scales ``[1, Hkv, 1, L]``; mask
    ``[n, L]``; returns ``[1, n, Hq, D]``.  The rep = Hq / Hkv query heads of a group are a
    batch dimension the keys and values broadcast over (``[1, Hkv, rep, n, .]`` against
    ``[1, Hkv, 1, L, D]``), so the mask is made once, ``[n, L]``, not once a head.  The keys
    are read through the product's transpose flag: XNNPACK packs the codes' float32 values
    as they lie, and no copy transposes them.
    """
    _, n, heads, dim = query.shape
    kv_heads = codes_k.shape[1]
    rep = heads // kv_heads
    q = query.reshape(1, n, kv_heads, rep, dim).permute(0, 2, 3, 1, 4)  # [1, Hkv, rep, n, D]
    # unsqueeze, not a reshape: L is a size the program computes, which no reshape should name
    keys, values = codes_k.to(torch.float32).unsqueeze(2), codes_v.to(torch.float32).unsqueeze(2)  # [1, Hkv, 1, L, D]
    scores = torch.matmul(q, keys.transpose(3, 4)) * (scale_k.unsqueeze(2) * scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores + mask, dim=-1) * scale_v.unsqueeze(2)
    out = torch.matmul(weights, values)  # [1, Hkv, rep, n, D]
    return out.permute(0, 3, 1, 2, 4).reshape(1, n, heads, dim)


def cached_attention(layer: int, query: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of ``layer``'s query ``[1, n, Hq, D]`` over its cache, after the call's update
    (module docstring); returns ``[1, n, Hq, D]``."""
    step = _STEP.get()
    plan = step.decoder.plans[layer]
    n = query.shape[1]
    if step.decoder.kv_cache == "int8":
        codes_k, scale_k, codes_v, scale_v = step.read[layer]
        length = codes_k.shape[2]
        mask = causal_bias(step, length) if plan.window is None else shared_ring_mask(step, plan, n, length)
        return int8_attention(query, codes_k, scale_k, codes_v, scale_v, mask, scaling, softcap)
    keys, values = step.read[layer]
    if plan.window is not None:
        mask = shared_ring_mask(step, plan, n, keys.shape[1])  # the slots written so far (softcapped: all)
        if softcap is not None:
            return plain_attention(query, keys, values, mask, scaling, softcap)
        return torch.ops.llama.custom_sdpa(query, keys, values, 0, mask, 0.0, False, scaling)
    if softcap is not None:  # the whole cache, positions not yet written masked: no size the program computes
        return plain_attention(query, keys, values, causal_bias(step, plan.size), scaling, softcap)
    return torch.ops.llama.custom_sdpa(query, keys, values, step.start, None, 0.0, True, scaling)


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
              dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the Decoder's cache: the query ``[1, Hq, n, D]``
    (``key`` / ``value`` are what the cache update returned: the Decoder reads its own);
    returns ``[1, n, Hq, D]`` as transformers' own implementations do."""
    step = _STEP.get()
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise XnnquantError(f"{type(module).__name__} computes attention with {name}=: the program's attention "
                                "has no such term; expected causal attention, windowed or soft-capped")
    if dropout:
        raise XnnquantError(f"attention dropout {dropout} in {type(module).__name__}: export the model in eval mode")
    layer = getattr(module, "layer_idx", step.last_layer)
    plan = step.decoder.plans[layer]
    window = kwargs.get("sliding_window")
    if window is not None and window >= step.decoder.max_context:
        window = None
    if window != plan.window:
        raise XnnquantError(f"{type(module).__name__} (layer {layer}) attends to a window of {window} positions, "
                            f"but its config gave {plan.window}: expected the window the model's config declares "
                            "(layer_types and sliding_window)")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return cached_attention(layer, query.transpose(1, 2), scale, kwargs.get("softcap")), None


def update_cache(decoder: Decoder, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write a call's keys and values ``[1, Hkv, n, D]`` of ``layer`` into its cache (module
    docstring) and note, in the step, the float keys and values its attention reads."""
    step = _STEP.get()
    plan = decoder.plans[layer]
    slots = step.positions if plan.window is None else torch.remainder(step.positions, plan.size)
    cache_k, cache_v = getattr(decoder, f"cache_k{layer}"), getattr(decoder, f"cache_v{layer}")
    # the slots written so far, start + n until a ring wraps (sym_min: the slice's bound is the
    # cache's size, which start's and n's separate bounds would put at size + max_seq_len - 2)
    used = torch.sym_min(step.start + keys.shape[2], plan.size)
    if decoder.kv_cache == "fp32":
        cache_k.index_copy_(1, slots, keys.transpose(1, 2))
        cache_v.index_copy_(1, slots, values.transpose(1, 2))
        # a full layer's custom_sdpa stops at the position itself; a ring's attends to what it reads
        ring = plan.window is not None and not decoder.softcapped
        step.read[layer] = (cache_k[:, :used], cache_v[:, :used]) if ring else (cache_k, cache_v)
    else:
        scale_k, scale_v = getattr(decoder, f"cache_k_scale{layer}"), getattr(decoder, f"cache_v_scale{layer}")
        for x, codes, scales in ((keys, cache_k, scale_k), (values, cache_v, scale_v)):
            code, scale = quantize_int8(x)  # [1, Hkv, n, D], [1, Hkv, n, 1]
            codes.index_copy_(2, slots, code)
            scales.index_copy_(3, slots, scale.transpose(2, 3))
        length = plan.size if decoder.softcapped else used  # soft-capped attention reads the whole cache
        step.read[layer] = (cache_k[:, :, :length], scale_k[..., :length], cache_v[:, :, :length],
                            scale_v[..., :length])
    step.last_layer = layer


@functools.cache
def _cache_classes() -> tuple[type, type]:
    """(the cache layer class, the cache class): a ``transformers.Cache`` over the Decoder's
    buffers, made once (transformers is imported on first use)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class XnnquantCacheLayer(CacheLayerMixin):
        """One layer: writes a call's keys and values into the Decoder's buffers (``update_cache``)."""

        is_compileable = True
        is_sliding = False

        def __init__(self, decoder: Decoder, layer: int) -> None:
            super().__init__()
            self.decoder, self.layer = decoder, layer
            self.keys, self.values = getattr(decoder, f"cache_k{layer}"), getattr(decoder, f"cache_v{layer}")
            self.is_initialized = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            update_cache(self.decoder, self.layer, key_states, value_states)
            read = _STEP.get().read[self.layer]
            # transformers is handed keys and values it does not read (``attention`` reads the step's):
            # an int8 cache's codes, not its scales
            return (read[0], read[2]) if self.decoder.kv_cache == "int8" else (read[0], read[1])

        def get_seq_length(self) -> Any:
            return _STEP.get().start

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.decoder.plans[self.layer].size, 0

        def get_max_length(self) -> int:
            return self.decoder.plans[self.layer].size

    class XnnquantCache(Cache):
        def __init__(self, decoder: Decoder) -> None:
            layers: list[Any] = [XnnquantCacheLayer(decoder, i) for i in range(decoder.layers)]
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

    def windows(self, model: Any) -> list[int | None]:
        """The window each attention layer attends to (None: every earlier position)."""
        return [None] * len(self.cache_shapes(model))

    def softcapped(self, model: Any) -> bool:
        """Whether the model caps its attention scores (Gemma 2): such layers read the whole cache."""
        return False

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

    def softcapped(self, model: Any) -> bool:
        return getattr(self.config, "attn_logit_softcapping", None) is not None

    def windows(self, model: Any) -> list[int | None]:
        """From the config: ``layer_types`` ("sliding_attention" layers attend to
        ``sliding_window`` positions), else ``sliding_window`` for every layer (Mistral,
        Phi-3); the attention function checks each layer's against what the model passes."""
        layers = int(self.config.num_hidden_layers)
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if types is None:
            return [None if window is None else int(window)] * layers
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise XnnquantError(f"{type(model).__name__} has layers of type {', '.join(unknown)}: expected "
                                "full_attention or sliding_attention layers")
        return [int(window) if t == "sliding_attention" and window is not None else None for t in types]

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


class Falcon(Transformers):
    """transformers' Falcon: its attention modules compute attention in their own code, so
    their ``forward`` is ours while the model is exported (``falcon_attention``)."""

    name = "falcon"

    def cache_shapes(self, model: Any) -> list[tuple[int, int]]:
        config = self.config
        heads = int(config.num_attention_heads)
        if config.new_decoder_architecture:
            kv_heads = int(config.num_kv_heads)
        else:
            kv_heads = 1 if config.multi_query else heads
        return [(kv_heads, int(config.hidden_size) // heads)] * int(config.num_hidden_layers)

    @contextlib.contextmanager
    def using(self, model: Any) -> Iterator[None]:
        _load_llama_kernels()
        attentions = [m for m in model.modules() if type(m).__name__ == "FalconAttention"]
        for module in attentions:  # its attention implementation stays: the masks it makes go unread
            module.forward = functools.partial(falcon_attention, module)
        try:
            yield
        finally:
            for module in attentions:
                del module.forward


def falcon_attention(module: Any, hidden_states: torch.Tensor, alibi: Any, attention_mask: Any,
                     position_ids: Any = None, layer_past: Any = None, use_cache: bool = False,
                     output_attentions: bool = False, position_embeddings: Any = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``FalconAttention.forward`` over the Decoder's cache: the fused projection split into the
    query heads and the key/value heads (without Falcon's broadcast of each key/value head to its
    query heads: grouped query heads read their shared head), rotary positions, ``cached_attention``."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    if alibi is not None:
        raise XnnquantError("this Falcon adds ALiBi position biases to its attention scores: the program's "
                            "attention has no such term; expected a rotary Falcon (alibi=False)")
    batch, n, _ = hidden_states.shape
    fused = module.query_key_value(hidden_states)
    heads, dim = module.num_heads, module.head_dim
    if module.new_decoder_architecture:
        groups = module.num_kv_heads
        qkv = fused.view(batch, n, groups, heads // groups + 2, dim)
        query = qkv[:, :, :, :-2].reshape(batch, n, heads, dim)
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif module.multi_query:
        qkv = fused.view(batch, n, heads + 2, dim)
        query, key, value = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:
        qkv = fused.view(batch, n, heads, 3, dim)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    layer_past.update(key, value, module.layer_idx)
    out = cached_attention(module.layer_idx, query.transpose(1, 2), module.inv_norm_factor)
    return module.dense(out.reshape(batch, n, heads * dim)), None


def _attention_through_interface(model: Any) -> bool:
    """Whether ``model``'s attention goes through transformers' attention interface: it says so
    (``_supports_attention_backend``), or its attention modules' code calls the interface
    (StableLM does without saying so)."""
    import inspect

    if getattr(model, "_supports_attention_backend", False):
        return True
    attentions = {type(m) for m in model.modules()
                  if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")}
    try:
        return bool(attentions) and all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(c.forward) for c in attentions)
    except (OSError, TypeError):
        return False


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
    if getattr(model.config, "is_encoder_decoder", False):
        raise XnnquantError(f"{cls.__name__} is an encoder-decoder model: expected a decoder-only causal LM")
    if type(model).__module__.startswith("transformers.models.falcon."):
        return Falcon(model)
    if not _attention_through_interface(model):
        raise XnnquantError(f"{cls.__name__} does not compute its attention through transformers' attention "
                            "interface, so its cache cannot be ExecuTorch's: expected a model family with "
                            "AttentionInterface support (Llama, Qwen2/3, Mistral, Phi-3, Gemma, StableLM, Falcon, ...)")
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
        if kv_cache != "fp32" and not family.cache_shapes(model):
            raise XnnquantError(f"kv_cache={kv_cache!r}: {family.name} models keep their own cache (float32): "
                                "expected kv_cache='fp32'")
        self.softcapped = family.softcapped(model)
        self.plans = plan_layers(family.cache_shapes(model), family.windows(model), max_context, self.max_seq_len)
        self.layers = len(self.plans)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))  # meta: streamed, zeros
        for i, plan in enumerate(self.plans):
            for kind in ("k", "v"):
                if kv_cache == "fp32":
                    self.register_buffer(f"cache_{kind}{i}", torch.zeros(1, plan.size, plan.heads, plan.dim,
                                                                         device=device), persistent=False)
                    continue
                self.register_buffer(f"cache_{kind}{i}", torch.zeros(1, plan.heads, plan.size, plan.dim,
                                                                     dtype=torch.int8, device=device), persistent=False)
                self.register_buffer(f"cache_{kind}_scale{i}", torch.ones(1, plan.heads, 1, plan.size, device=device),
                                     persistent=False)
        self.training = False  # the model's own flag is the model's (export refuses training mode)

    def cache_buffers(self) -> list[torch.Tensor]:
        """The cache's buffers (keys, values, and an int8 cache's scales); none where the family's
        model keeps its own cache (ExecuTorch's llama ``Transformer``)."""
        return [buffer for name, buffer in self.named_buffers() if name.startswith("cache_")]

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= self.max_context)
        torch._check(n <= self.max_seq_len)
        positions = torch.arange(n, dtype=torch.int64, device=input_pos.device) + input_pos
        token = _STEP.set(Step(start, positions, self))
        try:
            return self.family.logits(self, tokens, positions, input_pos)
        finally:
            _STEP.reset(token)
