"""Drop the nodes that compute nothing.

* checks that torch.export inserts and that have no effect on values
  (``_assert_tensor_metadata`` for ``.to()`` calls, ``_assert_scalar``, range constraints):
  erased;
* copies and aliases (``clone``, ``alias``, ``detach``, ``lift_fresh_copy``,
  ``contiguous``), eval-mode ``dropout``, and ``_to_copy`` / ``to`` to the dtype the
  input already has, on its device (a memory-format change: layouts are the lowering's
  business): their users read their input instead;
* ``to`` to another dtype (``to.dtype``, ``to.dtype_layout``, ``to.device``, ``to.other``:
  what torch.export keeps of ``.to(...)`` before decompositions), and ``_to_copy`` to
  another dtype, become ``_to_copy(x, dtype=)``, the op ExecuTorch's kernels run, with its
  result in its input's layout: a memory-format change is the lowering's business, and
  ExecuTorch's ``_to_copy`` kernel refuses a result in another dim order than its input
  (measured: ``x.to(torch.float, memory_format=torch.channels_last)`` of an int tensor
  failed with InvalidArgument, "tensors_have_same_dim_order(self, out)");
* in-place activations (``relu_``, ``hardtanh_``, as ``nn.ReLU6(inplace=True)`` traces)
  whose input nothing else reads: the functional op (no reader can tell the difference),
  so that the program needs no decomposition (functionalization) for them;
* the operands of a ``cat`` that have no elements (``(0, 2, 3)``, and the 1-D ``(0,)`` torch
  lets a cat skip): they contribute nothing, and XNNPACK holds no value of size 0; a cat
  left with one operand is that operand;
* nodes whose result nothing reads (torch.export leaves them where no decomposition ran):
  erased, unless they mutate or have other effects (``torch.fx``'s own rule);
* a reshape (``view``, ``unsqueeze``, ``permute``, ...: the same elements, laid out anew) of
  a value that an earlier node already reshapes the same way: its users read the earlier
  one.  A decoder's layers each unsqueeze the same rotary cos and sin: 60 XNNPACK copies a
  call become 2.  Only reshapes: sharing a value that computes something makes it live from
  its first reader to its last (a decoder's per-layer attention masks, 1 MB each at 128
  tokens a call, would live through every layer); a reshape's input is live as long
  anyway, and it holds as many elements.  Not in a graph that writes in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ..program import AtenProgram
from . import replace_uses, rewrite

aten = torch.ops.aten

#: Ops with no result that only check at run time.
CHECKS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.msg,
          aten.sym_constrain_range.default, aten.sym_constrain_range_for_size.default)
#: ``Tensor.to`` as torch.export keeps it, and the conversion ExecuTorch's kernels run.
TO = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other)
CONVERSIONS = (*TO, aten._to_copy.default)
#: Ops whose result is their first argument's value.
IDENTITIES = (aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
              aten.contiguous.default)
#: Ops whose result holds their input's elements, laid out anew.
RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
            aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.permute.default,
            aten.transpose.int, aten.t.default, aten.view_copy.default, aten.unsqueeze_copy.default,
            aten.squeeze_copy.dim, aten.squeeze_copy.dims, aten.permute_copy.default, aten.transpose_copy.int,
            aten.t_copy.default)
#: In-place activations -> their functional op.
IN_PLACE = {aten.relu_.default: aten.relu.default, aten.hardtanh_.default: aten.hardtanh.default}


def functional_in_place(node: Any) -> bool:
    """True for an in-place activation whose input only it reads (see the module docstring)."""
    users = getattr(node.args[0], "users", None) if node.args else None
    return node.target in IN_PLACE and users is not None and len(users) == 1


def _dtype(node: Any) -> Any:
    return getattr(node.meta.get("val"), "dtype", None) if hasattr(node, "meta") else None


def passes_through(node: Any) -> bool:
    """True for a node whose result is its first argument's value (see the module docstring)."""
    if node.target in IDENTITIES:
        return True
    if node.target is aten.dropout.default:
        return not (node.args[2] if len(node.args) > 2 else node.kwargs.get("train", False))
    if node.target in CONVERSIONS:
        return _same_device(node) and _dtype(node) is not None and _dtype(node) == _dtype(node.args[0])
    return False


def _same_device(node: Any) -> bool:
    """The result is on its input's device (a program runs on one)."""
    devices = [getattr(getattr(n, "meta", {}).get("val"), "device", None) for n in (node, node.args[0])]
    return devices[0] == devices[1]


def _converts(node: Any) -> bool:
    """A ``to`` or ``_to_copy`` node that changes the dtype (made a ``_to_copy`` in its input's
    layout)."""
    return node.target in CONVERSIONS and _same_device(node) and _dtype(node) is not None


def _in_input_layout(node: Any) -> Any:
    """``node``'s value (a fake tensor) with its input's strides (``Tensor.to`` preserves them)."""
    val, source = node.meta.get("val"), node.args[0].meta.get("val")
    mode = getattr(val, "fake_mode", None)
    if mode is None or source is None:
        return val
    with mode:
        return source.to(val.dtype)


@rewrite("cleanup", handles=CHECKS + IDENTITIES + TO + (aten.dropout.default, *IN_PLACE))
def cleanup(program: AtenProgram, options: Any) -> None:
    for node in list(program.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in CHECKS and not node.users:
            program.graph.erase_node(node)
        elif passes_through(node):
            replace_uses(node, node.args[0])
        elif _converts(node):
            with program.graph.inserting_before(node):
                copy = program.graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": _dtype(node)})
            copy.meta = {**node.meta, "val": _in_input_layout(node)}
            replace_uses(node, copy)
        elif functional_in_place(node):
            node.target = IN_PLACE[node.target]
        elif node.target is aten.cat.default:
            _drop_empty_operands(node)
    program.graph.eliminate_dead_code()
    _share_equal_reshapes(program.graph)


def _share_equal_reshapes(graph: Any) -> None:
    """Users of a reshape equal to an earlier one read the earlier one (module docstring);
    not in a graph that writes in place (there a write through one view must not reach the
    other's readers)."""
    calls = [n for n in graph.nodes if n.op == "call_function"]
    if any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in calls):
        return
    seen: dict[Any, Any] = {}
    for node in calls:
        if node.target not in RESHAPES:
            continue
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        try:
            earlier = seen.setdefault((node.target, str(spec), tuple(leaves)), node)
        except TypeError:  # an argument no key holds (a SymInt outside a node): left as it is
            continue
        if earlier is not node and not any(user.op == "output" for user in node.users):
            replace_uses(node, earlier)


def _is_empty(node: Any) -> bool:
    shape = getattr(getattr(node, "meta", {}).get("val"), "shape", None)
    return shape is not None and any(isinstance(d, int) and d == 0 for d in shape)


def _drop_empty_operands(cat: Any) -> None:
    """``cat(tensors, dim)`` without its operands of no elements (module docstring)."""
    tensors = list(cat.args[0])
    kept = [t for t in tensors if not _is_empty(t)]
    if len(kept) == len(tensors) or not kept:
        return
    if len(kept) == 1 and tuple(kept[0].meta["val"].shape) == tuple(cat.meta["val"].shape):
        replace_uses(cat, kept[0])
        return
    cat.args = (kept, *cat.args[1:])
