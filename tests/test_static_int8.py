"""Static int8 exports (``activations="qint8"``): every op XNNPACK runs in int8 runs in int8, and the
program's int8 codes are the reference interpreter's, bit for bit, on the real runtime.

Oracles: the real XNNPACK inside executorch 1.4.1 (``graph.run``, and every intermediate value
through ``graph.divergence.first_divergence``, which compares int8 codes exactly), torch (the
float module, and the self-check that every export runs), hand-made faults the self-check must
catch.  No tolerance on codes: ``interpret`` and the runtime must agree exactly.  The float
SQNR bounds are far below what the programs reach (they hold on any CPU: the int8 arithmetic
is exact, only torch's float reference moves by ulps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import xnnquant as xq
from xnnquant.errors import SelfCheckError, XnnquantError
from xnnquant.frontend.static_int8 import equalization
from xnnquant.frontend.static_int8 import rewrite as rewriting
from xnnquant.graph import interpret, run
from xnnquant.graph.divergence import first_divergence
from xnnquant.graph.rules import DATA_MOVEMENT
from xnnquant.models import cnn

pytestmark = pytest.mark.xnnpack

SHAPE = (1, 4, 8, 8)


def batches(count: int, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g),) for _ in range(count)]


def export(module: nn.Module, shape: tuple[int, ...] = SHAPE, **kw: Any) -> xq.Exported:
    cal = batches(16, shape)
    kw.setdefault("activations", "qint8")
    return xq.export(module.eval(), cal[0], weights="qc8w", calibration=cal, progress=False, **kw)


def sqnr(reference: np.ndarray, got: np.ndarray) -> float:
    r, g = reference.astype(np.float64), got.astype(np.float64)
    noise = float(np.sum((r - g) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(r * r)) / noise)


def assert_runtime_is_interpreter(exported: xq.Exported, inputs: list[torch.Tensor], exact: bool = True) -> None:
    """Every node's int8 codes on the real runtime equal the interpreter's on the runtime's own
    inputs to that node (fp32 nodes: within ``TOLERANCE``), and the program's outputs are the
    interpreter's exactly (``exact``: the last node is an int8 one, dequantized)."""
    arrays = [np.ascontiguousarray(x.numpy()) for x in inputs]
    divergence, checked, _ = first_divergence(exported.graph, arrays, exported.sources)
    assert divergence is None, str(divergence)
    assert checked == len(exported.graph.nodes)
    if exact:
        got, ref = run(exported.to_bytes(), arrays), interpret(exported.graph, arrays)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)


class Branches(nn.Module):
    """``op(conv_a(x), conv_b(x))``: two int8 activations meet in one op."""

    def __init__(self, op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b, self.op = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.a(x), self.b(x))


class Lambda(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _conv_then(fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), Lambda(fn))


#: case -> (module factory, input shape, the node kind that must compute in int8)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]] = {
    "conv + batch norm + relu": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8),
                                                       nn.ReLU()), SHAPE, "XNNConv2d"),
    "grouped conv, dilated": (lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), SHAPE, "XNNConv2d"),
    "depthwise conv + relu6": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, groups=4), nn.ReLU6()), SHAPE,
                               "XNNDepthwiseConv2d"),
    "pointwise conv": (lambda: nn.Conv2d(4, 5, 1), SHAPE, "XNNFullyConnected"),
    "linear": (lambda: nn.Linear(8, 5), (1, 3, 8), "XNNFullyConnected"),
    "add": (lambda: Branches(torch.add), SHAPE, "XNNAdd"),
    "subtract": (lambda: Branches(torch.sub), SHAPE, "XNNSubtract"),
    "multiply": (lambda: Branches(torch.mul), SHAPE, "XNNMultiply"),
    "concatenate": (lambda: Branches(lambda a, b: torch.cat([a, b], 1)), SHAPE, "XNNConcatenate2"),
    "max pooling": (lambda: _conv_then(lambda y: nn.functional.max_pool2d(y, 3, 2, 1)), SHAPE, "XNNMaxPooling2d"),
    "mean": (lambda: _conv_then(lambda y: y.mean((2, 3))), SHAPE, "XNNGlobalAvgPooling2d"),
    "hardswish": (lambda: _conv_then(nn.functional.hardswish), SHAPE, "XNNHardswish"),
    "sigmoid": (lambda: _conv_then(torch.sigmoid), SHAPE, "XNNSigmoid"),
    "silu": (lambda: _conv_then(nn.functional.silu), SHAPE, "XNNMultiply"),
    "tanh": (lambda: _conv_then(torch.tanh), SHAPE, "XNNTanh"),
    "gelu": (lambda: _conv_then(nn.functional.gelu), SHAPE, "XNNGelu"),
    "leaky relu": (lambda: _conv_then(lambda y: nn.functional.leaky_relu(y, 0.1)), SHAPE, "XNNLeakyReLU"),
    "clamp": (lambda: _conv_then(lambda y: torch.clamp(y, -0.3, 0.4) * 1.0), SHAPE, "XNNConv2d"),
    "resize bilinear": (lambda: _conv_then(lambda y: nn.functional.interpolate(y, scale_factor=2, mode="bilinear")),
                        SHAPE, "XNNStaticResizeBilinear2D"),
    "pad": (lambda: _conv_then(lambda y: nn.functional.pad(y, (1, 2, 0, 1))), SHAPE, "XNNStaticConstantPad"),
    "slice": (lambda: _conv_then(lambda y: y[:, 1:5, 2:7]), SHAPE, "XNNStaticSlice"),
    "flatten + linear": (lambda: nn.Sequential(nn.Conv2d(4, 3, 3), nn.Flatten(), nn.Linear(108, 7)), SHAPE,
                         "XNNStaticReshape"),
    "transpose": (lambda: _conv_then(lambda y: y.transpose(1, 3).contiguous() + 0), SHAPE, "XNNConv2d"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_op_runs_in_int8_and_the_runtime_gives_the_interpreters_codes(case: str) -> None:
    make, shape, kind = CASES[case]
    module = make().eval()
    exported = export(module, shape)
    graph = exported.graph
    # in int8: only the graph's edges convert, and the op's node writes a qint8 value
    assert [b.split(":")[0] for b in exported.boundaries] == ["input 0", "output 0"], exported.boundaries
    assert any(n.kind == kind and graph.value(n.outputs[0]).datatype is xq.Datatype.qint8 for n in graph.nodes)
    assert sum(n.kind == "XNNConvert" for n in graph.nodes) == 2
    assert exported.self_check.int8_nodes == exported.self_check.nodes
    evaluation = [x for (x,) in batches(3, shape, seed=9)]
    for x in evaluation:
        assert_runtime_is_interpreter(exported, [x])
    with torch.no_grad():
        reference = np.concatenate([module(x).numpy() for x in evaluation])
    got = np.concatenate([exported.run(x)[0] for x in evaluation])
    # measured 19 dB (a linear's 15 outputs per batch: few samples for its range) to 48 dB
    assert sqnr(reference, got) > 15


@pytest.mark.parametrize("make", [cnn.residual, cnn.inverted_residual])
def test_whole_networks_run_bit_exact_and_close_to_float(make: Callable[[], nn.Module]) -> None:
    module = make()
    cal = [(torch.from_numpy(x),) for x in cnn.random_batches(16, 1)]
    exported = xq.export(module, cal[0], weights="qc8w", activations="qint8", calibration=cal, progress=False)
    assert [b.split(":")[0] for b in exported.boundaries] == ["input 0", "output 0"]
    assert exported.static_int8.int8.equalized  # cross-layer equalization found pairs
    evaluation = [torch.from_numpy(x) for x in cnn.random_batches(4, 2)]
    assert_runtime_is_interpreter(exported, evaluation[:1])
    with torch.no_grad():
        reference = np.concatenate([module(x).numpy() for x in evaluation])
    got = np.concatenate([exported.run(x)[0] for x in evaluation])
    assert sqnr(reference, got) > 38  # measured 45 dB on both


def test_ops_without_an_int8_form_stay_fp32_between_converts_and_are_reported() -> None:
    module = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.AvgPool2d(2), nn.Conv2d(6, 6, 1), nn.Softmax(1))
    exported = export(module)
    lines = exported.boundaries
    assert lines[0].startswith("input 0: fp32 -> qint8")
    assert any(b.startswith("aten.avg_pool2d.default (node avg_pool2d, module 1): XNNPACK 1adaa7c7 has no qint8 "
                            "AvgPooling2d") for b in lines), lines
    assert any(b.startswith("aten.softmax.int (node softmax, module 3): XNNPACK 1adaa7c7 has no qint8 Softmax")
               for b in lines), lines
    # the 1x1 convolution between them reads and feeds fp32 nodes only: fp32 too (the converts
    # around its 6 x 6 filter would cost more than int8 saves)
    assert any(b.startswith("aten.conv2d.default (node conv2d_1, module 2): it reads and feeds only fp32 values")
               for b in lines), lines
    kinds = {n.kind: exported.graph.value(n.outputs[0]).datatype.name for n in exported.graph.nodes}
    assert kinds["XNNAvgPooling2d"] == "fp32" and kinds["XNNSoftmax"] == "fp32" and kinds["XNNConv2d"] == "qint8"
    assert "boundaries (4)" in str(exported)
    assert_runtime_is_interpreter(exported, [batches(1, seed=4)[0][0]], exact=False)  # ends with a float softmax


def test_compositions_stay_fp32_with_their_reason() -> None:
    exported = export(_conv_then(nn.functional.hardsigmoid))
    assert any("aten.hardsigmoid.default" in b and "a composition of 2 computing nodes" in b
               for b in exported.boundaries), exported.boundaries


def test_silu_computes_in_int8_within_its_derived_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """silu is ``x * sigmoid(x)``, two int8 nodes: the sigmoid's rounding, half its step times
    ``|x|``, comes on top of the multiply's own half step (``check.py``).  The self-check holds
    the output to that bound, and refuses it with the half step alone, which the program
    exceeds (so the bound is not loose by construction); silu's sigmoid has its own grid.  One
    of its nodes refused makes both fp32 (else the self-check would judge a half-int8 silu as an
    fp32 node)."""
    from xnnquant.frontend.static_int8 import check

    module = _conv_then(nn.functional.silu)
    exported = export(module)
    assert [b.split(":")[0] for b in exported.boundaries] == ["input 0", "output 0"], exported.boundaries
    kinds = [(n.kind, exported.graph.value(n.outputs[0]).datatype) for n in exported.graph.nodes]
    assert ("XNNSigmoid", xq.Datatype.qint8) in kinds and ("XNNMultiply", xq.Datatype.qint8) in kinds
    ratio = rewriting.Rewrite._ratio_refusal
    with monkeypatch.context() as patch:  # its multiply refused alone: the sigmoid goes fp32 with it
        patch.setattr(rewriting.Rewrite, "_ratio_refusal",
                      lambda self, n: "refused here" if n.kind == "XNNMultiply" else ratio(self, n))
        halves = export(module)
    kinds = [(n.kind, halves.graph.value(n.outputs[0]).datatype) for n in halves.graph.nodes]
    assert ("XNNSigmoid", xq.Datatype.fp32) in kinds and ("XNNMultiply", xq.Datatype.fp32) in kinds, kinds
    monkeypatch.setattr(check.Int8Check, "slack", lambda self, vid: check.DEFAULT_SLACK)
    with pytest.raises(SelfCheckError, match=r"self-check failed at aten.silu.default .* output steps \(bound 0.5"):
        export(module)


def test_calibration_choices_are_options() -> None:
    module = CASES["depthwise conv + relu6"][0]()
    for ranges in ("minmax", "percentile", "mse", "output_mse"):
        choice = xq.StaticInt8(ranges=ranges, equalize=False, bias_correction=False)
        exported = export(module, activations=choice)
        assert exported.activations == str(choice)
    assert str(xq.StaticInt8()) == "qint8"
    assert str(xq.StaticInt8(ranges="percentile", percentile=99.9)) == "qint8(ranges=percentile@99.9)"
    assert str(xq.StaticInt8(ranges="mse", equalize=False)) == "qint8(ranges=mse, equalize=False)"
    assert str(xq.StaticInt8(bias_correction=False)) == "qint8(bias_correction=False)"


@pytest.mark.parametrize("example_batch", [1, 2])
def test_a_batch_of_stacked_examples_calibrates_as_the_examples_one_by_one(example_batch: int) -> None:
    """A program of ``(n, 4, 8, 8)`` calibrated with batches of ``m * n`` images along dim 0 (16 for
    a program of one) runs them as ``m`` of its inputs, in order: the same bytes as the same
    images given one input at a time (with percentile ranges, which every image moves).  A
    batch whose dim 0 is not a multiple of the program's is refused, naming it."""
    module = CASES["conv + batch norm + relu"][0]().eval()
    images = torch.randn((16, *SHAPE[1:]), generator=torch.Generator().manual_seed(2))
    one_by_one = [(images[i:i + example_batch],) for i in range(0, 16, example_batch)]
    stacked = [(images[:8],), (images[8:12],), *one_by_one[12 // example_batch:]]
    choice = xq.StaticInt8(ranges="percentile", percentile=99.0)

    def export_with(calibration: list[Any]) -> bytes:
        return xq.export(module, one_by_one[0], weights="qc8w", activations=choice, calibration=calibration,
                         progress=False).to_bytes()

    reference = export_with(one_by_one)
    assert export_with(stacked) == reference
    assert export_with(one_by_one[:-1]) != reference  # the oracle can tell: one input fewer changes the ranges
    with pytest.raises(XnnquantError, match=r"calibration batch 0, input 0 \('input'\) has shape \(3, 4, "):
        export_with([(images[:3],)]) if example_batch == 2 else export_with([(images[:3, :, :7],)])


@pytest.mark.parametrize("case", ["fully connected, 4 rows", "fully connected, 3 x 5 rows", "convolution, 2 images"])
def test_bias_correction_reads_the_input_means_of_every_row_and_tap(case: str) -> None:
    """The means bias correction reads (``layer.means``) are the mean over every calibration
    row (fully connected) or over every image and output position per tap (torch's ``unfold``,
    padding read as zeros), whatever the program's batch dims: a program of 4 rows once
    divided them by 4 (its images counted from dim 0 of the program's input)."""
    g = torch.Generator().manual_seed(3)
    if case.startswith("fully"):
        shape = (4, 16) if "4 rows" in case else (3, 5, 16)
        module: nn.Module = nn.Linear(16, 8)
        cal = [(torch.randn(shape, generator=g) + 2,) for _ in range(6)]
        rows = torch.cat([x.reshape(-1, 16) for (x,) in cal]).double()
        want = rows.mean(0).numpy()
    else:
        module = nn.Conv2d(3, 8, 3, stride=2, padding=1, dilation=2)
        cal = [(torch.randn((2, 3, 9, 9), generator=g) + 2,) for _ in range(6)]
        taps = torch.cat([nn.functional.unfold(x.double(), 3, dilation=2, padding=1, stride=2) for (x,) in cal])
        want = taps.mean((0, 2)).reshape(3, 3, 3).permute(1, 2, 0).numpy()  # (C, KH, KW) -> (KH, KW, C)
    exported = xq.export(module.eval(), cal[0], weights="qc8w", activations=xq.StaticInt8(equalize=False),
                         calibration=cal, progress=False)
    (layer,) = exported.static_int8.int8.layers
    assert layer.means.shape == want.shape
    np.testing.assert_allclose(layer.means, want, rtol=1e-6)  # float32 inputs summed in float64


# ------------------------------------------------------------------ the self-check


def test_a_stored_bias_that_is_not_the_float_one_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = rewriting.quantize_bias

    def shifted(b: Any, s_x: Any, s_w: Any) -> xq.QuantizedTensor:
        q = real(b, s_x, s_w)
        return xq.QuantizedTensor(q.datatype, q.codes + 40, q.scale, 0, channel_dim=q.channel_dim)

    monkeypatch.setattr(rewriting, "quantize_bias", shifted)
    with pytest.raises(SelfCheckError, match=r"its stored int32 bias is not its float bias plus its bias correction"):
        export(CASES["conv + batch norm + relu"][0](), activations=xq.StaticInt8(bias_correction=False))


def test_an_equalization_applied_on_one_side_only_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(equalization.FloatFilters, "scale_input", lambda self, n, factors: None)
    module = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    with pytest.raises(SelfCheckError, match=r"its equalized float filter is not the module's filter times its "
                                             r"equalization factors"):
        export(module)


def test_an_equalization_through_relu6_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Factors through a ReLU6 move where the clamp cuts each channel (applied on both sides,
    so the filters alone look right): the rewrite leaves such groups alone, and the self-check
    refuses them if it did not, whether the clamp is fused into a convolution or into the add
    of a residual group (the check used to look at filtered nodes only, and passed the latter)."""
    module = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU6(), nn.Conv2d(8, 4, 3, padding=1))
    assert not export(module).static_int8.int8.equalized
    residual = AddReLU6()
    assert not export(residual).static_int8.int8.equalized
    monkeypatch.setattr(equalization, "scale_invariant", lambda n: True)
    with pytest.raises(SelfCheckError, match=r"equalized through XNNConv2d's clamp to \[0, 6\] with factors from"):
        export(module)
    with pytest.raises(SelfCheckError, match=r"equalized through XNNAdd's clamp to \[0, 6\] with factors from"):
        export(residual)
    relu = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    assert export(relu).static_int8.int8.equalized  # a ReLU commutes with them: equalized


class AddReLU6(nn.Module):
    """Two convolutions added, the sum through ReLU6 (fused into the add), then read by a third:
    the clamp sits on the add, not on a filtered node."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(4, 8, 3, padding=1)
        self.c = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(nn.functional.relu6(self.a(x) + self.b(x)))


def test_a_wrong_node_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 convolution emitted with an output bound the module does not have (a ReLU at 0.1
    out of nowhere) differs from torch by many steps."""
    real = rewriting.Rewrite._emit_int8

    def emit(self: Any, n: Any) -> None:
        real(self, n)
        node = self.out.nodes[-1]
        if node.kind == "XNNConv2d":
            node.output_min, node.output_max = 0.1, math.inf

    monkeypatch.setattr(rewriting.Rewrite, "_emit_int8", emit)
    with pytest.raises(SelfCheckError, match=r"self-check failed at aten.conv2d.default .* output steps"):
        export(nn.Sequential(nn.Conv2d(4, 6, 3), nn.Conv2d(6, 3, 3)))


# ------------------------------------------------------------------ bad input


def test_bad_calibration_is_refused_naming_the_tensor() -> None:
    module = nn.Sequential(nn.Conv2d(4, 6, 3)).eval()
    example = batches(1)[0]
    cases: list[tuple[Any, str]] = [
        ([], "calibration= is empty: expected at least one batch of inputs"),
        ([*batches(2), (torch.randn(1, 4, 9, 9),)],
         "calibration batch 2, input 0 ('input') has shape (1, 4, 9, 9): dim 2 is fixed at 8 (expected shape "
         "(1, 4, 8, 8))"),
        ([(torch.randn(SHAPE, dtype=torch.float64),)],
         "calibration batch 0, input 0 is torch.float64 of shape (1, 4, 8, 8): expected torch.float32 of rank 4, as "
         "example input 0 (1, 4, 8, 8)"),
        ([*batches(2), (torch.full(SHAPE, math.nan),)],
         "calibration: input 0 ('input') is not finite on calibration batch 2 (value nan at flat index 0): static int8 "
         "needs finite activations to choose their ranges"),
    ]
    for calibration, message in cases:
        with pytest.raises(XnnquantError) as caught:
            xq.export(module, example, weights="qc8w", activations="qint8", calibration=calibration, progress=False)
        assert str(caught.value) == message


def test_a_constant_activation_is_refused_naming_it() -> None:
    conv = nn.Conv2d(4, 6, 3)
    with torch.no_grad():
        conv.weight.zero_()
        conv.bias.fill_(-1.0)  # relu(-1) = 0 everywhere
    module = nn.Sequential(conv, nn.ReLU(), nn.Conv2d(6, 2, 1))
    with pytest.raises(XnnquantError) as caught:
        export(module)
    assert str(caught.value) == (
        "calibration: the output of aten.conv2d.default (node conv2d, module 0; XNNConv2d value 4) is 0 on every "
        "calibration input (a constant activation): its int8 range would be empty; calibrate with inputs that "
        "exercise it, or remove it")


def test_static_int8_options_are_checked() -> None:
    module, example = nn.Conv2d(4, 6, 3).eval(), batches(1)[0]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"weights": "qc8w", "activations": "qint8"},
         "activations='qint8' fixes every activation's scale and zero point at export: pass calibration= (an "
         "iterable of input tuples, e.g. 16 or more batches)"),
        ({"weights": "qb4w:32", "activations": "qint8", "calibration": batches(2)},
         "activations='qint8' computes every layer in int8 with per-channel int8 filters: weights must be 'qc8w', "
         "got 'qb4w:32'"),
        ({"weights": "qc8w", "activations": "int8"},
         "unknown activations: got 'int8', expected one of 'dynamic', 'qint8' or an xq.StaticInt8(...)"),
        ({"weights": "qc8w", "activations": "qint8", "calibration": batches(2), "method": "gptq"},
         "activations='qint8' chooses its filters' scales with 'minmax' or 'mse': got method 'gptq'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(XnnquantError) as caught:
            xq.export(module, example, progress=False, **kwargs)
        assert str(caught.value) == message
    with pytest.raises(XnnquantError, match=r"^unknown activation range method: got 'median', expected one of "
                                            r"'sensitivity', 'minmax', 'percentile', 'mse', 'output_mse'$"):
        xq.StaticInt8(ranges="median")
    with pytest.raises(XnnquantError, match=r"^budget=0.5 chooses the nodes to keep in fp32 .* got ranges='mse'"):
        xq.StaticInt8(budget=0.5, ranges="mse")  # it was silently ignored
    assert xq.StaticInt8(rounding=" Learned ").rounding == "learned"  # case and spaces ignored, as ranges


def test_the_cli_exports_static_int8(tmp_path: Any) -> None:
    from xnnquant.cli import main

    out = tmp_path / "residual.pte"
    assert main(["export", "xnnquant.models.cnn:example", "-o", str(out), "--weights", "qc8w", "--activations",
                 "qint8", "--calibration", "xnnquant.models.cnn:calibration", "--no-progress"]) == 0
    from xnnquant.pte import read_pte

    graph = read_pte(out.read_bytes()).delegates[0].graph
    assert sum(n.kind == "XNNConv2d" and graph.value(n.outputs[0]).datatype is xq.Datatype.qint8
               for n in graph.nodes) == 15  # 12 3x3 convolutions, 3 strided 1x1 shortcuts


# ------------------------------------------------- sensitivity ranges, mixed precision


class _Zoo(nn.Module):
    """Every kind ``torch_graph`` computes in a CNN: convolutions (strided, depthwise, grouped),
    batch norm, ReLU6, hardswish, max and average pooling, a pad, a concatenation, a residual
    add, global pooling and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(4, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU6())
        self.dw = nn.Conv2d(8, 8, 3, 1, 1, groups=8)
        self.grouped = nn.Conv2d(8, 8, 1, groups=2)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = y + self.grouped(nn.functional.hardswish(self.dw(y)))
        z = torch.cat([nn.functional.max_pool2d(y, 2), nn.functional.avg_pool2d(nn.functional.pad(y, (0, 1, 0, 1)),
                                                                                   2, ceil_mode=False)[:, :, :2, :2]], 1)
        return self.fc(z.mean((2, 3)))


@pytest.fixture(scope="module")
def zoo() -> tuple[nn.Module, xq.Exported]:
    torch.manual_seed(0)  # its figures (the mixed-precision test's margin) are of these weights
    module = _Zoo().eval()
    return module, export(module)


def test_the_torch_graph_computes_the_float_graph_as_the_module(zoo: tuple[nn.Module, xq.Exported]) -> None:
    """``torch_graph.forward`` on the float graph, three inputs in one batch, against the module
    itself (torch's float model): float32 sums in another order, within 1e-5 of the output scale."""
    from xnnquant.frontend.static_int8 import torch_graph

    module, exported = zoo
    graph = exported.static_int8.float_graph
    assert torch_graph.unsupported(graph) is None
    inputs = torch.cat([x for (x,) in batches(3, seed=5)])
    env = torch_graph.forward(graph, [inputs[:, None]], torch_graph.constants(graph))
    got = env[graph.outputs[0]].detach().numpy().reshape(3, -1)
    with torch.no_grad():
        want = module(inputs).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


class _Kinds(nn.Module):
    """Node kinds that CNN heads, U-Nets and transformers bring, with no int8 form or an fp32
    one only: a grouped transposed convolution with output padding, PReLU, bilinear resizes
    (half-pixel and aligned corners), a layer norm (reciprocal square root), square root, exp,
    log, sin, cos, a constant concatenated, a batch matrix product and softmax.  (Floor and ceiling are left out: a value
    within float rounding of an integer would make the comparison a coin toss.)"""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.prelu = nn.PReLU(6)
        self.norm = nn.LayerNorm(6)
        self.q = nn.Linear(6, 6)
        self.token = nn.Parameter(torch.randn(1, 1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.prelu(self.up(x))
        y = (nn.functional.interpolate(y, size=(20, 12), mode="bilinear", align_corners=False)
             + nn.functional.interpolate(y, size=(20, 12), mode="bilinear", align_corners=True))
        y = self.norm(y.permute(0, 2, 3, 1))
        y = torch.sqrt(y.abs() + 1) + torch.exp(-y * y) + torch.log(y * y + 1) + torch.sin(y) * torch.cos(y)
        t = torch.cat([self.token, y.reshape(1, 240, 6)], 1)  # a class token, as ViT's
        return torch.softmax(self.q(t) @ t.transpose(1, 2), -1) @ t


def test_the_torch_graph_computes_every_kind_a_float_graph_has() -> None:
    """The torch forms of the kinds ``_Kinds`` lowers to, on three inputs in one batch, against the
    module itself (torch's float model), as the test above: within 1e-5 of the output scale
    (measured 1.4e-6).  Graphs with them used to fall back to percentile ranges and could not take
    a budget."""
    from xnnquant.frontend.static_int8 import torch_graph

    module = _Kinds().eval()
    inputs = torch.randn(3, 1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    graph = xq.export(module, (inputs[0],), weights="fp32", progress=False).graph
    kinds = {n.kind for n in graph.nodes}
    assert {"XNNConvTranspose2d", "XNNPReLU", "XNNStaticResizeBilinear2D", "XNNReciprocalSquareRoot",
            "XNNBatchMatrixMultiply", "XNNExp", "XNNLog", "XNNSin", "XNNCos", "XNNSquareRoot"} <= kinds, kinds
    assert torch_graph.unsupported(graph) is None
    got = torch_graph.forward(graph, [inputs], torch_graph.constants(graph))[graph.outputs[0]]
    with torch.no_grad():
        want = np.stack([module(x).numpy() for x in inputs])
    assert np.abs(got.detach().numpy().reshape(want.shape) - want).max() <= 1e-5 * np.abs(want).max()


def test_a_weighted_histogram_prices_a_grid_as_the_sum_over_its_elements() -> None:
    """``WeightedHistogram.cost`` against the sum over the elements themselves (clipped ones their
    distance to the bound squared, the others step^2 / 12, zeros nothing), each weighted by its
    g^2: equal within the bins' width (4096 bins over the range: the error of placing an element
    at its bin's center), and ``best_range`` is the least of those sums over its candidates."""
    from xnnquant.frontend.static_int8 import sensitivity
    from xnnquant.frontend.static_int8.ranges import MSE_GRID

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000), 12 * rng.standard_normal(40), np.zeros(500)]).astype(np.float32)
    g2 = rng.exponential(1.0, x.size).astype(np.float32)
    g2[np.abs(x) > 8] *= 1e-4  # outliers that barely move the outputs: clipping them is nearly free
    hist = sensitivity.WeightedHistogram(float(x.min()), float(x.max()))
    hist.add(x, g2)
    hist.inputs = 1

    def brute(lo: float, hi: float) -> float:
        v, w = x.astype(np.float64), g2.astype(np.float64)
        step = (hi - lo) / 255
        error = np.where(v < lo, (v - lo) ** 2, np.where(v > hi, (v - hi) ** 2, step * step / 12))
        return float(np.sum(np.where(v == 0, 0.0, w * error)))

    for lo, hi in [(float(x.min()), float(x.max())), (-3.0, 2.5), (-1.0, 4.0)]:
        assert hist.cost(lo, hi) == pytest.approx(brute(lo, hi), rel=2e-3)
    lo, hi = hist.best_range()
    candidates = [(a, b) for a in x.min() * MSE_GRID for b in x.max() * MSE_GRID
                  if np.mean(x[x < 0] < a) <= sensitivity.MAX_CLIPPED and np.mean(x[x > 0] > b) <= sensitivity.MAX_CLIPPED]
    best = min(brute(a, b) for a, b in candidates)
    assert brute(lo, hi) <= best * 1.01
    assert hi < 0.7 * float(x.max())  # the nearly free outliers are clipped


def test_sensitivity_ranges_clip_what_a_later_relu6_saturates() -> None:
    """Channel 0 of the first convolution's output has rare outliers that the second convolution
    drives far into its ReLU6's saturation: clipping them costs the output nothing, and the
    sensitivity range clips them (min-max keeps them, and its coarser grid costs every other
    value): the int8 program is closer to torch's float model with ``sensitivity``."""
    first, second = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
    with torch.no_grad():
        second.weight.zero_()
        second.weight[:, :, 0, 0] = torch.eye(4)
        second.weight[0, 0, 0, 0] = 50.0  # channel 0 above 0.12 saturates the ReLU6
        second.bias.zero_()
    module = nn.Sequential(first, second, nn.ReLU6(), nn.Conv2d(4, 3, 1)).eval()
    cal = batches(16)
    for (x,) in cal[::4]:
        x[0, :, 0, 0] = 40.0  # the outliers
    evaluation = [x for (x,) in batches(4, seed=3)]
    with torch.no_grad():
        reference = np.concatenate([module(x).numpy() for x in evaluation])
    results = {}
    for ranges in ("sensitivity", "minmax"):
        exported = xq.export(module, cal[0], weights="qc8w", calibration=cal, progress=False,
                             activations=xq.StaticInt8(ranges=ranges, equalize=False))
        results[ranges] = sqnr(reference, np.concatenate([exported.run(x)[0] for x in evaluation]))
        assert exported.static_int8.int8.notes == []
    # measured 36.7 dB against 25.5 dB
    assert results["sensitivity"] > results["minmax"] + 5


def test_mixed_precision_keeps_the_costliest_nodes_fp32_within_its_budget(zoo: tuple[nn.Module, xq.Exported]) -> None:
    """``budget=0.3`` on the zoo network: some ATen nodes stay fp32 between converts, each listed
    with its measured cost and reported as a boundary, and others stay int8; the int8 nodes'
    codes on the real runtime are the interpreter's, bit for bit; the program is closer to
    torch's float model than the all-int8 one; ``budget=0`` keeps nothing; a bad budget is
    refused."""
    module, plain = zoo
    kept = export(module, activations=xq.StaticInt8(budget=0.3))  # 1.0 would keep every computing node
    assert plain.static_int8.int8.kept == [] and len(plain.boundaries) == 3  # its average pooling is fp32
    lines = kept.static_int8.int8.kept
    assert lines and all(" dB alone, " in line and line.endswith("% time") for line in lines), lines
    assert sum("kept in fp32 by budget=0.3" in b for b in kept.boundaries) >= 1, kept.boundaries
    computing = [(n.kind, kept.graph.value(n.outputs[0]).datatype) for n in kept.graph.nodes
                 if n.kind not in DATA_MOVEMENT and n.kind != "XNNConvert"]
    assert ("XNNAdd", xq.Datatype.fp32) in computing and ("XNNConv2d", xq.Datatype.qint8) in computing, computing
    evaluation = [x for (x,) in batches(3, seed=7)]
    assert_runtime_is_interpreter(kept, evaluation[:1], exact=False)
    with torch.no_grad():
        reference = np.concatenate([module(x).numpy() for x in evaluation])
    errors = {name: sqnr(reference, np.concatenate([e.run(x)[0] for x in evaluation]))
              for name, e in (("plain", plain), ("kept", kept))}
    # measured 50.1 against 44.2 dB; int8 codes are exact and fp32 nodes move by float rounding on
    # other CPUs, so half of the gain is a margin that only a worse choice or program can cross
    assert errors["kept"] > errors["plain"] + 3, errors
    assert str(xq.StaticInt8(budget=0.3)) == "qint8(budget=0.3)"
    with pytest.raises(XnnquantError, match=r"^budget is the extra time mixed precision may spend.*got -1"):
        xq.StaticInt8(budget=-1)


def test_options_that_cannot_be_followed_are_reported_and_warned(zoo: tuple[nn.Module, xq.Exported],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph with a node kind torch cannot compute here gets percentile ranges and keeps nothing
    in fp32 whatever the budget: both are said (the budget's note used to be dropped with the
    planning rewrite, and neither was shown), in the report and as one ``OptionWarning`` at the
    caller's line.  Layers a budget keeps in fp32 are asked for: no ``FallbackWarning``."""
    import warnings

    from xnnquant.frontend.report import FallbackWarning, OptionWarning
    from xnnquant.frontend.static_int8 import torch_graph

    module, _ = zoo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = export(module, activations=xq.StaticInt8(budget=0.3))
    assert kept.static_int8.int8.kept and not [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert "not as asked" not in str(kept)
    monkeypatch.setattr(torch_graph, "unsupported", lambda graph: "XNNSomething")
    with pytest.warns(OptionWarning) as record:
        exported = export(module, activations=xq.StaticInt8(budget=0.3))
    assert exported.static_int8.int8.kept == []
    (warning,) = [w for w in record if issubclass(w.category, OptionWarning)]
    assert warning.filename == __file__
    text = str(warning.message)
    assert text.startswith("activations='qint8(budget=0.3)' was not followed in full: ranges: percentile instead "
                           "of sensitivity (XNNSomething has no torch form here); budget: nothing kept in fp32"), text
    assert "\nnot as asked: ranges: percentile instead of sensitivity (XNNSomething" in str(exported)
    assert "\nnot as asked: budget: nothing kept in fp32" in str(exported)


class _MaskedAttention(nn.Module):
    """One attention head with a padding mask added to its scores, as BERT's: the scores come from
    an fp32 batch matrix product and go to an fp32 softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 4.0 + ((1.0 - mask) * -100.0)[:, None, :]
        return self.o(torch.softmax(scores, -1) @ self.v(x))


def _masked_batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        mask = torch.ones(1, 8)
        mask[0, 7 - i % 4:] = 0  # the last 1 to 4 of 8 tokens are padding
        out.append((torch.randn(1, 8, 16, generator=g), mask))
    return out


@pytest.mark.parametrize("islands", [True, False], ids=["kept fp32", "int8 (as before)"])
def test_int8_nodes_between_fp32_nodes_stay_fp32(islands: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``scores + mask`` reads the fp32 scores and feeds the fp32 softmax: in int8 its one grid held
    the mask's -100 and the scores, which it rounded in steps of 0.4; it is kept fp32 with the
    nodes computing the mask (cheaper by the time estimate: no converts), each a boundary with
    its reason, and the program is much closer to torch's float model.  The measured figure of
    the report is the outputs' SQNR on 4 calibration inputs, as computed here from torch's."""
    if not islands:
        monkeypatch.setattr(rewriting.Rewrite, "_keep_islands_fp32", lambda self: None)
    module = _MaskedAttention().eval()
    cal, held_out = _masked_batches(16, 1), _masked_batches(16, 2)
    exported = xq.export(module, cal[0], weights="qc8w", calibration=cal, progress=False,
                         activations=xq.StaticInt8(ranges="percentile"))
    with torch.no_grad():
        reference = np.concatenate([module(*b).numpy() for b in held_out])
        measured = [cal[i] for i in (0, 5, 10, 15)]  # sensitivity.spread(4, 16)
        in_sample = np.concatenate([module(*b).numpy() for b in measured])
    db = sqnr(reference, np.concatenate([exported.run(*b)[0] for b in held_out]))
    kept = [b for b in exported.boundaries if "it reads and feeds only fp32 values and nodes" in b]
    if not islands:  # measured 23.3 dB
        assert not kept and db < 29
        return
    assert len(kept) == 3 and all(b.startswith(("aten.rsub", "aten.mul", "aten.add")) for b in kept), kept
    assert db > 29, db  # measured 35.1 dB: half the 11.8 dB gain is the margin
    found = exported.static_int8.int8.measured
    got, inputs = found.db, found.inputs
    assert inputs == 4
    # the float graph and torch differ by float rounding only: far below the int8 error
    assert got == pytest.approx(sqnr(in_sample, np.concatenate([exported.run(*b)[0] for b in measured])), abs=0.01)
    assert f"outputs against the float graph: {got:.1f} dB SQNR on 4 of the calibration inputs" in str(exported)
    assert found.int8_ms > 0 and found.float_ms > 0 and "ms against the float graph's" in str(exported)


def test_a_program_that_keeps_little_accuracy_is_warned_of() -> None:
    """One output channel of a linear layer 1000 times the others (a transformer's outlier
    channel) shares the layer's int8 grid, whose steps round the other channels away; the layer
    norm after it leaves only them in the outputs (its scale is 0 on the outlier).  The export
    measures the outputs (report line) and raises ``AccuracyWarning`` at the caller's line."""
    import warnings

    from xnnquant.frontend.report import AccuracyWarning

    linear, norm = nn.Linear(16, 16), nn.LayerNorm(16)
    with torch.no_grad():
        linear.weight[0] *= 1000
        linear.bias[0] = 0
        norm.weight[0] = 0
    module = nn.Sequential(nn.Linear(16, 16), linear, norm, nn.Linear(16, 4))
    with pytest.warns(AccuracyWarning, match=r"keeps little of the module's accuracy: its outputs measure -?\d+\.\d dB "
                                             r"SQNR against the float graph's on 4 of its own calibration inputs") as rec:
        exported = export(module, (1, 8, 16))
    assert [w.filename for w in rec if issubclass(w.category, AccuracyWarning)] == [__file__]
    assert exported.static_int8.int8.measured.db < 10  # measured 3.9 dB
    with warnings.catch_warnings():
        warnings.simplefilter("error", AccuracyWarning)
        fine = export(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), (1, 8, 16))
    assert fine.static_int8.int8.measured.db > 30  # measured 40.1 dB


@pytest.mark.parametrize(("int8_ms", "float_ms", "warned"), [(2.0, 1.0, True), (1.1, 1.0, False), (0.8, 0.3, False)],
                         ids=["2x slower", "within 1.2x", "too short to tell"])
def test_a_program_slower_than_its_float_graph_is_warned_of(int8_ms: float, float_ms: float, warned: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The run times the export measured (here set, as no test may time) decide: more than 1.2x
    the float graph's, the float graph taking at least 0.5 ms, raise ``PerformanceWarning`` at the
    caller's line; a closer or shorter pair (fixed costs and noise) does not."""
    import warnings

    from xnnquant.frontend import static_int8

    measured = static_int8.Measured(40.0, 4, 3, int8_ms, float_ms, "AMD EPYC (Zen 4, AVX-512 VNNI)")
    monkeypatch.setattr(static_int8, "measure", lambda *args: measured)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = export(_conv_then(torch.relu))
    slower = [w for w in caught if issubclass(w.category, xq.PerformanceWarning)]
    assert exported.static_int8.int8.measured is measured and str(measured) in str(exported)
    if not warned:
        assert not slower
        return
    (warning,) = slower
    assert warning.filename == __file__
    assert str(warning.message).startswith("the static int8 program ran slower than its float graph on this machine, "
                                           "AMD EPYC (Zen 4, AVX-512 VNNI): 2 ms against 1 ms (median of 4 inputs x 3 "
                                           "runs)"), warning.message
    assert ("run time on this machine, AMD EPYC (Zen 4, AVX-512 VNNI), 2 ms against the float graph's 1 ms (2.00x)"
            in str(exported)) == (int8_ms == 2.0)


def test_efficientnet_lite0_loads_its_weights_and_classifies_a_photo() -> None:
    """The package's weights load into ``models.efficientnet_lite`` as they are, and the float model
    names the coffee photo espresso (ImageNet class 967), as torchvision's MobileNetV2 does."""
    from xnnquant.models import efficientnet_lite, mobilenet_v2

    photo = next(p for p in mobilenet_v2.photo_paths() if p.name == "coffee.png")
    crop = mobilenet_v2.crops(mobilenet_v2.load_photo(photo), 1, 0)
    with torch.no_grad():
        logits = efficientnet_lite.build()(torch.from_numpy(efficientnet_lite.preprocess(crop)))
    assert int(logits.argmax()) == 967


def test_learned_rounding_lowers_the_layer_output_error_within_one_code() -> None:
    """``rounding.learned_codes`` against nearest rounding on the objective it minimizes, the layer
    output's squared error over its calibration rows ``X`` (computed directly, ``|X (w - s q)^T|^2``):
    lower for every layout (one Gram, one per row), every code within one step of ``w / s``.  An
    export with ``rounding="learned"`` passes the self-check, which holds its codes to that step."""
    from xnnquant.frontend.static_int8 import rounding

    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 24))
    s = np.abs(w).max(axis=1) / 127
    x = rng.standard_normal((400, 24)) @ rng.standard_normal((24, 24))  # correlated inputs
    per_row = np.stack([(x * rng.uniform(0.5, 2, 24)).T @ (x * rng.uniform(0.5, 2, 24)) for _ in range(16)])
    for gram in (x.T @ x, per_row):
        learned = rounding.learned_codes(w, s, gram).astype(np.float64)
        nearest = np.rint(w / s[:, None])
        assert np.all(np.abs(learned - w / s[:, None]) < 1)

        def error(codes: np.ndarray, gram: np.ndarray = gram) -> float:
            d = w - codes * s[:, None]
            return float(np.einsum("ck,...kl,cl->", d, gram, d) if gram.ndim == 2
                         else np.einsum("ck,ckl,cl->", d, gram, d))

        assert error(learned) < 0.8 * error(nearest)  # measured 0.51 and 0.69 of it
    module = CASES["depthwise conv + relu6"][0]()
    exported = export(module, activations=xq.StaticInt8(rounding="learned"))
    assert str(xq.StaticInt8(rounding="learned")) == "qint8(rounding=learned)"
    assert any(layer.stored.meta.get("rounding") == "learned" for layer in exported.static_int8.int8.layers)


def test_a_large_bias_over_a_near_zero_filter_channel_keeps_its_value() -> None:
    """A batch norm folded into a channel of near-zero weights leaves a bias far beyond int32 codes at
    ``s_x * s_w``: the channel's filter scale is raised until it fits (it saturated at -2^31 before,
    and the self-check refused the bias).  The output channel stays at the bias, as torch has it."""
    conv, norm = nn.Conv2d(4, 3, 3), nn.BatchNorm2d(3)
    with torch.no_grad():
        conv.weight[0] *= 1e-7
        conv.bias.zero_()
        norm.bias[0] = -113.0
    module = nn.Sequential(conv, norm).eval()
    exported = export(module)
    (x,) = batches(1, seed=3)[0]
    with torch.no_grad():
        want = module(x).numpy()
    got = exported.run(x)[0]
    assert np.abs(got[0, 0] - want[0, 0]).max() < 0.01 * 113
