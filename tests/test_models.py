"""The numpy MiniLM forward pass against independent implementations.

Oracles: token ids two independent tokenizers agreed on (see GOLDEN_IDS); torch's
``nn.TransformerEncoderLayer`` (post-LayerNorm, GELU, which is BERT's layer) loaded with
the same weights, run in float64; ``math.erf`` in float64 for erf and GELU.

The torch references run in float64 so that they are the same on every CPU: torch's
float32 kernels (matmul, softmax, GELU) differ by vector width (AVX2 against AVX-512),
its float64 ones only at the 1e-12 level.  Our forward pass is float32 numpy, whose
matmul summation order also depends on the CPU (OpenBLAS picks its kernel at run time);
the tolerances below bound its float32 rounding, whatever the order (see each).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from xnnquant import XnnquantError
from xnnquant.models import minilm
from xnnquant.models.weights import minilm_tensors

torch = pytest.importorskip("torch")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantization to int4 with bf16 scales: does it hurt accuracy?",
    "Café naïve résumé — Zürich, 2024!",
    "XNNPACK runs on phones; ExecuTorch delegates to it.",
    "日本語 text, emoji 🙂 and unbelievably-hyphenated antidisestablishmentarianism",
    "a",
]


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return minilm_tensors()


#: Ids from two independent tokenizers that agreed: the hand-written WordPiece this
#: package had (removed for ``tokenizers``) and ``tokenizers`` on the model's
#: ``tokenizer.json``; they agreed on 22,885 of 22,894 strings (1.1 million tokens), the 9
#: others spelling special tokens such as "[UNK]" in the text, which ``tokenizers`` (like
#: BERT's own tokenizer) reads as the special token, as the last case shows.
GOLDEN_IDS = {
    "Café naïve résumé — Zürich, 2024!": [101, 7668, 15743, 13746, 1517, 10204, 1010, 16798, 2549, 999, 102],
    "日本語 text, emoji 🙂 and unbelievably-hyphenated antidisestablishmentarianism": [
        101, 1864, 1876, 1950, 3793, 1010, 7861, 29147, 2072, 100, 1998, 4895, 8671, 2666, 3567, 6321, 1011,
        1044, 22571, 10222, 4383, 3424, 10521, 4355, 7875, 13602, 3672, 12199, 2964, 102],
    "x" * 101 + " [UNK] ok": [101, 100, 100, 7929, 102],  # a word over 100 characters is [UNK]
}


@pytest.mark.parametrize("sentence", list(GOLDEN_IDS))
def test_tokenizer_golden_ids(sentence: str) -> None:
    assert minilm.tokenize(sentence) == GOLDEN_IDS[sentence]
    assert minilm.tokenize_batch([sentence, "a"])[0][0, : len(GOLDEN_IDS[sentence])].tolist() == GOLDEN_IDS[sentence]


def test_vocabulary() -> None:
    assert minilm.vocabulary()["[PAD]"] == 0 and len(minilm.vocabulary()) == 30522
    assert minilm.tokenize("hello world") == [101, 7592, 2088, 102]


def test_sample_sentences_token_count() -> None:
    assert int(minilm.tokenize_batch(minilm.SAMPLE_SENTENCES)[1].sum()) == 233


def test_tokenize_batch_pads_right_with_mask() -> None:
    ids, mask = minilm.tokenize_batch(["hello world", "a"])
    assert ids.shape == mask.shape == (2, 4)
    assert ids[1].tolist() == [101, 1037, 102, 0]  # [CLS] a [SEP] [PAD]
    assert mask.tolist() == [[True] * 4, [True, True, True, False]]


#: Abramowitz & Stegun 7.1.26 states |erf(x) - approximation| <= 1.5e-7 for every x >= 0
#: (odd extension for x < 0); the float64 arithmetic that evaluates it adds ~1e-16.
ERF_MAX_ERROR = 1.5e-7


def test_erf_and_gelu_match_exact_float64() -> None:
    """Against ``math.erf`` (float64 libm, no vector kernels): the same on every CPU.

    torch's GELU is no reference here: its vectorized float32 kernel differs by CPU (on
    AVX-512 it was off by 1.05e-6 at x = -3.488 where ours was within 1.6e-7).
    """
    x = np.linspace(-8, 8, 20001)
    exact = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(minilm.erf(x) - exact)) <= ERF_MAX_ERROR
    assert minilm.erf(np.array([0.0]))[0] == 0.0
    np.testing.assert_array_equal(minilm.erf(-x), -minilm.erf(x))  # odd by construction
    # gelu(x) = x/2 (1 + erf(x / sqrt 2)): the erf error is scaled by |x| / 2, then the
    # float32 result is rounded once (half an ulp of the output)
    x32 = x.astype(np.float32)
    x64 = x32.astype(np.float64)
    exact_gelu = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x64])
    got = minilm.gelu(x32)
    assert got.dtype == np.float32
    bound = np.abs(x64) / 2 * ERF_MAX_ERROR + np.spacing(np.abs(got)).astype(np.float64) / 2
    err = np.abs(got.astype(np.float64) - exact_gelu)
    assert np.all(err <= bound), f"worst at x = {x32[np.argmax(err / bound)]}: {err.max():.3g}"


def test_gelu_in_pieces_is_gelu_of_the_whole_array() -> None:
    """gelu runs piece by piece on every core: the bytes of the one-expression formula, for a
    shape that spans pieces unevenly, with signed zeros, infinities, NaN and subnormals."""
    from xnnquant.compute.special import GELU_PIECE, erf

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, GELU_PIECE + 7)) * 4).astype(np.float32)
    x[0, :6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40]
    with np.errstate(invalid="ignore"):
        whole = (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(np.float32)
        got = minilm.gelu(x)
    assert got.shape == x.shape and got.dtype == np.float32
    assert got.tobytes() == whole.tobytes()


def _float64(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in weights.items()}


def _torch_layer(weights: dict[str, np.ndarray], index: int) -> torch.nn.TransformerEncoderLayer:
    p = f"encoder.layer.{index}."
    layer = torch.nn.TransformerEncoderLayer(
        d_model=minilm.HIDDEN, nhead=minilm.HEADS, dim_feedforward=1536, dropout=0.0,
        activation="gelu", layer_norm_eps=minilm.LAYER_NORM_EPS, batch_first=True, norm_first=False,
    )
    t = {k: torch.from_numpy(v.copy()) for k, v in weights.items() if k.startswith(p)}
    qkv = ("attention.self.query", "attention.self.key", "attention.self.value")
    state = {
        "self_attn.in_proj_weight": torch.cat([t[p + n + ".weight"] for n in qkv]),
        "self_attn.in_proj_bias": torch.cat([t[p + n + ".bias"] for n in qkv]),
        "self_attn.out_proj.weight": t[p + "attention.output.dense.weight"],
        "self_attn.out_proj.bias": t[p + "attention.output.dense.bias"],
        "linear1.weight": t[p + "intermediate.dense.weight"],
        "linear1.bias": t[p + "intermediate.dense.bias"],
        "linear2.weight": t[p + "output.dense.weight"],
        "linear2.bias": t[p + "output.dense.bias"],
        "norm1.weight": t[p + "attention.output.LayerNorm.weight"],
        "norm1.bias": t[p + "attention.output.LayerNorm.bias"],
        "norm2.weight": t[p + "output.LayerNorm.weight"],
        "norm2.bias": t[p + "output.LayerNorm.bias"],
    }
    layer = layer.to(next(iter(t.values())).dtype)
    layer.load_state_dict(state)
    return layer.eval()


def _torch_embeddings(weights: dict[str, np.ndarray], ids: np.ndarray) -> torch.Tensor:
    t = {k: torch.from_numpy(v.copy()) for k, v in weights.items() if k.startswith("embeddings.")}
    ids_t = torch.from_numpy(ids)
    e = (torch.nn.functional.embedding(ids_t, t["embeddings.word_embeddings.weight"])
         + t["embeddings.position_embeddings.weight"][: ids.shape[1]]
         + t["embeddings.token_type_embeddings.weight"][0])
    return torch.nn.functional.layer_norm(e, (minilm.HIDDEN,), t["embeddings.LayerNorm.weight"],
                                          t["embeddings.LayerNorm.bias"], eps=minilm.LAYER_NORM_EPS)


#: Tolerances of our float32 forward pass against the float64 references.  The error is
#: float32 rounding only; the summation order (which differs by CPU) changes which
#: rounding errors occur, not their size.  Each K-term dot product is off by at most
#: gamma(K) sum|terms| in any order (u = 2^-24); here K <= 1536 and sum|terms| <= 196
#: (layer 0's FFN down projection), a worst case of 1.8e-2 that needs every rounding
#: error to have the same sign.  Rounding errors of mixed sign grow like sqrt(K) u
#: sum|terms| instead (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), and measured
#: against float64 the layers are within 1.4e-6, the embeddings 4e-7 and the sentence
#: embeddings 1.1e-7: each tolerance is about 100 times its measurement, far below what
#: a wrong weight, head split, mask or LayerNorm epsilon changes (>= 1e-3).
EMBED_ATOL = 2e-5
LAYER_ATOL, LAYER_RTOL = 2e-4, 1e-4
SENTENCE_ATOL = 2e-5


def test_two_layers_match_torch_transformer_encoder(weights: dict[str, np.ndarray]) -> None:
    ids, mask = minilm.tokenize_batch(SENTENCES)
    ours = minilm.forward(ids, mask, num_layers=2, weights=weights)
    exact = _float64(weights)
    with torch.no_grad():
        h = _torch_embeddings(exact, ids)
        assert h.dtype == torch.float64
        np.testing.assert_allclose(minilm.embed(ids, weights)[mask], h.numpy()[mask], atol=EMBED_ATOL, rtol=0)
        for index in range(2):
            # the reference layer runs on our previous output, so each layer is checked alone
            h_in = torch.from_numpy(ours[index - 1].output.astype(np.float64)) if index else h
            ref = _torch_layer(exact, index)(h_in, src_key_padding_mask=torch.from_numpy(~mask))
            np.testing.assert_allclose(ours[index].output[mask], ref.numpy()[mask], atol=LAYER_ATOL, rtol=LAYER_RTOL)


def test_sentence_embeddings_match_a_six_layer_torch_encoder(weights: dict[str, np.ndarray]) -> None:
    ids, mask = minilm.tokenize_batch(SENTENCES)
    exact = _float64(weights)
    with torch.no_grad():
        h = _torch_embeddings(exact, ids)
        for index in range(minilm.NUM_LAYERS):  # the torch chain never sees our activations
            h = _torch_layer(exact, index)(h, src_key_padding_mask=torch.from_numpy(~mask))
        m = torch.from_numpy(mask[..., None].astype(np.float64))
        expected = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1).numpy()
    ours = minilm.sentence_embeddings(SENTENCES, weights)
    assert ours.shape == (len(SENTENCES), minilm.HIDDEN) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, atol=SENTENCE_ATOL, rtol=0)


def test_sentence_embeddings_rank_paraphrases_first(weights: dict[str, np.ndarray]) -> None:
    e = minilm.sentence_embeddings(
        ["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell sharply today."],
        weights,
    )
    cos = e @ e.T
    assert cos[0, 1] > 0.7 and cos[0, 2] < 0.2, cos


def test_linear_inputs_are_the_tensors_each_linear_sees(weights: dict[str, np.ndarray]) -> None:
    acts = minilm.linear_inputs(SENTENCES[:3], num_layers=1, weights=weights)
    ids, mask = minilm.tokenize_batch(SENTENCES[:3])
    tokens = int(mask.sum())
    assert set(acts) == {f"encoder.layer.0.{n}" for n in minilm.LINEARS}
    assert acts["encoder.layer.0.output.dense"].shape == (tokens, 1536)
    assert all(a.dtype == np.float32 and a.shape[0] == tokens for a in acts.values())
    layer0 = minilm.forward(ids, mask, 1, weights)[0]
    np.testing.assert_array_equal(acts["encoder.layer.0.intermediate.dense"], layer0.inputs["intermediate.dense"][mask])
    # the layer input of layer 0 is the embedding output
    np.testing.assert_array_equal(acts["encoder.layer.0.attention.self.query"], minilm.embed(ids, weights)[mask])


def test_short_names_and_errors() -> None:
    assert minilm.short_name("encoder.layer.3.attention.self.query.weight") == "L3 query"
    assert minilm.short_name("encoder.layer.5.output.dense.weight") == "L5 ffn_down"
    with pytest.raises(XnnquantError, match="not an encoder weight name"):
        minilm.short_name("pooler.dense.weight")
    with pytest.raises(XnnquantError, match="num_layers out of range: got 7"):
        minilm.forward(np.zeros((1, 2), np.int64), np.ones((1, 2), bool), num_layers=7, weights={})
    with pytest.raises(XnnquantError, match="non-empty sequence"):
        minilm.tokenize_batch("just a string")
