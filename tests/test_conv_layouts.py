"""Conv weight layouts against the permutations ExecuTorch applies with torch."""

import numpy as np
import pytest

from xnnquant import XnnquantError
from xnnquant.packing import conv_weight, depthwise_weight, transposed_conv_weight

torch = pytest.importorskip("torch")


def channels_last_bytes(t) -> bytes:
    """Memory order of ``t`` after ``.to(memory_format=torch.channels_last)``: what ExecuTorch serializes."""
    cl = t.contiguous().to(memory_format=torch.channels_last)
    return cl.permute(0, 2, 3, 1).contiguous().numpy().tobytes()


def test_regular_conv_is_ohwi():
    w = torch.arange(4 * 3 * 2 * 5, dtype=torch.float32).reshape(4, 3, 2, 5)
    out = conv_weight(w)
    assert out.shape == (4, 2, 5, 3)
    assert out.tobytes() == channels_last_bytes(w)
    assert out[1, 0, 3, 2] == w[1, 2, 0, 3]


def test_depthwise_swaps_channels_then_channels_last():
    w = torch.randn(6, 1, 3, 3)
    out = depthwise_weight(w)
    assert out.shape == (1, 3, 3, 6)
    assert out.tobytes() == channels_last_bytes(w.transpose(0, 1))


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_transposed_conv_regrouped(groups):
    ic, ocg = 6, 4
    w = torch.randn(ic, ocg, 2, 3)
    regrouped = w.reshape(groups, ic // groups, ocg, 2, 3).transpose(1, 2).reshape(groups * ocg, ic // groups, 2, 3)
    out = transposed_conv_weight(w, groups=groups)
    assert out.shape == (groups * ocg, 2, 3, ic // groups)
    assert out.tobytes() == channels_last_bytes(regrouped)
    # spot check the formula out[g*OC/g + j, h, w, i] = in[g*IC/g + i, j, h, w]
    g, j, i = groups - 1, ocg - 1, 0
    assert out[g * ocg + j, 1, 2, i] == w[g * (ic // groups) + i, j, 1, 2]


def test_int8_codes_keep_their_dtype():
    codes = np.arange(-60, 60, dtype=np.int8).reshape(2, 3, 4, 5)
    assert conv_weight(codes).dtype == np.int8


@pytest.mark.parametrize("fn, shape, message", [
    (conv_weight, (4, 3, 3), r"conv weight must be 4-D \[OC, IC/g, KH, KW\]: got shape \(4, 3, 3\) \(rank 3\)"),
    (depthwise_weight, (4, 2, 3, 3), r"one input channel per group: got shape \(4, 2, 3, 3\)"),
    (depthwise_weight, (4, 3), r"must be 4-D"),
    (transposed_conv_weight, (5, 2, 3), r"must be 4-D"),
])
def test_bad_rank_or_shape(fn, shape, message):
    with pytest.raises(XnnquantError, match=message):
        fn(np.zeros(shape, np.float32))


def test_transposed_groups_must_divide():
    with pytest.raises(XnnquantError, match="got IC=5, groups=2"):
        transposed_conv_weight(np.zeros((5, 2, 3, 3)), groups=2)
    with pytest.raises(XnnquantError, match="groups must be a positive integer"):
        transposed_conv_weight(np.zeros((4, 2, 3, 3)), groups=0)
