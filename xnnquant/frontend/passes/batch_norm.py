"""Fold an eval-mode batch norm into the convolution before it.

``bn(conv(x, w, b))`` with ``s = gamma / sqrt(var + eps)`` per output channel is
``conv(x, w', b')``::

    w' = w * s    on the filter's output-channel axis   b' = (b - mean) * s + beta

computed in float64 and stored float32.  The output channels of a regular or grouped
filter ``[OC, IC/g, KH, KW]`` are its axis 0; those of a transposed filter
``[IC, OC/g, KH, KW]`` are axis 1 within each of the g groups of rows::

    transposed: w.reshape(g, IC/g, OC/g, KH, KW) * s.reshape(g, 1, OC/g, 1, 1)

``can_fold(program, conv, bn)`` is the guard: the fold is exact only when the convolution
feeds nothing but this batch norm, its filter, bias and the batch norm's parameters are
constants, and the batch norm's statistics outputs are unused.  Anything else keeps its
batch norm, which its own lowering computes as a per-channel multiply-add.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from ..program import AtenProgram
from . import replace_uses, rewrite

aten = torch.ops.aten

BATCH_NORM = aten._native_batch_norm_legit_no_training.default
#: ``aten::batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)``,
#: as torch.export traces ``nn.BatchNorm2d`` before any decomposition: folded alike when not training.
BATCH_NORM_OP = aten.batch_norm.default
CONVOLUTIONS = (aten.convolution.default, aten.conv2d.default)


def eps_of(bn: Any) -> float:
    """The epsilon of either batch-norm op."""
    return float(bn.args[7] if bn.target is BATCH_NORM_OP else bn.args[6])


def conv_parameters(conv: Any) -> tuple[Any, Any, bool, int]:
    """(filter node, bias node or None, transposed, groups) of an ATen convolution node."""
    args = list(conv.args)
    if conv.target is aten.conv2d.default:  # (input, weight, bias, stride, padding, dilation, groups)
        bias = args[2] if len(args) > 2 else conv.kwargs.get("bias")
        groups = args[6] if len(args) > 6 else conv.kwargs.get("groups", 1)
        return args[1], bias, False, int(groups)
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return args[1], args[2], bool(args[6]), int(args[8])


def can_fold(program: AtenProgram, conv: Any, bn: Any) -> str | None:
    """Why ``bn`` cannot be folded into ``conv`` (None: it can; see the module docstring)."""
    if getattr(conv, "target", None) not in CONVOLUTIONS:
        return "its input is not a convolution"
    if len(conv.users) != 1:
        return f"the convolution {conv.name} has {len(conv.users)} users"
    weight, bias, _, _ = conv_parameters(conv)
    if not program.is_constant(weight) or (bias is not None and not program.is_constant(bias)):
        return "the convolution's filter or bias is computed"
    if any(p is not None and not program.is_constant(p) for p in bn.args[1:5]):
        return "the batch norm's parameters are computed"
    if bn.target is BATCH_NORM_OP:
        return "the batch norm is in training mode" if bn.args[5] else None
    if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in bn.users):
        return "the batch norm's statistics outputs are used"
    return None


def _array(program: AtenProgram, node: Any, size: int, default: float, what: str) -> np.ndarray:
    if node is None:
        return np.full(size, default)
    return program.array(node.name, what).astype(np.float64).reshape(size)


@rewrite("batch_norm")
def fold_batch_norms(program: AtenProgram, options: Any) -> None:
    for bn in list(program.graph.nodes):
        if bn.op != "call_function" or bn.target not in (BATCH_NORM, BATCH_NORM_OP):
            continue
        conv = bn.args[0]
        if can_fold(program, conv, bn) is not None:
            continue
        weight, bias, transposed, groups = conv_parameters(conv)
        origin = program.origins.get(weight.name, "convolution")
        w = program.array(weight.name, f"the filter of {origin!r}").astype(np.float64)
        oc = w.shape[1] * groups if transposed else w.shape[0]
        eps = eps_of(bn)
        gamma, beta, mean, var = (_array(program, node, oc, default, f"batch norm parameter of {origin!r}")
                                  for node, default in zip(bn.args[1:5], (1.0, 0.0, 0.0, 1.0)))
        scale = gamma / np.sqrt(var + eps)
        if transposed:
            ic, ocg = w.shape[:2]
            spatial = (1,) * (w.ndim - 2)
            grouped = w.reshape(groups, ic // groups, ocg, *w.shape[2:])
            w = (grouped * scale.reshape(groups, 1, ocg, *spatial)).reshape(w.shape)
        else:
            w = w * scale.reshape(oc, *(1,) * (w.ndim - 1))
        b = np.zeros(oc) if bias is None else _array(program, bias, oc, 0.0, f"the bias of {origin!r}")
        b = (b - mean) * scale + beta
        new_weight = program.add_constant(torch.from_numpy(w.astype(np.float32)), f"{weight.name}_bn", origin)
        bias_origin = program.origins.get(bias.name) if bias is not None else None
        new_bias = program.add_constant(torch.from_numpy(b.astype(np.float32)), f"{conv.name}_bias_bn", bias_origin)
        args = list(conv.args)
        if conv.target is aten.conv2d.default:
            args += [None] * (3 - len(args))
            conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}
        args[1], args[2] = new_weight, new_bias
        conv.args = tuple(args)
        if bn.target is BATCH_NORM_OP:
            replace_uses(bn, conv)
            continue
        for user in list(bn.users):
            if user.args[1] == 0:
                replace_uses(user, conv)
            else:
                program.graph.erase_node(user)
        program.graph.erase_node(bn)
