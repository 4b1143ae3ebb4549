"""Modules quantized by torchao's ``quantize_`` (0.18), exported with ``xq.export``: the
``.pte`` holds torchao's codes and scales bit for bit (read back with ``read_pte``), or the
export refuses the layer saying why (``frontend/prequantized.py``).

Numbers are compared with the torchao module itself on the ExecuTorch 1.4.1 runtime.  A
weight-only layer computes ``x @ (codes * scale)^T`` in float32 on both sides: ``FLOAT_BOUND``
(float32 sums of 64 products in another order, relative to the output's largest
magnitude).  A dynamic-activation layer quantizes its input per row on both sides, torchao
with its own parameters (symmetric for ``Int8Tensor``, asymmetric for
``IntxUnpackedToInt8Tensor``, as XNNPACK), XNNPACK asymmetric: each input element is off by
at most half a step of each side's quantization, so an output by at most
``(s_torchao + s_xnnpack) / 2 * sum_k |w_k|`` (``_activation_bound``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import xnnquant as xq

torch = pytest.importorskip("torch")
quantization = pytest.importorskip("torchao.quantization")
granularity = pytest.importorskip("torchao.quantization.granularity")
pytestmark = pytest.mark.xnnpack

FLOAT_BOUND = 1e-5  # see the module docstring
PerAxis, PerGroup = granularity.PerAxis, granularity.PerGroup

CONFIGS: dict[str, tuple[Any, str, bool]] = {  # name: (config, the scheme stored, dynamic activations)
    "int8-dynamic-int8": (lambda: quantization.Int8DynamicActivationInt8WeightConfig(), "qc8w", True),
    "int8-weight-only": (lambda: quantization.Int8WeightOnlyConfig(), "qc8w", False),
    "8da4w-per-axis": (lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerAxis(0)), "qc4w", True),
    "8da8w-per-axis": (lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int8, weight_granularity=PerAxis(0)), "qc8w", True),
    "8da4w-g32-bf16-scales": (lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(32), weight_scale_dtype=torch.bfloat16), "qb4w:32", True),
    "int4-weight-only-per-axis": (lambda: quantization.IntxWeightOnlyConfig(
        weight_dtype=torch.int4, granularity=PerAxis(0)), "qc4w", False),
}


def _model(k: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(k, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()


def _quantized(config: Any, unwrapped: bool, k: int = 64) -> torch.nn.Module:
    from torchao.utils import unwrap_tensor_subclass

    model = _model(k)
    quantization.quantize_(model, config)
    if unwrapped:  # the form ExecuTorch's own tests export: the codes behind parametrizations
        unwrap_tensor_subclass(model)
    return model


def _fully_connected_filters(pte: bytes) -> list[Any]:
    from xnnquant.pte import read_pte

    filters = []
    for delegate in read_pte(pte).delegates:
        graph = delegate.graph
        filters += [graph.value(n.inputs[1]).quantized_tensor() for n in graph.nodes if n.kind == "XNNFullyConnected"]
    return filters


@pytest.mark.parametrize("unwrapped", [False, True], ids=["subclass", "parametrized"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torchao_codes_and_scales_are_exported_bit_for_bit(name: str, unwrapped: bool) -> None:
    make, scheme, dynamic = CONFIGS[name]
    model = _quantized(make(), unwrapped)
    weights = [(layer.weight.qdata.numpy(), layer.weight.scale.float().numpy()) for layer in (model[0], model[2])]
    exported = xq.export(model, (torch.randn(3, 64),), weights="fp32", progress=False)
    label = f"{scheme} (torchao)" if dynamic else f"{scheme} fp32 activations (torchao)"
    assert [(row.path, row.scheme) for row in exported.report] == [("0", label), ("2", label)]
    filters = _fully_connected_filters(exported.to_pte())
    assert len(filters) == 2
    for stored, (codes, scale) in zip(filters, weights):
        np.testing.assert_array_equal(stored.codes, codes)
        assert stored.scale.dtype == np.float32
        np.testing.assert_array_equal(stored.scale.reshape(scale.shape), scale)  # bf16 scales: exact in float32
    # the module is put back as it was: torchao's tensors, behind their parametrizations when unwrapped
    assert type(model[0].weight).__name__ in ("Int8Tensor", "IntxUnpackedToInt8Tensor")
    assert hasattr(model[0], "parametrizations") == unwrapped


def _activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output, the bound of the module docstring for a linear ``x @ w.T`` (torchao's step: the
    larger of the symmetric and asymmetric ones; plus 1e-6 for the float32 sums' order)."""
    top, low = np.maximum(x.max(-1), 0), np.minimum(x.min(-1), 0)
    symmetric, asymmetric = np.maximum(top, -low) / 127, (top - low) / 255
    half_steps = (np.maximum(symmetric, asymmetric) + asymmetric) / 2
    return half_steps[:, None] * np.abs(w).sum(-1)[None, :] + 1e-6


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_torchao_linear_runs_as_torchao_computes_it(name: str) -> None:
    make, _, dynamic = CONFIGS[name]
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 16).eval()
    quantization.quantize_(model, make())
    exported = xq.export(model, (torch.randn(5, 64),), weights="fp32", progress=False)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    (got,) = exported.run(x)
    with torch.no_grad():
        want = model(x).numpy()
        w = model.weight.dequantize().numpy()
    if dynamic:
        assert np.all(np.abs(got - want) <= _activation_bound(x.numpy(), w))
    else:
        assert np.abs(got - want).max() <= FLOAT_BOUND * np.abs(want).max()


def test_odd_in_features_with_dynamic_int4_per_axis_is_stored_as_qc8w() -> None:
    """XNNPACK's qd8 x qc4w kernels compute an odd in_features wrongly: the int4 codes go into
    qc8w (the same codes and scales, one byte each)."""
    config = quantization.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerAxis(0))
    torch.manual_seed(0)
    model = torch.nn.Linear(63, 8).eval()
    quantization.quantize_(model, config)
    exported = xq.export(model, (torch.randn(2, 63),), weights="fp32", progress=False)
    (stored,) = _fully_connected_filters(exported.to_pte())
    assert stored.datatype is xq.Datatype.qcint8
    np.testing.assert_array_equal(stored.codes, model.weight.qdata.numpy())


def test_activations_are_read_in_every_spelling_export_takes() -> None:
    """``activations="Dynamic"`` is ``"dynamic"`` to ``xq.export``, so torchao's codes are kept (it was
    refused as static int8 once); static int8, however spelled, is refused: it would quantize the
    layers again."""
    model = _quantized(CONFIGS["8da4w-g32-bf16-scales"][0](), unwrapped=False)
    example = (torch.randn(3, 64),)
    want = xq.export(model, example, weights="fp32", progress=False).to_bytes()
    for spelling in ("Dynamic", " DYNAMIC"):
        assert xq.export(model, example, weights="fp32", activations=spelling, progress=False).to_bytes() == want
    for static in ("QInt8", xq.StaticInt8()):
        with pytest.raises(xq.UnsupportedConfigError, match=r"rewrites the program into static int8"):
            xq.export(model, example, weights="qc8w", activations=static, calibration=[example], progress=False)


def test_check_reports_the_torchao_layers() -> None:
    model = _quantized(CONFIGS["8da4w-g32-bf16-scales"][0](), unwrapped=False)
    report = xq.check(model, (torch.randn(3, 64),), weights="fp32")
    assert report.ok and [(row.path, row.scheme) for row in report.weights] == [("0", "qb4w:32 (torchao)"),
                                                                              ("2", "qb4w:32 (torchao)")]


@pytest.mark.parametrize(("config", "reason"), [
    (lambda: quantization.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                weight_granularity=PerGroup(32)),
     "its group scales are float32 that bf16 does not hold exactly, and XNNPACK stores blockwise scales as bf16: "
     "quantize with weight_scale_dtype=torch.bfloat16 to export them bit for bit"),
    (lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerAxis(0),
        weight_mapping_type=quantization.MappingType.ASYMMETRIC),
     "its weights have zero points (an asymmetric mapping): XNNPACK's int8 and int4 weights are symmetric; quantize "
     "with weight_mapping_type=MappingType.SYMMETRIC"),
    (lambda: quantization.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8,
                                                                weight_granularity=PerGroup(32)),
     "int8 codes in groups of 32: XNNPACK has no blockwise int8 weights (expected PerAxis(0), or int4 codes)"),
    (lambda: quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(16), weight_scale_dtype=torch.bfloat16),
     "groups of 16: XNNPACK's blockwise int4 takes groups that are multiples of 32"),
    (lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
     "a weight-only config in groups of 32 (activations kept in float): XNNPACK's blockwise int4 weights take int8 "
     "dynamic activations only; quantize with Int8DynamicActivationIntxWeightConfig, or PerAxis(0)"),
], ids=["fp32-group-scales", "asymmetric", "int8-groups", "group-16", "weight-only-groups"])
def test_torchao_codes_xnnpack_has_no_scheme_for_are_refused_by_layer(config: Any, reason: str) -> None:
    model = _quantized(config(), unwrapped=False)
    with pytest.raises(xq.UnsupportedConfigError) as refused:
        xq.export(model, (torch.randn(3, 64),), weights="fp32", progress=False)
    assert str(refused.value) == ("the module holds weights torchao quantized, and their codes and scales cannot be "
                                  f"exported:\n  - layer '0': {reason}\n  - layer '2': {reason}")


def test_codes_and_scales_read_in_another_layout_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reading is checked against torchao's own ``dequantize()``: scales read in another
    layout than torchao's (here: each row's scales swapped with the next row's) are refused."""
    from xnnquant.frontend import prequantized
    from xnnquant.tensor import QuantizedTensor

    read = prequantized._stored_as

    def misread(weight: Any) -> Any:
        stored, why = read(weight)
        q = stored.quantized
        wrong = QuantizedTensor(q.datatype, q.codes, np.roll(q.scale, 1, axis=0), channel_dim=0,
                                group_size=q.group_size)
        return prequantized.Stored(wrong, stored.dynamic), why

    monkeypatch.setattr(prequantized, "_stored_as", misread)
    model = _quantized(CONFIGS["8da4w-g32-bf16-scales"][0](), unwrapped=False)
    with pytest.raises(xq.UnsupportedConfigError, match="do not give torchao's own dequantized weight"):
        xq.export(model, (torch.randn(3, 64),), weights="fp32", progress=False)
