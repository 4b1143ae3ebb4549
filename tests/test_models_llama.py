"""The Llama-shaped decoder: its file is a safetensors file, its module computes a Llama layer.

The oracle for the layer is a plain numpy transcription of the formulas in
``xnnquant.models.llama``'s docstring (float64), independent of the torch module.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from xnnquant.models.llama import LlamaConfig, decoder, random_tensors, write_random_safetensors  # noqa: E402

CONFIG = LlamaConfig(hidden=32, intermediate=96, layers=2, heads=4, seq=6)


def test_large_config_has_a_billion_weights() -> None:
    config = LlamaConfig.large()
    assert config.num_parameters == 16 * (4 * 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2048
    assert 4 * config.num_parameters == 4_295_237_632  # 4.3 GB of float32


def test_file_is_read_by_safetensors_with_every_tensor(tmp_path: Path) -> None:
    path = write_random_safetensors(tmp_path / "m.safetensors", CONFIG, seed=3)
    loaded = safetensors_numpy.load_file(str(path))
    expected = dict(random_tensors(CONFIG, seed=3))
    assert set(loaded) == set(expected) == set(CONFIG.shapes())
    for name, array in expected.items():
        assert loaded[name].dtype == np.float32 and loaded[name].tobytes() == array.tobytes(), name
    assert not list(tmp_path.glob(".*"))  # no temporary left


def test_meta_module_holds_every_tensor_of_the_file_and_no_data() -> None:
    module = decoder(CONFIG)
    state = module.state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == CONFIG.shapes()
    assert all(t.is_meta for t in state.values())


def reference_forward(x: np.ndarray, weights: dict[str, np.ndarray], config: LlamaConfig) -> np.ndarray:
    """float64 numpy transcription of the module docstring."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}

    def rms(v: np.ndarray, name: str) -> np.ndarray:
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + config.rms_eps) * w[name]

    def rope(v: np.ndarray) -> np.ndarray:  # (heads, seq, head_dim)
        half = v.shape[-1] // 2
        return v * w["rope_cos"] + np.concatenate([-v[..., half:], v[..., :half]], -1) * w["rope_sin"]

    h = x.astype(np.float64)
    s, d = config.seq, config.head_dim
    for i in range(config.layers):
        p = f"layers.{i}."
        n1 = rms(h, p + "input_layernorm.weight")
        q, k, v = (n1 @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = (t.reshape(s, config.heads, d).transpose(1, 0, 2) for t in (q, k, v))
        scores = rope(q) @ rope(k).transpose(0, 2, 1) / math.sqrt(d) + w["causal_mask"]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        h = h + attn.transpose(1, 0, 2).reshape(s, -1) @ w[p + "self_attn.o_proj.weight"].T
        n2 = rms(h, p + "post_attention_layernorm.weight")
        gate = n2 @ w[p + "mlp.gate_proj.weight"].T
        up = n2 @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(h, "norm.weight")


def test_module_computes_the_documented_layer() -> None:
    x = np.random.default_rng(0).standard_normal((CONFIG.seq, CONFIG.hidden)).astype(np.float32)
    module = decoder(CONFIG, "cpu", seed=5)
    with torch.no_grad():
        got = module(torch.from_numpy(x)[None])[0].numpy()
    expected = reference_forward(x, dict(random_tensors(CONFIG, seed=5)), CONFIG)
    # float32 module against the float64 transcription: a few float32 roundings per op
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert np.isfinite(got).all()
