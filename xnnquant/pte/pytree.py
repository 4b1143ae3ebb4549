"""A method's ``ContainerMetadata``: how its flat inputs and outputs nest, as pytree specs.

``torch.export`` records a program's signature as two torch pytree specs serialized as
JSON (protocol 1: ``[1, spec]``), and ExecuTorch writes them into every method.  A spec
is ``{"type": ..., "context": ..., "children_spec": [...]}``; a leaf (a tensor or a
scalar) is ``{"type": null, "context": null, "children_spec": []}``; a tuple's context
is the JSON text ``"null"``, a dict's the JSON text of its key list.  The specs written
here are those of ``forward(*inputs)`` returning a tuple::

    inputs   [1, tuple(tuple(leaf x n_inputs), dict())]     i.e. (args, kwargs)
    outputs  [1, tuple(leaf x n_outputs)]

Python's ``json.dumps`` spacing (``", "``, ``": "``), as torch writes them.
"""

from __future__ import annotations

import json
from typing import Any

_LEAF: dict[str, Any] = {"type": None, "context": None, "children_spec": []}


def _tuple(children: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "builtins.tuple", "context": "null", "children_spec": children}


def input_spec(count: int) -> str:
    """The pytree spec of ``count`` positional inputs and no keyword inputs."""
    empty_dict = {"type": "builtins.dict", "context": "[]", "children_spec": []}
    return json.dumps([1, _tuple([_tuple([_LEAF] * count), empty_dict])])


def output_spec(count: int) -> str:
    """The pytree spec of a tuple of ``count`` outputs."""
    return json.dumps([1, _tuple([_LEAF] * count)])


def constant_spec(value: Any) -> str:
    """The pytree spec of a constant method's outputs: one leaf for an int or a bool, a list of
    leaves for a list (ExecuTorch's ``extension.pytree``, as its emitter writes them)."""
    if isinstance(value, list):
        return json.dumps([1, {"type": "builtins.list", "context": "null", "children_spec": [_LEAF] * len(value)}])
    return json.dumps([1, _LEAF])
