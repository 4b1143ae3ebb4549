"""Every lowering, one op at a time: the registry, the op tables, the compositions.

Each case exports a one-op module (fp32 weights, both targets where the lowering differs),
runs it on the real XNNPACK and compares with torch in float64.  Bounds:

* element-wise binary ops are single IEEE operations in XNNPACK's x86 kernels: exact up
  to rounding once (``float_bounds.XNNPACK_F32``), so 1 ulp of the result;
* other ops: ``float_bounds`` per node kind, or the composition's own error, measured on
  AMD Zen 2 and stated in the module that composes it (activations.py, normalization.py)
  with a 4x margin for other CPUs' kernels.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph.interpreter import HANDLERS

torch = pytest.importorskip("torch")
F = torch.nn.functional
aten = torch.ops.aten

from xnnquant.frontend.lowering import LOWERINGS, elementwise, load_lowerings, lowers  # noqa: E402  (needs torch)


class Op(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: Any) -> Any:
        return self.fn(*xs)


def _check(fn: Callable[..., Any], *inputs: Any, bound: float = 2.0**-23, targets: tuple[str, ...] = ("1.4.1",),
           relative: bool = True) -> xq.Exported:
    """Export ``fn`` for each target, run it, compare with torch in float64.

    ``bound``: max |runtime - reference| over max |reference| (``relative``), or absolute.
    """
    module = fn if isinstance(fn, torch.nn.Module) else Op(fn).eval()
    double = copy.deepcopy(module).double()
    with torch.no_grad():
        reference = double(*(x.double() for x in inputs)).numpy()
    for target in targets:
        exported = xq.export(module, inputs, weights="fp32", target=target, progress=False)
        (got,) = exported.run(*inputs)
        assert got.shape == reference.shape
        error = np.abs(got - reference).max(initial=0.0)
        scale = np.abs(reference).max(initial=0.0) if relative else 1.0
        assert error <= bound * scale, f"{target}: error {error:.3g}, bound {bound * scale:.3g}"
    return exported


def test_every_registered_op_has_interpreter_handlers_for_what_it_emits() -> None:
    registry = load_lowerings()
    assert len(registry) > 75
    for op, registration in registry.items():
        assert registration.emits <= set(HANDLERS), (op, registration.emits - set(HANDLERS))
    families = {r.family for r in registry.values()}
    assert families == {"linear", "conv", "pooling", "elementwise", "activations", "normalization", "shape", "reduction",
                        "attention", "resize"}


def test_a_second_registration_is_refused() -> None:
    load_lowerings()
    with pytest.raises(RuntimeError, match=r"aten.linear.default is already lowered by xnnquant.frontend.lowering.linear.linear: "
                                           r"refusing a second lowering .*\.again"):
        @lowers(aten.linear.default, emits=())
        def again(ctx: Any, *args: Any) -> None:
            pass
    assert LOWERINGS[aten.linear.default].fn.__name__ == "linear"
    with pytest.raises(RuntimeError, match="unknown node kinds in emits=: \\['XNNNothing'\\]"):
        lowers(aten.abs.default, emits=("XNNNothing",))


RNG = torch.Generator().manual_seed(0)


def _x(*shape: int, low: float = -3.0, high: float = 3.0) -> Any:
    return torch.rand(*shape, generator=RNG) * (high - low) + low


@pytest.mark.xnnpack
@pytest.mark.parametrize("op", sorted(elementwise.BINARY, key=str), ids=str)
def test_binary_table(op: Any) -> None:
    """Each binary op on two activations (broadcast), and on an activation and a constant."""
    scalar = str(op).endswith(".Scalar")
    x = _x(2, 3, 8, low=0.5)
    y = _x(3, 1, low=0.5)
    if scalar:
        _check(lambda a: op(a, 1.75), x)
    else:
        _check(lambda a, b: op(a, b), x, y)
        _check(lambda a: op(a, torch.full((8,), 0.625)), x)


UNARY_DOMAIN = {"rsqrt": (0.01, 50.0), "sqrt": (0.0, 50.0), "log": (0.01, 50.0)}
# max |error| / max |reference| for each unary op (1.4.1, xn01), from float_bounds' XNNPACK
# bounds or the composition's stated error (elementwise.py), 4x the measurement
UNARY_BOUND = {"tanh": 2e-6, "exp": 4 * 2.0**-23, "log": 4 * 2.0**-23, "sin": 2e-6, "cos": 2e-6,
               "rsqrt": 4 * 2.0**-23, "sigmoid": 2e-6, "hardswish": 4e-6}


@pytest.mark.xnnpack
@pytest.mark.parametrize("op", sorted(elementwise.UNARY, key=str), ids=str)
def test_unary_table(op: Any) -> None:
    name = str(op).split(".")[1]
    low, high = UNARY_DOMAIN.get(name, (-6.0, 6.0))
    x = _x(4, 64, low=low, high=high)
    entry = elementwise.UNARY[op]
    bound = UNARY_BOUND.get(name, 2.0**-23)
    targets = ("1.4.1", "xn01") if entry.composed is not None else ("1.4.1",)
    exported = _check(lambda a: op(a), x, bound=bound, targets=targets)
    if entry.composed is None and "XNN" + entry.kind[3:] not in xq.graph.Target.XN01.node_kinds:
        with pytest.raises(UnsupportedConfigError, match=f"{entry.kind} is one of ExecuTorch 1.4.1's node kinds and "
                                                          "has no composition from XN01 kinds: export with "
                                                          "target='1.4.1'"):
            xq.export(Op(lambda a: op(a)).eval(), (x,), weights="fp32", target="xn01", progress=False)
    assert exported.graph.nodes


X = torch.linspace(-12, 12, 24000).reshape(3, -1)

# (function, max |error| absolute): measured on the real runtime against float64 torch
# (AMD Zen 2), bound = 4x.  GELU exact: XNNGelu 8.0e-7; its XN01 composition 3.4e-7
# (Abramowitz & Stegun 7.1.26, error 1.5e-7 in erf); GELU tanh 3.6e-7 against torch's
# tanh formula; tanh as 2 sigmoid(2x) - 1: 1.7e-7; hardsigmoid 4e-8; silu 7.9e-7.
COMPOSITIONS = {
    "gelu": (F.gelu, 3.2e-6),
    "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), 1.5e-6),
    "tanh": (torch.tanh, 1e-6),
    "hardsigmoid": (F.hardsigmoid, 2e-7),
    "silu": (F.silu, 3.2e-6),
    "relu": (F.relu, 0.0),
    "relu6": (F.relu6, 0.0),
    "hardtanh": (lambda t: F.hardtanh(t, -2.5, 0.75), 0.0),
    "clamp": (lambda t: torch.clamp(t, min=-1.0), 0.0),
    "leaky_relu": (lambda t: F.leaky_relu(t, 0.2), 2.0**-23 * 12 * 5),
    "elu": (lambda t: F.elu(t, 0.7), 5e-6 + 12e-5),
    "hardswish": (F.hardswish, 5e-6 + 12e-5),
}


@pytest.mark.xnnpack
@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_activations_against_float64(name: str) -> None:
    fn, bound = COMPOSITIONS[name]
    _check(fn, X, bound=bound, relative=False, targets=("1.4.1", "xn01"))


@pytest.mark.xnnpack
def test_gelu_node_kinds_by_target() -> None:
    exported = xq.export(Op(F.gelu).eval(), (X,), weights="fp32", target="1.4.1", progress=False)
    assert [n.kind for n in exported.graph.nodes] == ["XNNGelu"]
    exported = xq.export(Op(F.gelu).eval(), (X,), weights="fp32", target="xn01", progress=False)
    assert len(exported.graph.nodes) == 21 and "XNNELU" in {n.kind for n in exported.graph.nodes}


@pytest.mark.xnnpack
def test_layer_norm_composition() -> None:
    """Mean and variance as fully connected nodes with a 1/n filter; measured 1.7e-6 (1.4.1)
    and 2.1e-6 (xn01) on outputs of magnitude 6: the bound is 4x, relative to that."""
    norm = torch.nn.LayerNorm(384).eval()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=RNG)
        norm.bias.uniform_(-1.0, 1.0, generator=RNG)
    x = torch.randn(64, 384, generator=RNG) * 3 + 1
    _check(norm, x, bound=1.5e-6, targets=("1.4.1", "xn01"))
    two = torch.nn.LayerNorm((4, 16)).eval()
    _check(two, torch.randn(3, 4, 16, generator=RNG), bound=1.5e-6)


@pytest.mark.xnnpack
def test_softmax_over_any_dim() -> None:
    x = _x(2, 5, 7)
    for dim in (-1, 1, 0):
        _check(lambda t, d=dim: torch.softmax(t, d), x, bound=1e-6)


@pytest.mark.xnnpack
def test_prelu_per_channel_and_shared() -> None:
    for channels in (1, 6):
        prelu = torch.nn.PReLU(channels).eval()
        with torch.no_grad():
            prelu.weight.uniform_(0.1, 0.5, generator=RNG)
        _check(prelu, _x(2, 6, 5, 5))


# -------------------------------------------------------------------- shapes


SHAPE_CASES: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "view": (lambda t: t.view(6, 20) * 2, (2, 3, 4, 5)),
    "flatten": (lambda t: torch.flatten(t, 1) + 1, (2, 3, 4, 5)),
    "unsqueeze_squeeze": (lambda t: t.unsqueeze(1).squeeze(1).unsqueeze(-1) * 2, (3, 4)),
    "permute": (lambda t: t.permute(2, 0, 1) + 1, (2, 3, 4)),
    "transpose": (lambda t: t.transpose(0, 1) * 3, (5, 7)),
    "slice": (lambda t: t[:, 1:3, ::1, 2:] + 0, (2, 4, 3, 6)),
    "select": (lambda t: t[:, 2] * 1.5, (3, 4, 5)),
    "split": (lambda t: torch.split(t, [2, 3], dim=1)[1] * 2, (3, 5, 2)),
    "cat2": (lambda t: torch.cat([t, t * 2], dim=1), (2, 3, 4)),
    "cat6": (lambda t: torch.cat([t * k for k in range(1, 7)], dim=-1), (2, 3)),
    "pad": (lambda t: F.pad(t, (1, 2, 0, 3), value=0.5), (2, 3, 4)),
    "pad_zeros": (lambda t: F.pad(t, (0, 1, 1, 0)) * 2, (1, 3, 4, 5)),  # TF-style "same" padding: value None
    "pad_reflect": (lambda t: F.pad(t, (1, 1, 2, 1), mode="reflect") * 2, (1, 3, 4, 5)),  # decomposed by torch
    "expand": (lambda t: t.expand(3, 4, 5) * 1, (4, 1)),
    "mean_last": (lambda t: t.mean(-1, keepdim=True), (3, 4, 10)),
    "mean_dims": (lambda t: t.mean((0, 2)), (3, 4, 10)),
    "mean_spatial": (lambda t: t.mean((2, 3)), (2, 8, 5, 5)),
    "matmul": (lambda t: t @ t.transpose(-1, -2), (2, 3, 5, 4)),
    "bmm_broadcast": (lambda t: torch.matmul(t, t[0, 0]), (2, 3, 4, 4)),
}


@pytest.mark.xnnpack
@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_shape_ops(name: str) -> None:
    fn, shape = SHAPE_CASES[name]
    _check(fn, _x(*shape), bound=1e-6, targets=("1.4.1", "xn01"))


POOLING_CASES: dict[str, Callable[..., Any]] = {
    "max_pool": lambda t: F.max_pool2d(t, 3, stride=2, padding=1),
    "max_pool_ceil": lambda t: F.max_pool2d(t, 2, ceil_mode=True),
    "max_pool_dilated": lambda t: F.max_pool2d(t, 2, stride=1, dilation=2),
    "avg_pool_count_pad": lambda t: F.avg_pool2d(t, 3, stride=2, padding=1),
    "avg_pool_exclude_pad": lambda t: F.avg_pool2d(t, 3, stride=2, padding=1, count_include_pad=False),
    "adaptive_1x1": lambda t: F.adaptive_avg_pool2d(t, 1),
    "adaptive_3x3": lambda t: F.adaptive_avg_pool2d(t, (3, 3)),
    "upsample": lambda t: F.interpolate(t, size=(12, 14), mode="bilinear", align_corners=False),
    "upsample_corners": lambda t: F.interpolate(t, scale_factor=2, mode="bilinear", align_corners=True),
}


@pytest.mark.xnnpack
@pytest.mark.parametrize("name", sorted(POOLING_CASES))
def test_pooling_and_resizing(name: str) -> None:
    _check(POOLING_CASES[name], _x(2, 4, 9, 9), bound=1e-6)


@pytest.mark.xnnpack
@pytest.mark.parametrize("groups, stride, padding, dilation", [(1, 1, 1, 1), (2, 2, 0, 1), (4, 1, 2, 2), (8, 1, 1, 1)])
def test_convolutions(groups: int, stride: int, padding: int, dilation: int) -> None:
    """Regular, grouped and depthwise (groups = channels); float32 sums of up to 72 products."""
    torch.manual_seed(groups)
    conv = torch.nn.Conv2d(8, 16, 3, stride=stride, padding=padding, dilation=dilation, groups=groups).eval()
    exported = _check(conv, _x(2, 8, 10, 10), bound=1e-6)
    kinds = {n.kind for n in exported.graph.nodes}
    assert ("XNNDepthwiseConv2d" in kinds) == (groups == 8)


@pytest.mark.xnnpack
def test_transposed_convolution_needs_141() -> None:
    torch.manual_seed(0)
    deconv = torch.nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2).eval()
    x = _x(1, 6, 5, 5)
    _check(deconv, x, bound=1e-6)
    with pytest.raises(UnsupportedConfigError, match=r"transposed convolution needs target '1\.4\.1'"):
        xq.export(deconv, (x,), weights="fp32", target="xn01", progress=False)


@pytest.mark.xnnpack
def test_batch_norm_alone_and_linear_with_a_computed_weight() -> None:
    norm = torch.nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1, generator=RNG)
        norm.running_var.uniform_(0.5, 2, generator=RNG)
    _check(torch.nn.Sequential(torch.nn.ReLU(), norm).eval(), _x(2, 4, 3, 3), bound=1e-6)
    _check(lambda a, w: F.linear(a, w), _x(3, 8), _x(5, 8), bound=1e-6)


def test_getitem_is_the_only_python_callable() -> None:
    callables = [op for op in load_lowerings() if not hasattr(op, "_schema")]
    assert callables == [] and operator.getitem not in LOWERINGS  # getitem is handled by the walk itself
    assert math.isfinite(1.0)


def test_scalar_exponents_and_bad_ones() -> None:
    x = _x(3, 4, low=0.5)
    with pytest.raises(UnsupportedConfigError, match=r"aten.pow.Tensor_Scalar \(node pow_1, module <top level>\): "
                                                     r"pow with exponent 1.5 is not supported"):
        xq.export(Op(lambda t: t ** 1.5).eval(), (x,), weights="fp32", progress=False)
    with pytest.raises(XnnquantError):
        xq.export(Op(lambda t: t ** 1.5).eval(), (x,), weights="fp32", progress=False)
