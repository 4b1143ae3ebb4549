"""A transformers Llama-family causal LM as a Meta-format checkpoint: what ExecuTorch's llama
recipe (``executorch.examples.models.llama``: ``export_llama``, its ``Transformer``) reads.

``meta_checkpoint(model, out_dir)`` writes two files::

    out_dir/checkpoint.pth   torch.save of {Meta name: float32 tensor}
    out_dir/params.json      ModelArgs fields (dim, n_layers, n_heads, n_kv_heads, vocab_size,
                             hidden_dim, head_dim, norm_eps, rope_theta, use_scaled_rope, ...)

Names (N = layer index; ``model.`` prefix of transformers' names left out)::

    embed_tokens                      -> tok_embeddings
    layers.N.self_attn.q_proj/k_proj  -> layers.N.attention.wq/wk   rows permuted (below)
    layers.N.self_attn.v_proj/o_proj  -> layers.N.attention.wv/wo
    layers.N.mlp.gate_proj/down_proj/up_proj -> layers.N.feed_forward.w1/w2/w3
    layers.N.input_layernorm          -> layers.N.attention_norm
    layers.N.post_attention_layernorm -> layers.N.ffn_norm
    norm                              -> norm
    lm_head                           -> output   (tied embeddings: the token table itself)

Rotary position embedding pairs the dimensions of a head differently: Meta's model rotates
the pairs (2i, 2i+1) of a head of D dims by frequency i, transformers' ``rotate_half`` the
pairs (i, i + D/2).  transformers' Llama weights are Meta's with the rows of wq and wk
permuted so that the same rotation lands on the same numbers; within each head::

    hf row  p * D/2 + i   holds   meta row  2i + p        (i < D/2, p in {0, 1})

``to_meta_rows`` undoes it (q/k biases, 1-D, too); ``to_hf_rows`` makes it.  The result runs
in ExecuTorch's ``Transformer`` (``meta_transformer``) with the logits of the model.

Refused with ``XnnquantError`` (what ExecuTorch's ``ModelArgs`` cannot say): an activation
other than SiLU, biases other than q/k/v, a sliding window, rotary scaling other than
Llama 3's with ``low_freq_factor`` 1 and 8192 original positions (ExecuTorch's fixed
values), and any parameter without a Meta name (Qwen3's q/k norms, for one).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .. import arguments
from ..errors import XnnquantError, import_torch, missing_extra
from ..files import write_atomic

CHECKPOINT = "checkpoint.pth"
PARAMS = "params.json"

#: transformers' name (after ``model.``) -> Meta's; ``{}`` is the layer index.
_NAMES = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "norm.weight": "norm.weight",
    "layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.")
#: ExecuTorch's Llama 3 rotary scaling (``rope.apply_scaling``) fixes these two.
_ET_LOW_FREQ_FACTOR = 1.0
_ET_OLD_CONTEXT = 8192


def _torch() -> Any:
    return import_torch("writing a Meta-format checkpoint", extra="xnnpack")


def to_meta_rows(w: Any, n_heads: int) -> Any:
    """transformers' wq/wk rows (or q/k bias) in Meta's order: ``(n_heads * D, ...)`` -> same shape."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    head = rows // n_heads
    return w.reshape(n_heads, 2, head // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def to_hf_rows(w: Any, n_heads: int) -> Any:
    """Meta's wq/wk rows (or q/k bias) in transformers' order; the inverse of ``to_meta_rows``."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    head = rows // n_heads
    return w.reshape(n_heads, head // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _rope(config: Any) -> dict[str, Any]:
    """The rotary parameters of a transformers config (``rope_parameters`` since transformers 5,
    ``rope_theta`` + ``rope_scaling`` before)."""
    found = getattr(config, "rope_parameters", None)
    if found:
        return dict(found)
    return {**(getattr(config, "rope_scaling", None) or {}), "rope_theta": getattr(config, "rope_theta", 10000.0)}


def meta_params(config: Any) -> dict[str, Any]:
    """The ``params.json`` of a transformers Llama-family config (ExecuTorch ``ModelArgs`` fields)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise XnnquantError(f"ExecuTorch's llama Transformer computes SiLU MLPs: got hidden_act={act!r}")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise XnnquantError(f"ExecuTorch's llama recipe has no sliding-window attention: got sliding_window={window}")
    if getattr(config, "mlp_bias", False):
        raise XnnquantError("ExecuTorch's llama Transformer has no MLP biases: got mlp_bias=True")
    if getattr(config, "attention_bias", False):  # q, k, v and o: o has no place in Meta's names
        raise XnnquantError("ExecuTorch's llama Transformer has no output-projection bias: got attention_bias=True "
                            "(biases on q, k, v and o)")
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    rope = _rope(config)
    params: dict[str, Any] = {
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": getattr(config, "num_key_value_heads", None) or n_heads,
        "vocab_size": config.vocab_size,
        "hidden_dim": config.intermediate_size,
        "head_dim": head_dim,
        "norm_eps": float(config.rms_norm_eps),
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "use_scaled_rope": False,
        "use_hf_rope": False,
    }
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        low, old = rope.get("low_freq_factor"), rope.get("original_max_position_embeddings")
        factor, high = rope.get("factor", "absent"), rope.get("high_freq_factor", "absent")
        whole = all(isinstance(v, (int, float)) and float(v).is_integer() for v in (factor, high))
        if low != _ET_LOW_FREQ_FACTOR or old != _ET_OLD_CONTEXT or not whole:
            raise XnnquantError(
                "ExecuTorch's llama3 rotary scaling fixes low_freq_factor=1 and 8192 original positions and "
                f"takes integer factors: got low_freq_factor={low}, original_max_position_embeddings={old}, "
                f"factor={factor}, high_freq_factor={high}"
            )
        params.update(use_scaled_rope=True, rope_scale_factor=int(factor), high_freq_factor=int(high))
    elif kind != "default":
        raise XnnquantError(f"ExecuTorch's llama recipe has no {kind!r} rotary scaling: expected 'default' or 'llama3'")
    return params


def meta_state_dict(model: Any) -> dict[str, Any]:
    """Meta names -> tensors of a transformers Llama-family causal LM (float32, q/k rows in Meta's
    order, ``output.weight`` the token table itself when the embeddings are tied)."""
    torch = _torch()
    config = model.config
    params = meta_params(config)  # refuses what ExecuTorch's ModelArgs cannot say
    heads = {"q_proj": params["n_heads"], "k_proj": params["n_kv_heads"]}
    state: dict[str, Any] = {}
    unknown = []
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if not tied:
                state["output.weight"] = tensor.detach().to(torch.float32).contiguous()
            continue
        short = name.removeprefix("model.")
        match = _LAYER.match(short)
        template = _LAYER.sub("layers.{}.", short) if match else short
        if template not in _NAMES:
            unknown.append(name)
            continue
        value = tensor.detach().to(torch.float32)
        projection = template.split(".")[-2]
        if projection in heads:
            value = to_meta_rows(value, heads[projection])
        state[_NAMES[template].format(match.group(1) if match else "")] = value.contiguous()
    if unknown:
        raise XnnquantError(
            f"{len(unknown)} parameter(s) of {type(model).__name__} have no name in ExecuTorch's llama "
            f"Transformer: {', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''} "
            f"(expected Llama-family names: {', '.join(sorted(_NAMES))})"
        )
    if tied:
        state["output.weight"] = state["tok_embeddings.weight"]
    elif "output.weight" not in state:
        raise XnnquantError(f"{type(model).__name__} has no lm_head.weight and does not tie its embeddings")
    return state


def meta_checkpoint(model: Any, out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``checkpoint.pth`` and ``params.json`` of ``model`` (module docstring) into ``out_dir``
    (created if absent), each atomically; returns their paths.

    The checkpoint's name must not contain ``int8`` or ``8da4w``: ExecuTorch's ``Llama2Model``
    takes such a file for an already quantized one.
    """
    torch = _torch()
    out = arguments.path(out_dir, "out_dir")
    params = meta_params(model.config)
    state = meta_state_dict(model)
    out.mkdir(parents=True, exist_ok=True)
    if any(k.endswith(".wq.bias") for k in state):
        params["attention_qkv_bias"] = True
    tmp = out / f".{CHECKPOINT}.{os.getpid()}.tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, out / CHECKPOINT)
    finally:
        tmp.unlink(missing_ok=True)
    write_atomic(out / PARAMS, (json.dumps(params, indent=2) + "\n").encode())
    return out / CHECKPOINT, out / PARAMS


def meta_transformer(out_dir: str | os.PathLike[str], *, max_context: int = 128, full_logits: bool = True,
                     **model_args: Any) -> Any:
    """ExecuTorch's eager llama ``Transformer`` (no KV cache, float32, eval mode) with the weights of
    ``meta_checkpoint``'s files in ``out_dir``.

    ``forward(tokens int64 [1, n]) -> logits float32``: ``[1, n, vocab]`` with ``full_logits``,
    else ``[1, vocab]`` (the last token's).  ``model_args``: more ``ModelArgs`` fields.
    """
    torch = _torch()
    try:
        from executorch.examples.models.llama.llama_transformer import construct_transformer
        from executorch.examples.models.llama.model_args import ModelArgs
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "ExecuTorch's llama Transformer") from None
    out = arguments.path(out_dir, "out_dir")
    params = json.loads((out / PARAMS).read_text())
    args = ModelArgs(max_seq_len=max_context, max_context_len=max_context, generate_full_logits=full_logits,
                     **params, **model_args)
    transformer = construct_transformer(args)  # on the CPU: its rotary tables and masks are made here
    state = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=True)
    missing, unexpected = transformer.load_state_dict(state, strict=False, assign=True)
    missing_weights = [k for k in missing if k.endswith((".weight", ".bias"))]
    if missing_weights or unexpected:
        raise XnnquantError(f"{out / CHECKPOINT} does not fit ExecuTorch's Transformer of {out / PARAMS}: "
                            f"missing {missing_weights}, unexpected {list(unexpected)}")
    return transformer.eval()
