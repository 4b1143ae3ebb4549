"""pack_gemm against XNNPACK's own packed bytes, captured from operator creation.

The oracle is the real XNNPACK in executorch 1.4.1: ``capture_packed_weights`` creates
the fully-connected operator with a weights cache that copies out whatever XNNPACK packs.
For every operator this CPU has a kernel for, the captured buffer must equal
``pack_gemm`` with the configuration gemm-config.c selects on this CPU, byte for byte.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError
from xnnquant.packing import kernel_configs, pack_gemm

pytestmark = pytest.mark.xnnpack

RNG = np.random.default_rng(20261130)


def _capture():  # imported lazily: collecting the module must not need executorch
    from xnnquant.xnnpack.capture import capture_packed_weights, selected_configs

    return capture_packed_weights, selected_configs()


def qc8(n: int, k: int, rng: np.random.Generator = RNG) -> xq.QuantizedTensor:
    codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
    return xq.QuantizedTensor(xq.Datatype.qcint8, codes, rng.uniform(1e-3, 1, n).astype(np.float32), channel_dim=0)


def qc4(n: int, k: int, rng: np.random.Generator = RNG) -> xq.QuantizedTensor:
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, n).astype(np.float32)
    return xq.QuantizedTensor(xq.Datatype.qcint4, codes, scale, channel_dim=0)


def qb4(n: int, k: int, group: int, rng: np.random.Generator = RNG) -> xq.QuantizedTensor:
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(1e-3, 1, (n, k // group)).astype(ml_dtypes.bfloat16).astype(np.float32)
    return xq.QuantizedTensor(xq.Datatype.qbint4, codes, scale, group_size=group)


def bias_or_none(n: int, with_bias: bool) -> np.ndarray | None:
    return RNG.standard_normal(n).astype(np.float32) * 10 if with_bias else None


def assert_same_bytes(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.size == theirs.size, f"packed size: ours {ours.size}, XNNPACK {theirs.size}"
    diff = np.flatnonzero(ours != theirs)
    assert diff.size == 0, f"{diff.size} bytes differ, first at {diff[:8]}: ours {ours[diff[:8]]}, XNNPACK {theirs[diff[:8]]}"


def check(weight, bias, operator: str) -> None:
    capture, selected = _capture()
    config = selected[operator]
    if config is None:  # the model says XNNPACK has no kernel here: XNNPACK must refuse, not pack
        with pytest.raises(UnsupportedConfigError, match=f"XNNPACK has no {operator} kernel for this CPU"):
            capture(weight, bias, operator=operator)
        return
    captured = capture(weight, bias, operator=operator)
    assert captured.config == config, f"deduced {captured.config}, gemm-config.c selects {config}"
    assert_same_bytes(pack_gemm(weight, bias, config=config), captured.data)


# --- the shapes of the issue: N not a multiple of nr, K not a multiple of kr / odd, bias or not ---

SHAPES = [(1, 1), (3, 5), (7, 13), (13, 21), (16, 64), (33, 67), (70, 130), (300, 4100)]  # the last in row blocks


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("operator", ["qd8_f32_qc8w", "qdu8_f32_qc8w"])
def test_qc8w_signed_and_unsigned_inputs(operator: str, n: int, k: int, with_bias: bool) -> None:
    check(qc8(n, k), bias_or_none(n, with_bias), operator)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("operator", ["qd8_f32_qc4w", "qdu8_f32_qc4w"])
def test_qc4w_signed_and_unsigned_inputs(operator: str, n: int, k: int, with_bias: bool) -> None:
    check(qc4(n, k), bias_or_none(n, with_bias), operator)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k,group", [(1, 32, 32), (13, 64, 32), (9, 128, 64), (19, 256, 256), (8, 512, 256),
                                       (30, 192, 64), (300, 4096, 128)])
@pytest.mark.parametrize("operator", ["qd8_f32_qb4w", "qdu8_f32_qb4w"])
def test_qb4w(operator: str, n: int, k: int, group: int, with_bias: bool) -> None:
    check(qb4(n, k, group), bias_or_none(n, with_bias), operator)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 5), (7, 13), (17, 9), (40, 33), (64, 19), (1001, 7), (1015, 4),
                                 (1007, 2)])
def test_f32(n: int, k: int, with_bias: bool) -> None:
    """Small or awkward N switch XNNPACK to its small-nr f32 table (xnn_use_nr2); large N
    whose last partial tile costs under 1% keep the main one (on AVX2: nr 8 vs nr 16)."""
    from xnnquant.packing.gemm_configs import select_f32_config
    from xnnquant.xnnpack.capture import capture_packed_weights, cpu_features

    weight = RNG.standard_normal((n, k)).astype(np.float32)
    bias = bias_or_none(n, with_bias)
    config = select_f32_config(n, *cpu_features())
    captured = capture_packed_weights(weight, bias, operator="f32")
    assert captured.config == config, f"deduced {captured.config}, gemm-config.c selects {config}"
    assert_same_bytes(pack_gemm(weight, bias, config=config), captured.data)


def test_unsigned_input_falls_back_to_signed_when_the_cpu_has_no_kernel() -> None:
    capture, selected = _capture()
    weight = qc8(5, 9)
    captured = capture(weight)
    expected = "qdu8_f32_qc8w" if selected["qdu8_f32_qc8w"] is not None else "qd8_f32_qc8w"
    assert captured.operator == expected
    assert_same_bytes(pack_gemm(weight, config=captured.config), captured.data)


def test_qdu8_and_qd8_corrections_differ_for_4bit() -> None:
    """Signed nibbles carry a x16 row-sum term (qd8 on SSE2, and the qdu8 VNNI kernels),
    unsigned nibbles a x1 term (the qdu8 "madd" kernels of AVX2 and AVX-512 without VNNI):
    same weights, bytes as the layout the model gives each kernel on this CPU."""
    capture, selected = _capture()
    weight = qc4(4, 16)
    row_sum = int(weight.codes[0].astype(int).sum())
    signed = capture(weight, operator="qd8_f32_qc4w").data
    assert signed[:4].view(np.int32)[0] == -16 * row_sum
    unsigned_config = selected["qdu8_f32_qc4w"]
    if unsigned_config is None:  # SSE2-only CPUs: no unsigned kernel (checked by the shape tests)
        return
    unsigned = capture(weight, operator="qdu8_f32_qc4w").data
    expected = -row_sum if unsigned_config.weights == "qc4uw" else -16 * row_sum
    assert unsigned[:4].view(np.int32)[0] == expected


def test_every_selected_config_is_in_the_table() -> None:
    _, selected = _capture()
    table = kernel_configs()
    for operator, config in selected.items():
        assert config is None or config in table, operator


# --- hypothesis: random shapes, every operator this CPU has, against the real XNNPACK ---

_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(n=st.integers(1, 40), k=st.integers(1, 90), seed=st.integers(0, 2**32 - 1), with_bias=st.booleans(),
       operator=st.sampled_from(["qd8_f32_qc8w", "qd8_f32_qc4w", "qdu8_f32_qc4w"]))
def test_random_per_channel_shapes(n: int, k: int, seed: int, with_bias: bool, operator: str) -> None:
    rng = np.random.default_rng(seed)
    weight = qc8(n, k, rng) if operator.endswith("qc8w") else qc4(n, k, rng)
    check(weight, rng.standard_normal(n).astype(np.float32) if with_bias else None, operator)


@_SETTINGS
@given(n=st.integers(1, 40), blocks=st.integers(1, 4), group=st.sampled_from([32, 64, 256]),
       seed=st.integers(0, 2**32 - 1), with_bias=st.booleans())
def test_random_blockwise_shapes(n: int, blocks: int, group: int, seed: int, with_bias: bool) -> None:
    rng = np.random.default_rng(seed)
    check(qb4(n, blocks * group, group, rng), rng.standard_normal(n).astype(np.float32) if with_bias else None,
          "qd8_f32_qb4w")


@_SETTINGS
@given(n=st.integers(1, 60), k=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), with_bias=st.booleans())
def test_random_f32_shapes(n: int, k: int, seed: int, with_bias: bool) -> None:
    from xnnquant.xnnpack.capture import capture_packed_weights

    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if with_bias else None
    captured = capture_packed_weights(weight, bias, operator="f32")
    assert captured.config is not None, "no f32 configuration reproduces XNNPACK's bytes"
    assert_same_bytes(pack_gemm(weight, bias, config=captured.config), captured.data)


# --- the runtime path: the subgraph ExecuTorch builds, created with xnn_create_runtime_v4 ---


def _runtime_weights():
    yield "f32", RNG.standard_normal((13, 21)).astype(np.float32)
    yield "f32", RNG.standard_normal((1001, 6)).astype(np.float32)
    yield "qc8w", qc8(13, 21)
    yield "qc4w", qc4(13, 67)
    yield "qc4w", qc4(33, 64)
    for group in (32, 64, 256):
        yield "qb4w", qb4(19, 2 * group, group)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kind,weight", list(_runtime_weights()))
def test_runtime_packs_what_pack_gemm_packs(kind: str, weight, with_bias: bool) -> None:
    """The runtime's operator is the one ``runtime_config`` predicts (XNNPACK ranks the
    unsigned- and signed-input kernels by their ISA bit), and its bytes are pack_gemm's."""
    from xnnquant.xnnpack.capture import capture_runtime_packed_weights, runtime_configs, selected_configs

    bias = bias_or_none(weight.shape[0], with_bias)
    captured = capture_runtime_packed_weights(weight, bias)
    if kind == "f32":
        selected = selected_configs()
        assert captured.operator == "f32"
        assert captured.config in (selected["f32"], selected["f32 nr2"])
    else:
        expected = runtime_configs()[kind]
        assert expected is not None
        assert captured.operator == expected.operator
        assert captured.config == expected
    assert_same_bytes(pack_gemm(weight, bias, config=captured.config), captured.data)
