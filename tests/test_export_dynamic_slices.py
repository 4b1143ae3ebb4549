"""A constant read at positions that follow a dynamic size: the program takes every size.

A rotary table is read as ``self.cos[: x.shape[1]]`` (ExecuTorch's llama ``freqs_cos[:seqlen]``),
and with a KV cache as ``narrow(0, input_pos, seqlen)``.  XNNPACK slices at fixed positions,
so such a slice runs on ExecuTorch's portable kernels (``slice_copy``), its bounds computed
when the program runs; before, the lowering read the size as the number it had at export,
which made torch fix the dim for the whole program: it then refused every other size.
Each program here runs on the ExecuTorch 1.4.1 runtime at several sizes and is compared with
the module: a slice, a multiply and one small linear (a few float32 ulps of an 8-term sum:
``BOUND`` relative to the output's largest magnitude, far below the size of a wrong row);
programs with a softmax or SiLU (ExecuTorch's llama, the masked scores), whose kernels XNNPACK
accepts within 1e-5 of each value, ``float_bounds.APPROXIMATED``.
"""

from __future__ import annotations

import re

import pytest
from float_bounds import APPROXIMATED, SUMS, relative_error

import xnnquant as xq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack
Dim = torch.export.Dim

BOUND = SUMS  # see the module docstring


def _table(rows: int) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))


class Rotary(torch.nn.Module):
    """``cos[: seq]``: the table's first rows, as many as the input has tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", _table(64))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cos[: x.shape[1]]


class AfterThePast(torch.nn.Module):
    """``cos[past : past + seq]``: the start is another input's dynamic length."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", _table(64))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        start = past.shape[1]
        return x * self.cos[start: start + x.shape[1]]


class AtPosition(torch.nn.Module):
    """``cos.narrow(0, input_pos, seq)``: the start read from an int64 tensor (a KV cache's position)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", _table(64))
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        pos = input_pos[0].item()
        torch._check(pos >= 0)
        torch._check(pos + x.shape[1] <= 64)
        return self.lin(x) * self.cos.narrow(0, pos, x.shape[1])


class SplitAtSeq(torch.nn.Module):
    """``split(table, [seq, rows - seq])``: both parts' sizes follow the dim."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", _table(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head, _ = torch.split(self.table, [x.shape[1], 64 - x.shape[1]])
        return x * head


class PaddedToSeq(torch.nn.Module):
    """A 4-row table padded with zero rows up to the input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", _table(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.nn.functional.pad(self.table, (0, 0, 0, x.shape[1] - 4))


def _x(length: int) -> torch.Tensor:
    return torch.randn(1, length, 8, generator=torch.Generator().manual_seed(100 + length))


SEQ = Dim("seq", min=4, max=32)
CASES = {
    "rotary": (Rotary, lambda n: (_x(n),), ({1: SEQ},), (4, 10, 32), "aten.slice.Tensor"),
    "after-the-past": (AfterThePast, lambda n: (_x(n), torch.zeros(1, 40 - n)), ({1: SEQ}, {1: Dim("past", max=32)}),
                       (10, 16, 32), "aten.slice.Tensor"),
    "at-position": (AtPosition, lambda n: (_x(n), torch.tensor([64 - n - (n % 5)])), ({1: SEQ}, None),
                    (4, 10, 32), "aten.slice.Tensor aten.narrow.default"),  # narrow as it is, or decomposed
    "split": (SplitAtSeq, lambda n: (_x(n),), ({1: SEQ},), (4, 10, 32),
              "aten.split_with_sizes.default"),
    "pad": (PaddedToSeq, lambda n: (_x(n),), ({1: SEQ},), (4, 10, 32), "aten.constant_pad_nd.default"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_constant_read_at_dynamic_positions_takes_every_size(case: str) -> None:
    """The read runs on the portable kernels, the rest in XNNPACK, the program's inputs stay
    dynamic, and the ExecuTorch runtime gives the module's result at every size (the old
    code fixed the dim at the example's size: 'dim 1 is fixed at 10' at any other)."""
    make, inputs, spec, sizes, op = CASES[case]
    torch.manual_seed(0)
    module = make().eval()
    exported = xq.export(module, inputs(10), weights="fp32", dynamic_shapes=spec, progress=False)
    assert exported.inputs[0].dynamic and str(exported.inputs[0].dynamic[1]).startswith("seq in [")
    outside = [p for p in exported.placement if p.where == "portable kernels" and p.op in op.split()]
    assert len(outside) == 1 and any(why in outside[0].why for why in (
        "XNNPACK slices only at fixed positions", "it reads the dynamic size seq", "XNNPACK has no lowering"))
    for n in sizes:
        args = inputs(n)
        (got,) = exported.run(*args)
        with torch.no_grad():
            want = module(*args).numpy()
        assert got.shape == want.shape
        assert relative_error(got, want) < BOUND


def test_strict_refuses_the_read_naming_the_dim() -> None:
    """strict=True (one pure XNNPACK graph) refuses the slice, naming the positions that move."""
    with pytest.raises(xq.UnsupportedConfigError,
                       match=r"aten.slice.Tensor \(node slice\w*, module <top level>\): a slice of dim 0 \(size "
                             r"64\) between positions computed when the program runs \(s\d+\): XNNPACK slices only "
                             r"at fixed positions"):
        xq.export(Rotary().eval(), (_x(10),), weights="fp32", dynamic_shapes=({1: SEQ},), progress=False, strict=True)


def test_a_size_read_as_a_number_by_any_lowering_is_refused_naming_the_dim() -> None:
    """The class, not the case: a lowering that reads a dynamic size as a number (here
    ``split``'s sizes) is refused with the dim's name instead of fixing it; xq.check says the same."""
    report = xq.check(SplitAtSeq().eval(), (_x(10),), weights="fp32", dynamic_shapes=({1: SEQ},))
    (split,) = [p for p in report.portable if p.op == "aten.split_with_sizes.default"]
    assert re.fullmatch(r"it reads the dynamic size seq \(s\d+\) as the number it had at export \(s\d+ == 10\): the "
                        r"program would take that size only; expected static sizes for it", split.why)


def test_a_dim_fixed_after_torch_export_is_never_written_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    """The safety net: were a lowering to fix a dynamic dim anyway (the guard switched off
    here), the export raises instead of writing a program that takes one size."""
    import contextlib

    from xnnquant.frontend import lowering
    from xnnquant.frontend.lowering import walk

    def unguarded(*args: object, **kwargs: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    monkeypatch.setattr(walk, "sizes_stay_dynamic", unguarded)
    monkeypatch.setattr(lowering, "sizes_stay_dynamic", unguarded)  # the checks' (check_refusal)
    with pytest.raises(xq.XnnquantError, match=r"dynamic dim seq was fixed at its traced size while exporting"):
        xq.export(SplitAtSeq().eval(), (_x(10),), weights="fp32", dynamic_shapes=({1: SEQ},),
                  progress=False)


def test_executorchs_llama_transformer_takes_every_length() -> None:
    """ExecuTorch's own llama ``Transformer`` (no KV cache, GQA by repeat_interleave) reads its
    rotary tables as ``freqs_cos[:seqlen]`` and its causal mask as ``mask[:seqlen, :seqlen]``:
    one program for 1 to 31 tokens, on the runtime, against the module (the old code fixed
    the token count at the example's 9; the mask ``[L, S]`` meets the scores ``[1, H, L, S]``
    without a reshape to two dynamic dims).  Bound: float32 sums of at most 128 products
    through two layers, and its softmax and SiLU, relative to the largest logit: ``APPROXIMATED``."""
    pytest.importorskip("executorch.examples.models.llama.llama_transformer")
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    torch.manual_seed(0)
    model = construct_transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100,
                                            hidden_dim=128, max_seq_len=32, max_context_len=32, use_kv_cache=False,
                                            enable_dynamic_shape=True, generate_full_logits=True)).eval()

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))

    exported = xq.export(model, (ids(9),), weights="fp32", dynamic_shapes=({1: Dim("tokens", min=1, max=31)},),
                         progress=False)
    for n in (1, 9, 31):
        (got,) = exported.run(ids(n))
        with torch.no_grad():
            want = model(ids(n))
        want = (want[0] if isinstance(want, tuple) else want).numpy()
        assert got.shape == want.shape
        assert relative_error(got, want) < APPROXIMATED


def test_a_mask_with_two_dynamic_dims_broadcasts_against_the_scores() -> None:
    """``scores [1, 4, L, L] + mask [L, L]``: XNNPACK's add aligns the ranks from the right as
    torch does; the mask is not reshaped to ``[1, 1, L, L]`` (a reshape infers one dim)."""

    class Masked(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.view(1, x.shape[1], 4, 2).transpose(1, 2)
            scores = q @ q.transpose(-1, -2)
            mask = x[0, :, :1] - x[0, :, 1]  # [L, 1] - [L] -> [L, L], computed
            return torch.softmax(scores + mask, dim=-1)

    exported = xq.export(Masked().eval(), (_x(10),), weights="fp32", dynamic_shapes=({1: SEQ},), progress=False)
    assert not exported.mixed
    for n in (4, 10, 32):
        (got,) = exported.run(_x(n))
        assert relative_error(got, Masked()(_x(n)).numpy()) < APPROXIMATED  # a softmax
