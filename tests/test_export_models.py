"""xq.export -> .pte -> the real XNNPACK, against the float module, for every weights value.

Models (tests/export_models.py): an MLP; a small CNN (convolution, depthwise, pooling,
hardswish, a residual add); a MobileNet-style network (inverted residuals with batch
norm, squeeze-and-excitation, SiLU and hardswish); a transformer block (linear, bmm,
softmax, layer norm, GELU, residuals).  Two oracles per export:

* the float module: output SQNR at least the bound of the scheme (below);
* the reference interpreter, node by node on the runtime's own intermediate values
  (``xq.verify``): no node may differ by more than 1e-4 of its output's range, so every
  lowering and every kernel is right, whatever quantization costs.

The program itself is run through ``executorch.runtime`` from ``to_pte()`` bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from export_models import FALLBACK, MODELS

import xnnquant as xq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack

WEIGHTS = ("fp32", "qc8w", "qc4w", "qb4w:32")

# Output SQNR (dB) against the float module each scheme must reach.  Measured on AMD Zen 2
# (the lowest over the four models, both targets): fp32 131 (float32 sums in other orders),
# qc8w 41.5 (int8 weights and per-token int8 activations), qc4w 18.9, qb4w:32 20.4 (the
# MLP, whose 3 layers all take the scheme).  The bounds sit 6 dB (4x in noise power) below
# the measurements: other CPUs round the same ties another way.
MIN_SQNR_DB = {"fp32": 100.0, "qc8w": 35.0, "qc4w": 13.0, "qb4w:32": 14.0}


def _sqnr(reference: np.ndarray, approx: np.ndarray) -> float:
    ref = reference.astype(np.float64)
    return 10 * math.log10(np.sum(ref**2) / np.sum((approx.astype(np.float64) - ref) ** 2))


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> tuple[str, object, tuple, object, list[np.ndarray]]:
    module, inputs = MODELS[request.param]()
    program = torch.export.export(module, inputs, strict=False)  # exported once, lowered per scheme
    with torch.no_grad():
        out = module(*inputs)
    return request.param, module, inputs, program, [out.numpy()]


def _run_pte(pte: bytes, inputs: tuple) -> list[np.ndarray]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    method = program.load_method("forward")
    return [np.array(r.numpy()) for r in method.execute(list(inputs))]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_export_runs_on_xnnpack_close_to_the_float_module(model: tuple, weights: str) -> None:
    name, _module, inputs, program, expected = model
    exported = xq.export(program, weights=weights, fallback=FALLBACK, progress=False)
    got = _run_pte(exported.to_pte(), inputs)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        assert _sqnr(e, g) >= MIN_SQNR_DB[weights], f"{name} {weights}: {_sqnr(e, g):.1f} dB"
    report = xq.verify(exported, inputs)
    assert report.ok, f"{name} {weights}: {report}"
    # every weight is in the report, and a fallback is always said
    assert all(row.scheme == weights or row.fallback for row in exported.report)
    assert all(not row.fallback or row.fallback.startswith(f"{weights}: ") for row in exported.report)


@pytest.mark.parametrize("name", ["mobilenet", "transformer"])
def test_xn01_target_uses_xn01_kinds_only(name: str) -> None:
    """The same models with target "xn01": no 1.4.1 node kind, and the same accuracy."""
    from xnnquant.graph.layout import XN01_NODE_KINDS

    module, inputs = MODELS[name]()
    with torch.no_grad():
        expected = module(*inputs).numpy()
    for weights in ("fp32", "qb4w:32"):
        exported = xq.export(module, inputs, weights=weights, fallback=FALLBACK, target="xn01", progress=False)
        assert {n.kind for n in exported.graph.nodes} <= set(XN01_NODE_KINDS)
        (got,) = exported.run(*inputs)
        assert _sqnr(expected, got) >= MIN_SQNR_DB[weights]
        assert xq.verify(exported, inputs).ok


def test_layouts_need_no_transpose_between_nhwc_nodes() -> None:
    """Convolutions, batch norms, activations, SE and pooling stay NHWC: the MobileNet-style
    model needs one transpose, at its input (ExecuTorch's boundary transposes)."""
    module, inputs = MODELS["mobilenet"]()
    exported = xq.export(module, inputs, weights="fp32", progress=False)
    kinds = [n.kind for n in exported.graph.nodes]
    assert kinds.count("XNNStaticTranspose") == 1 and kinds[0] == "XNNStaticTranspose"
    # batch norms folded, relu6 / hardswish kept as nodes or bounds, no XNNClamp left after a conv
    assert "XNNClamp" not in kinds
    assert kinds.count("XNNConv2d") + kinds.count("XNNDepthwiseConv2d") == 3


def test_clamps_fuse_into_output_bounds() -> None:
    module, inputs = MODELS["mlp"]()
    exported = xq.export(module, inputs, weights="fp32", progress=False)
    nodes = exported.graph.nodes
    assert [n.kind for n in nodes] == ["XNNFullyConnected"] * 3
    assert (nodes[0].output_min, nodes[0].output_max) == (0.0, 6.0)  # relu6
    assert (nodes[1].output_min, nodes[1].output_max) == (0.0, math.inf)  # relu
    assert nodes[2].output_min is None


def test_report_and_fallback_text() -> None:
    module, inputs = MODELS["cnn"]()
    exported = xq.export(module, inputs, weights="qb4w:32", fallback=("qc8w", "fp32"), progress=False)
    rows = {row.path: row for row in exported.report}
    assert [(p, r.scheme) for p, r in rows.items()] == [
        ("stem", "qc8w"), ("dw", "fp32"), ("pw", "qb4w:32"), ("conv", "qc8w"), ("head", "qb4w:32")]
    assert rows["stem"].fallback == ("qb4w:32: XNNPACK has no 4-bit convolution (its quantized convolutions take "
                                     "int8 filters); took fallback qc8w")
    assert rows["dw"].fallback == ("qb4w:32: XNNPACK has no 4-bit convolution (its quantized convolutions take int8 "
                                   "filters); fallback qc8w: XNNPACK has no dynamically quantized depthwise "
                                   "convolution; took fallback fp32")
    assert rows["pw"].fallback == "" and rows["pw"].shape == (32, 32)  # a 1x1 convolution is a linear
    assert rows["dw"].shape == (1, 3, 3, 32) and rows["stem"].shape == (32, 3, 3, 3)  # XNNPACK's filter layouts
    assert math.isinf(rows["dw"].sqnr_db) and 40 < rows["stem"].sqnr_db < 60 and 15 < rows["head"].sqnr_db < 30
    lines = str(exported).splitlines()
    assert lines[0] == "xnnquant export: weights qb4w:32, method mse, target 1.4.1; 16 nodes, 27 values"
    total = next(line for line in lines if line.startswith("total: "))
    assert total.startswith("total: 5 weights, 21,248 parameters, ") and total.endswith(", 3 fallback(s)")
    assert lines[-1].startswith("fully connected kernels on this machine, ")  # after the total, per CPU


def test_auto_fallback_gives_each_layer_the_most_compact_scheme_it_takes() -> None:
    module, inputs = MODELS["cnn"]()
    with pytest.warns(xq.FallbackWarning, match=r"^3 of 5 layers could not take weights='qb4w:32' \(1 took fp32, 2 "
                                                r"took qc8w\); print\(exported\) gives each layer's reason$") as caught:
        rows = {row.path: row for row in xq.export(module, inputs, weights="qb4w:32", progress=False).report}
    assert caught[0].filename == __file__  # the caller's line, not the library's wrapper around export
    assert [(p, r.scheme) for p, r in rows.items()] == [
        ("stem", "qc8w"), ("dw", "fp32"), ("pw", "qb4w:32"), ("conv", "qc8w"), ("head", "qb4w:32")]
    assert rows["stem"].fallback == ("qb4w:32: XNNPACK has no 4-bit convolution (its quantized convolutions take "
                                     "int8 filters); took qc8w (fallback='auto')")
    assert rows["dw"].fallback == ("qb4w:32: XNNPACK has no 4-bit convolution (its quantized convolutions take "
                                   "int8 filters); took fp32 (fallback='auto')")
    with pytest.raises(xq.UnsupportedConfigError, match=r"layer 'stem' cannot take its weights: qb4w:32: XNNPACK has "
                                                         r"no 4-bit convolution .*\(pass fallback='auto'\)"):
        xq.export(module, inputs, weights="qb4w:32", fallback=None, progress=False)
