"""Accuracy per byte (issue 44): the emulation of a program's numbers, the ``range`` scales, layer
plans, and one int8 token table serving the lookup and the LM head.

Oracles: ExecuTorch's runtime running the written ``.pte`` from its file (the emulation's
logits, the shared table's bytes read by both kernels), ``xq.quantize_per_token`` (itself
bit-exact with XNNPACK, ``tests/test_schemes_per_token.py``) and hand-computed scales.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

import xnnquant as xq
from xnnquant.frontend.weights import EmbeddingScheme, Layer, LayerKind, LayerPlan, WeightPolicy, WeightScheme
from xnnquant.llm import emulate, evaluate
from xnnquant.metrics import sqnr_db
from xnnquant.pte import read_pte

VOCAB = 512


def _tied_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return tf.LlamaForCausalLM(config).eval()


# ---------------------------------------------------------------- per-token int8, q8_0


def test_per_token_codes_are_quantize_per_token_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 96)).astype(np.float32) * rng.uniform(0.01, 30, (64, 1)).astype(np.float32)
    x[3] = 0  # an all-zero row: scale 1, zero point as XNNPACK's
    x[4] = np.abs(x[4])  # rows of one sign: the range still includes 0
    x[5] = -np.abs(x[5])
    x[6, :8] = np.float32(255 / 7) * np.arange(8)  # products on rounding ties
    want = xq.quantize_per_token(x)
    codes, zero_point, scale = (t.numpy() for t in emulate.per_token_codes(torch.from_numpy(x)))
    assert np.array_equal(codes, want.codes) and np.array_equal(zero_point[:, 0], want.zero_point)
    assert np.array_equal(scale[:, 0].view(np.uint32), want.scale.view(np.uint32))
    assert np.array_equal(emulate.per_token_int8(torch.from_numpy(x)).numpy(), (codes - zero_point) * scale)


def test_q8_0_keeps_blocks_of_32_to_their_half_step() -> None:
    x = torch.randn(4, 64) * torch.tensor([1.0, 100.0]).repeat_interleave(32)
    got = emulate.q8_0(x)
    step = x.reshape(4, 2, 32).abs().amax(-1, keepdim=True) / 127  # fp16 rounding of d adds 2^-11 relative
    assert bool(((got - x).reshape(4, 2, 32).abs() <= step * (0.5 + 127 * 2**-11)).all())
    with pytest.raises(xq.XnnquantError, match="blocks of 32"):
        emulate.q8_0(torch.randn(2, 48))


# ---------------------------------------------------------------- method="range"


def test_range_scales_clip_nothing_and_keep_the_extremes_exactly() -> None:
    w = np.array([[-8.0, 1, 2, 3] * 8, [7.0, -1, 2, 3] * 8, [14.0, -1, 2, 3] * 8, [0.0] * 32], np.float32)
    qt = xq.quantize_blockwise(w, 32, method="range")
    # max(max / 7, -min / 8): 1 (a negative extreme at -8), 1 (a positive one at 7), 2, and 1 for zeros
    assert qt.scale.ravel().tolist() == [1.0, 1.0, 2.0, 1.0]
    assert np.array_equal(qt.dequantize()[:3, 0], w[:3, 0])
    per_channel = xq.quantize_per_channel(w[:3], bits=8, method="range")
    assert np.allclose(per_channel.scale, [8 / 128, 7 / 127, 14 / 127], rtol=1e-7)
    assert np.array_equal(per_channel.codes[:, 0], [-128, 127, 127])


# ---------------------------------------------------------------- layer plans


def test_a_layer_plan_chooses_by_path_and_falls_back_from_the_planned_scheme() -> None:
    plan = LayerPlan.of("qb4w:32", {"model.lm_head": "qc8w", "odd": "qb4w:64"})
    policy = WeightPolicy(plan)
    assert policy.choose(Layer(LayerKind.LINEAR, 64, "model.lm_head")).scheme == WeightScheme.parse("qc8w")
    assert policy.choose(Layer(LayerKind.LINEAR, 64, "other")).scheme == WeightScheme.parse("qb4w:32")
    fell = policy.choose(Layer(LayerKind.LINEAR, 96, "odd"))
    assert str(fell.scheme) == "qb4w:32" and "group size 64 does not divide in_features 96" in fell.note
    assert str(plan) == "qb4w:32 (2 layers planned otherwise)"
    with pytest.raises(xq.XnnquantError, match="unknown the scheme of layer 'x' scheme: got 'int3'"):
        LayerPlan.of("qb4w:32", {"x": "int3"})


# ---------------------------------------------------------------- the program against its emulation


@pytest.fixture(scope="module")
def shared_program(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path, Path]:
    """A tied decoder exported with its head reading the int8 table (``qc8w``, ``range``), and the
    same with the default int4 head; both written to files."""
    model = _tied_llama()
    folder = tmp_path_factory.mktemp("bytes")
    shared = xq.export_llm(model, max_context=32, method="range", progress=False,
                           weights=LayerPlan.of("qb4w:32", {"model.lm_head": "qc8w"}))
    separate = xq.export_llm(model, max_context=32, weights="qb4w:32", method="range", progress=False)
    shared.save(folder / "shared.pte")
    separate.save(folder / "separate.pte")
    return model, folder / "shared.pte", folder / "separate.pte"


@pytest.mark.xnnpack
def test_the_head_reads_the_token_tables_bytes(shared_program: tuple[torch.nn.Module, Path, Path]) -> None:
    model, shared, separate = shared_program
    codes = EmbeddingScheme(8).quantize(model.get_input_embeddings().weight.detach().numpy(), "range").codes
    program = read_pte(shared)
    held = [key for key, blob in program.named_data.items() if bytes(blob) == codes.tobytes()]
    assert held, "the LM head's weight is the table's int8 codes"
    # the table is stored once: the int8 head adds no byte over the int4 head's program but its scales
    int4_head = VOCAB * 64 // 2 + 2 * VOCAB * 64 // 32
    assert shared.stat().st_size < separate.stat().st_size - int4_head + 2 * 4 * VOCAB


@pytest.mark.xnnpack
def test_the_emulation_gives_the_programs_logits(shared_program: tuple[torch.nn.Module, Path, Path]) -> None:
    """Every position's logits of the program, token by token through its cache on ExecuTorch's
    runtime, against the emulated model's on the whole window at once.  They differ by the
    order of float sums (XNNPACK's integer dot products against torch's matmul), which could
    move a per-token code at a rounding tie: measured 134 dB SQNR on this model (float
    rounding).  The bound, 80 dB, leaves room for another CPU's kernels and sits far above
    what the emulation without per-token int8 reaches (the control: measured 42 dB), so a
    wrong activation model fails it."""
    model, shared, _ = shared_program
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    step = evaluate.ProgramStep(shared)
    program = np.stack([step(ids[:, i:i + 1].numpy(), i) for i in range(ids.shape[1])])
    head = emulate.head_name(model)
    table = model.get_input_embeddings().weight.detach().numpy()
    settings = {}
    for name, module in emulate.linear_modules(model).items():
        scheme = WeightScheme.parse("qc8w" if name == head else "qb4w:32")
        stored = scheme.quantize(module.weight.detach().numpy(), "range")
        settings[name] = emulate.LinearSetting(torch.from_numpy(stored.dequantize()), "qd8")
    stored_table = torch.from_numpy(EmbeddingScheme(8).quantize(table, "range").dequantize())
    with emulate.emulated(model, settings, stored_table), torch.no_grad():
        emulated = model(input_ids=ids, use_cache=False).logits[0].numpy()
    weights_only = {name: emulate.LinearSetting(s.weight, "fp32") for name, s in settings.items()}
    with emulate.emulated(model, weights_only, stored_table), torch.no_grad():
        control = model(input_ids=ids, use_cache=False).logits[0].numpy()
    assert sqnr_db(program, emulated) > 80.0
    assert sqnr_db(program, control) < 80.0
    # the model is put back as it was: tied, float
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert np.array_equal(model.get_input_embeddings().weight.detach().numpy(), table)


# ---------------------------------------------------------------- mixed schemes reading one input


@pytest.mark.xnnpack
def test_projections_of_other_schemes_reading_one_input_compute_right(tmp_path: Path) -> None:
    """q, k and v read one fp32 value, converted once to per-token int8 (``linear.py``); with a
    scheme each (qb4w:32, qc4w, qc8w; the MLP's three others), XNNPACK 1.4.1 chooses each
    fully-connected node's kernel (signed or unsigned int8 inputs) and may fuse the conversion
    into it.  The program from its file must still give the emulation's logits (the same
    bound and reason as ``test_the_emulation_gives_the_programs_logits``)."""
    model = _tied_llama()
    chosen = {"self_attn.q_proj": "qb4w:32", "self_attn.k_proj": "qc4w", "self_attn.v_proj": "qc8w",
              "mlp.gate_proj": "qc8w", "mlp.up_proj": "qb4w:64", "mlp.down_proj": "qc4w"}
    layers = {f"model.model.layers.{i}.{name}": scheme for i in range(2) for name, scheme in chosen.items()}
    exported = xq.export_llm(model, max_context=32, method="range", progress=False,
                             weights=LayerPlan.of("qb4w:32", {**layers, "model.lm_head": "qc8w@range"}))
    got = {r.path: r.scheme for r in exported.report}
    assert all(got[path] == scheme for path, scheme in layers.items()), got
    exported.save(tmp_path / "mixed.pte")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    step = evaluate.ProgramStep(tmp_path / "mixed.pte")
    program = np.stack([step(ids[:, i:i + 1].numpy(), i) for i in range(ids.shape[1])])
    settings = {}
    for name, module in emulate.linear_modules(model).items():
        scheme = WeightScheme.parse(layers.get("model." + name, "qc8w" if name == "lm_head" else "qb4w:32"))
        settings[name] = emulate.LinearSetting(torch.from_numpy(scheme.quantize(module.weight.detach().numpy(),
                                                                                "range").dequantize()), "qd8")
    table = EmbeddingScheme(8).quantize(model.get_input_embeddings().weight.detach().numpy(), "range")
    with emulate.emulated(model, settings, torch.from_numpy(table.dequantize())), torch.no_grad():
        emulated = model(input_ids=ids, use_cache=False).logits[0].numpy()
    assert sqnr_db(program, emulated) > 80.0


def test_auto_plans_within_its_budget_by_estimated_effect() -> None:
    """``weights="auto:B"``: the layers' bytes stay within B bits a weight; the smallest budget
    keeps every layer at qb4w:32, a budget above qc8w's cost upgrades every one; the upgrades
    taken are those of the most estimated NLL a byte; the tied head reads the int8 table."""
    from xnnquant.llm import mixed

    model = _tied_llama()
    tokens = [torch.randint(3, VOCAB, (1, 32), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    numel = sum(m.weight.numel() for n, m in emulate.linear_modules(model).items() if n != "lm_head")
    for bits in (4.5, 6.0, 8.6):
        plan, rows = mixed.plan_weights(model, bits, "range", tokens, prefix="model.", head_reads_table=True)
        assert sum(r.nbytes for r in rows) <= bits / 8 * numel
        head = next(r for r in rows if r.path == "model.lm_head")
        assert head.scheme == "qc8w@range" and head.nbytes == 0
        layers = [r for r in rows if r is not head]
        upgraded = [r for r in layers if r.scheme == "qc8w"]
        if bits == 4.5:
            assert not upgraded
        elif bits == 8.6:
            assert len(upgraded) == len(layers)
        else:
            assert 0 < len(upgraded) < len(layers)

            def rate(r: mixed.PlanRow) -> float:
                extra = WeightScheme.parse("qc8w").stored_nbytes(r.shape) - WeightScheme.parse(
                    "qb4w:32").stored_nbytes(r.shape)
                return (r.cost["qb4w:32"] - r.cost["qc8w"]) / extra

            kept = [r for r in layers if r.scheme == "qb4w:32"]
            # an upgrade not taken ranks below every one taken, unless it did not fit the budget left
            left = bits / 8 * numel - sum(r.nbytes for r in rows)
            for r in kept:
                extra = WeightScheme.parse("qc8w").stored_nbytes(r.shape) - r.nbytes
                assert rate(r) <= min(map(rate, upgraded)) or extra > left
        assert str(plan.scheme("model.lm_head")) == "qc8w@range"
    with pytest.raises(xq.XnnquantError, match=r"weights='auto:B' takes B, the bits a weight .* got 'auto:3'"):
        mixed.parse_auto("auto:3")


def test_export_llm_weights_auto_follows_its_plan() -> None:
    model = _tied_llama()
    calibration = [torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    exported = xq.export_llm(model, max_context=32, weights="auto:6", method="range", calibration=calibration,
                             progress=False, check=False)
    stored = {r.path: r.scheme for r in exported.report}
    assert {r.path: r.scheme for r in exported.plan} == {p: stored[p] for p in (r.path for r in exported.plan)}
    assert {"qb4w:32", "qc8w"} <= set(stored.values()) and stored["model.lm_head"] == "qc8w@range"
