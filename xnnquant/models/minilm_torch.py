"""all-MiniLM-L6-v2's encoder as a ``torch.nn.Module``: the model ``xq.export`` is built for.

The same six post-LayerNorm BERT layers as the numpy model in ``minilm.py``, from the
same safetensors file, written with plain ``nn.Linear`` / ``nn.LayerNorm`` modules so
that ``torch.export`` sees one linear per weight and module paths that match the
checkpoint's names (``layer.3.attention.self.query`` <-> ``encoder.layer.3.attention.self.query.weight``)::

    hidden float32 (B, T, 384)    the embedding output (word + position + token type, LayerNorm)
    mask   float32 (B, T)         1.0 on real tokens, 0.0 on padding
      -> float32 (B, T, 384)      the last layer's hidden states

The mask is float, not bool, because XNNPACK's external values are float: it enters the
graph as ``(1 - mask) * -1e4`` added to every head's attention scores, so a padded key's
weight is ``exp(-1e4)`` = 0.0 in float32 (the numpy model uses -inf, which gives the same
probabilities; a finite bias keeps fully padded rows NaN-free).  The embedding lookup
stays outside (``encoder_inputs``): a gather of token ids is not something XNNPACK computes.

torch is imported by this module only; ``xnnquant.models.minilm`` exposes the names
below lazily, so importing it does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from . import minilm

#: What the mask adds to the scores of padded keys (see the module docstring).
MASKED_SCORE = -1e4
#: Tokens per sentence of the default example inputs (the sample sentences fit).
DEFAULT_TOKENS = 32


class SelfAttention(nn.Module):
    """Multi-head self-attention: 12 heads of 32, ``softmax(Q K^T / sqrt(32) + mask) V``."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(minilm.HIDDEN, minilm.HIDDEN)
        self.key = nn.Linear(minilm.HIDDEN, minilm.HIDDEN)
        self.value = nn.Linear(minilm.HIDDEN, minilm.HIDDEN)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """h ``(B, T, 384)``, bias ``(B, 1, 1, T)`` -> context ``(B, T, 384)``."""
        b, t, _ = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:  # (B, T, 384) -> (B, 12, T, 32)
            return x.view(b, t, minilm.HEADS, minilm.HEAD_DIM).permute(0, 2, 1, 3)

        q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(minilm.HEAD_DIM) + bias
        context = torch.matmul(torch.softmax(scores, dim=-1), v)
        return context.permute(0, 2, 1, 3).reshape(b, t, minilm.HIDDEN)


class Dense(nn.Module):
    """A linear followed by a residual LayerNorm (BERT's ``*.output`` blocks)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, minilm.HIDDEN)
        self.LayerNorm = nn.LayerNorm(minilm.HIDDEN, eps=minilm.LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dense(x))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = SelfAttention()
        self.output = Dense(minilm.HIDDEN)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(h, bias), h)


class Intermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(minilm.HIDDEN, 4 * minilm.HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.dense(h))  # exact (erf) GELU, as the model's config says


class Layer(nn.Module):
    """One encoder layer: attention, then the feed-forward block, each with its LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.intermediate = Intermediate()
        self.output = Dense(4 * minilm.HIDDEN)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        attended = self.attention(h, bias)
        return self.output(self.intermediate(attended), attended)


class MiniLMEncoder(nn.Module):
    """The six encoder layers of all-MiniLM-L6-v2 (see the module docstring for I/O)."""

    def __init__(self, num_layers: int = minilm.NUM_LAYERS) -> None:
        super().__init__()
        if not 1 <= num_layers <= minilm.NUM_LAYERS:
            raise minilm.XnnquantError(
                f"num_layers out of range: got {num_layers}, expected 1..{minilm.NUM_LAYERS}")
        self.layer = nn.ModuleList(Layer() for _ in range(num_layers))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = ((1.0 - mask) * MASKED_SCORE)[:, None, None, :]
        for layer in self.layer:
            hidden = layer(hidden, bias)
        return hidden


class Embeddings(nn.Module):
    """BERT's embeddings: word + position + token type (always type 0 here), then LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(minilm.VOCABULARY_SIZE, minilm.HIDDEN)
        self.position_embeddings = nn.Embedding(minilm.MAX_POSITIONS, minilm.HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, minilm.HIDDEN)
        self.LayerNorm = nn.LayerNorm(minilm.HIDDEN, eps=minilm.LAYER_NORM_EPS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        summed = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(summed)


class SentenceEncoder(nn.Module):
    """The whole sentence-embedding model, as all-MiniLM-L6-v2 is used::

        ids            int64 (B, T)   token ids (``minilm.tokenize_batch``)
        attention_mask int64 (B, T)   1 on real tokens, 0 on padding
          -> float32 (B, 384)         the mean of the last hidden states over the real tokens, unit length
    """

    def __init__(self, num_layers: int = minilm.NUM_LAYERS) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = MiniLMEncoder(num_layers)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.to(torch.float32)
        hidden = self.encoder(self.embeddings(ids), mask)
        summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
        pooled = summed / mask.sum(dim=1, keepdim=True).clamp(min=1e-9)
        return pooled / pooled.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def sentence_encoder(num_layers: int = minilm.NUM_LAYERS,
                     weights: Mapping[str, np.ndarray] | None = None) -> SentenceEncoder:
    """``SentenceEncoder`` in eval mode with all-MiniLM-L6-v2's weights (``embeddings.*`` and
    ``encoder.*`` tensors)."""
    tensors = minilm.minilm_tensors() if weights is None else weights
    module = SentenceEncoder(num_layers)
    state = {name: torch.from_numpy(np.array(tensors[name], np.float32)) for name in module.state_dict()}
    module.load_state_dict(state, strict=True)
    return module.eval()


def sentence_inputs(sentences: Sequence[str], tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` int64 ``(B, T)`` of ``sentences``, padded to ``tokens`` (default:
    the longest sentence)."""
    ids, mask = minilm.tokenize_batch(sentences)
    if tokens is not None:
        if tokens < ids.shape[1]:
            raise minilm.XnnquantError(f"tokens too small: got {tokens}, the longest sentence has {ids.shape[1]} "
                                       "tokens")
        pad = tokens - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=minilm.vocabulary()[minilm.PAD])
        mask = np.pad(mask, ((0, 0), (0, pad)))
    return torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))


def encoder(num_layers: int = minilm.NUM_LAYERS, weights: Mapping[str, np.ndarray] | None = None) -> MiniLMEncoder:
    """``MiniLMEncoder`` in eval mode with all-MiniLM-L6-v2's weights (``encoder.*`` tensors).

    ``weights``: tensors by checkpoint name (default ``minilm_tensors()``).
    """
    tensors = minilm.minilm_tensors() if weights is None else weights
    module = MiniLMEncoder(num_layers)
    state = {name: torch.from_numpy(np.array(tensors["encoder." + name], np.float32))
             for name in module.state_dict()}
    module.load_state_dict(state, strict=True)
    return module.eval()


def encoder_inputs(sentences: Sequence[str], tokens: int | None = None,
                   weights: Mapping[str, np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's inputs for ``sentences``: hidden float32 ``(B, T, 384)`` (the numpy
    model's ``embed``), mask float32 ``(B, T)``.

    ``tokens``: pad every sentence to this many tokens (default: the longest sentence).
    """
    ids, mask = minilm.tokenize_batch(sentences)
    if tokens is not None:
        if tokens < ids.shape[1]:
            raise minilm.XnnquantError(
                f"tokens too small: got {tokens}, the longest sentence has {ids.shape[1]} tokens")
        pad = tokens - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=minilm.vocabulary()[minilm.PAD])
        mask = np.pad(mask, ((0, 0), (0, pad)))
    hidden = minilm.embed(ids, minilm.minilm_tensors() if weights is None else dict(weights))
    return torch.from_numpy(hidden), torch.from_numpy(mask.astype(np.float32))


def example(batch: int = 1, tokens: int = DEFAULT_TOKENS) -> tuple[MiniLMEncoder, tuple[torch.Tensor, torch.Tensor]]:
    """``(module, example_inputs)`` for ``xq.export`` and ``xnnquant export``: the encoder and
    the first ``batch`` sample sentences, padded to ``tokens`` tokens."""
    if not 1 <= batch <= len(minilm.SAMPLE_SENTENCES):
        raise minilm.XnnquantError(
            f"batch out of range: got {batch}, expected 1..{len(minilm.SAMPLE_SENTENCES)}")
    return encoder(), encoder_inputs(minilm.SAMPLE_SENTENCES[:batch], tokens)
