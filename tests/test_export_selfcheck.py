"""The self-check of every export: a wrong lowering, or a module that computes differently under
export, makes ``xq.export`` raise, naming what differs.

Faults are injected by replacing a registered lowering with a wrong one (each would
otherwise hand back a program that runs and gives wrong numbers), for float and quantized
layers, and by a module that branches on ``torch.compiler.is_exporting()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import SelfCheckError

torch = pytest.importorskip("torch")
nn = torch.nn
aten = torch.ops.aten

from xnnquant.frontend.lowering import LOWERINGS, load_lowerings  # noqa: E402  (needs torch)
from xnnquant.frontend.lowering import linear as linear_family  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)),)


@pytest.fixture
def replaced(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``replaced(op, fn)`` makes ``fn`` the lowering of ``op`` for this test."""
    load_lowerings()

    def replace(op: Any, fn: Any) -> None:
        monkeypatch.setitem(LOWERINGS, op, dataclasses.replace(LOWERINGS[op], fn=fn))

    return replace


def test_a_correct_export_reports_what_its_self_check_compared() -> None:
    exported = xq.export(Block().eval(), _inputs(), weights="qc8w", progress=False)
    check = exported.self_check
    assert check.nodes == 3 and check.worst_node_error < 1e-5
    assert str(check).startswith("self-check passed: 3 nodes of the graph agree with torch on their own inputs")
    assert "check" in exported.timings


def test_a_wrong_float_lowering_is_named(replaced: Any) -> None:
    from xnnquant.frontend.lowering.activations import clamped

    replaced(aten.relu.default, lambda ctx, x: clamped(ctx, x, 0.0, 0.5))  # relu clipped at 0.5: wrong
    with pytest.raises(SelfCheckError, match=r"^self-check failed at aten.relu.default \(node relu, module inner.1\): "
                                             r"output 0 of the lowered graph \(no node of its own\) differs from torch "
                                             r"on the same inputs by "):
        xq.export(Block().eval(), _inputs(), weights="fp32", progress=False)


@pytest.mark.parametrize("weights", ["qc8w", "qb4w:32"])
def test_a_wrong_quantized_lowering_is_named(replaced: Any, weights: str) -> None:
    def no_bias(ctx: Any, x: Any, weight: Any, bias: Any = None) -> Any:
        return linear_family.dense(ctx, ctx.value(x), weight, None)  # the bias dropped

    replaced(aten.linear.default, no_bias)
    with pytest.raises(SelfCheckError, match=r"^self-check failed at aten.linear.default \(node linear, module "
                                             r"inner.0\): output 0 of the lowered graph \(XNNConvert, "
                                             r"XNNFullyConnected\) differs"):
        xq.export(Block().eval(), _inputs(), weights=weights, progress=False)


def test_a_wrong_filter_layout_is_named(replaced: Any) -> None:
    """A convolution whose filter is laid out wrongly (OIHW read as OHWI), under qc8w."""
    from xnnquant.frontend.lowering import conv as conv_family

    def transposed_filter(ctx: Any, x: Any, weight: Any, *args: Any) -> Any:
        return conv_family.conv2d(ctx, x, weight.transpose(2, 3).contiguous(), *args)

    replaced(aten.conv2d.default, transposed_filter)
    module = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)).eval()  # square: the fault keeps every shape
    with pytest.raises(SelfCheckError, match=r"^self-check failed at aten.conv2d.default \(node conv2d, module 0\)"):
        xq.export(module, (torch.randn(1, 3, 9, 9),), weights="qc8w", progress=False)


class Exporting(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if torch.compiler.is_exporting() else x * 3


def test_a_module_that_computes_differently_under_export_is_refused() -> None:
    with pytest.raises(SelfCheckError, match=r"^self-check failed: output 0 of the exported program differs from the "
                                             r"module's eager forward by 0.333 .*torch.export traced another "
                                             r"computation than the module's eager forward"):
        xq.export(Exporting().eval(), (torch.ones(2, 3),), weights="fp32", progress=False)
    exported = xq.export(Exporting().eval(), (torch.ones(2, 3),), weights="fp32", progress=False, check=False)
    assert exported.self_check == "skipped (check=False)" and "check" not in exported.timings


def test_bad_check_argument() -> None:
    with pytest.raises(xq.XnnquantError, match=r"^check must be True or False: got str 'yes'"):
        xq.export(Block().eval(), _inputs(), check="yes", progress=False)


class Threshold(nn.Module):
    """Token ids -> embeddings -> linear -> a comparison: a bool output of float values."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(20, 8)
        self.dense = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.tokens(ids)) > 0


def test_a_discrete_output_that_differs_is_refused_saying_where_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A comparison of float values flips where a value lies within rounding of its threshold
    (XNNPACK and the interpreter round differently): the refusal counts the elements and says
    so, instead of calling every such program assembled wrongly."""
    torch.manual_seed(0)
    module = Threshold().eval()
    ids = torch.tensor([[1, 5, 7, 2]])
    run = xq.Exported.run

    def flipped(self: xq.Exported, *inputs: Any) -> list[np.ndarray]:
        outs = run(self, *inputs)
        outs[0] = outs[0].copy()
        outs[0].flat[0] = not outs[0].flat[0]
        return outs

    monkeypatch.setattr(xq.Exported, "run", flipped)
    with pytest.raises(SelfCheckError, match=r"output 0 \(bool\) of the program on ExecuTorch's runtime differs "
                                                r".* in 1 of 16 elements\. An output of comparisons, argmax or "
                                                r"rounding of float values flips"):
        xq.export(module, (ids,), weights="fp32", progress=False)


class ThresholdAndIds(Threshold):
    """A comparison of float values, and an output of integer arithmetic only."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(ids), ids * 3 + 1


@pytest.mark.parametrize(("output", "message"), [
    (0, r"output 0 \(bool\) .* in 1 of 16 elements\. An output of comparisons, argmax or rounding of float values "
        r"flips"),
    (1, r"output 1 \(int64\) .* in 1 of 4 elements\. It is computed from integer values only, exactly on both "
        r"sides: the program is assembled wrongly; please report it"),
])
def test_an_integer_output_that_differs_is_called_wrong_outright(monkeypatch: pytest.MonkeyPatch, output: int,
                                                                  message: str) -> None:
    """No rounding explains a difference in an output computed from integers only (token ids
    times 3 plus 1): the refusal says the program is wrong, where for a comparison of float
    values it says how rounding can flip it."""
    torch.manual_seed(0)
    ids = torch.tensor([[1, 5, 7, 2]])
    run = xq.Exported.run

    def changed(self: xq.Exported, *inputs: Any) -> list[np.ndarray]:
        outs = run(self, *inputs)
        outs[output] = outs[output].copy()
        outs[output].flat[0] = 0 if outs[output].dtype != bool else not outs[output].flat[0]
        return outs

    monkeypatch.setattr(xq.Exported, "run", changed)
    with pytest.raises(SelfCheckError, match=message):
        xq.export(ThresholdAndIds().eval(), (ids,), weights="fp32", progress=False)
