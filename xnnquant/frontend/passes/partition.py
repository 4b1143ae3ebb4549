"""Partitioning: which nodes run in XNNPACK delegates, which on ExecuTorch's portable kernels.

A node runs in XNNPACK when it has a lowering (``lowering.LOWERINGS``) whose ``check``
takes it, its activations are float32 (XNNPACK's external values are), and its lowering
did not refuse it (``options.portable``: the nodes an earlier lowering refused, which the
export loop sends back here).  Every other node runs on ExecuTorch's portable kernels,
when the 1.4.1 runtime has a kernel for its op (``pte.portable``); a node with neither is
refused by name.  A quantized embedding lookup (``embeddings.py``) runs on ExecuTorch's
quantized kernels, among the portable nodes.  ``strict=True`` sends nothing to the portable
kernels.

Delegates.  XNNPACK nodes are grouped into as few delegates as the graph allows: a
node's *phase* is the number of times a path from the inputs to it leaves XNNPACK for a
portable node, at most::

    phase(n) = max over inputs i of  phase(i) + (1 if i runs in XNNPACK and n does not else 0)

All XNNPACK nodes of one phase form one delegate.  No path leaves a delegate and comes
back into it (a path out of phase p through a portable node only reaches phases > p), so
the delegates and the portable nodes run in the order: portable nodes of phase 0,
delegate 0, portable nodes of phase 1, delegate 1, ...  A pure program is one delegate.

Then an XNNPACK node moves as late as its readers allow (the smallest of its XNNPACK
readers' phases and its portable readers' phases minus one), together with the XNNPACK
nodes only it reads (and only they, in turn), when that holds fewer elements between
delegates: its result, which a delegate would otherwise hand on from the phase it is made
in to the phase it is read in, against the group's inputs that would then be handed on
further than their other readers need.  Nodes are visited readers first.  A decoder's
layers each build their attention mask (a subtract and a clamp) from two vectors all
layers share: moved, each mask is made in its own layer's delegate, not held as a
delegate's output through every layer.

Each call node gets ``node.meta[PARTITION]``: its delegate's phase (an int >= 0), or
``PORTABLE``; a node computing a size (``sym_size`` and arithmetic on sizes) gets ``SIZE``;
and ``node.meta[PHASE]``, its phase (the emitter orders portable nodes by it).
"""

from __future__ import annotations

import operator
from typing import Any

from ...errors import XnnquantError
from ..lowering import LOWERINGS, load_lowerings, op_name
from ..program import AtenProgram
from . import rewrite

#: ``node.meta`` key of the decision (see the module docstring).
PARTITION = "xnnquant_partition"
PORTABLE = -1
SIZE = -2
#: ``node.meta`` key of why a node does not run in XNNPACK (for the delegation report).
WHY = "xnnquant_why_portable"
#: ``node.meta`` key of every call node's phase.
PHASE = "xnnquant_phase"


def is_size(node: Any) -> bool:
    """A node computing a size (a ``torch.SymInt`` or a plain int), not a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (int, bool)) or type(val).__name__ in ("SymInt", "SymBool", "SymFloat")


def _dtype(value: Any) -> str:
    return str(getattr(value, "dtype", "")).removeprefix("torch.")


def reads_int8(node: Any) -> bool:
    """A conversion of an int8 tensor to float32 (``aten._to_copy``): the one node an XNNPACK
    delegate takes an int8 value for (an external qint8 input of scale 1 converted to fp32)."""
    import torch

    if node.target is not torch.ops.aten._to_copy.default or not node.args:
        return False
    source, result = getattr(node.args[0], "meta", {}).get("val"), node.meta.get("val")
    return _dtype(source) == "int8" and _dtype(result) == "float32"


def xnnpack_refusal(program: AtenProgram, node: Any) -> str | None:
    """Why ``node`` cannot run in an XNNPACK delegate (None: it can, as far as the ATen node tells)."""
    load_lowerings()
    registration = LOWERINGS.get(node.target)
    if registration is None:
        return f"XNNPACK has no lowering of {op_name(node.target)}"
    int8_in = reads_int8(node)
    for arg in node.all_input_nodes:
        if program.is_constant(arg) or is_size(arg):
            continue
        vals = arg.meta.get("val")
        for val in vals if isinstance(vals, (tuple, list)) else (vals,):
            if hasattr(val, "dtype") and _dtype(val) != "float32" and not (int8_in and _dtype(val) == "int8"):
                return f"its input {arg.name} is {_dtype(val)} (XNNPACK's values here are float32)"
            if any(isinstance(d, int) and d == 0 for d in getattr(val, "shape", ())):
                return f"its input {arg.name} has no elements: XNNPACK holds no value of size 0"
    vals = node.meta.get("val")
    if isinstance(vals, (tuple, list)):  # the results read (max.dim's unread indices are not made)
        read = {user.args[1] for user in node.users if user.target is operator.getitem and user.users}
        vals = [val for i, val in enumerate(vals) if i in read]
    for val in vals if isinstance(vals, (tuple, list)) else (vals,):
        if hasattr(val, "dtype") and _dtype(val) != "float32":
            return f"its result is {_dtype(val)} (XNNPACK's values here are float32)"
        if any(isinstance(d, int) and d == 0 for d in getattr(val, "shape", ())):
            return f"its result has no elements (shape {tuple(val.shape)}): XNNPACK holds no value of size 0"
    if registration.check is not None:
        return registration.check(node)
    return None


def outside_xnnpack(node: Any) -> str | None:
    """Why a node of a pass's own making runs outside XNNPACK (a quantized embedding lookup)."""
    from .embeddings import QuantizedEmbedding

    return node.target.why if isinstance(node.target, QuantizedEmbedding) else None


def portable_refusal(node: Any) -> str | None:
    """Why ExecuTorch's portable kernels cannot run ``node`` (None: they can)."""
    from ...errors import XnnquantError
    from ...pte.portable import out_variant
    from .embeddings import QuantizedEmbedding

    if isinstance(node.target, QuantizedEmbedding):  # ExecuTorch's quantized kernels run it
        return None

    try:
        out_variant(node.target)
    except XnnquantError as exc:
        return str(exc)
    return _argument_refusal(node)


def _argument_refusal(node: Any) -> str | None:
    """Arguments the 1.4.1 portable kernel refuses at run time (the method fails with
    ``InvalidArgument``), found before the program is written."""
    import torch

    args: tuple[Any, ...] = tuple(getattr(node, "args", ()))
    if node.target is torch.ops.aten.constant_pad_nd.default and len(args) > 1:
        if any(isinstance(p, int) and p < 0 for p in args[1]):
            return (f"its portable kernel refuses negative padding (got pad {list(args[1])}: "
                    "'Padding values must be non-negative')")
    shape = getattr(getattr(node, "meta", {}).get("val"), "shape", ())
    if node.target in _fixed_out() and not all(isinstance(d, int) for d in shape):
        return (f"its portable kernel does not resize its result, which has dynamic dims {tuple(shape)} "
                "('out.size(2) == output_size[0]' fails at every other size); expected static shapes for it")
    return None


def _fixed_out() -> tuple[Any, ...]:
    """Ops whose 1.4.1 portable kernel checks its out tensor's sizes instead of resizing it."""
    import torch

    return (torch.ops.aten._upsample_bilinear2d_aa.default, torch.ops.aten._upsample_bilinear2d_aa.vec)


def phases(program: AtenProgram) -> None:
    """Give every XNNPACK node the phase of its delegate (module docstring)."""
    phase: dict[Any, int] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            phase[node] = 0
            continue
        here = node.meta.get(PARTITION)
        value = 0
        for arg in node.all_input_nodes:
            leaves = arg.meta.get(PARTITION, SIZE) >= 0 and here is not None and here < 0 and here != SIZE
            value = max(value, phase.get(arg, 0) + (1 if leaves else 0))
        phase[node] = value
    for node in reversed(program.graph.nodes):
        if node.op == "call_function" and node.meta.get(PARTITION, PORTABLE) >= 0:
            latest = _latest(node, phase)
            if latest > phase[node]:
                group = _only_feeding(node)
                if _holds_less_later(program, node, group, latest, phase):
                    for member in group:
                        phase[member] = latest
    for node in program.graph.nodes:
        if node.op == "call_function":
            node.meta[PHASE] = phase[node]
            if node.meta.get(PARTITION, PORTABLE) >= 0:
                node.meta[PARTITION] = phase[node]


def _read_until(user: Any, phase: dict[Any, int]) -> int | None:
    """The last delegate phase through which a value ``user`` reads must be held (None: to the
    end: a program output, a size or a getitem reads it)."""
    where = user.meta.get(PARTITION) if user.op == "call_function" else None
    if where is None or where == SIZE or user.target is operator.getitem:
        return None
    return phase[user] if where >= 0 else phase[user] - 1  # a portable node runs before its phase's delegate


def _latest(node: Any, phase: dict[Any, int]) -> int:
    """The last phase an XNNPACK node can run in and still reach its readers (-1: it stays)."""
    until = [_read_until(user, phase) for user in node.users]
    return -1 if not until or None in until else min(u for u in until if u is not None)


def _only_feeding(node: Any, most: int = 32) -> list[Any]:
    """``node`` and the XNNPACK nodes whose every reader is in the group (at most ``most``: a
    bound on the walk; a decoder's mask is 2 nodes, a layer's rotary chain under 10)."""
    group, seen = [node], {node}
    for member in group:
        for arg in member.all_input_nodes:
            if (arg not in seen and arg.op == "call_function" and arg.meta.get(PARTITION, PORTABLE) >= 0
                    and arg.target is not operator.getitem and all(u in seen for u in arg.users)
                    and len(group) < most):
                group.append(arg)
                seen.add(arg)
    return group


def _holds_less_later(program: AtenProgram, node: Any, group: list[Any], latest: int,
                      phase: dict[Any, int]) -> bool:
    """True when making ``group`` at phase ``latest`` hands on fewer elements between
    delegates than making it where it is (module docstring): ``node``'s result's, against
    those of the group's inputs that no other reader holds as far (constants and sizes
    aside), at their bounds."""
    def elements(n: Any) -> int:
        count = 1
        for size in program.shape(n.meta["val"], n.name):
            count *= size.bound
        return count

    members = set(group)
    inputs = {arg: None for member in group for arg in member.all_input_nodes if arg not in members}
    try:
        further = 0
        for arg in inputs:
            if program.is_constant(arg) or is_size(arg):
                continue
            until = [_read_until(u, phase) for u in arg.users if u not in members]
            if all(u is not None and u < latest for u in until):  # no other reader holds it as far
                further += elements(arg)
        return further < elements(node)
    except (KeyError, XnnquantError):
        return False


@rewrite("partition")
def partition(program: AtenProgram, options: Any) -> None:
    forced: dict[str, str] = getattr(options, "portable", {}) or {}
    strict = bool(getattr(options, "strict", False))
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if is_size(node):
            node.meta[PARTITION] = SIZE
            continue
        if node.target is operator.getitem:
            node.meta[PARTITION] = node.args[0].meta.get(PARTITION, PORTABLE)
            continue
        why = forced.get(node.name) or outside_xnnpack(node) or xnnpack_refusal(program, node)
        if why is None:
            node.meta[PARTITION] = 0
            continue
        node.meta[WHY] = why
        node.meta[PARTITION] = 0 if strict else PORTABLE  # strict: the lowering refuses it by name
    phases(program)
    for node in program.graph.nodes:  # a getitem follows its producer's delegate
        if node.op == "call_function" and node.target is operator.getitem:
            node.meta[PARTITION] = node.args[0].meta.get(PARTITION, PORTABLE)
