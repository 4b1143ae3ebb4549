"""``xq.export(..., dynamic_shapes=...)``: one program for every size in a dim's range.

A transformer block exported once with a dynamic sequence length runs, on the real
runtime, at lengths from 1 to the bound, and gives what the module gives at each length.
Bound: float32 programs of a few hundred products per output; XNNPACK's sums run in
another order than torch's, which moves the result by a few float32 ulps of the sums, far
below ``1e-5`` of the output's largest magnitude (a wrong shape or an unwritten row is off
by the output's size).  A fixed-shape export at the same length runs the same kernels on
the same data: the two agree to the same bound.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from export_models import TransformerBlock
from float_bounds import relative_error

import xnnquant as xq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack
Dim = torch.export.Dim

BOUND = 1e-5  # relative to the largest output magnitude (see the module docstring)


@pytest.fixture(scope="module")
def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return TransformerBlock().eval()


def _x(length: int) -> torch.Tensor:
    return torch.randn(1, length, 64, generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("weights", ["fp32", "qb4w:32"])
def test_one_program_runs_at_every_length(block: torch.nn.Module, weights: str) -> None:
    exported = xq.export(block, (_x(10),), weights=weights, dynamic_shapes=({1: Dim("seq", max=48)},),
                         progress=False)
    (spec,) = exported.inputs
    assert spec.shape == (1, 48, 64) and str(spec.dynamic[1]) == "seq in [1, 48]" and exported.dynamic
    assert exported.self_check.nodes > 10
    for length in (1, 7, 10, 48):
        x = _x(length)
        (got,) = exported.run(x)
        assert got.shape == (1, length, 64)
        if weights == "fp32":
            with torch.no_grad():
                assert relative_error(got, block(x).numpy()) < BOUND
        fixed = xq.export(block, (x,), weights=weights, progress=False, check=False)
        assert relative_error(got, fixed.run(x)[0]) < BOUND


def test_the_program_takes_other_lengths_on_executorch(block: torch.nn.Module) -> None:
    from executorch.runtime import Runtime

    exported = xq.export(block, (_x(10),), weights="fp32", dynamic_shapes=({1: Dim("seq", max=48)},),
                         progress=False)
    program = Runtime.get().load_program(exported.to_pte())
    method = program.load_method("forward")
    for length in (3, 48):
        x = _x(length)
        (got,) = method.execute([x])
        with torch.no_grad():
            assert relative_error(got.numpy(), block(x).numpy()) < BOUND


def test_outside_the_bounds_is_refused_by_name(block: torch.nn.Module) -> None:
    exported = xq.export(block, (_x(10),), weights="fp32",
                         dynamic_shapes=({1: Dim("seq", min=2, max=48)},), progress=False)
    with pytest.raises(xq.XnnquantError, match=r"^inputs\[0\] \('x'\) has size 49 in dim 1: the program takes seq in "
                                               r"\[2, 48\] there \(its memory is planned at 48\); expected shape "
                                               r"\(1, seq<=48, 64\)$"):
        exported.run(_x(49))
    with pytest.raises(xq.XnnquantError, match=r"has size 1 in dim 1: the program takes seq in \[2, 48\]"):
        exported.run(_x(1))
    with pytest.raises(xq.XnnquantError, match=r"dim 2 is fixed at 64"):
        exported.run(torch.randn(1, 5, 32))


def test_a_dim_without_a_max_is_refused(block: torch.nn.Module) -> None:
    with pytest.raises(xq.XnnquantError, match=r"has a dynamic dim s\d+ with no upper bound: ExecuTorch plans memory "
                                               r"at the bound; give its torch.export.Dim a max"):
        xq.export(block, (_x(10),), weights="fp32", dynamic_shapes=({1: Dim("seq")},), progress=False)


def test_a_spec_torch_rejects_is_reported_with_torch_reason() -> None:
    class Tail(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, 1:] * 2

    with pytest.raises(xq.XnnquantError, match=r"^torch.export.export failed on Tail with these dynamic_shapes: "
                                               r"UserError: Constraints violated \(seq\)!"):
        xq.export(Tail().eval(), (torch.randn(1, 9),), weights="fp32",
                  dynamic_shapes=({1: Dim("seq", max=100)},), progress=False)


class TwoDynamic(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return (x.view(b, t, 4, d // 4) * 2).view(b, t, d)


class FromTheEnd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, -2:] + 1


class MeanOverTime(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


@pytest.mark.parametrize(("module", "reason"), [
    (TwoDynamic(), r"a reshape to \(s\d+, s\d+, 4, 8\) has 2 dynamic dims: XNNPACK infers at most one dim"),
    (FromTheEnd(), r"a slice of dynamic dim 1 \(s\d+\) at -2, from its end"),
    (MeanOverTime(), r"mean over dynamic dims \(s\d+,\): it is a fixed 1/n filter here"),
], ids=["reshape-two-dynamic", "slice-from-end", "mean-over-dynamic"])
def test_what_xnnpack_cannot_resize_runs_outside_it_naming_the_dim(module: torch.nn.Module, reason: str) -> None:
    """strict=True refuses the node naming the dynamic dim; by default it runs on the portable
    kernels (the delegation report gives the same reason) and the program follows the sizes."""
    seq = Dim("seq", min=3, max=16)  # x[:, -2:] makes torch guard seq > 2
    dims = {0: Dim("batch", max=4), 1: seq} if isinstance(module, TwoDynamic) else {1: seq}
    with pytest.raises(xq.UnsupportedConfigError, match=reason):
        xq.export(module.eval(), (torch.randn(2, 5, 32),), weights="fp32", dynamic_shapes=(dims,), progress=False,
                  strict=True)
    exported = xq.export(module.eval(), (torch.randn(2, 5, 32),), weights="fp32", dynamic_shapes=(dims,),
                         progress=False)
    assert re.search(reason, exported.delegation_report())
    for shape in ((2, 5, 32), (2, 16, 32), (2, 3, 32)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
        (got,) = exported.run(x)
        want = module(x).numpy()
        assert got.shape == want.shape
        if isinstance(module, MeanOverTime):  # a sum of T terms, ordered differently on each side: each
            t = shape[1]  # float32 sum is within (T - 1) * 2^-24 * sum|x| of the exact one, then / T
            bound = 2 * (t - 1) * 2.0**-24 * np.abs(x.numpy()).sum(axis=1) / t
            assert np.all(np.abs(got - want) <= bound)
        else:  # a reshape or a slice, a multiply and an add: exact
            np.testing.assert_array_equal(got, want)


class LinearsAroundATail(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x))[:, -2:])


def test_a_program_lowered_again_after_refusals_quantizes_each_filter_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic pure program is lowered whole, then, its refused nodes sent to the portable
    kernels, once per delegate: each filter's quantization (an ``mse`` search) is kept from the
    first lowering, not searched again, with the same bytes as searched again; nothing is kept
    after the export."""
    from xnnquant.frontend import weights as weight_schemes
    from xnnquant.frontend.lowering import context

    calls: list[tuple[int, ...]] = []
    original = weight_schemes.WeightScheme.quantize

    def counted(self: Any, arr: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(arr.shape))
        return original(self, arr, *args, **kwargs)

    monkeypatch.setattr(weight_schemes.WeightScheme, "quantize", counted)
    torch.manual_seed(0)
    module = LinearsAroundATail().eval()
    spec = ({1: Dim("seq", min=3, max=16)},)

    def export() -> bytes:
        exported = xq.export(module, (torch.randn(2, 5, 32),), weights="qc8w", dynamic_shapes=spec, progress=False)
        assert "from its end" in exported.delegation_report()  # lowered again: two delegates
        return exported.to_pte()

    made: list[Any] = []

    class Recorded(context.WeightOptions):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(context, "WeightOptions", Recorded)
    once = export()
    assert sorted(calls) == [(32, 64), (64, 32)]
    kept = [w.memo for w in made if w.memo is not None]  # the export's (dry runs keep none)
    assert kept and all(memo == {} for memo in kept)  # emptied after lowering
    monkeypatch.setattr(context, "_known", lambda *args: None)  # nothing kept: searched again
    calls.clear()
    assert export() == once
    assert sorted(calls) == [(32, 64), (32, 64), (64, 32), (64, 32)]


def test_ceil_mode_max_pool_over_a_dynamic_dim_runs_on_the_portable_kernels() -> None:
    """``aten.max_pool2d`` has no portable kernel: over a dynamic H with ceil_mode (which
    XNNPACK cannot resize), it is decomposed into ``max_pool2d_with_indices``, which has one,
    and runs there, exactly (a max), at every size; strict=True refuses it naming the dim."""

    class Pool(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = torch.nn.MaxPool2d(3, 2, ceil_mode=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pool(x) + 1

    dims = ({2: 2 * Dim("half", min=3, max=10) - 1},)  # odd H: torch's guard for ceil mode
    example = (torch.randn(1, 4, 9, 9),)
    with pytest.raises(xq.UnsupportedConfigError, match=r"max_pool2d with ceil_mode over dynamic H or W"):
        xq.export(Pool().eval(), example, weights="fp32", dynamic_shapes=dims, progress=False, strict=True)
    exported = xq.export(Pool().eval(), example, weights="fp32", dynamic_shapes=dims, progress=False)
    assert "portable: aten.max_pool2d_with_indices.default x1" in exported.delegation_report()
    for h in (5, 9, 19):
        x = torch.randn(1, 4, h, 9, generator=torch.Generator().manual_seed(h))
        (got,) = exported.run(x)
        np.testing.assert_array_equal(got, Pool()(x).numpy())


def test_a_layer_that_cannot_take_its_weights_is_refused_with_dynamic_dims() -> None:
    """With dynamic dims, nodes whose lowering refuses run on the portable kernels, but a layer
    that cannot take the weights asked for is refused (a weight refusal, never a reason to run
    the layer in float elsewhere), the mean's refusal listed beside it."""

    class LinearThenMean(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(30, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).mean(dim=1)

    with pytest.raises(xq.UnsupportedConfigError) as raised:
        xq.export(LinearThenMean().eval(), (torch.randn(2, 5, 30),), weights="qb4w:32", fallback=None,
                  dynamic_shapes=({1: Dim("seq", max=16)},), progress=False)
    assert "layer 'lin' cannot take its weights: qb4w:32" in str(raised.value)
    assert "mean over dynamic dims" in str(raised.value)


def test_check_takes_dynamic_shapes_too() -> None:
    """``xq.check`` says what export does: the mean over the dynamic dim runs on the portable
    kernels (refused with strict=True), saying why."""
    example, dims = (torch.randn(2, 5, 32),), ({1: Dim("seq", max=16)},)
    report = xq.check(MeanOverTime().eval(), example, weights="fp32", dynamic_shapes=dims)
    assert report.ok and [p.op for p in report.portable] == ["aten.mean.dim"]
    assert "mean over dynamic dims" in report.portable[0].why
    exported = xq.export(MeanOverTime().eval(), example, weights="fp32", dynamic_shapes=dims, progress=False)
    assert "aten.mean.dim" in exported.delegation_report() and "portable" in exported.delegation_report()
    strict = xq.check(MeanOverTime().eval(), example, weights="fp32", dynamic_shapes=dims, strict=True)
    assert not strict.ok and "mean over dynamic dims" in strict.refused[0]


class RowsView(torch.nn.Module):
    """GPT-2's Conv1D: the hidden states viewed as rows ``[-1, 64]``, an addmm, viewed back."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(3)) / 8)
        self.bias = torch.nn.Parameter(torch.randn(32, generator=torch.Generator().manual_seed(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.addmm(self.bias, x.view(-1, 64), self.weight)
        return rows.view(x.shape[0], x.shape[1], 32)


def test_a_view_whose_inferred_dim_is_the_dynamic_one_is_inferred_on_every_call() -> None:
    """``view(-1, 64)`` of ``(1, seq, 64)``: the -1 is ``seq``, written inferred (not its bound)."""
    module = RowsView().eval()
    exported = xq.export(module, (_x(10),), weights="fp32", dynamic_shapes=({1: Dim("seq", max=48)},),
                         progress=False)
    for length in (1, 10, 48):
        x = _x(length)
        (got,) = exported.run(x)
        with torch.no_grad():
            assert relative_error(got, module(x).numpy()) < BOUND


class VarArgs(torch.nn.Module):
    """A wrapper called as ``forward(*inputs)``, as transformers models are often wrapped."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(*inputs)


def test_a_spec_per_input_fits_a_forward_that_takes_varargs(block: torch.nn.Module) -> None:
    """torch.export wants ``forward(*inputs)``'s specs as one tuple; ``dynamic_shapes=`` gives
    one spec per input (the docstring's form), which the export nests as torch wants."""
    module = VarArgs(block).eval()
    exported = xq.export(module, (_x(10),), weights="fp32", dynamic_shapes=({1: Dim("seq", max=48)},),
                         progress=False)
    assert str(exported.inputs[0].dynamic[1]) == "seq in [1, 48]"
    for length in (3, 48):
        x = _x(length)
        with torch.no_grad():
            assert relative_error(exported.run(x)[0], module(x).numpy()) < BOUND
