"""A boolean attention mask computed by the program becomes a float mask before attention.

``scaled_dot_product_attention(q, k, v, attn_mask=m)`` with a boolean ``m`` (True: attend)
means adding 0 where ``m`` holds and -inf where it does not.  XNNPACK has no boolean
values, so when ``m`` is computed (from the input ids, as transformers' SDPA masks are) the
attention would leave XNNPACK; instead this pass writes the addition's float mask::

    m (bool, computed)  ->  where(m, 0.0, -inf)  (float32; ExecuTorch's portable kernels)
                        ->  scaled_dot_product_attention(q, k, v, attn_mask=<that>)  (XNNPACK)

which is what torch computes for a boolean mask, so the values do not change.  A constant
boolean mask is left to the attention's lowering, which folds it into a constant.
"""

from __future__ import annotations

from typing import Any

import torch

from ..program import AtenProgram
from . import rewrite

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def _boolean(node: Any) -> bool:
    return getattr(getattr(node, "meta", {}).get("val"), "dtype", None) is torch.bool


@rewrite("masks")
def float_masks(program: AtenProgram, options: Any) -> None:
    zero = neg_inf = None
    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if mask is None or not _boolean(mask) or program.is_constant(mask):
            continue
        if zero is None:
            zero = program.add_constant(torch.tensor(0.0), "attention_mask_zero")
            neg_inf = program.add_constant(torch.tensor(float("-inf")), "attention_mask_neg_inf")
        with program.graph.inserting_before(node):
            additive = program.graph.call_function(aten.where.self, (mask, zero, neg_inf))
        val = mask.meta["val"]
        additive.meta = {**mask.meta, "val": torch.empty_like(val, dtype=torch.float32)}
        if len(node.args) > 3:
            node.args = node.args[:3] + (additive,) + node.args[4:]
        else:
            node.kwargs = {**node.kwargs, "attn_mask": additive}
