"""Rotation of a decoder's residual stream (``rotation="hadamard"``) and the matrices behind it.

Oracles: the Hadamard property checked exactly on integers (``H H^T = n I``); torch's float
model (a float32 program with the rotation folded in computes the model's function: its
logits agree with transformers' to float rounding, ``RTOL``); the weights the program holds
against the rotation applied by hand with numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from float_bounds import APPROXIMATED

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.schemes.rotation import hadamard, rotation

#: float32 rounding of a 2-layer decoder of width 64, rotated: sums over 64 channels in another
#: order and XNNPACK's softmax and SiLU (measured below 1e-6 of the logits' largest magnitude;
#: on any CPU ``float_bounds.APPROXIMATED``)
RTOL = APPROXIMATED
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 36, 60, 76, 128, 576, 896, 960, 1536])
def test_hadamard_matrices(n: int) -> None:
    h = hadamard(n)
    assert h is not None and h.shape == (n, n) and set(np.unique(h)) <= {-1, 1}
    assert np.array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))


def test_rotations_are_orthogonal_and_seeded() -> None:
    for n in (576, 18):  # 18 has no Hadamard matrix built here: a random orthogonal one
        q = rotation(n, seed=3)
        np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-12)
        np.testing.assert_array_equal(q, rotation(n, seed=3))
    assert hadamard(18) is None
    assert not np.array_equal(rotation(64, seed=0), rotation(64, seed=1))


def _decoder(family: str, **sizes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {**COMMON, **sizes}
    model = {"llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
             "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=32)),
             "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32))}[family]().eval()
    with torch.no_grad():  # norm scales that are not all ones, so folding them is tested
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


#: widths that are not powers of 2: SmolLM2-135M's are 576 and 1536 (Hadamard matrices of 12 * 2^k),
#: and 18 has no Hadamard matrix here (a random orthogonal rotation of the stream)
WIDTHS = {"llama": {}, "gemma": {}, "qwen3": {}, "llama 48/96": dict(hidden_size=48, intermediate_size=96),
          "llama 18/40": dict(hidden_size=18, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1)}


@pytest.mark.xnnpack
@pytest.mark.parametrize("case", list(WIDTHS))
def test_a_rotated_float_program_computes_the_model(case: str) -> None:
    """Tied and scaled tables (gemma), q/k norms (qwen3), widths that are not powers of 2: the
    rotated program, stepped, gives transformers' logits."""
    model = _decoder(case.split()[0], **WIDTHS[case])
    exported = xq.export_llm(model, max_context=16, weights="fp32", embeddings=None, rotation="hadamard",
                             progress=False)
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    llm = xq.LLM(exported)
    got = [llm.forward(ids[0, :5].tolist(), 0)] + [llm.forward([int(ids[0, i])], i) for i in range(5, 8)]
    np.testing.assert_allclose(np.stack(got), want[4:], rtol=0, atol=RTOL * float(np.abs(want).max()))
    online = [row for row in exported.report if "online rotation" in row.fallback]
    assert len(online) == 4 and all(row.scheme == "fp32" for row in online)  # o_proj and down_proj inputs


@pytest.mark.xnnpack
def test_the_weights_are_rotated_as_by_hand() -> None:
    """q_proj holds (W diag(g)) Q; down_proj holds Q^T W R_B with R_B = blockdiag(H_B / sqrt(B))."""
    from xnnquant.frontend.passes.rotation import SEED

    model = _decoder("llama")
    exported = xq.export_llm(model, max_context=16, weights="fp32", embeddings=None, rotation="hadamard",
                             progress=False, check=False)
    q = rotation(64, SEED)
    layer = model.model.layers[0]
    w_q = layer.self_attn.q_proj.weight.detach().numpy().astype(np.float64)
    g = layer.input_layernorm.weight.detach().numpy().astype(np.float64)
    w_down = layer.mlp.down_proj.weight.detach().numpy().astype(np.float64)
    r = np.kron(np.eye(1), hadamard(128) / np.sqrt(128))
    filters = [v.array() for graph in exported.delegates for v in graph.values
               if v.is_constant and len(v.dims) == 2]
    for want in ((w_q * g[None, :]) @ q, q.T @ w_down @ r):
        assert any(f.shape == want.shape and np.allclose(f, want, atol=1e-6) for f in filters)


@pytest.mark.xnnpack
def test_a_block_that_is_not_a_power_of_2_is_the_int4_group_and_quantized_as_by_hand() -> None:
    """Under qb4w:128, down_proj's 96 input channels are one int4 group of 96 (the largest multiple
    of 32 up to 128 dividing 96), and its online rotation one block of 96 (a Paley Hadamard
    matrix, 12 x 8): the program holds exactly ``quantize_blockwise(Q^T W R_96, 96)`` with
    ``R_96 = H_96 / sqrt(96)``, and the self-check (each node against torch, with its stored
    filter) passes.  o_proj's 48 channels, which no multiple of 32 divides, rotate in blocks of 16."""
    from xnnquant.frontend.passes.rotation import SEED

    model = _decoder("llama", hidden_size=48, intermediate_size=96)
    exported = xq.export_llm(model, max_context=16, weights="qb4w:128", embeddings=None, rotation="hadamard",
                             progress=False)
    assert "passed" in str(exported.self_check)
    hadamards = sorted(v.dims for graph in exported.delegates for v in graph.values
                       if v.is_constant and len(v.dims) == 2 and v.dims[0] == v.dims[1])
    assert (16, 16) in hadamards and (96, 96) in hadamards, hadamards
    q = rotation(48, SEED)
    held = [v.quantized_tensor() for graph in exported.delegates for v in graph.values
            if v.is_constant and v.datatype is xq.Datatype.qbint4]
    for layer in model.model.layers:
        w = q.T @ layer.mlp.down_proj.weight.detach().numpy()  # as the pass computes it: Q^T W, then the blocks
        w = (w.reshape(48, 1, 96) @ (hadamard(96) / np.sqrt(96))).reshape(48, 96)
        want = xq.quantize_blockwise(w.astype(np.float32), group_size=96, method="mse")
        assert any(t.shape == (48, 96) and t.group_size == 96 and np.array_equal(t.codes, want.codes)
                   and np.array_equal(t.scale, want.scale) for t in held)


class _Normed(torch.nn.Module):
    """A token table read through ``h * rsqrt(mean(h^2) + shift)`` by a linear: an RMS norm when
    ``shift`` is a number (its eps), no norm a rotation commutes with when it is a vector."""

    def __init__(self, vector: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.shift = torch.nn.Parameter(torch.rand(8) + 0.5) if vector else 1e-6
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.lin(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.shift))


class _StreamAsTable(torch.nn.Module):
    """The residual stream read as an embedding table (rows of ``h`` looked up by id)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.emb(ids))


def test_what_a_rotation_cannot_be_folded_into_is_refused() -> None:
    phi = tf.PhiForCausalLM(tf.PhiConfig(**COMMON)).eval()
    with pytest.raises(UnsupportedConfigError, match=r"aten.layer_norm.default .* is a layer norm reading the stream: "
                                                     r"it subtracts the mean, which a rotation changes"):
        xq.export_llm(phi, max_context=16, rotation="hadamard", progress=False)

    class Stream(torch.nn.Module):  # returns the residual stream itself
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids) * 2

    with pytest.raises(UnsupportedConfigError, match="is an output of the program: a rotation would change it"):
        xq.export(Stream().eval(), (torch.tensor([[1, 2]]),), weights="fp32", rotation="hadamard", progress=False)
    with pytest.raises(XnnquantError, match=r"rotation must be None or one of 'hadamard': got 'givens'"):
        xq.export(Stream().eval(), (torch.tensor([[1, 2]]),), rotation="givens")
    with pytest.raises(UnsupportedConfigError, match="looks up no constant embedding table"):
        xq.export(torch.nn.Linear(4, 4).eval(), (torch.randn(1, 4),), rotation="hadamard", progress=False)


@pytest.mark.xnnpack
def test_an_rms_norm_adds_a_number_and_the_stream_is_no_table() -> None:
    """``_norm_core`` takes an add of one eps to the mean, not of a vector; an embedding lookup in
    the stream itself is refused (both were taken before, the self-check left to catch them)."""
    ids = torch.tensor([[1, 2, 5]])
    exported = xq.export(_Normed(vector=False).eval(), (ids,), weights="fp32", rotation="hadamard", progress=False)
    assert "passed" in str(exported.self_check)  # an eps: an RMS norm, rotated (the control)
    with pytest.raises(UnsupportedConfigError, match=r"aten.pow.Tensor_Scalar .* squares the stream outside an RMS "
                                                     r"norm"):  # a vector added to the mean: refused, even unchecked
        xq.export(_Normed(vector=True).eval(), (ids,), weights="fp32", rotation="hadamard", progress=False,
                  check=False)
    with pytest.raises(UnsupportedConfigError, match=r"aten.embedding.default .* reads the stream, and a rotation "
                                                     r"does not commute with it"):
        xq.export(_StreamAsTable().eval(), (torch.tensor([1, 2, 5]),), weights="fp32", rotation="hadamard",
                  progress=False, check=False)
