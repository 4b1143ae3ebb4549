"""Linear layers and matrix products: XNNFullyConnected and XNNBatchMatrixMultiply.

A product with a constant right-hand side is a linear layer: its weight goes through the
weight scheme (``Lowerer.weight_scheme``, ``quantize.py``) and is stored ``[N, K]``
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

import torch

from ..errors import XnnquantError
from .lowering import Lowerer, Tensor, identity
from .quantize import linear_refusal
from .registry import lowers

aten = torch.ops.aten

DENSE_KINDS = ("XNNFullyConnected", "XNNConvert", "XNNStaticTranspose", "XNNStaticReshape", "XNNMultiply")
PRODUCT_KINDS = ("XNNBatchMatrixMultiply", "XNNStaticTranspose", "XNNStaticReshape", "XNNAdd")


LAYER_NORMS = (aten.layer_norm.default, aten.native_layer_norm.default)


def plan_equalization(ctx: Lowerer, graph: Any) -> None:
    """Mark every ``aten.linear`` that reads a layer norm's output, with calibration
    statistics for it, for equalization (``calibration.py``), grouped by that input."""
    import operator

    stats = ctx.statistics
    parameters = ctx.program.graph_signature.inputs_to_parameters
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default or len(node.args) < 2:
            continue
        source = node.args[0]
        produced = source.args[0] if getattr(source, "target", None) is operator.getitem else source
        name = parameters.get(getattr(node.args[1], "name", ""), "")
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if getattr(produced, "target", None) in LAYER_NORMS and module in stats.absmax:
            ctx.equalized[node] = source


def dense(ctx: Lowerer, x: Tensor, weight: Any, bias: Any, *, transposed: bool = False) -> Tensor:
    """``x @ weight.T + bias`` with a constant ``weight`` ``[N, K]`` (``[K, N]`` if ``transposed``).

    A linear marked for equalization (``plan_equalization``) under a quantized scheme reads
    ``x / s`` and stores ``weight * s`` (``s`` per input channel; see calibration.py).
    """
    shape = tuple(weight.shape)
    if len(shape) != 2:
        raise XnnquantError(f"a linear weight must be 2-D: got shape {shape}")
    n, k = (shape[1], shape[0]) if transposed else shape
    if x.shape[-1] != k:
        raise XnnquantError(f"input features {x.shape[-1]} do not match the weight's {k} (weight {shape})")
    path = ctx.weight_path(weight)
    scheme, note = ctx.weight_scheme(path, lambda s: linear_refusal(s, k))
    source = ctx.equalized.get(ctx.node) if scheme.is_quantized and not transposed else None
    scales = None if source is None else ctx.equalization(source, path)
    if scales is not None:
        weight = ctx.constant_array(weight) * scales
    wid = ctx.quantized_weight(weight, path, scheme, note, layout=(lambda a: a.T) if transposed else None)
    bid = None
    if bias is not None:
        b = ctx.constant_array(bias, f"the bias of {path!r}")
        if b.shape != (n,):
            raise XnnquantError(f"bias of {path!r} has shape {b.shape}: expected ({n},)")
        bid = ctx.constant(b, key=bias)
    xin = ctx.canonical(x)
    if scales is not None:
        xin = ctx.scaled_input(xin, source, scales)
    if scheme.is_quantized:
        xin = ctx.dynamic(xin, num_nonbatch_dims=1)
    return ctx.tensor(ctx.graph.fully_connected(xin, wid, bid), x.shape[:-1] + (n,))


def product(ctx: Lowerer, a: Tensor, b: Tensor) -> Tensor:
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


def _plus_bias(ctx: Lowerer, y: Tensor, bias: Any) -> Tensor:
    if bias is None:
        return y
    from .elementwise import binary

    return binary(ctx, "add", y, bias)


@lowers(aten.linear.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def linear(ctx: Lowerer, x: Any, weight: Any, bias: Any = None) -> Tensor:
    """``aten::linear(input, weight [N, K], bias [N]?)``."""
    x = ctx.value(x)
    if isinstance(weight, Tensor):  # F.linear with a computed weight: a product with its transpose
        wt = Tensor(weight.id, weight.shape[::-1], weight.perm[::-1])
        return _plus_bias(ctx, product(ctx, x, wt), bias)
    return dense(ctx, x, weight, bias)


def _alpha_beta(beta: Any, alpha: Any) -> None:
    if beta != 1 or alpha != 1:
        raise XnnquantError(f"addmm with beta={beta}, alpha={alpha} is not supported: expected 1 and 1")


@lowers(aten.addmm.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def addmm(ctx: Lowerer, bias: Any, x: Any, w: Any, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``aten::addmm(bias, x [M, K], w [K, N])``: a linear whose weight was transposed."""
    _alpha_beta(beta, alpha)
    if not isinstance(x, Tensor):
        raise XnnquantError("addmm with a constant left operand is not supported")
    if isinstance(w, Tensor):
        return _plus_bias(ctx, product(ctx, x, w), bias)
    return dense(ctx, x, w, bias, transposed=True)


@lowers(aten.mm.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def mm(ctx: Lowerer, x: Any, w: Any) -> Tensor:
    """``aten::mm(x [M, K], w [K, N])``."""
    if not isinstance(x, Tensor):
        raise XnnquantError("mm with a constant left operand is not supported")
    if isinstance(w, Tensor):
        return product(ctx, x, w)
    return dense(ctx, x, w, None, transposed=True)


@lowers(aten.bmm.default, aten.matmul.default, emits=DENSE_KINDS + PRODUCT_KINDS)
def matmul(ctx: Lowerer, a: Any, b: Any) -> Tensor:
    """``aten::bmm`` / ``aten::matmul``: batched products; a constant 2-D right operand is a linear."""
    if not isinstance(a, Tensor):
        raise XnnquantError("a matrix product with a constant left operand is not supported")
    if not isinstance(b, Tensor):
        if getattr(b, "ndim", 0) == 2:
            return dense(ctx, a, b, None, transposed=True)
        b = ctx.value(b)
    return product(ctx, a, b)
