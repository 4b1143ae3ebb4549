"""Output shapes of the node kinds, as XNNPACK computes them, and 2-D window geometry.

Activations of the 2-D convolutions and poolings are NHWC ``[N, H, W, C]``.  Each
function takes the input dims and the node's parameters and returns the output dims, or
raises ``XnnquantError`` naming the node kind and the mismatch.

Dims of a payload's values are upper bounds when it runs at other sizes: XNNPACK's reshape
step computes every node's output dims again from the actual inputs on each call
(``node_output_dims`` for one node, ``propagate`` for a graph), with the rules a payload
stores for it: a reshape's ``new_shape`` infers one dim stored as 0, a slice keeps what
fits of ``offsets`` / ``sizes`` in each dim (``slice_kept``), a fully connected node
keeps its input's leading dims.

``Window`` is the geometry of a convolution or pooling node (kernel, stride, dilation,
padding): the builder turns it into the node's schema fields, the interpreter reads it
back from them, and both compute the output size with ``Window.output_hw``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import arguments
from ..constants import (
    XNN_FLAG_KEEP_DIMS,
    XNN_FLAG_TENSORFLOW_SAME_PADDING,
    XNN_FLAG_TRANSPOSE_B,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
)
from ..errors import UnsupportedConfigError, XnnquantError
from .layout import NODE_KINDS

if TYPE_CHECKING:
    from .model import Node

Dims = tuple[int, ...]
#: How a payload's ``new_shape`` marks the dim XNNPACK infers from the input's element
#: count (the schema's field is unsigned: torch's -1 cannot be stored).
INFERRED_DIM = 0


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


def nhwc(kind: str, x: Dims) -> Dims:
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


Pair = tuple[int, int]
Padding = tuple[int, int, int, int]  # (top, right, bottom, left)
#: What callers may give for a pair (kernel, stride, dilation): ``n`` or ``(h, w)``.
PairSpec = int | Sequence[int]
#: What callers may give for padding: ``n``, ``(h, w)`` or ``(top, right, bottom, left)``.
PaddingSpec = int | Sequence[int]
_PADDING_FIELDS = ("padding_top", "padding_right", "padding_bottom", "padding_left")


def as_pair(v: PairSpec, name: str) -> Pair:
    """``int`` or ``(h, w)`` -> ``(h, w)``, each at least 0 (``window`` checks its own minimum)."""
    if arguments.is_plain_int(v):
        n = arguments.integer(v, name, low=0)
        return n, n
    if not _is_list(v) or len(v) != 2:  # type: ignore[arg-type]
        raise XnnquantError(f"{name} must be an int or a pair (h, w): got {arguments.shown(v)}")
    h, w = arguments.integers(v, name, length=2, low=0)
    return h, w


def _is_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) or (isinstance(v, np.ndarray) and v.ndim == 1)


def as_padding(v: PaddingSpec) -> Padding:
    """``int``, ``(h, w)`` or ``(top, right, bottom, left)`` -> (top, right, bottom, left), each >= 0."""
    if arguments.is_plain_int(v):
        n = arguments.integer(v, "padding", low=0)
        return n, n, n, n
    if not _is_list(v) or len(v) not in (2, 4):  # type: ignore[arg-type]
        raise XnnquantError(f"padding must be an int, (h, w) or (top, right, bottom, left) >= 0: got "
                            f"{arguments.shown(v)}")
    t = arguments.integers(v, "padding", low=0)
    if len(t) == 2:
        return (t[0], t[1], t[0], t[1])
    return t[0], t[1], t[2], t[3]


@dataclass(frozen=True)
class Window:
    """Where a 2-D convolution or pooling window reads an NHWC input.

    Window ``(oy, ox)``, tap ``(i, j)`` reads row ``oy * stride[0] + i * dilation[0] - top``
    and column ``ox * stride[1] + j * dilation[1] - left`` of the input; rows and columns
    outside it are padding.
    """

    kernel: Pair
    stride: Pair
    dilation: Pair = (1, 1)
    padding: Padding = (0, 0, 0, 0)

    def output_hw(self, kind: str, x: Dims) -> Pair:
        """Output ``(H, W)`` for NHWC input dims ``x``."""
        _, h, w, _ = nhwc(kind, x)
        top, right, bottom, left = self.padding
        return (window(kind, h, (top, bottom), self.kernel[0], self.stride[0], self.dilation[0]),
                window(kind, w, (left, right), self.kernel[1], self.stride[1], self.dilation[1]))

    def transposed_output_hw(self, kind: str, x: Dims, adjustment: Pair = (0, 0)) -> Pair:
        """Output ``(H, W)`` of a transposed convolution for NHWC input dims ``x``:
        ``(H - 1) * stride + adjustment + (K - 1) * dilation + 1 - top - bottom`` (likewise W)."""
        _, h, w, _ = nhwc(kind, x)
        top, right, bottom, left = self.padding
        if not (0 <= adjustment[0] < self.stride[0] and 0 <= adjustment[1] < self.stride[1]):
            raise XnnquantError(f"{kind}: adjustment must be in [0, stride): got {adjustment}, stride {self.stride}")
        oh = (h - 1) * self.stride[0] + adjustment[0] + (self.kernel[0] - 1) * self.dilation[0] + 1 - top - bottom
        ow = (w - 1) * self.stride[1] + adjustment[1] + (self.kernel[1] - 1) * self.dilation[1] + 1 - left - right
        if oh < 1 or ow < 1:
            raise XnnquantError(f"{kind}: padding {self.padding} leaves no output for input {x}, kernel {self.kernel}")
        return oh, ow

    def conv_params(self) -> dict[str, int]:
        """The window's fields of a convolution node (``_XNNNodeConv``)."""
        return {**dict(zip(_PADDING_FIELDS, self.padding)),
                "kernel_height": self.kernel[0], "kernel_width": self.kernel[1],
                "subsampling_height": self.stride[0], "subsampling_width": self.stride[1],
                "dilation_height": self.dilation[0], "dilation_width": self.dilation[1]}

    def pool_params(self, *, strided: bool = True) -> dict[str, int]:
        """The window's fields of a pooling node (``_XNNPooling2D``; ``strided=False``: the
        argmax pooling table, which has padding and kernel only)."""
        params = {**dict(zip(_PADDING_FIELDS, self.padding)),
                  "pooling_height": self.kernel[0], "pooling_width": self.kernel[1]}
        if strided:
            params.update(stride_height=self.stride[0], stride_width=self.stride[1],
                          dilation_height=self.dilation[0], dilation_width=self.dilation[1])
        return params

    @classmethod
    def of_conv(cls, params: Mapping[str, Any]) -> Window:
        """The window of a convolution node's params (a dilation stored as 0 reads as 1)."""
        return cls((params["kernel_height"], params["kernel_width"]),
                   (params["subsampling_height"], params["subsampling_width"]),
                   _dilation(params), _stored_padding(params))

    @classmethod
    def of_pool(cls, params: Mapping[str, Any]) -> Window:
        """The window of a pooling node's params (no stride fields: stride = kernel)."""
        kernel = (params["pooling_height"], params["pooling_width"])
        stride = (params.get("stride_height", kernel[0]), params.get("stride_width", kernel[1]))
        return cls(kernel, stride, _dilation(params), _stored_padding(params))

    def with_padding_for(self, flags: int, x: Dims) -> Window:
        """This window, its padding replaced by TensorFlow's SAME padding when ``flags`` has
        ``XNN_FLAG_TENSORFLOW_SAME_PADDING`` (output ``ceil(size / stride)``, the odd pixel
        of padding at the bottom / right)."""
        if not flags & XNN_FLAG_TENSORFLOW_SAME_PADDING:
            return self
        total = []
        for size, k, s, d in zip(x[1:3], self.kernel, self.stride, self.dilation):
            out = -(-size // s)
            total.append(max((out - 1) * s + (k - 1) * d + 1 - size, 0))
        padding = (total[0] // 2, total[1] - total[1] // 2, total[0] - total[0] // 2, total[1] // 2)
        return Window(self.kernel, self.stride, self.dilation, padding)


def windows(x: np.ndarray, window: Window, fill: float, kind: str) -> np.ndarray:
    """Sliding windows of NHWC ``x`` ``[N, H, W, C]`` -> ``[N, OH, OW, KH, KW, C]`` (x's dtype).

    ``x`` is first padded with ``fill`` (``window.padding``: top, right, bottom, left).
    Window ``(oy, ox)`` tap ``(i, j)`` reads padded row ``oy * sh + i * dh`` and column
    ``ox * sw + j * dw``.
    """
    top, right, bottom, left = window.padding
    oh, ow = window.output_hw(kind, x.shape)
    xp = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), constant_values=fill)
    (kh, kw), (sh, sw), (dh, dw) = window.kernel, window.stride, window.dilation
    rows = (np.arange(oh) * sh)[:, None] + (np.arange(kh) * dh)[None, :]  # [OH, KH]
    cols = (np.arange(ow) * sw)[:, None] + (np.arange(kw) * dw)[None, :]  # [OW, KW]
    return xp[:, rows[:, None, :, None], cols[None, :, None, :], :]


def _dilation(params: Mapping[str, Any]) -> Pair:
    return max(params.get("dilation_height", 1), 1), max(params.get("dilation_width", 1), 1)


def _stored_padding(params: Mapping[str, Any]) -> Padding:
    top, right, bottom, left = (params.get(f, 0) for f in _PADDING_FIELDS)
    return top, right, bottom, left


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
    """``new_shape`` with its inferred dim resolved; element counts must agree.

    The inferred dim is written -1 (as in torch) or 0 (``INFERRED_DIM``, as a payload
    stores it and XNNPACK reads it: one 0 takes the input's element count divided by the
    other dims); at most one.
    """
    shape = [int(d) for d in new_shape]
    count = int(np.prod(x, dtype=np.int64))
    inferred = [i for i, d in enumerate(shape) if d in (-1, INFERRED_DIM)]
    if len(inferred) > 1 or any(d < -1 for d in shape):
        raise XnnquantError(
            f"XNNStaticReshape: new_shape may infer one dim (written -1 or 0) and hold no other negative: got {shape}"
        )
    if inferred:
        rest = int(np.prod([d for i, d in enumerate(shape) if i != inferred[0]], dtype=np.int64))
        if count % rest:
            raise XnnquantError(f"XNNStaticReshape: cannot infer a dim of {shape} for input {x}: {count} elements "
                                f"are not a multiple of {rest}")
        shape[inferred[0]] = count // rest
    if int(np.prod(shape, dtype=np.int64)) != count:
        raise XnnquantError(
            f"XNNStaticReshape: element count changes: got input {x} ({count} elements) and new_shape {tuple(shape)}"
        )
    return tuple(shape)


def stored_new_shape(new_shape: Sequence[int]) -> Dims:
    """``new_shape`` as a payload stores it: the inferred dim (-1) as ``INFERRED_DIM``."""
    return tuple(INFERRED_DIM if int(d) == -1 else int(d) for d in new_shape)


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


def slice_kept(x: Dims, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[Dims, Dims]:
    """``(offsets, sizes)`` that XNNPACK's slice keeps of an input of dims ``x`` (its reshape
    step, per dim): the slice ends at ``offset + size``, or at the end of the dim when both
    are 0; offset and end are clipped to the dim, so a slice past the end keeps what is
    there (possibly nothing)."""
    if len(offsets) != len(x) or len(sizes) != len(x):
        raise XnnquantError(f"XNNStaticSlice: one offset and size per dim: got input {x}, offsets "
                            f"{tuple(offsets)}, sizes {tuple(sizes)}")
    kept_offsets, kept_sizes = [], []
    for d, o, s in zip(x, offsets, sizes):
        end = d if o == 0 and s == 0 else min(o + s, d)
        start = min(o, d)
        kept_offsets.append(start)
        kept_sizes.append(max(end - start, 0))
    return tuple(kept_offsets), tuple(kept_sizes)


def pad(x: Dims, pre: Sequence[int], post: Sequence[int]) -> Dims:
    if len(pre) != len(x) or len(post) != len(x) or min((*pre, *post), default=0) < 0:
        raise XnnquantError(
            f"XNNStaticConstantPad: one non-negative pre and post padding per dim: got input {x}, "
            f"pre {tuple(pre)}, post {tuple(post)}"
        )
    return tuple(d + a + b for d, a, b in zip(x, pre, post))


def within(dims: Sequence[int], bound: Sequence[int]) -> bool:
    """Whether ``dims`` fit a value declared with dims ``bound``: the same rank, each dim
    at most the declared one (what a program planned at the declared dims can hold)."""
    return len(dims) == len(bound) and all(0 <= d <= b for d, b in zip(dims, bound))


def node_output_dims(node: Node, dims: Sequence[Dims]) -> list[Dims]:
    """Dims of each output of ``node`` for inputs of ``dims`` (in ``node.inputs`` order,
    constants included), as XNNPACK's reshape step computes them from the actual inputs."""
    kind, p, flags = node.kind, node.params, node.flags
    x = tuple(dims[0])
    table = NODE_KINDS[kind].table if kind in NODE_KINDS else None
    if kind == "XNNFullyConnected":
        return [fully_connected(x, dims[1], bool(flags & XNN_FLAG_TRANSPOSE_WEIGHTS))]
    if kind == "XNNBatchMatrixMultiply":
        b = dims[1]
        if flags & XNN_FLAG_TRANSPOSE_B and len(b) >= 2:
            b = (*b[:-2], b[-1], b[-2])
        return [batch_matrix_multiply(x, b)]
    if kind == "XNNPReLU":
        broadcast(kind, x, dims[1])
        return [x]
    if table == "_XNNNode2x1":
        return [broadcast(kind, x, dims[1])]
    if kind in ("XNNConv2d", "XNNDepthwiseConv2d"):
        oh, ow = Window.of_conv(p).with_padding_for(flags, x).output_hw(kind, x)
        return [(x[0], oh, ow, dims[1][0] if kind == "XNNConv2d" else dims[1][3])]
    if kind == "XNNConvTranspose2d":
        adjustment = (p.get("adjustment_height", 0), p.get("adjustment_width", 0))
        oh, ow = Window.of_conv(p).transposed_output_hw(kind, x, adjustment)
        return [(x[0], oh, ow, dims[1][0])]
    if kind in ("XNNAvgPooling2d", "XNNMaxPooling2d", "XNNArgMaxPooling2d"):
        stored = Window.of_pool(p)
        if kind != "XNNMaxPooling2d":  # no dilation; argmax windows do not overlap
            stride = stored.kernel if kind == "XNNArgMaxPooling2d" else stored.stride
            stored = Window(stored.kernel, stride, (1, 1), stored.padding)
        oh, ow = stored.with_padding_for(flags, x).output_hw(kind, x)
        out = (x[0], oh, ow, x[3])
        return [out, out] if kind == "XNNArgMaxPooling2d" else [out]
    if kind == "XNNGlobalAvgPooling2d":
        n, _, _, c = nhwc(kind, x)
        return [(n, 1, 1, c) if flags & XNN_FLAG_KEEP_DIMS else (n, c)]
    if kind == "XNNStaticReshape":
        return [reshape(x, p["new_shape"])]
    if kind == "XNNStaticTranspose":
        return [transpose(x, p["perm"])]
    if kind == "XNNStaticSlice":
        return [slice_kept(x, p["offsets"], p["sizes"])[1]]
    if kind == "XNNStaticConstantPad":
        return [pad(x, p["pre_paddings"], p["post_paddings"])]
    if kind == "XNNStaticResizeBilinear2D":
        n, _, _, c = nhwc(kind, x)
        return [(n, p["new_height"], p["new_width"], c)]
    if table == "_XNNCat":
        return [concatenate(kind, [tuple(d) for d in dims], p["axis"])]
    if kind == "XNNScaledDotProductAttention":
        return [x[:-1] + (dims[2][-1],)]
    if table in ("_XNNNode1x1", "XNNLeakyReLU", "XNNELU"):
        return [x]
    raise UnsupportedConfigError(f"{kind}: no shape rule for this node kind")


def propagate(nodes: Sequence[Node], known: Mapping[int, Dims]) -> dict[int, Dims]:
    """Dims of every value that ``nodes`` compute, in order, as XNNPACK's reshape step does,
    from ``known``: the dims of the external inputs (the actual ones) and of the constants.
    Returns ``known`` and the computed dims by value id; raises ``XnnquantError`` naming the
    first node whose inputs do not fit together."""
    env = {vid: tuple(int(d) for d in dims) for vid, dims in known.items()}
    for position, node in enumerate(nodes):
        missing = [i for i in node.inputs if i not in env]
        if missing:
            raise XnnquantError(f"node {position} ({node.kind}) reads value {missing[0]} before any node wrote it")
        try:
            outs = node_output_dims(node, [env[i] for i in node.inputs])
        except XnnquantError as exc:
            raise type(exc)(f"node {position} ({node.kind}): {exc}") from None
        env.update(zip(node.outputs, outs))
    return env
