"""all-MiniLM-L6-v2 in float32 numpy: tokenizer, embeddings and encoder layers.

It exists to produce *real activations*, the inputs that each linear layer of the
encoder sees, for accuracy experiments on dynamic (per-token) quantization.  It follows
BERT's post-LayerNorm encoder (the model's ``config.json``: hidden 384, 12 heads of 32,
FFN 1536 with exact GELU, LayerNorm eps 1e-12)::

    h0 = LayerNorm(word[ids] + position[t] + token_type[0])
    per layer:  a   = softmax(Q K^T / sqrt(32) + mask) V        Q, K, V = linears of h
                h'  = LayerNorm(h + attention.output.dense(a))
                out = LayerNorm(h' + output.dense(GELU(intermediate.dense(h'))))

Weights come from ``xnnquant.models.weights.minilm_tensors()``; the tokenizer is the model's own
``tokenizer.json`` beside them, read by the ``tokenizers`` library.  Everything is
float32 except the GELU's erf (float64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..compute.special import erf, gelu  # noqa: F401  (erf re-exported: models.minilm.erf)
from ..errors import MissingExtraError, XnnquantError
from .weights import minilm_path, minilm_tensors

if TYPE_CHECKING:
    from tokenizers import Tokenizer

HIDDEN = 384
HEADS = 12
HEAD_DIM = HIDDEN // HEADS
NUM_LAYERS = 6
LAYER_NORM_EPS = 1e-12
MAX_POSITIONS = 512
VOCABULARY_SIZE = 30522  # rows of embeddings.word_embeddings.weight
CLS, SEP, PAD, UNK = "[CLS]", "[SEP]", "[PAD]", "[UNK]"

#: The six linears of one encoder layer, in the order data flows through them.
LINEARS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)

Weights = dict[str, np.ndarray]
#: ``linear(name, x) -> y``: computes the linear ``name`` (``"encoder.layer.{i}.{LINEARS[j]}"``)
#: on ``x`` float32 ``(B, T, K)``, returning float32 ``(B, T, N)``, bias included.
Linear = Callable[[str, np.ndarray], np.ndarray]

#: A fixed set of short, varied sentences (233 tokens) for activations and embeddings.
SAMPLE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Quantization reduces the size of neural network weights.",
    "How do I reset my password if I forgot my email address?",
    "The stock market fell sharply after the announcement on Tuesday.",
    "She baked three loaves of sourdough bread for the neighbours.",
    "Phones run small language models on their CPUs with XNNPACK.",
    "It rained all weekend, so the football match was postponed.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "Can you recommend a quiet restaurant near the train station?",
    "The committee approved the budget of 4.2 million euros for 2025.",
    "Error: file not found (code 404) while loading config.yaml!",
    "Two children are building a sandcastle on the beach.",
    "Mitochondria are often called the powerhouse of the cell.",
    "Le café est fermé le dimanche matin.",
    "Please summarise the attached report in three bullet points.",
)


# --------------------------------------------------------------------------- tokenizer


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """The model's own tokenizer (its ``tokenizer.json``, BERT's uncased WordPiece), read by
    the ``tokenizers`` library, with padding and truncation off."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingExtraError(
            "tokenizing for all-MiniLM-L6-v2 needs the 'tokenizers' package: pip install 'xnnquant[models]'"
        ) from None
    tok = Tokenizer.from_file(str(Path(minilm_path()).parent / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def vocabulary() -> dict[str, int]:
    """WordPiece vocabulary of the model: token -> id (30,522 entries)."""
    return tokenizer().get_vocab()


def tokenize(text: str) -> list[int]:
    """Token ids of one sentence, ``[CLS] ... [SEP]``."""
    return list(tokenizer().encode(text).ids)


def tokenize_batch(sentences: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Ids and attention mask of several sentences, padded on the right with [PAD].

    Returns ``ids`` int64 ``(B, T)`` and ``mask`` bool ``(B, T)`` (True on real tokens),
    ``T`` the longest sentence in tokens.
    """
    if isinstance(sentences, str) or not sentences:
        raise XnnquantError(f"sentences must be a non-empty sequence of strings: got {sentences!r}")
    rows = [tokenize(s) for s in sentences]  # encode_batch's threads would warn in forked children
    longest = max(len(r) for r in rows)
    if longest > MAX_POSITIONS:
        raise XnnquantError(f"sentence too long: got {longest} tokens, expected at most {MAX_POSITIONS}")
    ids = np.full((len(rows), longest), tokenizer().token_to_id(PAD), np.int64)
    mask = np.zeros((len(rows), longest), bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = True
    return ids, mask


# --------------------------------------------------------------------------- float layers


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """LayerNorm over the last axis (biased variance, eps 1e-12); float32, shape of ``x``."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + np.float32(LAYER_NORM_EPS)) * gamma + beta).astype(np.float32)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x @ weight.T + bias``: x ``(..., K)``, weight ``(N, K)``, bias ``(N,)``; float32 ``(..., N)``."""
    rows = x.reshape(-1, x.shape[-1])  # one 2-D GEMM: numpy's batched matmul is far slower
    y = (rows @ weight.T).reshape(x.shape[:-1] + (weight.shape[0],))
    return (y if bias is None else y + bias).astype(np.float32)


def embed(ids: np.ndarray, weights: Weights) -> np.ndarray:
    """Embedding sum and LayerNorm: ids int ``(B, T)`` -> float32 ``(B, T, 384)``."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] > MAX_POSITIONS:
        raise XnnquantError(f"ids must be (batch, tokens<={MAX_POSITIONS}): got shape {ids.shape}")
    e = (
        weights["embeddings.word_embeddings.weight"][ids]
        + weights["embeddings.position_embeddings.weight"][: ids.shape[1]]
        + weights["embeddings.token_type_embeddings.weight"][0]
    )
    return layer_norm(e, weights["embeddings.LayerNorm.weight"], weights["embeddings.LayerNorm.bias"])


@dataclass(frozen=True)
class LayerActivations:
    """What one encoder layer computed, each float32 ``(B, T, features)``.

    ``inputs[name]`` is the input of the linear ``name`` (one of ``LINEARS``): the layer
    input for query/key/value, the attention context for ``attention.output.dense``, the
    post-attention LayerNorm for ``intermediate.dense``, the GELU output (1536 wide) for
    ``output.dense``.
    """

    inputs: dict[str, np.ndarray]
    output: np.ndarray


def encoder_layer(h: np.ndarray, mask: np.ndarray, weights: Weights, index: int,
                  linear_fn: Linear | None = None) -> LayerActivations:
    """Encoder layer ``index`` on ``h`` float32 ``(B, T, 384)``; ``mask`` bool ``(B, T)``.

    Keys where ``mask`` is False (padding) get no attention weight.  ``linear_fn``, when
    given, computes the six linears instead of ``weights`` (e.g. with quantized weights, or
    to record their inputs); the layer norms still come from ``weights``.
    """
    if not 0 <= index < NUM_LAYERS:
        raise XnnquantError(f"layer index out of range: got {index}, expected 0..{NUM_LAYERS - 1}")
    p = f"encoder.layer.{index}."

    def dense(name: str, x: np.ndarray) -> np.ndarray:
        if linear_fn is not None:
            return linear_fn(p + name, x)
        return linear(x, weights[p + name + ".weight"], weights[p + name + ".bias"])

    batch, tokens, _ = h.shape

    def heads(x: np.ndarray) -> np.ndarray:  # (B, T, 384) -> (B, 12, T, 32)
        return x.reshape(batch, tokens, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

    q, k, v = (heads(dense(name, h)) for name in LINEARS[:3])
    scores = np.matmul(q, k.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(HEAD_DIM))
    scores = np.where(mask[:, None, None, :], scores, np.float32(-np.inf))
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    context = np.matmul(probs, v).transpose(0, 2, 1, 3).reshape(batch, tokens, HIDDEN)
    attended = layer_norm(h + dense(LINEARS[3], context),
                          weights[p + "attention.output.LayerNorm.weight"],
                          weights[p + "attention.output.LayerNorm.bias"])
    hidden = gelu(dense(LINEARS[4], attended))
    out = layer_norm(attended + dense(LINEARS[5], hidden),
                     weights[p + "output.LayerNorm.weight"], weights[p + "output.LayerNorm.bias"])
    inputs = {LINEARS[0]: h, LINEARS[1]: h, LINEARS[2]: h,
              LINEARS[3]: context, LINEARS[4]: attended, LINEARS[5]: hidden}
    return LayerActivations(inputs={n: x.astype(np.float32) for n, x in inputs.items()}, output=out)


def forward(ids: np.ndarray, mask: np.ndarray, num_layers: int = NUM_LAYERS,
            weights: Weights | None = None) -> list[LayerActivations]:
    """Embeddings then the first ``num_layers`` encoder layers; one record per layer."""
    if not 1 <= num_layers <= NUM_LAYERS:
        raise XnnquantError(f"num_layers out of range: got {num_layers}, expected 1..{NUM_LAYERS}")
    weights = minilm_tensors() if weights is None else weights
    h = embed(ids, weights)
    layers = []
    for index in range(num_layers):
        layers.append(encoder_layer(h, mask, weights, index))
        h = layers[-1].output
    return layers


def sentence_embeddings(sentences: Sequence[str], weights: Weights | None = None) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings: float32 ``(len(sentences), 384)``, unit length.

    As the model is meant to be used (its ``modules.json``): all six layers, then the mean
    of the last hidden states over the real tokens of each sentence, then L2 normalization.
    ``weights``: the model's tensors by name (default ``minilm_tensors()``), e.g. with
    quantized-then-dequantized linear weights swapped in.
    """
    ids, mask = tokenize_batch(sentences)
    return mean_pooled(forward(ids, mask, NUM_LAYERS, weights)[-1].output, mask)


def mean_pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Sentence embeddings from the last hidden states: the mean of ``hidden`` float
    ``(B, T, 384)`` over the real tokens of ``mask`` ``(B, T)`` (bool or 1.0 / 0.0), then L2
    normalization; float32 ``(B, 384)``."""
    m = np.asarray(mask).astype(np.float32)[..., None]
    mean = (np.asarray(hidden, np.float32) * m).sum(axis=1) / m.sum(axis=1)
    return (mean / np.linalg.norm(mean, axis=1, keepdims=True)).astype(np.float32)


def linear_inputs(sentences: Sequence[str], num_layers: int = 2,
                  weights: Weights | None = None) -> dict[str, np.ndarray]:
    """Real activations entering each linear of the first ``num_layers`` layers.

    Returns ``{"encoder.layer.{i}.{linear}": x}`` with ``x`` float32 ``(tokens, in_features)``:
    the rows of every real (non-padding) token of every sentence, in order.  Query, key
    and value share one input; each gets its own entry.
    """
    ids, mask = tokenize_batch(sentences)
    layers = forward(ids, mask, num_layers, weights)
    return {
        f"encoder.layer.{i}.{name}": np.ascontiguousarray(x[mask])
        for i, layer in enumerate(layers)
        for name, x in layer.inputs.items()
    }


def short_name(weight_name: str) -> str:
    """``encoder.layer.3.attention.self.query.weight`` -> ``L3 query`` (labels for plots)."""
    parts = weight_name.split(".")
    if len(parts) < 4 or parts[0] != "encoder" or parts[1] != "layer":
        raise XnnquantError(f"not an encoder weight name: got {weight_name!r}, expected 'encoder.layer.N....'")
    rest = ".".join(p for p in parts[3:] if p not in ("weight", "bias"))
    label = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
             "attention.output.dense": "attn_out", "intermediate.dense": "ffn_up", "output.dense": "ffn_down"}
    return f"L{parts[2]} {label.get(rest, rest)}"



# --------------------------------------------------------------------------- torch module

#: Names defined in ``minilm_torch`` (which imports torch), reachable from here on first use.
TORCH_NAMES = ("MiniLMEncoder", "encoder", "encoder_inputs", "example")


def __getattr__(name: str) -> object:
    """``minilm.MiniLMEncoder``, ``minilm.encoder()``, ...: imported from ``minilm_torch`` on
    first use, so that ``import xnnquant.models.minilm`` never imports torch."""
    if name in TORCH_NAMES:
        from . import minilm_torch

        return getattr(minilm_torch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
