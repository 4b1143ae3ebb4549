"""Lowerings: ATen overload -> function emitting XNNPACK nodes, one table for every op family.

Each op family module (``linear``, ``conv``, ``pooling``, ``elementwise``, ``activations``,
``normalization``, ``shape``, ``reduction``, ``attention``, ``resize``) registers its
lowerings with ``@lowers``, keyed by the op objects themselves
(``torch.ops.aten.linear.default``, not strings), naming the node kinds the lowering may
emit (a test checks the reference interpreter has a handler for each) and, optionally, a
``check``: ``check(node) -> reason or None`` says from the ATen node alone (its arguments
and the shapes and dtypes torch.export recorded) whether the lowering can take it, so
``xq.check`` and the partitioner can ask without building anything.  A second
registration of the same op is refused.

A lowering is called as ``fn(ctx, *args, **kwargs)``: ``ctx`` is the ``LoweringContext``
(the only surface a lowering sees), and the arguments are the ATen node's, with every
input node replaced by what it lowered to (an ``Activation`` in the graph, or a torch
tensor for a constant).  It returns an ``Activation`` (or a tuple for ops with several
outputs), or raises ``XnnquantError`` saying why it cannot (a refusal).

A dynamic size stays a ``torch.SymInt`` in the arguments.  A lowering (or check) that reads
one as a number (``int(s)``, ``s == 10``, ``range(s)``) would make torch fix the size at
its traced value for the whole program, silently; a registered check always runs under
``sizes_stay_dynamic``, and the walk calls the lowering under it too, where such a read
refuses the node naming the dim instead (with dynamic shapes, a refused node runs on the
portable kernels, sized at run time).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...graph.layout import NODE_KINDS

Lowering = Callable[..., Any]
Check = Callable[[Any], "str | None"]

#: The op family modules; importing them fills ``LOWERINGS``.
FAMILIES = ("linear", "conv", "pooling", "elementwise", "activations", "normalization", "shape", "reduction",
            "attention", "resize")


@dataclass(frozen=True)
class Registration:
    """One registered lowering: the op, its function, the node kinds it may emit, its check."""

    op: Any  # a torch OpOverload
    fn: Lowering
    emits: frozenset[str]
    check: Check | None = None

    @property
    def composed_at_export_sizes(self) -> bool:
        """True when the check refuses only dynamic shapes (``static_shapes``): the lowering
        composes the op at the sizes seen at export."""
        return getattr(self.check, "__wrapped__", self.check) is static_shapes

    @property
    def family(self) -> str:
        """The op family: the module the lowering lives in (``linear``, ``conv``, ...)."""
        return self.fn.__module__.rsplit(".", 1)[-1]


#: Every registered lowering, by op object.
LOWERINGS: dict[Any, Registration] = {}


def op_name(op: Any) -> str:
    """``aten.linear.default`` for an OpOverload, the function's name otherwise."""
    name = getattr(op, "__name__", None) if not hasattr(op, "_schema") else None
    return str(op) if name is None else name


def lowers(*ops: Any, emits: Iterable[str], check: Check | None = None) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of ``ops``; returns it unchanged.

    ``emits``: the node kinds it may create (checked against the schema's kinds).
    ``check``: see the module docstring.  Registering an op twice raises ``RuntimeError``
    naming both functions.
    """
    kinds = frozenset(emits)
    unknown = kinds - set(NODE_KINDS)
    if unknown:
        raise RuntimeError(f"unknown node kinds in emits=: {sorted(unknown)}")

    def register(fn: Lowering) -> Lowering:
        for op in ops:
            if op in LOWERINGS:
                first = LOWERINGS[op].fn
                raise RuntimeError(
                    f"{op_name(op)} is already lowered by {first.__module__}.{first.__qualname__}: "
                    f"refusing a second lowering {fn.__module__}.{fn.__qualname__}")
            LOWERINGS[op] = Registration(op, fn, kinds, None if check is None else _guarded(check))
        return fn

    return register


def reads_later_outputs(node: Any) -> bool:
    """True when a result of ``node`` other than its first is read (a ``getitem`` of index > 0
    with users, or any other kind of user): what lowerings that compute only the first
    result (values without indices, a norm without its statistics) refuse in their check."""
    import operator

    return any(user.target is not operator.getitem or (user.args[1] != 0 and user.users) for user in node.users)


def static_shapes(node: Any) -> str | None:
    """Why ``node`` cannot be lowered: a tensor it reads or gives has a dynamic dim (for
    lowerings composed at the sizes seen at export: their reshapes, windows, constants and
    index lists would not follow a size that changes)."""
    import torch

    vals = [getattr(a, "meta", {}).get("val") for a in node.all_input_nodes]
    vals += torch.utils._pytree.tree_leaves(node.meta.get("val"))
    for val in vals:
        shape = getattr(val, "shape", None)
        if shape is not None and not all(isinstance(d, int) for d in shape):
            return (f"{op_name(node.target)} of a tensor with dynamic dims {tuple(shape)} is not supported: it is "
                    "composed at the sizes seen at export; expected static shapes for it")
    return None


def all_of(*checks: Check) -> Check:
    """One check that gives the first reason of ``checks``."""
    def check(node: Any) -> str | None:
        for c in checks:
            reason = c(node)
            if reason is not None:
                return reason
        return None

    return check


def _shape_env(node: Any) -> Any:
    """The ``ShapeEnv`` of the program ``node`` was traced in (None without one)."""
    import torch

    for arg in (node, *getattr(node, "all_input_nodes", ())):
        for val in torch.utils._pytree.tree_leaves(getattr(arg, "meta", {}).get("val")):
            env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
            if env is None and type(val).__name__ == "SymInt":
                env = val.node.shape_env
            if env is not None:
                return env
    return None


@contextmanager
def sizes_stay_dynamic(node: Any, dim_names: dict[str, str] | None = None) -> Iterator[None]:
    """Inside, reading a dynamic size of ``node``'s program as a number raises ``XnnquantError``
    naming its dim (``dim_names``: size symbol -> the user's ``Dim`` name) instead of adding
    a guard that fixes the size at its traced value (module docstring).  Facts the dims'
    ranges already decide (``s >= 1`` for a ``Dim`` with ``min=1``) are read as usual."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, _ShapeEnvGuardError

    from ...errors import XnnquantError

    env = _shape_env(node)
    if env is None:
        yield
        return
    try:
        with env.error_on_new_guards():
            yield
    except _ShapeEnvGuardError as exc:
        fact = str(exc).split(": ", 1)[-1]
        raise XnnquantError(f"it reads the dynamic size {_dims(fact, dim_names)} as the number it had at export "
                            f"({fact}): the program would take that size only; expected static sizes "
                            "for it") from None
    except GuardOnDataDependentSymNode as exc:
        fact = str(getattr(exc, "cond", "") or "")
        raise XnnquantError(f"it reads {_dims(fact, dim_names) or 'a size'}, which the program computes from a "
                            "tensor's values when it runs, as a number; expected static sizes for it") from None


def _guarded(check: Check) -> Check:
    """``check`` asked under ``sizes_stay_dynamic``: a check that reads a dynamic size as a
    number refuses the node (module docstring)."""
    from ...errors import XnnquantError

    @functools.wraps(check)
    def guarded(node: Any) -> str | None:
        try:
            with sizes_stay_dynamic(node):
                return check(node)
        except XnnquantError as exc:
            return str(exc)

    return guarded


def _dims(fact: str, dim_names: dict[str, str] | None) -> str:
    """The size symbols of ``fact`` (``s27``, ``u0``), each with the user's name for it."""
    import re

    names = dim_names or {}
    symbols = sorted(set(re.findall(r"\b[su]\d+\b", fact)))
    return ", ".join(f"{names[s]} ({s})" if s in names else s for s in symbols)


def load_lowerings() -> dict[Any, Registration]:
    """Import every op family module and return the registry they filled."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
    return LOWERINGS
