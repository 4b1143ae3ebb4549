"""Linear layers and matrix products: XNNFullyConnected and XNNBatchMatrixMultiply.

A product with a constant right-hand side is a linear layer: its weight goes through the
weight policy (``LoweringContext.weight``, ``weights.py``) and is stored ``[N, K]``
(out_features, in_features), the layout XNNPACK's quantized kernels need (a transposed
``[K, N]`` filter is computed wrongly for qbint4).  A quantized layer reads its input
converted to per-token dynamic int8 (XNNConvert to qdint8, a row being the last dim), as
ExecuTorch's 8-bit-dynamic-activation flows do; the bias stays fp32::

    x [..., K] fp32 --XNNConvert--> qdint8 [..., K]
        --XNNFullyConnected(w [N, K] qcint8 / qcint4 / qbint4, bias [N] fp32)--> [..., N] fp32

One conversion serves every layer reading the same value (query, key and value share
theirs).  A product of two activations is an XNNBatchMatrixMultiply, with batch dims
broadcast; a right-hand side laid out ``[..., N, K]`` is read through the node's
transpose flag instead of being transposed first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from ..passes.equalization import EQUALIZE
from ..prequantized import stored_of
from ..weights import Layer, LayerKind
from . import lowers
from .context import Activation, LoweringContext, identity

aten = torch.ops.aten

DENSE_KINDS = ("XNNFullyConnected", "XNNConvert", "XNNStaticTranspose", "XNNStaticReshape", "XNNMultiply", "XNNAdd")
PRODUCT_KINDS = ("XNNBatchMatrixMultiply", "XNNStaticTranspose", "XNNStaticReshape", "XNNAdd")


def dense(ctx: LoweringContext, x: Activation, weight: Any, bias: Any, *, transposed: bool = False,
          values: np.ndarray | None = None, path: str | None = None,
          input_layout: tuple[int, ...] | None = None) -> Activation:
    """``x @ weight.T + bias`` with a constant ``weight`` ``[N, K]`` (``[K, N]`` if ``transposed``).

    ``values``: the weight's values when the caller computed them (a 1x1 convolution's
    filter as ``[N, K]``); ``path``: the layer's name when ``weight`` does not give it;
    ``input_layout``: the torch dims of the node's input in ``x``'s order (a 1x1
    convolution reads its NCHW input as NHWC rows), for the self-check's reference.  A
    linear the ``equalization`` pass noted reads ``x / s`` and stores ``weight * s`` when
    its scheme is quantized (``s`` per input channel; see calibration.py).
    """
    shape = tuple(int(d) for d in (values if values is not None else weight).shape)
    if len(shape) != 2:
        raise XnnquantError(f"a linear weight must be 2-D: got shape {shape}")
    n, k = (shape[1], shape[0]) if transposed else shape
    if x.shape[-1] != k:
        raise XnnquantError(f"input features {x.shape[-1]} do not match the weight's {k} (weight {shape})")
    path = ctx.weight_path(weight) if path is None else path
    layer = Layer(LayerKind.LINEAR, k, path)
    noted: tuple[Any, np.ndarray] | None = ctx.annotation(EQUALIZE) if not transposed else None
    torchao = stored_of(weight)
    if noted is not None and (torchao is not None or not ctx.choose(path, layer).scheme.is_quantized):
        noted = None  # an fp32 layer needs no equalization; torchao's codes are kept as they are
    if noted is not None:  # the weight read now, scaled (a streaming export has no calibration)
        values = (ctx.constant_array(weight, "a linear weight") if values is None else values) * noted[1]
    wid, scheme = ctx.weight(weight, layer, path=path, values=values, layout=(lambda a: a.T) if transposed else None)
    bid = None
    if bias is not None:
        b = ctx.constant_array(bias, f"the bias of {path!r}")
        if b.shape != (n,):
            raise XnnquantError(f"bias of {path!r} has shape {b.shape}: expected ({n},)")
        bid = ctx.constant(b, key=bias)
    xin = ctx.canonical(x)
    if noted is not None:
        xin = ctx.scaled_input(xin, noted[0], noted[1])
    if torchao is not None and not torchao.dynamic:  # torchao's weight-only: fp32 activations, the bias added after
        y = ctx.tensor(ctx.graph.fully_connected(xin, wid, None), x.shape[:-1] + (n,))
        return y if bid is None else ctx.tensor(ctx.graph.add(y.id, bid), y.shape)
    if scheme.is_quantized:
        xin = ctx.dynamic(xin, num_nonbatch_dims=1)
        ctx.note_quantized(weight, input_scale=None if noted is None else ctx.reciprocal(noted[1]),
                           input_layout=identity(x.rank) if input_layout is None else input_layout, nonbatch_dims=1)
    return ctx.tensor(ctx.graph.fully_connected(xin, wid, bid), x.shape[:-1] + (n,))


def product(ctx: LoweringContext, a: Activation, b: Activation) -> Activation:
    """``a @ b`` of two activations (ranks >= 2, batch dims broadcast) by XNNBatchMatrixMultiply."""
    if a.rank < 2 or b.rank < 2:
        raise XnnquantError(f"matrix products of 1-D tensors are not supported: got {a.shape} @ {b.shape}")
    swapped = identity(b.rank)[:-2] + (b.rank - 1, b.rank - 2)
    transpose_b = b.perm == swapped  # already [..., N, K]: read it through the transpose flag
    ib = b.id if transpose_b else ctx.canonical(b)
    ia = ctx.canonical(a)
    out = ctx.graph.batch_matrix_multiply(ia, ib, transpose_b=transpose_b)
    batch = tuple(int(d) for d in torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    return ctx.tensor(out, batch + (a.shape[-2], b.shape[-1]))


def _plus_bias(ctx: LoweringContext, y: Activation, bias: Any) -> Activation:
    if bias is None:
        return y
    from .elementwise import binary

    return binary(ctx, "add", y, bias)


@lowers(aten.linear.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def linear(ctx: LoweringContext, x: Any, weight: Any, bias: Any = None) -> Activation:
    """``aten::linear(input, weight [N, K], bias [N]?)``."""
    x = ctx.value(x)
    if isinstance(weight, Activation):  # F.linear with a computed weight: a product with its transpose
        wt = Activation(weight.id, weight.shape[::-1], weight.perm[::-1])
        return _plus_bias(ctx, product(ctx, x, wt), bias)
    return dense(ctx, x, weight, bias)


@lowers(aten.addmm.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def addmm(ctx: LoweringContext, bias: Any, x: Any, w: Any, beta: Any = 1, alpha: Any = 1) -> Activation:
    """``aten::addmm(bias, x [M, K], w [K, N], beta, alpha) = beta * bias + alpha * (x @ w)``: a
    linear whose weight was transposed.  A constant bias that broadcasts as ``[N]`` (``[N]``,
    ``[1, N]``) is the node's bias when ``alpha`` is 1 (scaled by ``beta``); otherwise the
    product is multiplied by ``alpha`` and the scaled bias added after it (``beta == 0``
    ignores the bias, as torch does)."""
    if not isinstance(x, Activation):
        raise XnnquantError("addmm with a constant left operand is not supported")
    from .elementwise import binary

    beta, alpha = float(beta), float(alpha)
    n = int(w.shape[-1])
    folded = None
    if bias is not None and beta != 0 and not isinstance(bias, Activation) and alpha == 1:
        b = ctx.constant_array(bias, "the bias of addmm")
        if b.size == n and b.shape in ((n,), (1, n)):
            folded = torch.from_numpy(np.ascontiguousarray(b.reshape(n) * np.float32(beta)))
            bias = None
    y = product(ctx, x, w) if isinstance(w, Activation) else dense(ctx, x, w, folded, transposed=True)
    if isinstance(w, Activation) and folded is not None:
        y = binary(ctx, "add", y, folded)
    if alpha != 1:
        y = binary(ctx, "multiply", y, alpha)
    if bias is not None and beta != 0:
        if isinstance(bias, Activation):
            term = bias if beta == 1 else binary(ctx, "multiply", bias, beta)
        else:
            term = ctx.constant_array(bias, "the bias of addmm") * np.float32(beta)
        y = binary(ctx, "add", y, term)
    return y


@lowers(aten.mm.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def mm(ctx: LoweringContext, x: Any, w: Any) -> Activation:
    """``aten::mm(x [M, K], w [K, N])``."""
    if not isinstance(x, Activation):
        raise XnnquantError("mm with a constant left operand is not supported")
    if isinstance(w, Activation):
        return product(ctx, x, w)
    return dense(ctx, x, w, None, transposed=True)


@lowers(aten.bmm.default, aten.matmul.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def matmul(ctx: LoweringContext, a: Any, b: Any) -> Activation:
    """``aten::bmm`` / ``aten::matmul``: batched products; a constant 2-D right operand is a linear."""
    if not isinstance(a, Activation):
        raise XnnquantError("a matrix product with a constant left operand is not supported")
    if not isinstance(b, Activation):
        if getattr(b, "ndim", 0) == 2:
            return dense(ctx, a, b, None, transposed=True)
        b = ctx.value(b)
    return product(ctx, a, b)
