"""ATen overload -> lowering function, one table for every op family.

Each op family module (``linear``, ``conv``, ``pooling``, ``elementwise``,
``activations``, ``normalization``, ``shape``) registers its lowerings with ``@lowers``,
keyed by the op objects themselves (``torch.ops.aten.linear.default``, not strings) and
naming the node kinds the lowering may emit, so that a test can check the reference
interpreter has a handler for each.  A second registration of the same op is refused.

A lowering is called as ``fn(ctx, *args, **kwargs)``: ``ctx`` is the ``Lowerer`` (the
graph under construction, the current node, the weight options), and the arguments are
the ATen node's, with every input node replaced by what it lowered to (a ``Tensor`` in
the graph, or a torch tensor for a constant).  It returns a ``Tensor`` (or a tuple of
them for ops with several outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..graph.layout import NODE_KINDS

Lowering = Callable[..., Any]


@dataclass(frozen=True)
class Registration:
    """One registered lowering: the op, its function, the node kinds it may emit."""

    op: Any  # a torch OpOverload, or a Python callable such as operator.getitem
    fn: Lowering
    emits: frozenset[str]

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


def lowers(*ops: Any, emits: Iterable[str]) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of ``ops``; returns it unchanged.

    ``emits``: the node kinds it may create (checked against the schema's kinds).
    Registering an op twice raises ``RuntimeError`` naming both functions.
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
            LOWERINGS[op] = Registration(op, fn, kinds)
        return fn

    return register
