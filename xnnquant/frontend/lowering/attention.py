"""Scaled dot-product attention, composed from XNNPACK nodes.

ExecuTorch 1.4.1's runtime refuses the schema's XNNScaledDotProductAttention node
("Unhandled node type", tests/test_graph_runtime.py), so ``F.scaled_dot_product_attention``
becomes five nodes (no transpose: the key is read through the product's transpose flag)::

    q [..., L, E], k [..., S, E], v [..., S, Ev]
    s = XNNBatchMatrixMultiply(q, k, transpose_b)       [..., L, S]
    s = XNNMultiply(s, scale)                           scale = 1/sqrt(E) unless given
    s = XNNAdd(s, mask)                                 when there is a mask
    p = XNNSoftmax(s)                                   over S
    o = XNNBatchMatrixMultiply(p, v)                    [..., L, Ev]

Masks.  A float mask is added as it is (a constant or a computed value).  A boolean mask
(True: attend) and ``is_causal`` (key j <= query i) become a constant additive mask of 0
and -inf; XNNPACK has no boolean values, so a boolean mask must be a constant when the
program is lowered (built from buffers, ``arange`` / comparisons or the example inputs'
static shapes: the constants pass folds it), and a computed one is refused by the check.
torch gives 0 for a query row that masks every key; a constant mask with such rows adds 0
there instead and multiplies those output rows by 0, so they are 0 too.  (A computed
float mask with a row of -inf gives NaN there.)

Dynamic sizes.  The nodes follow a dynamic batch, head count or length; a constant mask
(boolean, causal or float) cannot follow a dynamic query or key length and is refused
there (``LoweringContext.constant_like``), as are reshapes to two dynamic dims.

Multi-query attention (one key and value head, Falcon's): the key's and value's batch
dims broadcast against the query's, as in torch, through the products' broadcast of
batch dims (any batch dims that broadcast to the query's are taken so).

Grouped-query attention (``enable_gqa``, key and value with ``Hkv`` heads, the query
with ``Hq = G * Hkv``): query head h reads key head ``h // G``, so the query is read as
``[..., Hkv, G * L, E]`` (its heads are consecutive in memory) and key and value are
never repeated; a computed per-head mask is read as ``[..., Hkv, G, L, S]`` against the
scores read so too, a constant one is laid out ``[..., Hkv, G * L, S]`` at export.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ...errors import XnnquantError
from ..passes.masks import COMPUTED_MASK, computed_boolean_mask
from . import lowers
from .context import Activation, LoweringContext
from .elementwise import binary
from .linear import product
from .shape import permute, reshaped

aten = torch.ops.aten

SDPA_KINDS = ("XNNBatchMatrixMultiply", "XNNMultiply", "XNNAdd", "XNNSoftmax", "XNNStaticReshape",
              "XNNStaticTranspose")


def _argument(node: Any, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def sdpa_check(node: Any) -> str | None:
    """What the lowering refuses, told from the ATen node (see the module docstring)."""
    dropout = _argument(node, 4, "dropout_p", 0.0)
    if dropout:
        return f"scaled_dot_product_attention with dropout_p={dropout} is not supported: expected 0 (eval)"
    shapes = [tuple(getattr(getattr(a, "meta", {}).get("val"), "shape", ())) for a in node.args[:3]]
    if any(len(s) < 2 for s in shapes):
        return f"scaled_dot_product_attention needs query, key and value of rank >= 2: got shapes {shapes}"
    if computed_boolean_mask(node):  # last: the masks pass removes this refusal alone (``masks.rescued``)
        return COMPUTED_MASK
    return None


def _additive(ctx: LoweringContext, mask: Any, causal: bool, length: int, keys: int) -> tuple[Any, np.ndarray | None]:
    """(the additive mask: a constant array, an activation or None; a ``[L, 1]`` 0/1 multiplier
    for the output rows that mask every key, or None)."""
    if causal:
        if mask is not None:
            raise XnnquantError("scaled_dot_product_attention with both attn_mask and is_causal=True: torch refuses it")
        mask = torch.ones(length, keys, dtype=torch.bool).tril()
    if mask is None or isinstance(mask, Activation):
        return mask, None
    if mask.dtype == torch.bool:
        allowed = mask.detach().numpy()
        additive = np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)
    else:
        additive = ctx.constant_array(mask, "the attention mask")
        allowed = additive != -np.inf
    empty = ~allowed.any(axis=-1, keepdims=True)  # rows that mask every key
    if not empty.any():
        return additive, None
    if empty.shape[:-2] and any(d != 1 for d in empty.shape[:-2]):
        raise XnnquantError("a constant attention mask with per-batch or per-head rows that mask every key is not "
                            "supported: expected such rows only in a [L, S] mask")
    additive = np.where(empty, np.float32(0), additive).astype(np.float32)
    return additive, (~empty).astype(np.float32).reshape(empty.shape[-2:])


def _as(a: Activation, exprs: tuple[Any, ...]) -> Activation:
    """``a`` with the dynamic dims ``exprs`` (the compositions' intermediate values carry them,
    so that a constant meeting a dynamic dim is refused, and reshapes follow them)."""
    return Activation(a.id, a.shape, a.perm, tuple(exprs) if any(e is not None for e in exprs) else ())


@lowers(aten.scaled_dot_product_attention.default, emits=SDPA_KINDS, check=sdpa_check)
def scaled_dot_product_attention(ctx: LoweringContext, query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *, scale: Any = None,
                                 enable_gqa: bool = False) -> Activation:
    """``aten::scaled_dot_product_attention`` (see the module docstring)."""
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    length, width = q.shape[-2:]
    keys = k.shape[-2]
    if q.is_dynamic(-1) or k.is_dynamic(-1) or v.is_dynamic(-1):
        raise XnnquantError("scaled_dot_product_attention with a dynamic head size: expected a static head size")
    heads, kv_heads = (q.shape[-3], k.shape[-3]) if q.rank >= 3 and k.rank >= 3 else (1, 1)
    groups = 1
    grouped = enable_gqa and heads != kv_heads and heads % kv_heads == 0 and v.shape[-3] == kv_heads
    if grouped:
        groups = heads // kv_heads
    elif not _broadcasts(q.shape[:-2], k.shape[:-2], v.shape[:-2]):
        raise XnnquantError(f"query with batch dims {q.shape[:-2]} and key / value with {k.shape[:-2]} / "
                            f"{v.shape[:-2]}: expected key and value batch dims that broadcast to the query's (equal "
                            "heads, or one key / value head), or enable_gqa=True with key and value heads dividing "
                            "the query's")
    factor = 1.0 / math.sqrt(width) if scale is None else float(scale)
    mask, keep = _additive(ctx, attn_mask, bool(is_causal), length, keys)
    batch, batch_exprs = q.shape[:-2], q.exprs[:-2]
    rows = query_rows = q.exprs[-2]  # the query length (dynamic or None)
    if groups > 1:  # [..., Hq, L, E] read as [..., Hkv, G * L, E]
        rows = None if rows is None else groups * rows
        q = reshaped(ctx, q, batch[:-1] + (kv_heads, groups * length, width), batch_exprs[:-1] + (None, rows, None))
    score_exprs = q.exprs[:-2] + (rows, k.exprs[-2])
    swap = tuple(range(k.rank - 2)) + (k.rank - 1, k.rank - 2)
    kt = permute(ctx, k, swap)  # k^T, no node: the product reads it through its transpose flag when it can
    scores = _as(product(ctx, q, kt), score_exprs)
    scores = _as(binary(ctx, "multiply", scores, factor), score_exprs)
    if mask is not None:
        scores = _as(_masked(ctx, scores, mask, batch, groups, length, keys), score_exprs)
    probs = _as(ctx.tensor(ctx.graph.softmax(ctx.canonical(scores)), scores.shape), score_exprs)
    out = _as(product(ctx, probs, v), score_exprs[:-1] + (None,))
    if groups > 1:
        out = reshaped(ctx, out, batch + (length, v.shape[-1]), batch_exprs + (query_rows, None))
    if keep is not None:
        out = binary(ctx, "multiply", out, keep)
    return out


def _broadcasts(query: tuple[int, ...], key: tuple[int, ...], value: tuple[int, ...]) -> bool:
    """True when the key's and value's batch dims broadcast to the query's (torch's products do)."""
    try:
        return tuple(torch.broadcast_shapes(query, key, value)) == tuple(query)
    except RuntimeError:
        return False


def _masked(ctx: LoweringContext, scores: Activation, mask: Any, batch: tuple[int, ...], groups: int, length: int,
            keys: int) -> Activation:
    """``scores + mask``, the mask broadcast against the torch scores ``[*batch, L, S]``; with
    grouped heads the scores are ``[..., Hkv, G * L, S]`` and are read as ``[..., Hkv, G, L, S]``."""
    if groups == 1:
        return binary(ctx, "add", scores, mask)
    full = batch + (length, keys)
    shape = tuple(mask.shape)
    if len(shape) > len(full):
        raise XnnquantError(f"an attention mask of shape {shape} does not broadcast into the scores {full}")
    shape = (1,) * (len(full) - len(shape)) + shape
    h = len(full) - 3
    kv_heads = full[h] // groups
    split = shape[:h] + ((kv_heads, groups) if shape[h] != 1 else (1, 1)) + shape[h + 1:]
    if not isinstance(mask, Activation):  # a constant is laid out as the scores are: [..., Hkv or 1, G * L, S]
        arr = np.broadcast_to(np.asarray(mask).reshape(split), split[:h + 1] + (groups, length, keys))
        return binary(ctx, "add", scores, arr.reshape(split[:h + 1] + (groups * length, keys)))
    if scores.dynamic or mask.dynamic:
        raise XnnquantError("grouped-query attention with a computed mask and dynamic dims: the mask is read per "
                            "group by reshapes laid out at the sizes seen at export; expected static shapes")
    mask = reshaped(ctx, mask, split)
    grouped = reshaped(ctx, scores, full[:h] + (kv_heads, groups, length, keys))
    return reshaped(ctx, binary(ctx, "add", grouped, mask), scores.shape)
