"""transformers Llama-family models as Meta-format checkpoints (``xnnquant.models.meta_format``).

The oracle is ExecuTorch's own eager llama ``Transformer`` (``examples/models/llama``, the
model its ``export_llama`` recipe exports) against transformers' model: the same logits at
every position, to float32 rounding, in both directions of the rotary row permutation
(transformers -> Meta checkpoint -> ExecuTorch; ExecuTorch's random weights -> transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from xnnquant.errors import XnnquantError  # noqa: E402
from xnnquant.models import meta_format  # noqa: E402
from xnnquant.models.meta_format import meta_checkpoint, meta_transformer, to_hf_rows, to_meta_rows  # noqa: E402

pytestmark = pytest.mark.xnnpack  # ExecuTorch's llama Transformer comes with the executorch wheel

TOKENS = torch.tensor([[3, 17, 42, 8, 0, 63, 21, 5, 9]])
#: largest |difference| of logits relative to the largest |logit|: two float32 computations of the
#: same function (summations in other orders, rotations as complex pairs vs rotate_half) differ
#: by a few float32 epsilons per layer; a wrong permutation or name gives order-1 differences
TOLERANCE = 1e-5


def tiny_config(cls: type = transformers.LlamaConfig, **overrides: object) -> object:
    """2 layers, GQA (4 query heads, 2 key/value heads of 8 dims), vocab 64."""
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    fields.update(overrides)
    return cls(**fields)


def random_model(config: object, seed: int = 0) -> object:
    """A transformers causal LM with every weight random (norm weights around 1), float32, eval."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    return model


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def et_logits(model: object, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(transformers' logits, ExecuTorch's Transformer's on the Meta checkpoint), [1, n, vocab] each."""
    meta_checkpoint(model, tmp_path)
    transformer = meta_transformer(tmp_path, max_context=16)
    with torch.no_grad():
        return model(TOKENS).logits, transformer(TOKENS)


def test_rows_move_as_drawn() -> None:
    """One head of 4 dims: transformers' rows (q0, q1 | q0', q1') hold Meta's pairs (q0, q0'), (q1, q1')."""
    hf = torch.tensor([[10.0], [11.0], [20.0], [21.0], [30.0], [31.0], [40.0], [41.0]])  # 2 heads
    meta = to_meta_rows(hf, n_heads=2)
    assert meta.flatten().tolist() == [10, 20, 11, 21, 30, 40, 31, 41]
    assert torch.equal(to_hf_rows(meta, n_heads=2), hf)
    bias = torch.arange(16.0)  # 1-D (a q/k bias), 2 heads of 8
    assert torch.equal(to_hf_rows(to_meta_rows(bias, 2), 2), bias)
    assert to_meta_rows(bias, 2)[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_runs_in_executorch_transformer(tmp_path: Path, tied: bool) -> None:
    model = random_model(tiny_config(tie_word_embeddings=tied))
    expected, got = et_logits(model, tmp_path)
    assert got.shape == expected.shape == (1, TOKENS.shape[1], 64)
    assert relative_error(got, expected) < TOLERANCE
    params = json.loads((tmp_path / "params.json").read_text())
    assert params == {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "hidden_dim": 48,
                      "head_dim": 8, "norm_eps": 1e-5, "rope_theta": 10000.0, "use_scaled_rope": False,
                      "use_hf_rope": False}
    state = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert (state["output.weight"].untyped_storage().data_ptr()
            == state["tok_embeddings.weight"].untyped_storage().data_ptr()) is tied


def test_without_the_permutation_the_logits_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: rows left in transformers' order change the model."""
    model = random_model(tiny_config())
    monkeypatch.setattr(meta_format, "to_meta_rows", lambda w, n_heads: w)
    expected, got = et_logits(model, tmp_path)
    assert relative_error(got, expected) > 1e-2


def test_executorch_weights_run_in_transformers(tmp_path: Path) -> None:
    """The other direction: ExecuTorch's Transformer with random weights, its q/k rows put in
    transformers' order (``to_hf_rows``) and its names mapped back, loaded into transformers' Llama."""
    config = tiny_config()
    meta_checkpoint(random_model(config, seed=1), tmp_path)  # params.json for the config
    torch.manual_seed(2)
    transformer = meta_transformer(tmp_path, max_context=16)
    with torch.no_grad():
        for p in transformer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    hf_names = {meta: hf for hf, meta in meta_format._NAMES.items()}
    state = {}
    for name, tensor in transformer.state_dict().items():
        if name == "output.weight":
            state["lm_head.weight"] = tensor
            continue
        layer = name.split(".")[1] if name.startswith("layers.") else ""
        template = name.replace(f"layers.{layer}.", "layers.{}.", 1) if layer else name
        if template not in hf_names:
            continue  # rotary tables, masks
        heads = {"wq": 4, "wk": 2}.get(template.split(".")[-2])
        state["model." + hf_names[template].format(layer)] = to_hf_rows(tensor, heads) if heads else tensor
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k]
    with torch.no_grad():
        assert relative_error(model(TOKENS).logits, transformer(TOKENS)) < TOLERANCE


def test_qwen2_biases_and_llama3_rope_scaling(tmp_path: Path) -> None:
    """q/k/v biases (Qwen2: permuted as their rows) and Llama 3's rotary scaling (ExecuTorch's
    fixed low_freq_factor 1, 8192 positions; with head_dim 8 one frequency is smoothed)."""
    qwen = random_model(tiny_config(transformers.Qwen2Config, use_sliding_window=False))
    expected, got = et_logits(qwen, tmp_path / "qwen2")
    assert json.loads((tmp_path / "qwen2" / "params.json").read_text())["attention_qkv_bias"] is True
    assert relative_error(got, expected) < TOLERANCE
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    llama3 = random_model(tiny_config(rope_parameters=rope, max_position_embeddings=16384))
    expected, got = et_logits(llama3, tmp_path / "llama3")
    params = json.loads((tmp_path / "llama3" / "params.json").read_text())
    assert (params["use_scaled_rope"], params["rope_scale_factor"], params["high_freq_factor"]) == (True, 8, 4)
    assert relative_error(got, expected) < TOLERANCE


def test_refusals_name_what_executorch_cannot_say(tmp_path: Path) -> None:
    cases = [
        (tiny_config(hidden_act="gelu"), "ExecuTorch's llama Transformer computes SiLU MLPs: got hidden_act='gelu'"),
        (tiny_config(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
         "ExecuTorch's llama recipe has no 'linear' rotary scaling: expected 'default' or 'llama3'"),
        (tiny_config(mlp_bias=True), "ExecuTorch's llama Transformer has no MLP biases: got mlp_bias=True"),
        (tiny_config(attention_bias=True), "ExecuTorch's llama Transformer has no output-projection bias: got "
                                           "attention_bias=True (biases on q, k, v and o)"),
        (tiny_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=8),
         "ExecuTorch's llama recipe has no sliding-window attention: got sliding_window=8"),
    ]
    for config, message in cases:
        with pytest.raises(XnnquantError) as info:
            meta_checkpoint(random_model(config), tmp_path)
        assert str(info.value) == message
    qwen3 = random_model(tiny_config(transformers.Qwen3Config, head_dim=8, use_sliding_window=False))
    with pytest.raises(XnnquantError, match=r"^4 parameter\(s\) of Qwen3ForCausalLM have no name in ExecuTorch's "
                                            r"llama Transformer: model\.layers\.0\.self_attn\.q_norm\.weight, "):
        meta_checkpoint(qwen3, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written for a refused model


def test_checkpoint_name_is_not_taken_for_a_quantized_one() -> None:
    """ExecuTorch's Llama2Model reads a checkpoint whose path holds 'int8' or '8da4w' as quantized."""
    assert "int8" not in meta_format.CHECKPOINT and "8da4w" not in meta_format.CHECKPOINT
