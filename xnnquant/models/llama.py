"""A Llama-shaped decoder in torch with random weights, for scale tests and benchmarks.

Every weight of a Llama layer is there and used (no grouped-query attention)::

    per layer:  a   = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))
                out = a + down_proj(silu(gate_proj(n2)) * up_proj(n2))
                where n1 = input_layernorm(x), n2 = post_attention_layernorm(a)
    then        norm(out)

``RMSNorm(x) = x * rsqrt(mean(x**2, -1) + eps) * weight``; attention is causal
(``softmax(q k^T / sqrt(head_dim) + mask) v`` per head) with rotary position embedding
(``x * cos + rotate_half(x) * sin``).  The input is hidden states ``(batch, seq, hidden)``
after an embedding lookup, as for the MiniLM module; there is no embedding or LM head.

The rotary tables and the causal mask are persistent buffers, saved with the weights,
so a decoder built on the ``meta`` device holds no data at all and a safetensors file
holds everything.  ``LlamaConfig.large()`` is the benchmark's 1.07-billion-parameter
model (16 layers, hidden 2048, MLP 8192: 4.3 GB of float32).

``write_random_safetensors`` writes the weights one tensor at a time, so making a file
larger than memory needs little memory.  The format is safetensors' own (an 8-byte
little-endian header length, a JSON header of dtype, shape and data offsets, then the
data); the ``safetensors`` package reads such files but has no writer that streams.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import missing_extra

try:
    import torch
    from torch import nn
except ImportError:  # pragma: no cover - the torch extra is missing
    torch = None
    nn = None


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the decoder; ``seq`` is the sequence length the tables and mask cover."""

    hidden: int = 64
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    seq: int = 8
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def large(cls) -> LlamaConfig:
        """16 layers, hidden 2048 (32 heads of 64), MLP 8192: 1.07e9 weights."""
        return cls(hidden=2048, intermediate=8192, layers=16, heads=32, seq=16)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the state dict, in file order: name -> shape."""
        h, m = self.hidden, self.intermediate
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.layers):
            p = f"layers.{i}."
            out[p + "input_layernorm.weight"] = (h,)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{name}.weight"] = (h, h)
            out[p + "post_attention_layernorm.weight"] = (h,)
            out[p + "mlp.gate_proj.weight"] = (m, h)
            out[p + "mlp.up_proj.weight"] = (m, h)
            out[p + "mlp.down_proj.weight"] = (h, m)
        out["norm.weight"] = (h,)
        out["rope_cos"] = (self.seq, self.head_dim)
        out["rope_sin"] = (self.seq, self.head_dim)
        out["causal_mask"] = (self.seq, self.seq)
        return out

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(s) for name, s in self.shapes().items() if name.endswith(".weight"))


def _torch() -> Any:
    if torch is None:
        raise missing_extra("torch", "torch", "the Llama-shaped decoder")
    return torch


def _buffers(config: LlamaConfig) -> dict[str, np.ndarray]:
    """Rotary tables ``(seq, head_dim)`` and the causal mask ``(seq, seq)``, float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.outer(np.arange(config.seq, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=1)
    mask = np.triu(np.full((config.seq, config.seq), np.finfo(np.float32).min, np.float32), k=1)
    return {"rope_cos": np.cos(angles).astype(np.float32), "rope_sin": np.sin(angles).astype(np.float32),
            "causal_mask": mask}


def random_tensors(config: LlamaConfig, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 array)`` for every tensor of ``config.shapes()``, made one at a time.

    Linear weights are normal with standard deviation ``1 / sqrt(in_features)``; norm
    weights are ``1 + 0.1 * normal`` (so no two norm tensors are equal).
    """
    rng = np.random.default_rng(seed)
    tables = _buffers(config)
    for name, shape in config.shapes().items():
        if name in tables:
            yield name, tables[name]
        elif len(shape) == 1:
            yield name, (1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32)
            w *= np.float32(1 / math.sqrt(shape[1]))
            yield name, w


def write_random_safetensors(path: str | os.PathLike[str], config: LlamaConfig, seed: int = 0) -> Path:
    """Write ``random_tensors(config, seed)`` as a float32 safetensors file, one tensor at a time.

    Layout: ``u64 n`` (little-endian) | ``n`` bytes of JSON ``{name: {"dtype": "F32",
    "shape": [...], "data_offsets": [begin, end]}}`` padded with spaces to a multiple of 8
    | the tensors' bytes back to back in ``shapes()`` order.  Written to a temporary file,
    then renamed.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in config.shapes().items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for _, array in random_tensors(config, seed):
                f.write(np.ascontiguousarray(array, "<f4").tobytes())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


if torch is not None:

    class RMSNorm(nn.Module):
        def __init__(self, size: int, eps: float, device: Any) -> None:
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(size, device=device))

        def forward(self, x: Any) -> Any:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Attention(nn.Module):
        def __init__(self, config: LlamaConfig, device: Any) -> None:
            super().__init__()
            h = config.hidden
            self.heads, self.head_dim = config.heads, config.head_dim
            self.q_proj = nn.Linear(h, h, bias=False, device=device)
            self.k_proj = nn.Linear(h, h, bias=False, device=device)
            self.v_proj = nn.Linear(h, h, bias=False, device=device)
            self.o_proj = nn.Linear(h, h, bias=False, device=device)

        def _heads(self, x: Any) -> Any:
            b, s, _ = x.shape
            return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

        @staticmethod
        def _rope(x: Any, cos: Any, sin: Any) -> Any:
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return x * cos + rotated * sin

        def forward(self, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
            b, s, h = x.shape
            q = self._rope(self._heads(self.q_proj(x)), cos, sin)
            k = self._rope(self._heads(self.k_proj(x)), cos, sin)
            v = self._heads(self.v_proj(x))
            scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(self.head_dim)) + mask
            out = torch.softmax(scores, dim=-1) @ v
            return self.o_proj(out.transpose(1, 2).reshape(b, s, h))

    class MLP(nn.Module):
        def __init__(self, config: LlamaConfig, device: Any) -> None:
            super().__init__()
            h, m = config.hidden, config.intermediate
            self.gate_proj = nn.Linear(h, m, bias=False, device=device)
            self.up_proj = nn.Linear(h, m, bias=False, device=device)
            self.down_proj = nn.Linear(m, h, bias=False, device=device)

        def forward(self, x: Any) -> Any:
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self, config: LlamaConfig, device: Any) -> None:
            super().__init__()
            self.input_layernorm = RMSNorm(config.hidden, config.rms_eps, device)
            self.self_attn = Attention(config, device)
            self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_eps, device)
            self.mlp = MLP(config, device)

        def forward(self, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class LlamaDecoder(nn.Module):
        """Hidden states ``(batch, config.seq, hidden)`` -> hidden states, float32."""

        def __init__(self, config: LlamaConfig, device: Any = "meta") -> None:
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.layers))
            self.norm = RMSNorm(config.hidden, config.rms_eps, device)
            for name, shape in config.shapes().items():
                if "." not in name:
                    self.register_buffer(name, torch.zeros(shape, device=device))

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x, self.rope_cos, self.rope_sin, self.causal_mask)
            return self.norm(x)


def decoder(config: LlamaConfig, device: str = "meta", seed: int | None = None) -> Any:
    """``LlamaDecoder`` on ``device``; with ``seed`` (on a real device), filled with
    ``random_tensors(config, seed)`` (the values ``write_random_safetensors`` writes)."""
    _torch()
    module = LlamaDecoder(config, device)
    if seed is not None:
        module.load_state_dict({n: torch.from_numpy(a) for n, a in random_tensors(config, seed)})
    return module.eval()
