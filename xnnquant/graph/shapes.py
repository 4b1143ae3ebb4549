"""Output shapes of the node kinds, as XNNPACK computes them.

Activations of the 2-D convolutions and poolings are NHWC ``[N, H, W, C]``.  Each
function takes the input dims and the node's parameters and returns the output dims, or
raises ``XnnquantError`` naming the node kind and the mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import XnnquantError

Dims = tuple[int, ...]


def broadcast(kind: str, a: Dims, b: Dims) -> Dims:
    """Numpy broadcasting of two shapes (what XNNPACK's binary nodes do)."""
    try:
        return tuple(int(d) for d in np.broadcast_shapes(a, b))
    except ValueError:
        raise XnnquantError(f"{kind}: input shapes do not broadcast: got {a} and {b}") from None


def fully_connected(x: Dims, w: Dims, transpose_weights: bool) -> Dims:
    """``x [..., K]`` times filter ``[N, K]`` (``[K, N]`` transposed) -> ``[..., N]``."""
    if len(w) != 2 or not x:
        raise XnnquantError(f"XNNFullyConnected: filter must be 2-D and input at least 1-D: got {x} and {w}")
    n, k = (w[1], w[0]) if transpose_weights else w
    if x[-1] != k:
        layout = "[K, N]" if transpose_weights else "[N, K]"
        raise XnnquantError(
            f"XNNFullyConnected: input channels do not match the filter: got input {x} "
            f"and filter {w} (layout {layout}), expected input[-1] == K == {k}"
        )
    return x[:-1] + (n,)


def _nhwc(kind: str, x: Dims) -> Dims:
    if len(x) != 4:
        raise XnnquantError(f"{kind}: input must be 4-D NHWC [N, H, W, C]: got {x}")
    return x


def window(kind: str, size: int, padding: tuple[int, int], kernel: int, stride: int, dilation: int) -> int:
    """``(size + pads - dilation * (kernel - 1) - 1) // stride + 1``, checked to be >= 1."""
    span = dilation * (kernel - 1) + 1
    padded = size + padding[0] + padding[1]
    if kernel < 1 or stride < 1 or dilation < 1 or padded < span:
        raise XnnquantError(
            f"{kind}: window does not fit: got size {size} padded by {padding}, kernel {kernel}, "
            f"stride {stride}, dilation {dilation}"
        )
    return (padded - span) // stride + 1


def conv_hw(kind: str, x: Dims, kernel: tuple[int, int], padding: tuple[int, int, int, int],
            stride: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int]:
    """Output ``(H, W)``; padding is ``(top, right, bottom, left)``."""
    _, h, w, _ = _nhwc(kind, x)
    top, right, bottom, left = padding
    return (window(kind, h, (top, bottom), kernel[0], stride[0], dilation[0]),
            window(kind, w, (left, right), kernel[1], stride[1], dilation[1]))


def concatenate(kind: str, shapes: Sequence[Dims], axis: int) -> Dims:
    first = shapes[0]
    if not 0 <= axis < len(first):
        raise XnnquantError(f"{kind}: axis out of range: got axis={axis} for rank {len(first)}")
    for s in shapes[1:]:
        if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != axis):
            raise XnnquantError(f"{kind}: shapes must agree except along axis {axis}: got {list(shapes)}")
    return first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1:]


def batch_matrix_multiply(a: Dims, b: Dims) -> Dims:
    """``[..., M, K] @ [..., K, N] -> [..., M, N]`` with broadcast batch dims."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        raise XnnquantError(
            f"XNNBatchMatrixMultiply: expected [..., M, K] and [..., K, N]: got {a} and {b}"
        )
    return broadcast("XNNBatchMatrixMultiply", a[:-2], b[:-2]) + (a[-2], b[-1])


def reshape(x: Dims, new_shape: Sequence[int]) -> Dims:
    """``new_shape`` with at most one -1 resolved; element counts must agree."""
    shape = [int(d) for d in new_shape]
    count = int(np.prod(x, dtype=np.int64))
    if shape.count(-1) > 1 or any(d < -1 for d in shape):
        raise XnnquantError(f"XNNStaticReshape: new_shape may hold one -1 and no other negative: got {shape}")
    if -1 in shape:
        rest = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if rest == 0 or count % rest:
            raise XnnquantError(f"XNNStaticReshape: cannot infer -1 in {shape} for input {x}")
        shape[shape.index(-1)] = count // rest
    if int(np.prod(shape, dtype=np.int64)) != count:
        raise XnnquantError(
            f"XNNStaticReshape: element count changes: got input {x} ({count} elements) and new_shape {tuple(shape)}"
        )
    return tuple(shape)


def transpose(x: Dims, perm: Sequence[int]) -> Dims:
    if sorted(perm) != list(range(len(x))):
        raise XnnquantError(f"XNNStaticTranspose: perm must be a permutation of 0..{len(x) - 1}: got {tuple(perm)}")
    return tuple(x[p] for p in perm)


def slice_(x: Dims, offsets: Sequence[int], sizes: Sequence[int]) -> Dims:
    if len(offsets) != len(x) or len(sizes) != len(x) or any(
        o < 0 or s < 1 or o + s > d for o, s, d in zip(offsets, sizes, x)
    ):
        raise XnnquantError(
            f"XNNStaticSlice: offsets and sizes must select inside the input: got input {x}, "
            f"offsets {tuple(offsets)}, sizes {tuple(sizes)}"
        )
    return tuple(int(s) for s in sizes)


def pad(x: Dims, pre: Sequence[int], post: Sequence[int]) -> Dims:
    if len(pre) != len(x) or len(post) != len(x) or min((*pre, *post), default=0) < 0:
        raise XnnquantError(
            f"XNNStaticConstantPad: one non-negative pre and post padding per dim: got input {x}, "
            f"pre {tuple(pre)}, post {tuple(post)}"
        )
    return tuple(d + a + b for d, a, b in zip(x, pre, post))
