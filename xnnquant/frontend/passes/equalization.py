"""Equalization of the quantized linears that read a layer norm (with calibration statistics).

``x W^T = (x / s) (W s)^T`` for any positive per-input-channel ``s``; with
``calibration.equalization_scales`` (SmoothQuant's rule) the input's few large channels
give some of their range to the weight, and per-token int8 quantization of the input
keeps more levels for the small ones.  This pass finds every ``aten.linear`` whose input
is a layer norm's output and whose module has statistics, groups them by that input
(query, key and value share theirs, and so keep sharing one conversion), computes ``s``
over all the group's weights, and notes on each linear::

    node.meta[EQUALIZE] = (input node, s)    s: float32 (in_features,)

The linear's lowering then stores ``W * s`` and reads ``x / s`` (one multiply per input)
when its scheme is quantized; an fp32 layer ignores the note.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from ..calibration import equalization_scales
from ..program import AtenProgram
from . import rewrite

aten = torch.ops.aten

#: ``node.meta`` key of the note (see the module docstring).
EQUALIZE = "xnnquant_equalize"
LAYER_NORMS = (aten.layer_norm.default, aten.native_layer_norm.default)


def _module(program: AtenProgram, weight: Any) -> str:
    name = program.origins.get(getattr(weight, "name", ""), "")
    return name[: -len(".weight")] if name.endswith(".weight") else name


@rewrite("equalization")
def plan_equalization(program: AtenProgram, options: Any) -> None:
    stats = getattr(options, "statistics", None)
    if stats is None or stats.quantized or not stats.absmax:
        return
    groups: dict[Any, list[Any]] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not aten.linear.default or len(node.args) < 2:
            continue
        source = node.args[0]
        produced = source.args[0] if getattr(source, "target", None) is operator.getitem else source
        if getattr(produced, "target", None) in LAYER_NORMS and program.is_constant(node.args[1]) \
                and _module(program, node.args[1]) in stats.absmax:
            groups.setdefault(source, []).append(node)
    for source, readers in groups.items():
        path = _module(program, readers[0].args[1])
        weights = [program.array(n.args[1].name, "a linear weight") for n in readers]
        scales = equalization_scales(stats.absmax[path], weights)
        for node in readers:
            node.meta[EQUALIZE] = (source, np.asarray(scales, np.float32))
