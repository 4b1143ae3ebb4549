"""Convolution weight layouts, as ExecuTorch serializes them for XNNPACK.

PyTorch keeps conv weights as OIHW; XNNPACK reads them channels-last.  Each function
takes the PyTorch weight and returns a C-contiguous array in the layout XNNPACK reads,
whose shape is the ``dims`` to serialize.  The dtype is kept, so quantized codes and
float weights go through the same permutation.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput, is_int, to_numpy
from ..errors import XnnquantError


def _weight4d(w: ArrayInput, name: str, layout: str) -> np.ndarray:
    arr = to_numpy(w, name)
    if arr.ndim != 4:
        raise XnnquantError(f"{name} must be 4-D {layout}: got shape {tuple(arr.shape)} (rank {arr.ndim})")
    return arr


def conv_weight(w: ArrayInput) -> np.ndarray:
    """Regular conv: ``[OC, IC/g, KH, KW]`` (OIHW) -> ``[OC, KH, KW, IC/g]`` (OHWI).

    ``out[o, h, w, i] = in[o, i, h, w]``; in memory, the input channels of one tap are
    contiguous, then taps run along W, then H, then output channels::

        out bytes: o0 h0 w0 [i0 i1 ... ] o0 h0 w1 [i0 i1 ...] ... o1 h0 w0 [...]
    """
    return np.ascontiguousarray(_weight4d(w, "conv weight", "[OC, IC/g, KH, KW]").transpose(0, 2, 3, 1))


def depthwise_weight(w: ArrayInput) -> np.ndarray:
    """Depthwise conv: ``[OC, 1, KH, KW]`` -> ``[1, KH, KW, OC]``.

    ``out[0, h, w, o] = in[o, 0, h, w]``: for each tap, the weights of all output channels
    are contiguous, so the per-channel axis of the result is 3::

        out bytes: h0 w0 [o0 o1 ... oC-1] h0 w1 [o0 ...] ... hKH-1 wKW-1 [o0 ...]
    """
    arr = _weight4d(w, "depthwise weight", "[OC, 1, KH, KW]")
    if arr.shape[1] != 1:
        raise XnnquantError(
            f"depthwise weight must have one input channel per group: got shape {tuple(arr.shape)}, "
            "expected [OC, 1, KH, KW]"
        )
    return np.ascontiguousarray(arr.transpose(1, 2, 3, 0))


def transposed_conv_weight(w: ArrayInput, groups: int = 1) -> np.ndarray:
    """Transposed conv: ``[IC, OC/g, KH, KW]`` -> ``[OC, KH, KW, IC/g]``.

    The PyTorch weight holds, per group ``g``, ``IC/g`` input-channel slices of
    ``OC/g`` filters.  Regrouped, output channel ``o = g * OC/g + j`` gets::

        out[g*OC/g + j, h, w, i] = in[g*IC/g + i, j, h, w]

    that is, reshape to ``(g, IC/g, OC/g, KH, KW)``, swap the two channel axes, reshape to
    ``[OC, IC/g, KH, KW]`` and lay it out OHWI as ``conv_weight`` does.
    """
    arr = _weight4d(w, "transposed conv weight", "[IC, OC/g, KH, KW]")
    if not is_int(groups) or groups < 1:
        raise XnnquantError(f"groups must be a positive integer: got {groups!r}")
    ic, ocg, kh, kw = arr.shape
    if ic % groups:
        raise XnnquantError(
            f"transposed conv input channels must divide into groups: got IC={ic}, groups={groups}"
        )
    regrouped = arr.reshape(groups, ic // groups, ocg, kh, kw).swapaxes(1, 2)
    return np.ascontiguousarray(regrouped.reshape(groups * ocg, ic // groups, kh, kw).transpose(0, 2, 3, 1))
