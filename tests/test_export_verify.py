"""xq.verify: outputs compared three ways, and the first diverging node found exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
from export_models import MODELS

import xnnquant as xq
from xnnquant.graph import interpreter

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack


@pytest.fixture(scope="module")
def transformer() -> tuple:
    module, inputs = MODELS["transformer"]()
    return module, inputs, xq.export(module, inputs, weights="qb4w:32", progress=False)


def test_a_correct_export_verifies(transformer: tuple) -> None:
    module, inputs, exported = transformer
    report = xq.verify(exported, inputs, module)
    assert report.ok and report.first_divergence is None
    assert report.nodes_checked == sum(1 for n in exported.graph.nodes if n.kind != "XNNConvert")
    pairs = [c.pair for c in report.comparisons]
    assert pairs == ["runtime-interpreter", "runtime-module", "interpreter-module"]
    # quantization error shows between runtime and module; runtime and interpreter agree far better
    by_pair = {c.pair: c.sqnr_db for c in report.comparisons}
    assert by_pair["runtime-interpreter"] > by_pair["runtime-module"] + 20 and 25 < by_pair["runtime-module"] < 50
    assert str(report).splitlines()[-1].startswith(f"no node diverges: {report.nodes_checked} nodes checked")
    # the same check from payload bytes (no module paths known then)
    assert xq.verify(exported.to_bytes(), inputs).ok


def test_a_fault_in_one_handler_is_named_and_nothing_earlier(transformer: tuple,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _module, inputs, exported = transformer
    softmax = interpreter.HANDLERS["XNNSoftmax"]

    def faulty(node: object, args: list[np.ndarray]) -> list[np.ndarray]:
        (out,) = softmax(node, args)
        out = out.copy()
        out[..., 0] += 1e-3  # a small fault: one column off by a thousandth
        return [out]

    monkeypatch.setitem(interpreter.HANDLERS, "XNNSoftmax", faulty)
    report = xq.verify(exported, inputs)
    first = next(i for i, n in enumerate(exported.graph.nodes) if n.kind == "XNNSoftmax")
    divergence = report.first_divergence
    assert divergence is not None and divergence.index == first and divergence.kind == "XNNSoftmax"
    assert divergence.source is not None and divergence.source[0] == "aten.softmax.int"
    assert 1e-4 < divergence.relative_error < 1e-2
    assert str(report).splitlines()[-1] == f"first diverging node: {divergence}"
    assert not report.ok and math.isfinite(report.worst_node_error)


def test_bad_subjects() -> None:
    with pytest.raises(xq.XnnquantError, match="verify takes an Exported, a Graph, payload bytes or a path: got int"):
        xq.verify(3, [])
