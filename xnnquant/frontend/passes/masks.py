"""A boolean attention mask computed by the program becomes a float mask before attention.

``scaled_dot_product_attention(q, k, v, attn_mask=m)`` with a boolean ``m`` (True: attend)
means: scores where ``m`` is False get no weight, and a query row that attends to no key
at all gives 0 (torch's result).  XNNPACK has no boolean values, so when ``m`` is computed
(from the input ids, as transformers' SDPA masks are) this pass writes it as what it
stands for::

    bias = where(m, 0, FLT_LOWEST)                 float32, ExecuTorch's portable kernels
    keep = where(any(m, -1, keepdim), 1, 0)        float32, 1 for a row that attends to a key
    out  = scaled_dot_product_attention(q, k, v, attn_mask=bias) * keep        XNNPACK

``FLT_LOWEST`` (the lowest float32) instead of -inf: a score plus it is it (the scores are
far smaller), so a masked key's ``exp(bias - max)`` is exactly 0 in a row that attends
somewhere, as with -inf; a row masking every key gets equal scores and a finite average,
which ``keep`` makes 0, where -inf would give NaN.  A constant boolean mask is left to the
attention's lowering, which folds it into a constant.
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


#: What a masked key's score becomes (see the module docstring).
FLT_LOWEST = float(torch.finfo(torch.float32).min)


def _call(program: AtenProgram, before: Any, target: Any, args: tuple[Any, ...], val: Any) -> Any:
    with program.graph.inserting_before(before):
        node = program.graph.call_function(target, args)
    node.meta = {**before.meta, "val": val}
    return node


#: The attention lowering's refusal of a computed boolean mask (``lowering/attention.py``'s check
#: gives it after every other refusal), which this pass removes.
COMPUTED_MASK = ("the boolean attention mask is computed at run time: XNNPACK has no boolean values (the masks pass "
                 "turns it into a float mask outside XNNPACK when the program may be mixed)")


def computed_boolean_mask(node: Any) -> bool:
    """True for an attention whose mask is a boolean the program computes (not an input), which
    this pass makes a float mask."""
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask is not None and _boolean(mask) and getattr(mask, "op", None) != "placeholder"


def rescued(node: Any) -> bool:
    """True for an attention whose lowering refuses only its computed boolean mask, which this
    pass replaces (so the attention needs no decomposition)."""
    from ..lowering import LOWERINGS  # the registry: this pass knows no op family

    if node.op != "call_function" or node.target is not SDPA or not computed_boolean_mask(node):
        return False
    check = LOWERINGS[SDPA].check
    return check is None or check(node) == COMPUTED_MASK


@rewrite("masks")
def float_masks(program: AtenProgram, options: Any) -> None:
    if getattr(options, "strict", False):  # the float mask needs the portable kernels
        return
    constants: dict[str, Any] = {}

    def constant(name: str, value: float) -> Any:
        if name not in constants:
            constants[name] = program.add_constant(torch.tensor(value), f"attention_mask_{name}")
        return constants[name]

    for node in list(program.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if mask is None or not _boolean(mask) or program.is_constant(mask):
            continue
        val = mask.meta["val"]
        bias = _call(program, node, aten.where.self, (mask, constant("zero", 0.0), constant("lowest", FLT_LOWEST)),
                     torch.empty_like(val, dtype=torch.float32))
        rows = _call(program, node, aten.any.dim, (mask, -1, True), torch.empty_like(val[..., :1]))
        keep = _call(program, node, aten.where.self, (rows, constant("one", 1.0), constant("zero", 0.0)),
                     torch.empty_like(val[..., :1], dtype=torch.float32))
        if len(node.args) > 3:
            node.args = node.args[:3] + (bias,) + node.args[4:]
        else:
            node.kwargs = {**node.kwargs, "attn_mask": bias}
        with program.graph.inserting_after(node):
            kept = program.graph.call_function(aten.mul.Tensor, (node, keep))
        kept.meta = dict(node.meta)
        node.replace_all_uses_with(kept, delete_user_cb=lambda user, kept=kept: user is not kept)
