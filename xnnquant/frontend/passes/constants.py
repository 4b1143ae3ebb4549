"""Compute every node whose inputs are all constants, with torch, ahead of lowering.

A node whose tensor arguments are all constant placeholders (a transposed weight, a
mask built from a buffer, a ``zeros`` made in ``forward``) becomes a new constant
placeholder holding torch's result; a node with several results is folded through its
``getitem`` users.  A result computed from one named tensor keeps that name for the
report.  Ops that draw random numbers are left to their lowering (none exists: they are
refused by name).  On a streaming export's meta tensors the result is a meta tensor,
which the lowering refuses to read, naming the tensor it was computed from.

A streaming export traces its module on ``meta``, so the tensors its ``forward`` makes
(``arange(..., device=x.device)``) and the copies it moves there (``buffer.to(x.device)``)
say ``device=meta``.  The program runs on the CPU: a node whose inputs all hold data (a
buffer kept in memory, Llama's rotary ``inv_freq``, or another folded value) is computed
on the CPU, so rotary tables and position ids fold into values as they do in memory.  A
meta input the weight file holds is read from it first when the node's meta inputs come to
at most ``FOLD_READ_BYTES`` (a position embedding table looked up at the example's
positions, token type ids); a node with a meta input left is computed on meta (its
data-holding inputs moved there).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..program import AtenProgram
from . import replace_uses, rewrite

_META = torch.device("meta")


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device == _META


def _on_cpu(value: Any) -> Any:
    return torch.device("cpu") if isinstance(value, torch.device) and value == _META else value


def _inputs(node: Any) -> list[Any]:
    return list(node.all_input_nodes)


def foldable(program: AtenProgram, node: Any) -> bool:
    """True when every input of ``node`` is a constant and torch computes it deterministically."""
    if node.op != "call_function" or node.target is operator.getitem or not node.users:
        return False
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return False
    return all(program.is_constant(n) for n in _inputs(node))


#: Bytes of a streaming export's meta tensors one node may read from the weight file to be
#: folded (a position table, token type ids: megabytes); a node reading more (a layer weight
#: transposed) stays on meta, and the lowering refuses it by name.
FOLD_READ_BYTES = 64 << 20


def _with_data(program: AtenProgram, values: dict[Any, Any], read: dict[str, Any]) -> dict[Any, Any]:
    """``values`` with their meta tensors read from a streaming export's weight file, when it
    holds them all and they come to at most ``FOLD_READ_BYTES`` (``read``: the ones read so
    far, by placeholder name); else ``values`` as they are."""
    meta = {n: v for n, v in values.items() if _is_meta(v)}
    if not meta or program.weight_file is None:
        return values
    if sum(v.numel() * v.element_size() for n, v in meta.items() if n.name not in read) > FOLD_READ_BYTES:
        return values
    for n in meta:
        if n.name not in read:
            read[n.name] = program.stored_tensor(n.name)
        if read[n.name] is None:
            return values
    return {n: read[n.name] if n in meta else v for n, v in values.items()}


@rewrite("constants")
def fold_constants(program: AtenProgram, options: Any) -> None:
    read: dict[str, Any] = {}  # meta tensors read from the weight file, by placeholder (_with_data)
    for node in list(program.graph.nodes):
        if not foldable(program, node):
            continue
        values = {n: program.constants[n.name] for n in _inputs(node)}
        values = _with_data(program, values, read)
        on_meta = [_is_meta(v) for v in values.values()]
        if any(on_meta):  # no data in, none out: all on meta
            values = {n: v.to(_META) if isinstance(v, torch.Tensor) else v for n, v in values.items()}
        args = torch.fx.node.map_arg(node.args, values.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
        if not any(on_meta):  # computed from data: on the CPU (module docstring)
            args, kwargs = torch.utils._pytree.tree_map(_on_cpu, (args, kwargs))
        with torch.no_grad():
            try:
                result = node.target(*args, **kwargs)
            except Exception:
                continue
        named = [program.origins[n.name] for n in _inputs(node) if n.name in program.origins]
        origin = named[0] if len(named) == 1 else None
        if isinstance(result, torch.Tensor):
            replace_uses(node, program.add_constant(result, f"{node.name}_folded", origin))
        elif isinstance(result, (tuple, list)) and all(u.target is operator.getitem for u in node.users):
            for user in list(node.users):
                part = result[user.args[1]]
                if isinstance(part, torch.Tensor):
                    replace_uses(user, program.add_constant(part, f"{user.name}_folded", origin))
            if not node.users:
                program.graph.erase_node(node)
