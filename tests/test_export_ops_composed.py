"""The ops lowered by composing XNNPACK nodes: attention, 1-D convolutions, group and instance
norm, resizing, pooling divisors, recurrent cells, reductions, softplus / mish / log1p, the
``*_copy`` views, strided slices, negative padding, addmm.

Each case exports a small module (fp32 weights), runs it on the real XNNPACK and compares
with the module in float64 torch (``module.double()`` on the inputs made double).  Bounds:

* **data movement** (slices, pads, concatenations, reshapes, transposes, nearest resizes,
  max pooling, negation) and single binary operations: exact.  The float64 reference of a
  copy of float32 values is those values, and XNNPACK's x86 binary kernels are correctly
  rounded (the float64 result rounded once).
* **linear maps with non-negative weights** (average poolings, adaptive pooling, sums, the
  separable resizes): a float32 sum of ``n`` products in any order is within
  ``gamma(n) * sum|terms|`` of the exact sum (``float_bounds.gamma``), and ``sum|terms|``
  is the same map applied to ``|x|``; two chained maps add their term counts, and weights
  rounded to float32 two more.  ``_check_linear`` applies that bound element by element.
* **everything else** (compositions of XNNPACK's transcendental kernels and sums): the
  largest error relative to the output's largest magnitude, measured on AMD EPYC (Zen)
  with a 4x margin for other CPUs' kernels, stated per case.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError

torch = pytest.importorskip("torch")
F = torch.nn.functional
nn = torch.nn
aten = torch.ops.aten

from float_bounds import assert_within, gamma, half_ulp  # noqa: E402

pytestmark = pytest.mark.xnnpack


class Op(nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: Any) -> Any:
        return self.fn(*xs)


def _module(fn: Any) -> Any:
    return fn.eval() if isinstance(fn, nn.Module) else Op(fn).eval()


def _reference(module: Any, inputs: tuple[Any, ...]) -> np.ndarray:
    double = copy.deepcopy(module).double()
    with torch.no_grad():
        out = double(*(x.double() for x in inputs))
    return (out[0] if isinstance(out, tuple) else out).numpy()


def _export(fn: Any, *inputs: Any, weights: str = "fp32") -> tuple[xq.Exported, np.ndarray]:
    exported = xq.export(_module(fn), inputs, weights=weights, progress=False)
    (got, *_) = exported.run(*inputs)
    return exported, got


def _check(fn: Any, *inputs: Any, bound: float) -> xq.Exported:
    """max |runtime - float64 torch| <= ``bound`` * max |float64 torch|."""
    module = _module(fn)
    reference = _reference(module, inputs)
    exported, got = _export(module, *inputs)
    assert got.shape == reference.shape
    error = np.abs(got - reference).max(initial=0.0)
    assert error <= bound * np.abs(reference).max(initial=0.0), (error, np.abs(reference).max())
    return exported


def _check_linear(fn: Any, x: Any, terms: int) -> xq.Exported:
    """A linear map with non-negative weights of at most ``terms`` products per output (module docstring)."""
    module = _module(fn)
    reference = _reference(module, (x,))
    magnitude = _reference(module, (x.abs(),))
    exported, got = _export(module, x)
    assert_within(got, reference, gamma(terms) * magnitude + half_ulp(reference), "linear map")
    return exported


def _exact(fn: Any, *inputs: Any) -> xq.Exported:
    """Data movement, and single IEEE operations, which XNNPACK's x86 kernels round correctly:
    the float64 result rounded once to float32 (``float_bounds.XNNPACK_F32``)."""
    module = _module(fn)
    reference = _reference(module, inputs)
    exported, got = _export(module, *inputs)
    assert got.shape == reference.shape
    np.testing.assert_array_equal(got, reference.astype(np.float32))
    return exported


def _kinds(exported: xq.Exported) -> set[str]:
    return {n.kind for n in exported.graph.nodes}


def _refused(fn: Any, *inputs: Any) -> str:
    """What XNNPACK refuses (``strict=True``: a mixed program would run it outside XNNPACK)."""
    with pytest.raises(UnsupportedConfigError) as info:
        xq.export(_module(fn), inputs, weights="fp32", progress=False, strict=True)
    return str(info.value)


RNG = torch.Generator().manual_seed(0)


def _x(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Any:
    return torch.randn(*shape, generator=RNG) * scale + shift


# ------------------------------------------------------------------ attention

sdpa = F.scaled_dot_product_attention
Q, K, V = _x(2, 4, 5, 8), _x(2, 4, 7, 8), _x(2, 4, 7, 6)
GQ = _x(2, 8, 5, 8)  # 8 query heads over K and V's 4
BOOL_MASK = torch.rand(5, 7, generator=RNG) > 0.3
BOOL_MASK[2] = False  # a query that attends to nothing: torch gives 0


class MaskBuffer(nn.Module):
    def __init__(self, mask: Any, gqa: bool = False) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.gqa = gqa

    def forward(self, q: Any, k: Any, v: Any) -> Any:
        return sdpa(q, k, v, attn_mask=self.mask, enable_gqa=self.gqa)


class CausalFromShapes(nn.Module):
    """A causal mask built in forward from the inputs' (static) shapes, as models do."""

    def forward(self, q: Any, k: Any, v: Any) -> Any:
        mask = torch.arange(q.shape[-2])[:, None] >= torch.arange(k.shape[-2])[None, :]
        return sdpa(q, k, v, attn_mask=mask)


# (module or function, inputs).  Measured: at most 1.9e-7 of the largest output (two float32
# dot products of 8 and 7 terms and XNNPACK's softmax, 1e-5 relative at worst by its own
# tests, on probabilities that average values of magnitude ~1): bound 1e-6.
SDPA_CASES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "plain": (lambda q, k, v: sdpa(q, k, v), (Q, K, V)),
    "scale": (lambda q, k, v: sdpa(q, k, v, scale=0.3), (Q, K, V)),
    "causal": (lambda q, k, v: sdpa(q, k, v, is_causal=True), (Q, K, V)),
    "causal_square": (lambda q, k, v: sdpa(q, k, v, is_causal=True), (Q, Q, Q)),
    "bool_buffer_with_an_empty_row": (MaskBuffer(BOOL_MASK), (Q, K, V)),
    "float_buffer": (MaskBuffer(_x(5, 7)), (Q, K, V)),
    "float_input": (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), (Q, K, V, _x(2, 1, 5, 7))),
    "causal_from_shapes": (CausalFromShapes(), (Q, K, V)),
    "rank_3": (lambda q, k, v: sdpa(q, k, v), (Q[0], K[0], V[0])),
    "gqa": (lambda q, k, v: sdpa(q, k, v, enable_gqa=True), (GQ, K, V)),
    "gqa_causal": (lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True), (GQ, K, V)),
    "gqa_bool_buffer": (MaskBuffer(BOOL_MASK, gqa=True), (GQ, K, V)),
    "gqa_per_head_input_mask": (lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, enable_gqa=True),
                                (GQ, K, V, _x(1, 8, 5, 7))),
}


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_scaled_dot_product_attention(name: str) -> None:
    fn, inputs = SDPA_CASES[name]
    exported = _check(fn, *inputs, bound=1e-6)
    kinds = _kinds(exported)
    assert {"XNNBatchMatrixMultiply", "XNNMultiply", "XNNSoftmax"} <= kinds
    assert kinds <= {"XNNBatchMatrixMultiply", "XNNMultiply", "XNNSoftmax", "XNNAdd", "XNNStaticReshape"}


def test_attention_is_not_decomposed_and_needs_no_transpose() -> None:
    from xnnquant.frontend.stages.decompose import decomposition_table

    assert aten.scaled_dot_product_attention.default not in decomposition_table()
    exported, _ = _export(lambda q, k, v: sdpa(q, k, v, is_causal=True), Q, K, V)
    assert [n.kind for n in exported.graph.nodes] == ["XNNBatchMatrixMultiply", "XNNMultiply", "XNNAdd",
                                                      "XNNSoftmax", "XNNBatchMatrixMultiply"]


def test_a_computed_boolean_mask_becomes_a_float_mask() -> None:
    """A mixed program: the mask and its rows' keep factor on the portable kernels (passes/masks.py),
    the attention in XNNPACK; a query that attends to no key gives 0, as in torch.  Bound as
    for the float masks above: 1e-6 of the largest output."""
    def fn(q: Any, k: Any, v: Any, m: Any) -> Any:
        return sdpa(q, k, v, attn_mask=m > 0)

    scores = _x(5, 7)
    scores[2] = -1.0  # query 2 attends to nothing
    exported = xq.export(_module(fn), (Q, K, V, scores), weights="fp32", progress=False)
    (got,) = exported.run(Q, K, V, scores)
    want = fn(Q, K, V, scores).numpy()
    assert not want[:, :, 2].any() and not got[:, :, 2].any()
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert "XNNBatchMatrixMultiply" in {n.kind for graph in exported.delegates for n in graph.nodes}


def test_attention_refusals() -> None:
    message = _refused(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m > 0), Q, K, V, _x(5, 7))
    assert ("aten.scaled_dot_product_attention.default (node scaled_dot_product_attention, module <top level>): the "
            "boolean attention mask is computed at run time: XNNPACK has no boolean values (the masks pass turns it "
            "into a float mask outside XNNPACK when the program may be mixed)") in message
    message = _refused(lambda q, k, v: sdpa(q, k, v, dropout_p=0.1), Q, K, V)
    assert "scaled_dot_product_attention with dropout_p=0.1 is not supported: expected 0 (eval)" in message


# ------------------------------------------------------------ 1-D convolution


class ChannelsLast1d(nn.Module):
    """A convolution over ``[N, L, C]`` activations (transposed in and out), as audio models do."""

    def __init__(self, conv: Any) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: Any) -> Any:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class WithBatchNorm(nn.Module):
    def __init__(self, conv: Any, channels: int) -> None:
        super().__init__()
        self.conv, self.bn = conv, nn.BatchNorm1d(channels)
        with torch.no_grad():
            self.bn.weight.copy_(_x(channels))
            self.bn.bias.copy_(_x(channels))
            self.bn.running_mean.copy_(_x(channels))
            self.bn.running_var.copy_(torch.rand(channels, generator=RNG) + 0.5)

    def forward(self, x: Any) -> Any:
        return torch.relu(self.bn(self.conv(x)))


def _conv1d_cases() -> dict[str, tuple[Any, tuple[int, ...]]]:
    torch.manual_seed(1)
    return {
        "regular": (nn.Conv1d(8, 16, 3, padding=1), (2, 8, 20)),
        "strided_dilated": (nn.Conv1d(8, 16, 3, stride=2, padding=2, dilation=2), (2, 8, 21)),
        "grouped": (nn.Conv1d(8, 16, 3, groups=2), (2, 8, 20)),
        "depthwise": (nn.Conv1d(8, 8, 5, groups=8, padding=2), (2, 8, 20)),
        "pointwise": (nn.Conv1d(8, 16, 1), (2, 8, 20)),
        "same_even_kernel": (nn.Conv1d(8, 16, 4, padding="same"), (1, 8, 17)),
        "channels_last": (ChannelsLast1d(nn.Conv1d(8, 16, 3, padding=1)), (2, 20, 8)),
        "batch_norm": (WithBatchNorm(nn.Conv1d(8, 16, 3), 16), (2, 8, 20)),
        "depthwise_batch_norm": (WithBatchNorm(nn.Conv1d(8, 8, 3, groups=8), 8), (2, 8, 20)),
        "transposed": (nn.ConvTranspose1d(8, 4, 3, stride=2, padding=1, output_padding=1), (2, 8, 10)),
        "transposed_batch_norm": (WithBatchNorm(nn.ConvTranspose1d(8, 4, 3, stride=2), 4), (2, 8, 10)),
    }


CONV1D = _conv1d_cases()


@pytest.mark.parametrize("name", sorted(CONV1D))
def test_conv1d_as_conv2d(name: str) -> None:
    """float32 sums of at most 24 products (8 channels x 3 taps; batch norm folded into the
    filter in float64): measured 2.2e-7 of the largest output, bound 1e-6."""
    module, shape = CONV1D[name]
    exported = _check(module, _x(*shape), bound=1e-6)
    kinds = _kinds(exported)
    if "batch_norm" in name:  # folded: no multiply-add left
        assert not kinds & {"XNNMultiply", "XNNAdd"}
    if name == "channels_last":  # an NLC value is NHWC of height 1 by a reshape
        assert "XNNStaticTranspose" not in kinds
    if name.startswith("depthwise"):
        assert "XNNDepthwiseConv2d" in kinds


def test_conv1d_quantized_per_image() -> None:
    """qc8w: the filter quantized per output channel, the input per image, as 2-D ones
    (the self-check computes the node as the graph defines it); within 2% of float."""
    module = CONV1D["regular"][0].eval()
    x = _x(2, 8, 20)
    exported, got = _export(module, x, weights="qc8w")
    assert [row.scheme for row in exported.report] == ["qc8w"] and "XNNConvert" in _kinds(exported)
    reference = _reference(module, (x,))
    assert np.sqrt(np.mean((got - reference) ** 2) / np.mean(reference ** 2)) < 0.02


# ------------------------------------------------------------------ norms


def _affine(norm: Any) -> Any:
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(_x(*p.shape))
    return norm


class ConvThen(nn.Module):
    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 8, 3), norm

    def forward(self, x: Any) -> Any:
        return self.norm(self.conv(x))


def _norm_cases() -> dict[str, tuple[Any, tuple[int, ...]]]:
    torch.manual_seed(2)
    tracked = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
    with torch.no_grad():
        tracked.running_mean.copy_(_x(8))
        tracked.running_var.copy_(torch.rand(8, generator=RNG) + 0.5)
    return {
        "group_norm": (_affine(nn.GroupNorm(4, 32)), (2, 32, 6, 6)),
        "group_norm_1d": (_affine(nn.GroupNorm(3, 6)), (2, 6, 10)),
        "group_norm_no_affine": (nn.GroupNorm(2, 8, affine=False), (2, 8, 5, 5)),
        "conv_group_norm": (ConvThen(_affine(nn.GroupNorm(2, 8))), (2, 4, 9, 9)),
        "instance_norm_2d": (nn.InstanceNorm2d(8), (2, 8, 6, 6)),
        "instance_norm_affine": (_affine(nn.InstanceNorm2d(8, affine=True)), (2, 8, 6, 6)),
        "instance_norm_1d": (nn.InstanceNorm1d(8), (2, 8, 16)),
        "instance_norm_running_stats": (tracked, (2, 8, 6, 6)),
        "conv_instance_norm": (ConvThen(_affine(nn.InstanceNorm2d(8, affine=True))), (2, 4, 9, 9)),
        "batch_norm_input_statistics": (lambda t: F.batch_norm(t, None, None, training=True), (2, 8, 5, 5)),
    }


NORMS = _norm_cases()


@pytest.mark.parametrize("name", sorted(NORMS))
def test_group_and_instance_norm(name: str) -> None:
    """Composed as layer norm is (normalization.py): measured 3.5e-7 of the largest output on
    inputs of mean 1, deviation 3; bound 1.5e-6."""
    fn, shape = NORMS[name]
    _check(fn, _x(*shape, scale=3.0, shift=1.0), bound=1.5e-6)


def test_instance_norm_is_lowered_as_itself() -> None:
    exported, _ = _export(NORMS["instance_norm_2d"][0], _x(2, 8, 6, 6))
    assert "XNNFullyConnected" in _kinds(exported)  # the means
    from xnnquant.frontend.lowering import LOWERINGS, load_lowerings

    load_lowerings()
    for op in (aten.instance_norm.default, aten.group_norm.default, aten.native_group_norm.default,
               aten._native_batch_norm_legit.no_stats):
        assert LOWERINGS[op].family == "normalization"


# --------------------------------------------------------------- resizing

IMAGE = _x(2, 3, 7, 9)
NEAREST_SIZES: dict[str, dict[str, Any]] = {
    "x2": {"scale_factor": 2}, "x3": {"scale_factor": 3}, "x2_by_1": {"scale_factor": (2, 1)},
    "x1.5": {"scale_factor": 1.5}, "half": {"scale_factor": 0.5}, "12x15": {"size": (12, 15)},
    "5x7": {"size": (5, 7)}, "3x4": {"size": (3, 4)}, "20x4": {"size": (20, 4)},
}


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("name", sorted(NEAREST_SIZES))
def test_nearest_resize_is_data_movement(name: str, mode: str) -> None:
    exported = _exact(lambda t: F.interpolate(t, mode=mode, **NEAREST_SIZES[name]), IMAGE)
    assert not _kinds(exported) & {"XNNFullyConnected", "XNNStaticResizeBilinear2D"}
    if name in ("x2", "x3"):  # a whole factor: one concatenation of copies per axis
        assert sum(n.kind.startswith("XNNConcatenate") for n in exported.graph.nodes) == 2


def test_nearest_resize_keeps_infinities_and_nan() -> None:
    x = IMAGE.clone()
    x[0, 0, 0, 0], x[0, 1, 2, 3], x[1, 2, 6, 8] = float("inf"), float("nan"), -float("inf")
    _, got = _export(lambda t: F.interpolate(t, size=(10, 13)), x)
    np.testing.assert_array_equal(got, F.interpolate(x, size=(10, 13)).numpy())


BILINEAR_SIZES = {"x2": {"scale_factor": 2}, "12x15": {"size": (12, 15)}, "5x7": {"size": (5, 7)},
                  "3x4": {"size": (3, 4)}, "x1.5": {"scale_factor": 1.5}, "half": {"scale_factor": 0.5}}


@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("name", sorted(BILINEAR_SIZES))
def test_bilinear_resize(name: str, align_corners: bool, antialias: bool) -> None:
    """XNNStaticResizeBilinear2D where torch's weights are XNNPACK's (whole sizes; antialiased
    upscaling without align_corners): it interpolates with a lerp, whose ``b - a`` cancels,
    and computes its own coordinates in float32; measured 9e-7 of the largest output, bound
    4e-6.  Else the separable map, element by element: at most 2 * (9 / 3 + 1) = 8 terms
    per axis (antialiased, 9 -> 3) plus 2 weight roundings, gamma(18)."""
    fn = lambda t: F.interpolate(t, mode="bilinear", align_corners=align_corners,  # noqa: E731
                                 antialias=antialias, **BILINEAR_SIZES[name])
    whole = name in ("x2", "12x15", "5x7", "3x4")
    upscale = name in ("x2", "12x15")
    node = whole and (not antialias or (upscale and not align_corners))
    exported = _check(fn, IMAGE, bound=4e-6) if node else _check_linear(fn, IMAGE, terms=18)
    assert ("XNNStaticResizeBilinear2D" in _kinds(exported)) == node


# ---------------------------------------------------------------- pooling


AVG_POOLS = [(k, s, p, ceil, pad) for k in (2, 3) for s in (1, 2, 3) for p in (0, 1) for ceil in (False, True)
             for pad in (False, True) if p <= k // 2]


@pytest.mark.parametrize("k, s, p, ceil, count_include_pad", AVG_POOLS)
def test_avg_pool_divisors(k: int, s: int, p: int, ceil: bool, count_include_pad: bool) -> None:
    """torch's divisor for every window, ceil_mode's windows past the padding included (pooling.py)."""
    exported = _check_linear(lambda t: F.avg_pool2d(t, k, s, p, ceil, count_include_pad), IMAGE, terms=k * k + 1)
    assert "XNNAvgPooling2d" in _kinds(exported)


@pytest.mark.parametrize("divisor", [3, 5])
def test_avg_pool_divisor_override(divisor: int) -> None:
    exported = _check_linear(lambda t: F.avg_pool2d(t, 3, 2, 1, True, True, divisor), IMAGE, terms=10)
    assert "XNNDepthwiseConv2d" in _kinds(exported)


@pytest.mark.parametrize("size", [(4, 3), (5, 7), (2, 2), (9, 9), (1, 3), (7, 3)])
def test_adaptive_avg_pool_to_any_size(size: tuple[int, int]) -> None:
    """Windows of up to 3 x 4 cells here; the separable map sums 3 then 4 terms: gamma(9)."""
    _check_linear(lambda t: F.adaptive_avg_pool2d(t, size), IMAGE, terms=9)


def test_max_pool_with_ceil_mode_and_indices() -> None:
    _exact(lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True), IMAGE)
    _exact(lambda t: F.max_pool2d(t, 2, return_indices=True)[0], IMAGE)  # the indices unused
    message = _refused(lambda t: F.max_pool2d(t, 2, return_indices=True)[1].float(), IMAGE)
    assert ("aten.max_pool2d_with_indices.default (node max_pool2d_with_indices, module <top level>): the indices "
            "of max_pool2d_with_indices are used: XNNPACK's max pooling gives the values only (its argmax pooling "
            "gives window-relative indices, and only for non-overlapping windows); a mixed program runs this op "
            "outside XNNPACK") in message


# -------------------------------------------------------- recurrent cells


class LSTMLinear(nn.Module):
    """ExecuTorch's test_lstm module: an LSTM, the last step through two linears, log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 32, batch_first=True)
        self.linear, self.linear2 = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: Any) -> Any:
        y, _ = self.lstm(x)
        return F.log_softmax(self.linear2(self.linear(y[:, -1, :])), dim=1)


class Cell(nn.Module):
    def __init__(self, rnn: Any) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Any) -> Any:
        return self.rnn(x)[0]


def _recurrent_cases() -> dict[str, tuple[Any, tuple[int, ...]]]:
    torch.manual_seed(3)
    return {
        "lstm": (Cell(nn.LSTM(16, 24, batch_first=True)), (2, 5, 16)),
        "lstm_two_layers_bidirectional": (Cell(nn.LSTM(16, 12, num_layers=2, bidirectional=True)), (5, 2, 16)),
        "gru": (Cell(nn.GRU(16, 24)), (5, 2, 16)),
        "gru_bidirectional": (Cell(nn.GRU(16, 12, batch_first=True, bidirectional=True)), (2, 5, 16)),
        "executorch_lstm_linear": (LSTMLinear(), (1, 8, 32)),
    }


RECURRENT = _recurrent_cases()


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_cells(name: str) -> None:
    """torch.export unrolls LSTM / GRU into per-step linears, sigmoids, tanhs, products and sums
    (their biases are constants of rank 3 broadcasting rank-2 activations: ``elementwise.widened``).
    Measured 2.8e-7 of the largest output over 5 steps; bound 1.5e-6."""
    module, shape = RECURRENT[name]
    _check(module, _x(*shape), bound=1.5e-6)


def test_a_constant_of_higher_rank_broadcasts_the_activation_up() -> None:
    exported = _exact(lambda t: t + torch.full((2, 1, 7), 0.5), _x(6, 7))
    assert [n.kind for n in exported.graph.nodes] == ["XNNStaticReshape", "XNNAdd"]
    # an NHWC activation keeps its layout: the new unit dim goes first in the value too
    exported = _exact(lambda t: F.max_pool2d(t, 2) * torch.tensor([2.0, -1.0]).reshape(2, 1, 1, 1, 1), IMAGE)
    assert sum(n.kind == "XNNStaticTranspose" for n in exported.graph.nodes) == 2  # in and out of the pooling


# ------------------------------------------------------------- reductions

X4 = _x(2, 3, 6, 7, scale=3.0, shift=2.0)


@pytest.mark.parametrize("name, fn", [
    ("amax", lambda t: t.amax((1, 2))), ("amin_keepdim", lambda t: t.amin(-1, keepdim=True)),
    ("max_dim", lambda t: torch.max(t, 2)[0]), ("min_dim_keepdim", lambda t: torch.min(t, 1, keepdim=True)[0]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_maxima_are_exact(name: str, fn: Any) -> None:
    exported = _exact(fn, X4)
    assert "XNNMaxPooling2d" in _kinds(exported)


@pytest.mark.parametrize("dims, keepdim", [((1, 3), False), (-1, True), ((0, 1, 2), False)])
def test_sums(dims: Any, keepdim: bool) -> None:
    _check_linear(lambda t: t.sum(dims, keepdim=keepdim), X4, terms=2 * 3 * 6)


@pytest.mark.parametrize("name, fn", [
    ("var", lambda t: t.var(-1)), ("var_biased_keepdim", lambda t: torch.var(t, (2, 3), correction=0, keepdim=True)),
    ("std", lambda t: t.std(1)), ("log_softmax_dim1", lambda t: F.log_softmax(t * 10, 1)),
    ("log_softmax_last", lambda t: F.log_softmax(t * 10, -1)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_variances_and_log_softmax(name: str, fn: Any) -> None:
    """Sums of squares of deviations (two float32 sums of up to 42 terms), and log-softmax as
    ``x - max - log(sum exp)`` (XNNPACK's exp and log, 6 eps at most): measured 1.6e-7 of
    the largest output; bound 1e-6."""
    _check(fn, X4, bound=1e-6)


@pytest.mark.parametrize("order, dims, keepdim", [(2, -1, True), (2, (1, 2), False), (1, 1, False),
                                                  (float("inf"), -1, False), (float("-inf"), (2, 3), True)])
def test_vector_norms(order: float, dims: Any, keepdim: bool) -> None:
    """ord 1: a sum of |x| (gamma(n) of the sum); ord 2: the square root of a sum of squares
    (gamma(n + 1) of the sum, halved by the root, plus the root's half ulp); inf and -inf select
    an |x|: exact."""
    fn = lambda t: torch.linalg.vector_norm(t, order, dims, keepdim)  # noqa: E731
    module = _module(fn)
    reference = _reference(module, (X4,))
    exported, got = _export(module, X4)
    n = X4.numel() // reference.size
    if math.isinf(order):
        np.testing.assert_array_equal(got, reference.astype(np.float32))
    else:
        relative = gamma(n) if order == 1 else gamma(n + 1) / 2
        assert_within(got, reference, relative * reference + half_ulp(reference), f"norm {order}")
    assert "XNNFullyConnected" in _kinds(exported) or "XNNMaxPooling2d" in _kinds(exported)


def test_reduction_refusals() -> None:
    message = _refused(lambda t: torch.max(t, 2)[1].float(), X4)
    assert ("aten.max.dim (node max_1, module <top level>): the indices output of aten.max.dim is used: XNNPACK "
            "computes the values only (a mixed program runs this op outside XNNPACK)") in message
    message = _refused(lambda t: t.sum() * 2, X4)
    assert ("aten.sum.default (node sum_1, module <top level>): aten.sum.default over every dim gives a 0-d tensor: "
            "XNNPACK values have at least one dim; expected keepdim=True or a reduction that keeps a dim") in message


# --------------------------------------------------------- activations

LINE = torch.linspace(-30, 30, 6000).reshape(6, -1)


@pytest.mark.parametrize("name, fn", [
    ("softplus", F.softplus),
    ("softplus_beta", lambda t: F.softplus(t, beta=2.0, threshold=20.0)),
    ("mish", F.mish),
], ids=lambda v: v if isinstance(v, str) else "")
def test_softplus_and_mish(name: str, fn: Any) -> None:
    """relu(x) + log1p(exp(-|x|)) (and x tanh of it), the log1p accurate relative to its
    result (activations.log1p_unit): measured 3.4e-6 relative at worst (XNNPACK's exp on
    large negative arguments), 4.8e-7 absolute (at |x| = 30); bound 4x relative, plus
    1e-9 absolute for results near 0."""
    reference = fn(LINE.double()).numpy()
    _, got = _export(fn, LINE)
    assert_within(got, reference, 1e-9 + 1.4e-5 * np.abs(reference), name)


def test_log1p() -> None:
    """log(1 + x) with its rounding corrected (activations.log1p_value): XNNPACK's log is right
    to an ulp of 1 near 1 (measured 1.2e-7 absolute), so the bound is absolute: 4x that."""
    x = torch.linspace(-0.9, 10.0, 4000).reshape(4, -1)
    reference = torch.log1p(x.double()).numpy()
    _, got = _export(torch.log1p, x)
    assert np.abs(got - reference).max() <= 5e-7
    tiny = torch.tensor([[1e-9, -2e-8, 2.5e-8, 0.0]])  # 1 + x rounds to 1 (|x| < 2^-25): x itself
    _, got = _export(torch.log1p, tiny)
    np.testing.assert_array_equal(got, tiny.numpy())


def test_softplus_below_its_least_threshold_is_refused() -> None:
    message = _refused(lambda t: F.softplus(t, threshold=5.0), LINE)
    assert ("aten.softplus.default (node softplus, module <top level>): softplus with threshold=5.0 (beta=1) is not "
            "supported: torch switches to the identity where softplus still differs from it, which needs a select; "
            "expected threshold >= 15") in message


# ------------------------------------------------------- shapes and addmm

copies = aten


@pytest.mark.parametrize("name, fn", [
    ("permute_copy", lambda t: torch.permute_copy(t, (0, 2, 3, 1))),
    ("view_copy", lambda t: copies.view_copy(t, [6, 42])),
    ("unsqueeze_squeeze_copy", lambda t: copies.squeeze_copy(copies.unsqueeze_copy(t, 1), [1])),
    ("transpose_t_copy", lambda t: copies.t_copy(copies.transpose_copy(t[0, 0], 0, 1))),
    ("select_slice_copy", lambda t: copies.slice_copy(copies.select_copy(t, 1, 2), 1, 1, 5)),
    ("expand_copy", lambda t: copies.expand_copy(t[:, :1], [2, 3, 6, 7]) * 1),
    ("split_copy", lambda t: copies.split_copy(t, 2, 3)[1]),
    ("unbind", lambda t: torch.unbind(t, 1)[2]),
    ("repeat", lambda t: t.repeat(2, 1, 3, 1, 7)),
    ("flip", lambda t: torch.flip(t, (1, 3))),
    ("strided_slices", lambda t: t[:, :, ::2, 1::3]),
    ("strided_slice_of_nhwc", lambda t: F.max_pool2d(t, 1)[:, :, 1::2, ::4]),
    ("strided_slice_past_the_end", lambda t: t[..., 2:7:4]),
    ("negative_padding", lambda t: F.pad(t, (-1, 2, -2, -1))),
    ("negative_and_positive_padding", lambda t: F.pad(t, (0, 0, -2, 2))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_copies_slices_and_padding_are_exact(name: str, fn: Any) -> None:
    _exact(fn, X4)


def test_slice_refusals() -> None:
    message = _refused(lambda t: t[:, 3:3] + 1, X4)
    assert ("an empty slice 3:3 of dim 1 of a value of shape (2, 3, 6, 7) is not supported: XNNPACK cannot hold a "
            "value of size 0") in message


class Addmm(nn.Module):
    def __init__(self, bias: Any, beta: float = 1.0, alpha: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("bias", bias)
        self.register_buffer("weight", _x(4, 4))
        self.beta, self.alpha = beta, alpha

    def forward(self, x: Any) -> Any:
        return torch.addmm(self.bias, x, self.weight, beta=self.beta, alpha=self.alpha)


@pytest.mark.parametrize("name, module", [
    ("bias_1_n", Addmm(_x(1, 4))),
    ("bias_n_alpha_beta", Addmm(_x(4), beta=0.5, alpha=2.0)),
    ("full_bias", Addmm(_x(3, 4), beta=0.5)),
    ("beta_0", Addmm(_x(3, 4), beta=0.0)),
    ("activations", Op(lambda t: torch.addmm(t[:, :3], t, t.T, beta=2.0, alpha=0.5))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_addmm(name: str, module: Any) -> None:
    """float32 dot products of 4 terms, a scaling and a bias: measured 1.1e-7; bound 1e-6."""
    _check(module, _x(3, 4), bound=1e-6)


# ------------------------------------------------------ building blocks


class LayerNormGeluLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(64), nn.Linear(64, 128)

    def forward(self, x: Any) -> Any:
        return self.linear(F.gelu(self.norm(x)))


def _blocks() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    torch.manual_seed(4)
    q, kv = _x(2, 4, 6, 32), _x(2, 4, 6, 32)
    return {
        "sdpa": (Op(lambda a, b, c: sdpa(a, b, c)), (q, kv, kv)),
        "sdpa_causal": (Op(lambda a, b, c: sdpa(a, b, c, is_causal=True)), (q, kv, kv)),
        "MultiheadAttention": (nn.MultiheadAttention(64, 4, batch_first=True), (_x(2, 7, 64),) * 3),
        "TransformerEncoderLayer": (nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), (_x(2, 7, 64),)),
        "LSTM": (Cell(nn.LSTM(32, 48, batch_first=True)), (_x(2, 5, 32),)),
        "GRU": (Cell(nn.GRU(32, 48)), (_x(5, 2, 32),)),
        "GroupNorm": (nn.GroupNorm(4, 32), (_x(2, 32, 6, 6),)),
        "InstanceNorm2d": (nn.InstanceNorm2d(32), (_x(2, 32, 6, 6),)),
        "Upsample_nearest": (nn.Upsample(scale_factor=2), (_x(1, 8, 5, 7),)),
        "Conv1d": (nn.Conv1d(32, 64, 3, padding=1), (_x(2, 32, 20),)),
        "Softplus": (nn.Softplus(), (_x(4, 64, scale=5.0),)),
        "Mish": (nn.Mish(), (_x(4, 64, scale=5.0),)),
        "LogSoftmax": (nn.LogSoftmax(-1), (_x(4, 64, scale=5.0),)),
        "PixelShuffle": (nn.PixelShuffle(2), (_x(1, 32, 5, 5),)),
        "ConvTranspose2d": (nn.ConvTranspose2d(32, 16, 3, stride=2), (_x(1, 32, 5, 5),)),
        "RMSNorm": (nn.RMSNorm(64), (_x(4, 64),)),
        "LayerNorm_GELU_Linear": (LayerNormGeluLinear(), (_x(4, 64),)),
    }


BLOCKS = _blocks()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp32", "qb4w:32"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_building_blocks(name: str, weights: str) -> None:
    """Each PyTorch building block exports and runs.  fp32: measured 3.6e-7 of the largest
    output at worst (bound 2e-6).  qb4w:32 (4-bit weights where a linear's in_features is a
    multiple of 32, else the auto fallback): the normalized RMS error, measured 9.4e-2 at
    worst (MultiheadAttention: 4-bit query, key, value and output projections), bound 0.25
    (the quantized bound of benchmarks/executorch_op_tests.py)."""
    module, inputs = BLOCKS[name]
    module = module.eval()
    with torch.no_grad():
        out = module(*inputs)
    reference = (out[0] if isinstance(out, tuple) else out).double().numpy()
    _, got = _export(module, *inputs, weights=weights)
    assert got.shape == reference.shape
    if weights == "fp32":
        assert np.abs(got - reference).max() <= 2e-6 * np.abs(reference).max()
    else:
        assert np.sqrt(np.mean((got - reference) ** 2) / np.mean(reference ** 2)) <= 0.25


def test_check_reports_what_the_registrations_refuse_without_lowering() -> None:
    """``xq.check`` asks each registration's check on the ATen node (what a mixed program's
    partitioner reads to place an op outside XNNPACK)."""
    def fn(q: Any, k: Any, v: Any, m: Any) -> Any:
        return sdpa(q, k, v, attn_mask=m > 0) + torch.max(q, -1, keepdim=True)[1].float()

    report = xq.check(Op(fn).eval(), (Q, Q, Q, _x(5, 5)), weights="fp32", strict=True)
    assert not report.ok
    reasons = "\n".join(report.refused)
    assert "the boolean attention mask is computed at run time" in reasons
    assert "the indices output of aten.max.dim is used" in reasons
    assert "aten.gt.Scalar (node gt, module <top level>): unsupported operator" in reasons
    # mixed: the same nodes run on the portable kernels, each with its reason
    report = xq.check(Op(fn).eval(), (Q, Q, Q, _x(5, 5)), weights="fp32")
    assert report.ok
    portable = {p.op: p.why for p in report.portable}
    assert portable["aten.gt.Scalar"] == "XNNPACK has no lowering of aten.gt.Scalar"
    assert portable["aten.max.dim"] == "its result is int64 (XNNPACK's values here are float32)"
    assert "aten.bmm.default" in report.lowered or "aten.scaled_dot_product_attention.default" in report.lowered


# ------------------------------------------------------------ dynamic sizes

Dim = torch.export.Dim


def _dynamic(fn: Any, inputs: tuple[Any, ...], spec: Any) -> xq.Exported:
    return xq.export(_module(fn), inputs, weights="fp32", dynamic_shapes=spec, progress=False)


def test_attention_and_conv1d_follow_dynamic_sizes() -> None:
    """One program at every size in range, against torch at that size (bound as in their own
    tests: 1e-6 of the largest output)."""
    seq = Dim("seq", min=2, max=16)
    attention = _dynamic(lambda q, k, v: sdpa(q, k, v, enable_gqa=True), (GQ, _x(2, 4, 5, 8), _x(2, 4, 5, 6)),
                         (({2: seq}, {2: seq}, {2: seq}),))
    conv = _dynamic(CONV1D["channels_last"][0], (_x(2, 20, 8),), ({1: Dim("length", min=4, max=40)},))
    for n in (2, 9, 16):
        q, k, v = _x(2, 8, n, 8), _x(2, 4, n, 8), _x(2, 4, n, 6)
        (got,) = attention.run(q, k, v)
        want = sdpa(q, k, v, enable_gqa=True).numpy()
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        x = _x(2, 2 * n + 4, 8)
        (got,) = conv.run(x)
        with torch.no_grad():
            want = CONV1D["channels_last"][0](x).numpy()
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_compositions_at_fixed_sizes_refuse_dynamic_ones() -> None:
    seq = Dim("seq", min=2, max=16)
    with pytest.raises(UnsupportedConfigError, match=r"a constant of shape \(16, 16\) is combined with dim 2 of "
                                                     r"\(2, 4, 16, 16\), which is dynamic"):
        _dynamic(lambda q, k, v: sdpa(q, k, v, is_causal=True), (Q, _x(2, 4, 5, 8), _x(2, 4, 5, 6)),
                 (({2: seq}, {2: seq}, {2: seq}),))
    # without strict=True a group norm over dynamic dims runs on the portable native_group_norm
    # (tests/test_export_valid_models.py)
    with pytest.raises(UnsupportedConfigError, match=r"aten.group_norm.default of a tensor with dynamic dims "
                                                     r"\(s\d+, 8, 5\) is not supported: it is composed at the sizes "
                                                     r"seen at export; expected static shapes for it"):
        xq.export(nn.GroupNorm(2, 8).eval(), (_x(2, 8, 5),), weights="fp32", dynamic_shapes=({0: Dim("batch", max=8)},),
                  progress=False, strict=True)
