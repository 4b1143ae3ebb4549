"""Mixed programs: XNNPACK delegates and ExecuTorch's portable kernels in one ``.pte``.

Modules take token ids (int64), look up embeddings, build masks and positions, and cumulate:
ops XNNPACK cannot run.  Each program is run on ExecuTorch's runtime and compared with the
module in eager torch.  Bound: the float work in XNNPACK differs from torch by the rounding
of its sums (a few float32 ulps of sums of at most a few hundred products: far below
``1e-5`` of the output's largest magnitude); portable kernels compute as torch does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from et_lowered import planned_tensors
from float_bounds import relative_error

import xnnquant as xq

torch = pytest.importorskip("torch")
nn = torch.nn
pytestmark = pytest.mark.xnnpack

BOUND = 1e-5  # relative to the largest output magnitude (see the module docstring)


class Tokens(nn.Module):
    """ids -> token + position embeddings -> linear -> relu; a mask built from the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(100, 32)
        self.positions = nn.Embedding(64, 32)
        self.dense = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        hidden = self.tokens(ids) + self.positions(positions)
        return torch.relu(self.dense(hidden)) * (ids > 5).unsqueeze(-1)


class TwoDelegates(nn.Module):
    """linear -> cumsum (portable) -> linear: two delegates around a portable node."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cumsum(self.a(x), dim=1))


def _module(cls: type) -> nn.Module:
    torch.manual_seed(0)
    return cls().eval()


def _ids(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("weights", ["fp32", "qc8w"])
def test_token_ids_in_one_program(weights: str) -> None:
    module = _module(Tokens)
    exported = xq.export(module, (_ids(7),), weights=weights, progress=False)
    assert exported.mixed and len(exported.delegates) == 1
    assert [(t.name, t.dtype) for t in exported.inputs] == [("ids", "int64")]
    ids = _ids(7)
    (got,) = exported.run(ids)
    with torch.no_grad():
        ref = module(ids)
    assert relative_error(got, ref) < (BOUND if weights == "fp32" else 0.05)  # qc8w: int8 weights and activations


def test_the_delegation_report_says_what_ran_where_and_why() -> None:
    exported = xq.export(_module(Tokens), (_ids(7),), weights="fp32", progress=False)
    text = str(exported)
    assert text.splitlines()[0].startswith("xnnquant export: weights fp32, method mse, target 1.4.1; 1 XNNPACK "
                                           "delegate(s) (")
    assert "  portable: aten.embedding.default x1 (XNNPACK has no lowering of aten.embedding.default); modules " \
           "tokens" in text
    assert "  portable: aten.gt.Scalar x1 (XNNPACK has no lowering of aten.gt.Scalar); modules <top level>" in text
    report = json.loads(exported.to_json())
    assert report["summary"]["delegates"] == 1 and report["summary"]["portable_nodes"] >= 3
    where = {p["op"]: p["where"] for p in report["placement"]}
    assert where["aten.linear.default"] == "XNNPACK delegate 0" and where["aten.gt.Scalar"] == "portable kernels"


def test_as_few_delegates_as_the_graph_allows() -> None:
    module = _module(TwoDelegates)
    x = torch.randn(2, 5, 16)
    exported = xq.export(module, (x,), weights="fp32", progress=False)
    assert len(exported.delegates) == 2
    assert [p.where for p in exported.placement if p.op == "aten.linear.default"] == [
        "XNNPACK delegate 0", "XNNPACK delegate 1"]
    (got,) = exported.run(x)
    with torch.no_grad():
        assert relative_error(got, module(x)) < BOUND


def test_dynamic_lengths_are_computed_when_the_program_runs() -> None:
    module = _module(Tokens)
    exported = xq.export(module, (_ids(7, 1),), weights="fp32", progress=False,
                         dynamic_shapes=({1: torch.export.Dim("seq", max=48)},))
    for length in (1, 9, 48):
        ids = _ids(length, 1)
        (got,) = exported.run(ids)
        assert got.shape == (1, length, 16)
        with torch.no_grad():
            assert relative_error(got, module(ids)) < BOUND


def test_the_saved_program_runs_on_executorch(tmp_path: Path) -> None:
    from executorch.runtime import Runtime

    module = _module(Tokens)
    exported = xq.export(module, (_ids(7),), weights="fp32", progress=False)
    path = exported.save(tmp_path / "tokens.pte")
    program = Runtime.get().load_program(str(path))  # from its file: the delegate's bytes are freed after init
    ids = _ids(7)
    (got,) = program.load_method("forward").execute([ids])
    with torch.no_grad():
        assert relative_error(got.numpy(), module(ids)) < BOUND
    with pytest.raises(xq.XnnquantError, match=r"a mixed program \(XNNPACK delegates and portable kernels\) is an "
                                               r"ExecuTorch program: save it as .pte"):
        exported.save(tmp_path / "tokens.xnn")
    with pytest.raises(xq.XnnquantError, match=r"^a mixed program has 1 XNNPACK delegate\(s\) and portable kernels, "
                                               r"no single payload"):
        exported.to_bytes()


def test_strict_refuses_every_node_xnnpack_cannot_run() -> None:
    with pytest.raises(xq.UnsupportedConfigError) as info:
        xq.export(_module(Tokens), (_ids(7),), weights="fp32", progress=False, strict=True)
    text = str(info.value)
    assert "aten.embedding.default (node embedding, module tokens)" in text and "aten.gt.Scalar" in text


class Neither(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfcx(x) + 1


def test_an_op_neither_runs_is_refused_by_name() -> None:
    with pytest.raises(xq.UnsupportedConfigError, match=r"aten.special_erfcx.default \(node special_erfcx, module "
                                                        r"<top level>\): neither XNNPACK \(XNNPACK has no lowering of "
                                                        r"aten.special_erfcx.default\) nor ExecuTorch's portable "
                                                        r"kernels"):
        xq.export(Neither().eval(), (torch.randn(2, 3),), weights="fp32", progress=False)


class MaxWithIndices(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.max(x, dim=1)
        return values, indices


def test_a_program_with_no_node_for_xnnpack_runs_on_the_portable_kernels() -> None:
    """As ExecuTorch's flow would make it: no delegate, every node a portable kernel call."""
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    exported = xq.export(MaxWithIndices().eval(), (x,), weights="fp32", progress=False)
    assert "0 XNNPACK delegate(s)" in exported.delegation_report()
    values, indices = exported.run(x)
    want_values, want_indices = torch.max(x, dim=1)
    assert np.array_equal(values, want_values.numpy()) and np.array_equal(indices, want_indices.numpy())


class Arithmetic(nn.Module):
    """One expression of the ids, on the portable kernels."""

    def __init__(self, fn: object) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fn(ids)  # type: ignore[operator]


#: torch traces ``x + 1`` as ``add.Tensor(x, 1)``: a number where the kernel takes a tensor.
#: The first two add 0 and 1, the indices of the method's first two values (the ids and
#: ``ne``'s result): read as indices, they gave a program that ran and was wrong.
NUMBERS_FOR_TENSORS = {
    "int32 + 0": lambda ids: (ids != 1).int().cumsum(1) + 0,
    "int64 + 1, * 2, - 1": lambda ids: (ids.cumsum(1) + 1) * 2 - 1,
    "bool + int": lambda ids: (ids > 5) + 3,
    "int + float": lambda ids: ids.cumsum(1) + 0.5,
    "float64 * float": lambda ids: ids.double().cumsum(1) * 0.1,
    "uint8 + an int it cannot hold": lambda ids: ids.to(torch.uint8) + 300,
    "where(mask, ids, 0)": lambda ids: torch.where(ids > 5, ids, 0),
}


@pytest.mark.parametrize("name", list(NUMBERS_FOR_TENSORS))
def test_a_number_where_the_op_takes_a_tensor_is_a_tensor_of_it(name: str) -> None:
    """RoBERTa's positions are ``(cumsum(ids != pad) + 0) * mask + pad``.  Exact: integer
    arithmetic, and float arithmetic on the same operands in the same type as torch."""
    module = Arithmetic(NUMBERS_FOR_TENSORS[name]).eval()
    ids = torch.tensor([[3, 1, 5, 7, 1, 2, 9], [1, 1, 8, 0, 4, 6, 2]])
    exported = xq.export(module, (ids,), weights="fp32", progress=False, check=False)
    (got,) = exported.run(ids)
    want = module(ids).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fn", [lambda ids: (ids.to(torch.bfloat16) + 3001).float(),
                                lambda ids: (ids.to(torch.float16) / 7 + 0.3).float()], ids=["bf16 + int", "f16 + float"])
def test_a_number_with_half_precision_operands_is_refused(fn: object) -> None:
    """torch rounds the number to bfloat16 in ``x + 3001`` and not in ``x * 0.1``: held as float32
    the number gave 16.0 off in the first (and a float16 ulp off in ``x / 7 + 0.3``), held as
    bfloat16 it broke the second; no one type matches every op, so it is refused."""
    ids = torch.tensor([[3, 1, 5, 7]])
    with pytest.raises(xq.UnsupportedConfigError, match=r"runs on ExecuTorch's portable kernels, and cannot: "
                                                        r"argument 'other' is the number .* with torch\.(b?float16) "
                                                        r"operands"):
        xq.export(Arithmetic(fn).eval(), (ids,), weights="fp32", progress=False, check=False)


def test_a_dynamic_size_where_the_op_takes_a_tensor_is_computed_when_the_program_runs() -> None:
    module = Arithmetic(lambda ids: ids.cumsum(1) + ids.shape[1]).eval()
    exported = xq.export(module, (_ids(7, 1),), weights="fp32", progress=False, check=False,
                         dynamic_shapes=({1: torch.export.Dim("seq", max=32)},))
    for length in (1, 7, 32):
        ids = _ids(length, 1)
        (got,) = exported.run(ids)
        np.testing.assert_array_equal(got, module(ids).numpy())


class PermutedBias(nn.Module):
    """T5's attention bias: a table permuted into (1, heads, q, k) and masked on the portable
    kernels, which torch traces channels-last (the table's strides), read by a delegate."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(6, 6, 4, generator=torch.Generator().manual_seed(1)))
        self.dense = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = self.table.permute(2, 0, 1).unsqueeze(0)
        bias = torch.where(mask[:, None, None, :].bool(), bias, -1e4)
        return self.dense(x + bias)


def test_a_portable_result_traced_channels_last_is_laid_out_as_its_kernel_and_its_delegate_read_it() -> None:
    """The portable kernels take operands all contiguous or all channels-last (the mask is
    contiguous: the where writes contiguous), and the delegate declared channels-last gets a
    copy in that order."""
    module = _module(PermutedBias)
    x = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    exported = xq.export(module, (x, mask), weights="fp32", progress=False)
    (got,) = exported.run(x, mask)
    with torch.no_grad():
        assert relative_error(got, module(x, mask)) < BOUND


#: Views of a channels-last int tensor, on the portable kernels: its kernels refused the first
#: two (0x12), and the third ran and gave 118 of 120 elements wrong, until every portable
#: operand was made contiguous first.
CHANNELS_LAST_VIEWS = {
    "permute": lambda x: x.permute(0, 3, 1, 2).cumsum(1),
    "expand": lambda x: x[:, :1].expand(-1, 3, -1, -1).cumsum(3),
    "unsqueeze": lambda x: (x.unsqueeze(1) * 2).cumsum(2),
}


@pytest.mark.parametrize("name", list(CHANNELS_LAST_VIEWS))
def test_a_channels_last_input_is_read_contiguous_by_the_portable_kernels(name: str) -> None:
    module = Arithmetic(CHANNELS_LAST_VIEWS[name]).eval()
    x = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last)
    exported = xq.export(module, (x,), weights="fp32", progress=False, check=False)
    np.testing.assert_array_equal(exported.run(x)[0], module(x).numpy())


class NegativePad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (1, -1))


def test_arguments_the_portable_kernel_refuses_are_refused_by_name() -> None:
    """1.4.1's portable constant_pad_nd fails the method on a negative pad (InvalidArgument)."""
    with pytest.raises(xq.UnsupportedConfigError, match=r"aten.constant_pad_nd.default \(node constant_pad_nd, module "
                                                        r"<top level>\): neither XNNPACK \(.*\) nor ExecuTorch's "
                                                        r"portable kernels \(its portable kernel refuses negative "
                                                        r"padding \(got pad \[1, -1\]"):
        xq.export(NegativePad().eval(), (torch.randint(0, 9, (2, 4)),), weights="fp32", progress=False)


class SliceFromTheEnd(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 2.0)[:, :-1] + 1.0


def test_a_node_its_lowering_refuses_runs_on_the_portable_kernels() -> None:
    """XNNPACK slices a dynamic dim only from its start: the slice goes to the portable kernels
    and the rest stays in XNNPACK (as ExecuTorch's partitioner leaves such a slice out)."""
    n = torch.export.Dim("n", min=3, max=16)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    exported = xq.export(SliceFromTheEnd().eval(), (x,), weights="fp32", progress=False, dynamic_shapes=({1: n},))
    report = exported.delegation_report()
    assert re.search(r"portable: aten\.slice\.Tensor x1 \(a slice of dynamic dim 1 \(\w+\) at -1, from its end", report)
    assert exported.summary["delegates"] == 2
    for size in (8, 3, 16):
        x = torch.randn(3, size, generator=torch.Generator().manual_seed(size))
        (got,) = exported.run(x)
        assert np.array_equal(got, SliceFromTheEnd()(x).numpy())  # one multiply, relu, slice, add: exact
    with pytest.raises(xq.UnsupportedConfigError, match=r"a slice of dynamic dim 1 \(\w+\) at -1, from its end"):
        xq.export(SliceFromTheEnd().eval(), (x,), weights="fp32", progress=False, dynamic_shapes=({1: n},),
                  strict=True)


class EmptySlice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[3:3], x * 2.0]) + 1.0


def test_a_value_of_size_zero_in_a_cat_is_left_out() -> None:
    """XNNPACK holds no value of size 0: the empty slice contributes nothing to the cat and is
    left out of it (the cleanup pass), so the rest runs in XNNPACK."""
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    exported = xq.export(EmptySlice().eval(), (x,), weights="fp32", progress=False)
    assert not exported.mixed and "aten.slice" not in {op for op, _, _ in exported.sources}
    (got,) = exported.run(x)
    assert np.array_equal(got, EmptySlice()(x).numpy())  # a multiply and an add: exact


class ToFloatChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4).reshape(1, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float, memory_format=torch.channels_last) * self.scale


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16])
def test_a_dtype_and_memory_format_conversion_runs_in_its_inputs_layout(dtype: torch.dtype) -> None:
    """ExecuTorch's portable ``_to_copy`` refuses a result in another dim order than its input
    (InvalidArgument, measured): the conversion keeps the input's layout, and XNNPACK's
    lowering takes care of the layout after it (as ExecuTorch's own op tests do it)."""
    x = torch.randint(-9, 10, (2, 4, 3, 5), dtype=dtype, generator=torch.Generator().manual_seed(0))
    module = ToFloatChannelsLast().eval()
    exported = xq.export(module, (x,), weights="fp32", progress=False)
    assert "portable: aten._to_copy.default x1" in exported.delegation_report()
    (got,) = exported.run(x)
    np.testing.assert_array_equal(got, module(x).detach().numpy())  # small integers times a float: exact


class LateReaders(nn.Module):
    """Values made from the input that only the second delegate reads (after a cumsum on the
    portable kernels): a broadcast difference [b, t, 16, 16], and two equal unsqueezes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pairs = torch.clamp(x.unsqueeze(-1) - x.unsqueeze(-2), -1.0, 1.0)  # [b, t, 16, 16]
        y = torch.cumsum(x * 2.0, dim=1)
        return (pairs * y.unsqueeze(-1)).sum(-1) + x.unsqueeze(-1).squeeze(-1) * (x.unsqueeze(-1).squeeze(-1) + y)


def test_a_value_only_a_later_delegate_reads_is_made_there_and_equal_reshapes_are_made_once() -> None:
    """The broadcast difference and its clamp would be delegate 0's output, held in planned
    memory across the cumsum; they are made in delegate 1 from the input, which the program
    holds anyway.  Equal unsqueezes of x are one node.  Fails if either goes."""
    module = _module(LateReaders)
    x = torch.randn(2, 5, 16)
    exported = xq.export(module, (x,), weights="fp32", progress=False)
    where = {p.op: p.where for p in exported.placement if p.op in ("aten.sub.Tensor", "aten.clamp.default")}
    assert where == {"aten.sub.Tensor": "XNNPACK delegate 1", "aten.clamp.default": "XNNPACK delegate 1"}
    assert [2, 5, 16, 16] not in [sizes for _, sizes in planned_tensors(exported.to_pte())]
    # x.unsqueeze(-1) three times, x.unsqueeze(-2), y.unsqueeze(-1): 3 nodes, not 5
    assert sum(p.op == "aten.unsqueeze.default" for p in exported.placement) == 3
    (got,) = exported.run(x)
    with torch.no_grad():
        assert relative_error(got, module(x)) < BOUND
