"""graph.shapes.Window: the one place the builder and the interpreter get window geometry from."""

from __future__ import annotations

import pytest

from xnnquant.constants import XNN_FLAG_TENSORFLOW_SAME_PADDING
from xnnquant.errors import XnnquantError
from xnnquant.graph.shapes import Window, as_padding, as_pair


def test_params_read_back_as_the_same_window() -> None:
    w = Window(kernel=(3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 0, 2, 3))
    assert Window.of_conv(w.conv_params()) == w
    assert Window.of_pool(w.pool_params()) == w
    # the argmax table has no stride or dilation: they read as the kernel and 1
    assert Window.of_pool(w.pool_params(strided=False)) == Window((3, 2), (3, 2), (1, 1), (1, 0, 2, 3))
    assert w.conv_params()["subsampling_height"] == 2 and w.pool_params()["stride_width"] == 1


def test_output_size() -> None:
    # (size + pads - dilation * (kernel - 1) - 1) // stride + 1: H (7 + 3 - 3) // 2 + 1 = 4,
    # W (9 + 3 - 3) // 1 + 1 = 10
    assert Window((3, 2), (2, 1), (1, 2), (1, 0, 2, 3)).output_hw("XNNConv2d", (1, 7, 9, 4)) == (4, 10)
    with pytest.raises(XnnquantError, match="XNNMaxPooling2d: window does not fit: got size 2 padded by"):
        Window((3, 3), (1, 1)).output_hw("XNNMaxPooling2d", (1, 2, 5, 1))
    with pytest.raises(XnnquantError, match=r"XNNConv2d: input must be 4-D NHWC \[N, H, W, C\]: got \(7, 9\)"):
        Window((1, 1), (1, 1)).output_hw("XNNConv2d", (7, 9))


def test_tensorflow_same_padding() -> None:
    """Hand-derived: output ceil(size / stride); total padding (out - 1) * s + k - size, the odd
    pixel at the bottom / right."""
    w = Window((3, 3), (2, 2), padding=(9, 9, 9, 9))
    assert w.with_padding_for(0, (1, 7, 8, 1)) is w  # flag absent: the stored padding
    same = w.with_padding_for(XNN_FLAG_TENSORFLOW_SAME_PADDING, (1, 7, 8, 1))
    # H: out 4, total 3 * 2 + 3 - 7 = 2 -> 1 and 1; W: out 4, total 3 * 2 + 3 - 8 = 1 -> 0 left, 1 right
    assert same.padding == (1, 1, 1, 0)
    assert same.output_hw("XNNConv2d", (1, 7, 8, 1)) == (4, 4)


def test_parsing() -> None:
    assert as_pair(3, "kernel") == (3, 3) and as_pair((2, 5), "kernel") == (2, 5)
    assert as_padding(1) == (1, 1, 1, 1) and as_padding((1, 2)) == (1, 2, 1, 2)
    assert as_padding((1, 2, 3, 4)) == (1, 2, 3, 4)
    with pytest.raises(XnnquantError, match=r"^stride must be an int or a pair \(h, w\): got \(1, 2, 3\)$"):
        as_pair((1, 2, 3), "stride")
    with pytest.raises(XnnquantError, match=r"^padding\[1\] is out of range: got -1, expected >= 0$"):
        as_padding((1, -1, 0, 0))


def test_transposed_output_size() -> None:
    # (H - 1) * s + adj + (K - 1) * d + 1 - top - bottom: H (3 - 1) * 2 + 1 + 2 + 1 - 2 = 6,
    # W (4 - 1) * 2 + 0 + 2 + 1 - 0 = 9
    w = Window((3, 3), (2, 2), (1, 1), (1, 0, 1, 0))
    assert w.transposed_output_hw("XNNConvTranspose2d", (1, 3, 4, 1), (1, 0)) == (6, 9)
    with pytest.raises(XnnquantError, match=r"adjustment must be in \[0, stride\): got \(2, 0\)"):
        w.transposed_output_hw("XNNConvTranspose2d", (1, 3, 4, 1), (2, 0))
