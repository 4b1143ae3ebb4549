"""The numpy reference interpreter on its own: hand-derived golden values, torch
cross-checks, and the errors of ``run`` / ``interpret`` that need no runtime.

The comparisons against the real runtime are in ``test_graph_runtime.py``; these tests
pin the semantics that were settled there (argmax index order, padding excluded from
averages, half-pixel resize, where output_min/max apply) so they hold without
executorch installed.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from float_bounds import assert_within, half_ulp

import xnnquant as xq
from xnnquant import Datatype as D
from xnnquant import QuantizedTensor
from xnnquant.errors import MissingExtraError, XnnquantError
from xnnquant.graph import Graph, interpret, run, to_pte


def nhwc(rows: list[list[float]]) -> np.ndarray:
    """A one-image, one-channel NHWC array from a 2-D list."""
    return np.asarray(rows, np.float32)[None, :, :, None]


def test_argmax_pooling_numbers_taps_column_by_column() -> None:
    g = Graph()
    x = g.input((1, 2, 4, 1))
    values, indices = g.argmax_pooling_2d(x, kernel=2)
    g.output(values)
    g.output(indices)
    # window 0: max 4 at row 0, column 1 -> 1 * KH + 0 = 2; window 1: max 5 at row 1, column 0 -> 1
    out_values, out_indices = interpret(g, [nhwc([[1, 4, 2, 0], [3, 2, 5, 1]])])
    np.testing.assert_array_equal(out_values[0, 0, :, 0], [4, 5])
    np.testing.assert_array_equal(out_indices[0, 0, :, 0], [2, 1])
    assert out_indices.dtype == np.int64


def test_average_pooling_leaves_padding_out() -> None:
    g = Graph()
    x = g.input((1, 2, 2, 1))
    g.output(g.avg_pooling_2d(x, kernel=3, stride=1, padding=1))
    # every 3x3 window holds all four pixels and five padding positions: mean 10 / 4
    np.testing.assert_array_equal(interpret(g, [nhwc([[1, 2], [3, 4]])])[0], np.full((1, 2, 2, 1), 2.5))


@pytest.mark.parametrize("align_corners, expected", [
    (False, [0, 0.25, 0.75, 1]),  # half-pixel centres, clamped to the edge pixels
    (True, [0, 1 / 3, 2 / 3, 1]),
])
def test_resize_bilinear_coordinates(align_corners: bool, expected: list[float]) -> None:
    g = Graph()
    x = g.input((1, 1, 2, 1))
    g.output(g.static_resize_bilinear_2d(x, 1, 4, align_corners=align_corners))
    np.testing.assert_allclose(interpret(g, [nhwc([[0, 1]])])[0][0, 0, :, 0], expected, rtol=1e-6)


def test_static_quantized_output_is_snapped_to_its_grid() -> None:
    g = Graph()
    x = g.input((4,))
    q = g.convert(x, D.qint8, scale=0.5, zero_point=1)
    g.output(q)
    g.output(g.convert(q, D.fp32))
    codes, real = interpret(g, [np.array([0.2, 0.3, -70, 70], np.float32)])
    # rint(x / 0.5) + 1, saturated to int8
    np.testing.assert_array_equal(codes, np.array([1, 2, -128, 127], np.int8))
    np.testing.assert_array_equal(real, (codes.astype(np.float32) - 1) * 0.5)


def test_dynamic_fully_connected_sees_the_per_token_codes() -> None:
    """qdint8 x qcint8: dequant(quantize_per_token(x)) @ dequant(w).T + bias."""
    rng = np.random.default_rng(0)
    w = QuantizedTensor(D.qcint8, rng.integers(-127, 128, (6, 16)).astype(np.int8),
                        np.linspace(0.01, 0.02, 6, dtype=np.float32), 0, channel_dim=0)
    bias = rng.standard_normal(6).astype(np.float32)
    g = Graph()
    x = g.input((3, 16))
    g.output(g.fully_connected(g.convert(x, D.qdint8), g.constant(w), g.constant(bias)))
    data = rng.standard_normal((3, 16)).astype(np.float32)
    want = (xq.quantize_per_token(data).dequantize().astype(np.float64)
            @ w.dequantize().astype(np.float64).T + bias)
    # the interpreter computes the same float64 sum and rounds it once to float32
    assert_within(interpret(g, [data])[0], want, half_ulp(want) * (1 + 1e-6), "dynamic fully connected")


def test_output_min_max_only_where_the_runtime_applies_them() -> None:
    g = Graph()
    a, b = g.input((4,)), g.input((4,))
    g.output(g.add(a, b, output_min=-1.0, output_max=1.0))
    g.output(g.maximum(a, b, output_min=-1.0, output_max=1.0))  # not forwarded by the 1.4.1 runtime
    x = np.array([-3, -0.5, 0.5, 3], np.float32)
    added, largest = interpret(g, [x, x])
    np.testing.assert_array_equal(added, [-1, -1, 1, 1])
    np.testing.assert_array_equal(largest, x)


@pytest.mark.parametrize("groups, padding, stride, dilation", [(1, (1, 0, 2, 1), (2, 1), (1, 2)), (3, 1, 1, 1)])
def test_conv2d_equals_torch(groups: int, padding, stride, dilation) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(groups)
    x = rng.standard_normal((2, 6, 7, 6)).astype(np.float32)
    w_oihw = rng.standard_normal((9, 6 // groups, 3, 2)).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    g = Graph()
    xi = g.input(x.shape)
    g.output(g.conv2d(xi, g.constant(xq.packing.conv_weight(w_oihw)), g.constant(bias), padding=padding,
                      stride=stride, dilation=dilation, groups=groups))
    top, right, bottom, left = padding if isinstance(padding, tuple) else (padding,) * 4
    f64 = torch.from_numpy  # float64 torch: the same on every CPU, unlike its float32 conv kernels
    padded = torch.nn.functional.pad(f64(x.astype(np.float64)).permute(0, 3, 1, 2), (left, right, top, bottom))
    want = torch.nn.functional.conv2d(padded, f64(w_oihw.astype(np.float64)), f64(bias.astype(np.float64)),
                                      stride=stride, dilation=dilation, groups=groups).permute(0, 2, 3, 1)
    # the interpreter sums in float64 and rounds once to float32: half an ulp, plus the two
    # float64 sums' own rounding (far below it)
    assert_within(interpret(g, [x])[0], want.numpy(), half_ulp(want.numpy()) * (1 + 1e-6), "conv2d")


def test_transposed_conv_equals_torch() -> None:
    """ConvTranspose2d (a kind only ExecuTorch 1.4.1 writes) on a hand-made node."""
    torch = pytest.importorskip("torch")
    from xnnquant.graph.interpreter import HANDLERS
    from xnnquant.graph.model import Node

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 5, 4, 4)).astype(np.float32)
    w_iohw = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)  # [IC, OC/g, KH, KW], groups 2
    bias = rng.standard_normal(6).astype(np.float32)
    params = dict(padding_top=1, padding_right=0, padding_bottom=1, padding_left=0, kernel_height=3,
                  kernel_width=2, subsampling_height=2, subsampling_width=3, dilation_height=1,
                  dilation_width=2, group_input_channels=2, group_output_channels=3, groups=2,
                  adjustment_height=1, adjustment_width=0)
    node = Node("XNNConvTranspose2d", (0, 1, 2), (3,), params)
    got = HANDLERS["XNNConvTranspose2d"](node, [x, xq.packing.transposed_conv_weight(w_iohw, groups=2), bias])[0]
    want = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2), torch.from_numpy(w_iohw.astype(np.float64)),
        torch.from_numpy(bias.astype(np.float64)),
        stride=(2, 3), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2)).permute(0, 2, 3, 1)
    # float64 on both sides, ours rounded once to float32 (see test_conv2d_equals_torch)
    assert_within(got, want.numpy(), half_ulp(want.numpy()) * (1 + 1e-6), "transposed conv")


def test_interpret_checks_inputs() -> None:
    g = Graph()
    x = g.input((2, 3))
    g.output(g.abs(x))
    with pytest.raises(XnnquantError, match="one array per external input"):
        interpret(g, [])
    with pytest.raises(XnnquantError, match=r"got shape \(2, 3\) float64, expected \(2, 3\) float32"):
        interpret(g, [np.zeros((2, 3))])
    np.testing.assert_array_equal(interpret(g.to_bytes(), [-np.ones((2, 3), np.float32)])[0], np.ones((2, 3)))


@pytest.mark.parametrize("blocked", [
    ("torch",), ("executorch", "executorch.runtime", "executorch.exir"),
])
def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch, blocked: tuple[str, ...]) -> None:
    for name in blocked:  # a None entry makes the import fail, even after an earlier import
        monkeypatch.setitem(sys.modules, name, None)
    g = Graph()
    x = g.input((2,))
    g.output(g.abs(x))
    with pytest.raises(MissingExtraError, match=r"xnnquant\[xnnpack\]"):
        run(g.to_bytes(), [np.zeros(2, np.float32)])
    assert to_pte(g.to_bytes())[4:8] == b"ET12"  # xnnquant's own writer: neither torch nor executorch
