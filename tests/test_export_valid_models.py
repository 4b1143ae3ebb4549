"""Valid models that the export refused or broke (issue 34), each run on the ExecuTorch 1.4.1
runtime and compared with torch's float model.

Bounds: float32 programs whose outputs are sums of at most a few hundred products, layer or
group norms of them: XNNPACK sums in another order than torch, which moves a result by a
few float32 ulps of the sums; ``BOUND`` (relative to the output's largest magnitude,
``float_bounds.SUMS``) is two orders above that and far below a wrong row or a wrong size.
A GELU after a group norm (``ConvGroupNorm``) adds at most XNNPACK's acceptance for GELU on
any CPU, ``10 EPS + 5 EPS |y|`` (``float_bounds.XNNPACK_F32``), under 2e-6 of outputs of
magnitude 1 or more: within ``BOUND``.  Programs with a softmax (attention: wav2vec2, the
multi-query attention, Falcon), whose kernels XNNPACK accepts within 1e-5 of each
probability, are held to ``float_bounds.APPROXIMATED``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from float_bounds import APPROXIMATED, SUMS, relative_error

import xnnquant as xq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack
Dim = torch.export.Dim

BOUND = SUMS  # see the module docstring


def _runs_like_the_module(exported: xq.Exported, module: torch.nn.Module, inputs: list[tuple[torch.Tensor, ...]],
                          bound: float = BOUND) -> None:
    for args in inputs:
        (got,) = exported.run(*args)
        with torch.no_grad():
            want = module(*args).numpy()
        assert got.shape == want.shape
        assert relative_error(got, want) < bound, args[0].shape


# ---------------------------------------------------------------- the size of a delegate's value


class LengthOfAConvOutput(torch.nn.Module):
    """Positions ``arange(h.shape[1])`` of a strided convolution's output ``h``: the portable
    ``arange`` needs the length of a value that XNNPACK computes, in the delegate the
    positions then feed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3, stride=2)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).transpose(1, 2)
        pos = torch.arange(h.shape[1], dtype=torch.float32)
        return self.lin(h + pos[:, None])


class _Output(torch.nn.Module):
    """A transformers ``model`` returning one tensor: ``pick(model, x)``."""

    def __init__(self, model: torch.nn.Module, pick: Any) -> None:
        super().__init__()
        self.model = model
        self.pick = pick

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pick(self.model, x)


def test_a_portable_node_reads_the_size_of_a_value_inside_a_delegate() -> None:
    """The length is computed from the input's (``(T - 1) // 2`` of ``T = 2L + 1``), before the
    delegate runs, so the program stays one delegate (the old code: 'no value for convolution')."""
    torch.manual_seed(0)
    module = LengthOfAConvOutput().eval()
    exported = xq.export(module, (torch.randn(1, 4, 21),), weights="fp32",
                         dynamic_shapes=({2: 2 * Dim("L", min=3, max=32) + 1},), progress=False)
    assert len(exported.delegates) == 1
    assert [p.op for p in exported.placement if p.where == "portable kernels"] == ["aten.arange.start_step"]
    _runs_like_the_module(exported, module, [(torch.randn(1, 4, t, generator=torch.Generator().manual_seed(t)),)
                                             for t in (7, 21, 65)])


def test_wav2vec2_with_a_layer_norm_feature_extractor_takes_every_length() -> None:
    """transformers' Wav2Vec2 (``feat_extract_norm="layer"``, tiny) over a dynamic number of
    samples: its attention mask is built from the feature projection's length (the old code
    raised 'no value for linear'), and its attention's head split views are static (torch
    infers their -1 as ``(32*s - 32)/(16*s - 16)``: 2 heads), so they stay in XNNPACK."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), feat_extract_norm="layer", num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, do_stable_layer_norm=True)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config).eval()

    module = _Output(model, lambda m, samples: m(samples).last_hidden_state).eval()
    exported = xq.export(module, (torch.randn(1, 800),), weights="fp32",
                         dynamic_shapes=({1: 10 * Dim("tenths", min=40, max=160)},), progress=False)
    assert not [p for p in exported.placement if p.op == "aten.view.default" and p.where == "portable kernels"]
    _runs_like_the_module(exported, module, [(torch.randn(1, n, generator=torch.Generator().manual_seed(n)),)
                                             for n in (400, 1230, 1600)], APPROXIMATED)


# ---------------------------------------------------------------- multi-query attention


class MultiQuery(torch.nn.Module):
    """Four query heads, one key / value head broadcast to all (``enable_gqa`` not given), with
    no mask, a causal one, or a float mask computed from an input (``[B, 1, L, S]``)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.mask = mask
        self.q, self.kv = torch.nn.Linear(16, 32), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 1, 16).transpose(1, 2).split(8, dim=-1)
        mask = (x[:, None, :, :1] - x[:, None, None, :, 0]) if self.mask == "computed" else None
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               is_causal=self.mask == "causal")
        return out.transpose(1, 2).reshape(b, t, 32)


@pytest.mark.parametrize("mask", ["none", "causal", "computed"])
def test_multi_query_attention_broadcasts_its_key_and_value_head(mask: str) -> None:
    """torch broadcasts the key's and value's one head to every query head; so does the
    lowering (the old code: 'expected equal heads, or enable_gqa=True').  A causal mask is a
    constant: static length; the others over a dynamic length."""
    torch.manual_seed(0)
    module = MultiQuery(mask).eval()
    spec = None if mask == "causal" else ({1: Dim("seq", min=2, max=24)},)
    exported = xq.export(module, (torch.randn(1, 6, 16),), weights="fp32", dynamic_shapes=spec, progress=False)
    assert not exported.mixed and "aten.scaled_dot_product_attention.default" in {op for op, _, _ in exported.sources}
    lengths = (6,) if spec is None else (2, 6, 24)
    _runs_like_the_module(exported, module, [(torch.randn(1, t, 16, generator=torch.Generator().manual_seed(t)),)
                                             for t in lengths], APPROXIMATED)


def test_falcon_with_sdpa_and_one_key_value_head() -> None:
    """transformers' Falcon (``multi_query=True``, SDPA attention), tiny, over a dynamic token count."""
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                       bias=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()

    module = _Output(model, lambda m, ids: m(ids, use_cache=False).logits).eval()

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))

    exported = xq.export(module, (ids(12),), weights="fp32", dynamic_shapes=({1: Dim("tokens", min=2, max=32)},),
                         progress=False)
    assert any(p.op == "aten.scaled_dot_product_attention.default" and p.where.startswith("XNNPACK")
               for p in exported.placement)
    _runs_like_the_module(exported, module, [(ids(n),) for n in (2, 12, 32)], APPROXIMATED)


# ---------------------------------------------------------------- group norm over a dynamic length


class ConvGroupNorm(torch.nn.Module):
    """An audio front end: Conv1d, GroupNorm (2 groups of 4 channels), GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv1d(4, 8, 3), torch.nn.GroupNorm(2, 8)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.norm(self.conv(x)))


def test_group_norm_over_a_dynamic_length_runs_on_the_portable_kernel() -> None:
    """XNNPACK's group norm is composed at the sizes seen at export; over a dynamic length it
    runs on ExecuTorch's ``native_group_norm.out`` (the old code refused it: 'no portable
    kernel'), the convolution and GELU around it in XNNPACK; xq.check says the same."""
    torch.manual_seed(0)
    module = ConvGroupNorm().eval()
    example, spec = (torch.randn(1, 4, 20),), ({2: Dim("time", min=4, max=64)},)
    report = xq.check(module, example, weights="fp32", dynamic_shapes=spec)
    assert report.ok and [p.op for p in report.portable] == ["aten.native_group_norm.default"]
    exported = xq.export(module, example, weights="fp32", dynamic_shapes=spec, progress=False)
    assert [p.op for p in exported.placement if p.where == "portable kernels"] == ["aten.native_group_norm.default"]
    _runs_like_the_module(exported, module, [(torch.randn(1, 4, t, generator=torch.Generator().manual_seed(t)),)
                                             for t in (4, 20, 64)])
    with pytest.raises(xq.UnsupportedConfigError, match=r"aten.group_norm.default \(node group_norm, module norm\): "
                                                        r"aten.group_norm.default of a tensor with dynamic dims"):
        xq.export(module, example, weights="fp32", dynamic_shapes=spec, progress=False, strict=True)


class LogSoftmaxHead(torch.nn.Module):
    """A CTC head: a linear, then log_softmax over the vocabulary, per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.lin(x), dim=-1)


class ConvInstanceNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv1d(4, 8, 3), torch.nn.InstanceNorm1d(8, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


@pytest.mark.parametrize(("make", "shape", "dim", "runs_portable"), [
    (LogSoftmaxHead, (1, 10, 8), 1, "aten._log_softmax.default"),
    (ConvInstanceNorm, (1, 4, 10), 2, "aten._native_batch_norm_legit.no_stats"),
], ids=["log_softmax", "instance_norm"])
def test_a_lowered_op_refused_over_a_dynamic_dim_runs_as_its_decomposition(make: Any, shape: tuple[int, ...],
                                                                           dim: int, runs_portable: str) -> None:
    """The class of the group norm: an op that XNNPACK composes at the sizes seen at export and
    that has no portable kernel is decomposed where its check refuses it, into ops that run (the
    old code refused them).  Lengths from 8 frames: a norm over 2 or 3 nearly equal values
    cancels most of their digits, and torch and the kernel compute its variance differently."""
    torch.manual_seed(0)
    module = make().eval()
    spec = ({dim: Dim("time", min=4, max=32)},)
    exported = xq.export(module, (torch.randn(*shape),), weights="fp32", dynamic_shapes=spec, progress=False)
    assert [p.op for p in exported.placement if p.where == "portable kernels"] == [runs_portable]

    def x(t: int) -> torch.Tensor:
        return torch.randn(*shape[:dim], t, *shape[dim + 1:], generator=torch.Generator().manual_seed(t))

    _runs_like_the_module(exported, module, [(x(t),) for t in (10, 17, 32)])


def test_an_antialiased_resize_over_a_dynamic_dim_is_refused_before_it_runs() -> None:
    """Decomposed, an antialiased bilinear resize has a portable kernel, but that kernel checks
    its out tensor's sizes instead of resizing it (1.4.1: 'out.size(2) == output_size[0]'):
    over a dynamic dim it is refused by name, not written to fail at run time."""

    class Resize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.interpolate(x * 2, scale_factor=2, mode="bilinear", antialias=True)

    with pytest.raises(xq.UnsupportedConfigError, match=r"nor ExecuTorch's portable kernels \(its portable kernel does "
                                                        r"not resize its result, which has dynamic dims"):
        xq.export(Resize().eval(), (torch.randn(1, 2, 10, 6),), weights="fp32",
                  dynamic_shapes=({2: Dim("h", min=4, max=32)},), progress=False)


# ---------------------------------------------------------------- a cat with empty operands


class CatTwice(torch.nn.Module):
    """ExecuTorch's own op test: ``cat`` of four inputs, two of them empty, then ``x + x``."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = torch.cat(inputs, dim=0)
        return x + x


class CatEmptyBuffer(torch.nn.Module):
    """A cat with a 1-D empty buffer, which torch skips whatever the other operands' rank."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("nothing", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.nothing, x, x * 2], dim=1) + 1


@pytest.mark.parametrize(("module", "inputs"), [
    (CatTwice(), (torch.randn(0, 2, 3), torch.randn(1, 2, 3), torch.randn(3, 2, 3), torch.randn(0, 2, 3))),
    (CatTwice(), (torch.randn(2, 3), torch.randn(0, 3))),
    (CatEmptyBuffer(), (torch.randn(2, 3),)),
], ids=["executorch-op-test", "one-left", "empty-buffer"])
def test_an_empty_operand_of_a_cat_contributes_nothing(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
    """The empty operands are left out of the cat (the old code refused the empty inputs); an
    empty input stays an input of the program, which ExecuTorch's runtime takes and nothing
    reads: exact (a copy and a sum)."""
    exported = xq.export(module.eval(), inputs, weights="fp32", progress=False)
    assert [spec.shape for spec in exported.inputs] == [tuple(x.shape) for x in inputs]
    (got,) = exported.run(*inputs)
    np.testing.assert_array_equal(got, module(*inputs).numpy())


def test_an_empty_input_something_reads_is_refused_by_name() -> None:
    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return y + x.sum()

    with pytest.raises(xq.XnnquantError, match=r"aten.sum.default \(node sum\w*, module <top level>\): neither "
                                               r"XNNPACK \(its input x has no elements: XNNPACK holds no value of "
                                               r"size 0\)"):
        xq.export(Sum().eval(), (torch.randn(0, 3), torch.randn(2, 3)), weights="fp32", progress=False)


# ---------------------------------------------------------------- static int8 through a global response norm


class GlobalResponseNorm(torch.nn.Module):
    """ConvNeXt V2's GRN between two convolutions (channels-last inside, as ConvNeXt V2 has it):
    ``gamma * (x * N(x)) + beta + x`` with ``N(x) = |x|_HW / mean_C |x|_HW``."""

    def __init__(self, zero: bool) -> None:
        super().__init__()
        self.first, self.last = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 8, 1)
        self.gamma = torch.nn.Parameter(torch.zeros(1, 1, 1, 16) if zero else torch.randn(1, 1, 1, 16) / 2)
        self.beta = torch.nn.Parameter(torch.zeros(1, 1, 1, 16) if zero else torch.randn(1, 1, 1, 16) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x).permute(0, 2, 3, 1)
        gx = torch.norm(y, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        y = self.gamma * (y * nx) + self.beta + y
        return self.last(y.permute(0, 3, 1, 2))


@pytest.mark.parametrize("zero", [False, True], ids=["trained", "initial-gamma-0"])
def test_static_int8_through_a_global_response_norm(zero: bool) -> None:
    """The norm (a square, a sum by a fully connected node, a square root) stays fp32 as a whole
    (before, its sum alone went int8 between two fp32 nodes and the self-check caught the
    rounding inside the node); with gamma = beta = 0 the GRN's term is zero by construction,
    which any int8 grid holds exactly (before: 'is 0 on every calibration input', a hint about
    calibration).  The self-check judges every int8 node against torch."""
    torch.manual_seed(0)
    module = GlobalResponseNorm(zero).eval()
    batches = [(torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(k)),) for k in range(8)]
    exported = xq.export(module, batches[0], weights="qc8w", activations="qint8", calibration=batches,
                         progress=False)
    assert exported.self_check.nodes > 0
    (norm,) = [b for b in exported.boundaries if b.startswith("aten.linalg_vector_norm.default")]
    assert "lowered as a composition of 3 computing nodes (XNNSquare, XNNFullyConnected, XNNSquareRoot)" in norm


def test_static_int8_refuses_a_value_calibration_saw_only_zeros_of() -> None:
    """A value that is 0 on every calibration batch only because of the batches (not by
    construction) still has no range: refused with the calibration hint."""

    class Dead(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return torch.relu(y - 100.0) + y

    batches = [(torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(k)),) for k in range(4)]
    with pytest.raises(xq.XnnquantError, match=r"is 0 on every calibration input \(a constant activation\): its int8 "
                                               r"range would be empty; calibrate with inputs that exercise it"):
        xq.export(Dead().eval(), batches[0], weights="qc8w", activations="qint8", calibration=batches,
                  progress=False)


# ---------------------------------------------------------------- xq.check is the dry run of xq.export


@pytest.mark.parametrize(("make", "inputs", "spec"), [
    (LengthOfAConvOutput, (torch.randn(1, 4, 21),), ({2: 2 * Dim("L", min=3, max=32) + 1},)),
    (ConvGroupNorm, (torch.randn(1, 4, 20),), ({2: Dim("time", min=4, max=64)},)),
    (LogSoftmaxHead, (torch.randn(1, 10, 8),), ({1: Dim("time", min=4, max=32)},)),
    (lambda: MultiQuery("computed"), (torch.randn(1, 6, 16),), ({1: Dim("seq", min=2, max=24)},)),
    (CatTwice, (torch.randn(0, 2, 3), torch.randn(1, 2, 3)), None),
], ids=["size-of-a-delegate-value", "group-norm", "log-softmax", "multi-query", "empty-cat"])
@pytest.mark.parametrize("weights", ["fp32", "qb4w:32"])
def test_check_says_what_export_does(make: Any, inputs: tuple[Any, ...], spec: Any, weights: str) -> None:
    """Same placement (the ops left to the portable kernels) and both take the module (the old
    code: check said yes to the delegate's size case, which export then failed on)."""
    torch.manual_seed(0)
    module = make().eval()
    report = xq.check(module, inputs, weights=weights, dynamic_shapes=spec)
    exported = xq.export(module, inputs, weights=weights, dynamic_shapes=spec, progress=False, check=False)
    assert report.ok
    assert sorted(p.op for p in report.portable) == sorted(p.op for p in exported.placement
                                                           if p.where == "portable kernels")


def test_a_value_and_its_transpose_multiplied_keep_their_layouts() -> None:
    """``q @ q^T`` of a transposed view: both operands are one graph value read in two orders;
    each gets its own layout (the old code cached one layout for both and refused the product,
    'expected [..., M, K] and [..., K, N]')."""

    class Gram(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = x.view(1, 10, 4, 2).transpose(1, 2)
            return q @ q.transpose(-1, -2)

    x = torch.randn(1, 10, 8, generator=torch.Generator().manual_seed(0))
    exported = xq.export(Gram().eval(), (x,), weights="fp32", progress=False)
    _runs_like_the_module(exported, Gram(), [(x,)])
