"""One ATen operator as a ``KernelCall`` of ExecuTorch's portable kernels.

``portable_call(method, torch.ops.aten.embedding.default, (table, ids))`` appends to
``method`` the call of the kernel ExecuTorch 1.4.1 registers for that operator and returns
the value index of its result.  How the call is made, as ExecuTorch's emitter makes it:

1. The out variant.  A view operator (its schema returns an alias of an input, e.g.
   ``aten::view``, ``aten::slice.Tensor``) becomes its ``_copy`` operator (``view_copy``,
   ``slice_copy.Tensor``: same arguments, a copy instead of an alias; ``aten::_unsafe_view``,
   a view whose schema does not say so, too).  The kernel is then
   the overload of the same name whose schema has out arguments and, out arguments and
   returns left aside, the same signature (torchgen's ``FunctionSchema.signature``, which
   also leaves out dtype/layout/device/pin_memory): ``aten::add.Tensor`` ->
   ``aten::add.out``, ``aten::lt.Scalar`` -> ``aten::lt.Scalar_out``, ``aten::max.dim`` ->
   ``aten::max.dim_max``.  It must be one of the names the 1.4.1 runtime registers
   (``registered_operators.txt``, the runtime's ``_get_operator_names()``), else the
   operator is refused by name.
2. The arguments: every argument of the out variant's schema in order, each the one given
   (by position or name, as for the functional operator), else the schema's default, else
   the out tensor(s); then the returned value again (the out tensor, or a ``TensorList``
   of several).  Tensors are given as value indices; a list of tensors becomes a
   ``TensorList`` (``OptionalTensorList`` with None), None a ``Null`` (an empty tensor
   where the schema wants a non-optional Tensor), a list of ints a boxed ``IntList``,
   of floats a ``DoubleList``, of bools a ``BoolList``; a bool a ``Bool``, an int an
   ``Int``, a float a ``Double``, a str a ``String``; a dtype, layout or memory format its
   number as an ``Int``.  A functional argument the out variant lacks (``dtype=`` of a
   factory) is dropped: the out tensor carries it.
3. The out tensors: given (``out=``), else made from torch's meta kernels (sizes, dtype,
   dim order of the result for the given inputs' sizes, upper bounds when an input is
   DYNAMIC_BOUND, which the outputs then are too).

torch (and torchgen, part of it) is imported on use; executorch is not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UnsupportedConfigError, XnnquantError, missing_extra
from .builder import MethodBuilder
from .quantized import LLAMA_KERNELS, OutKernel
from .values import NUMPY_DTYPES, IntList, ScalarType, ShapeDynamism, Tensor

#: The runtime's operator registry (executorch 1.4.1 pybindings), one "name.overload" a line.
REGISTERED_OPERATORS_FILE = Path(__file__).with_name("registered_operators.txt")
#: torch dtype name -> ScalarType (c10's numbering).
_TORCH_DTYPES = {"uint8": ScalarType.BYTE, "int8": ScalarType.CHAR, "int16": ScalarType.SHORT,
                 "int32": ScalarType.INT, "int64": ScalarType.LONG, "float16": ScalarType.HALF,
                 "float32": ScalarType.FLOAT, "float64": ScalarType.DOUBLE, "bool": ScalarType.BOOL,
                 "bfloat16": ScalarType.BFLOAT16, "uint16": ScalarType.UINT16, "uint32": ScalarType.UINT32,
                 "uint64": ScalarType.UINT64}
#: torch.layout / torch.memory_format names -> the numbers ExecuTorch's kernels read.
_LAYOUTS = {"torch.strided": 0, "torch.sparse_coo": 1}
_MEMORY_FORMATS = {"torch.contiguous_format": 0, "torch.preserve_format": 1}


@dataclass(frozen=True)
class RuntimeInt:
    """An int argument computed when the program runs (a dynamic size): the value index of
    its ``Int``, and the largest value it can take (what the meta kernel sizes outputs by;
    an output sized by one is bounded)."""

    index: int
    bound: int


@functools.cache
def registered_operators() -> frozenset[str]:
    """Every ``namespace::name.overload`` the 1.4.1 runtime has a kernel for."""
    return frozenset(line.strip() for line in REGISTERED_OPERATORS_FILE.read_text().splitlines() if line.strip())


def _torch() -> Any:
    try:
        import torch
        import torchgen.model  # noqa: F401
    except ImportError:
        raise missing_extra("torch", "torch", "emitting ATen operators as portable kernel calls") from None
    return torch


def kernel_name(op: Any) -> str:
    """``"aten::add.out"`` for ``torch.ops.aten.add.out`` (``"default"`` overloads: no suffix)."""
    name = str(op._schema.name)
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def _signature(op: Any) -> Any:
    from torchgen.model import FunctionSchema

    return dataclasses.replace(FunctionSchema.parse(str(op._schema)).signature(), returns=())


@functools.cache
def out_variant(op: Any) -> Any:
    """The out-variant overload of ``op`` whose kernel the runtime registers (module
    docstring, step 1), or ``UnsupportedConfigError`` naming ``op``."""
    try:
        return _out_variant(op)
    except XnnquantError:
        raise
    except Exception as exc:  # a schema torchgen cannot parse (e.g. a default list it does not know)
        raise UnsupportedConfigError(f"{op}: torch's schema of it cannot be read ({type(exc).__name__}: {exc}); "
                                     "ExecuTorch's portable kernels are not known to run it") from None


def _out_variant(op: Any) -> Any:
    torch = _torch()
    from torchgen.model import FunctionSchema, SchemaKind

    if not isinstance(op, torch._ops.OpOverload):
        raise XnnquantError(f"expected an ATen OpOverload such as torch.ops.aten.add.Tensor: got {op!r}")
    if op is torch.ops.aten._unsafe_view.default:  # a view whose schema does not say so
        op = torch.ops.aten.view_copy.default
    schema = FunctionSchema.parse(str(op._schema))
    target = op
    if schema.kind() == SchemaKind.functional and any(r.annotation is not None for r in schema.returns):
        packet = getattr(torch.ops.aten, op._overloadpacket.__name__ + "_copy", None)
        copy = getattr(packet, op._overloadname, None) if packet is not None else None
        if copy is None or FunctionSchema.parse(str(copy._schema)).view_signature() != schema.view_signature():
            raise UnsupportedConfigError(f"{kernel_name(op)} is a view with no _copy operator: ExecuTorch's "
                                         "portable kernels have no kernel for it")
        target, schema = copy, FunctionSchema.parse(str(copy._schema))
    if schema.kind() == SchemaKind.out:
        found = target
    elif schema.kind() == SchemaKind.functional:
        wanted = _signature(target)
        packet = target._overloadpacket
        found = next((getattr(packet, name) for name in packet.overloads()
                      if FunctionSchema.parse(str(getattr(packet, name)._schema)).kind() == SchemaKind.out
                      and _signature(getattr(packet, name)) == wanted), None)
        if found is None:
            raise UnsupportedConfigError(f"{kernel_name(op)} has no out variant in torch's schemas: ExecuTorch's "
                                         "portable kernels have no kernel for it")
    else:
        raise UnsupportedConfigError(f"{kernel_name(op)} mutates its inputs ({schema.kind().name}): expected a "
                                     "functional or out-variant operator")
    if kernel_name(found) not in registered_operators() | LLAMA_KERNELS:
        raise UnsupportedConfigError(
            f"{kernel_name(op)}: its out variant {kernel_name(found)} has no kernel in the ExecuTorch 1.4.1 runtime "
            f"(none of its {len(registered_operators())} registered operators)")
    return found


def _scalar_type(dtype: Any) -> ScalarType:
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise UnsupportedConfigError(f"dtype {dtype} has no ExecuTorch scalar type here: expected one of "
                                     f"{', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def _bind(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments given to the functional ``op``, by schema name."""
    params = op._schema.arguments
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise XnnquantError(f"{kernel_name(op)} takes {len(positional)} positional arguments: got {len(args)}")
    bound = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in params}
    for name, v in kwargs.items():
        if name not in names or name in bound:
            raise XnnquantError(f"{kernel_name(op)}: unexpected or repeated argument {name!r} (its arguments: "
                                f"{', '.join(a.name for a in params)})")
        bound[name] = v
    return bound


def _meta_outputs(method: MethodBuilder, op: Any, bound: Mapping[str, Any]) -> list[int]:
    """Out tensors made from torch's meta kernel of ``op`` at the inputs' sizes."""
    torch = _torch()
    dynamic = False

    def meta_tensor(index: Any) -> Any:
        nonlocal dynamic
        value = method.values[_tensor_index(method, index, kernel_name(op))]
        assert isinstance(value, Tensor)  # checked by _tensor_index
        dynamic |= value.dynamism == ShapeDynamism.DYNAMIC_BOUND
        strides = [0] * len(value.sizes)
        step = 1
        for d in reversed(value.dim_order):
            strides[d], step = step, step * max(value.sizes[d], 1)
        dtype = getattr(torch, NUMPY_DTYPES[value.scalar_type].name, torch.bfloat16)
        return torch.empty_strided(value.sizes, strides, dtype=dtype, device="meta")

    def concrete(value: Any) -> Any:
        nonlocal dynamic
        if isinstance(value, RuntimeInt):
            dynamic = True
            return value.bound
        if isinstance(value, (list, tuple)):
            return type(value)(concrete(v) for v in value)
        return value

    given = {}
    for arg in op._schema.arguments:
        if arg.name in bound:
            value, kind = bound[arg.name], str(arg.type)
            if value is not None and "Tensor" in kind:
                value = ([None if v is None else meta_tensor(v) for v in value] if "List" in kind
                         else meta_tensor(value))
            given[arg.name] = concrete(value)
    result = op(**given)
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    outs = []
    for r in results:
        order = sorted(range(r.dim()), key=lambda d: -r.stride(d))
        outs.append(method.tensor(_scalar_type(r.dtype), tuple(r.shape), dim_order=order, dynamic=dynamic))
    return outs


def _tensor_index(method: MethodBuilder, index: Any, where: str) -> int:
    """``index`` checked to be the index of a Tensor value of ``method``."""
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(method.values) \
            or not isinstance(method.values[index], Tensor):
        raise XnnquantError(f"{where}: a tensor argument must be the index of a Tensor value: got {index!r}")
    return int(index)


def _argument(method: MethodBuilder, arg: Any, value: Any, where: str) -> int:
    """The value index of one argument (module docstring, step 2)."""
    kind = str(arg.type)
    if kind == "Tensor":
        return method.tensor(ScalarType.BYTE, (0,), planned=False) if value is None else \
            _tensor_index(method, value, where)
    if kind == "Optional[Tensor]":
        return method.null() if value is None else _tensor_index(method, value, where)
    if kind in ("List[Tensor]", "Optional[List[Tensor]]") and value is not None:
        return method.tensor_list([_tensor_index(method, v, where) for v in value])
    if kind == "List[Optional[Tensor]]":
        return method.optional_tensor_list([None if v is None else _tensor_index(method, v, where) for v in value])
    if value is None:
        return method.null()
    if isinstance(value, RuntimeInt):
        return value.index
    if isinstance(value, (list, tuple)):
        inner = kind.removeprefix("Optional[").removeprefix("List[")
        if inner.startswith(("int", "SymInt")):
            if any(isinstance(v, RuntimeInt) for v in value):
                return method.value(IntList(tuple(v.index if isinstance(v, RuntimeInt) else method.int_value(int(v))
                                                  for v in value)))
            return method.int_list([int(v) for v in value])
        if inner.startswith("float"):
            return method.double_list([float(v) for v in value])
        if inner.startswith("bool"):
            return method.bool_list([bool(v) for v in value])
        raise UnsupportedConfigError(f"{where}: argument {arg.name!r} of type {kind} is not a list ExecuTorch emits")
    if isinstance(value, np.generic):
        value = value.item()  # numpy scalars as the Python scalars they hold
    torch = _torch()
    if isinstance(value, torch.dtype):
        return method.int_value(int(_scalar_type(value)))
    if isinstance(value, (torch.layout, torch.memory_format)):
        table = _LAYOUTS if isinstance(value, torch.layout) else _MEMORY_FORMATS
        if str(value) not in table:
            raise UnsupportedConfigError(f"{where}: argument {arg.name!r} = {value} has no ExecuTorch number")
        return method.int_value(table[str(value)])
    if isinstance(value, bool):
        return method.bool_value(value)
    if isinstance(value, int):
        return method.int_value(value)
    if isinstance(value, float):
        return method.double(value)
    if isinstance(value, str):
        return method.string(value)
    raise UnsupportedConfigError(f"{where}: argument {arg.name!r} = {value!r} ({type(value).__name__}) has no "
                                 "ExecuTorch value kind")


def portable_call(method: MethodBuilder, op: Any, args: Sequence[Any] = (),
                  kwargs: Mapping[str, Any] | None = None, out: int | Sequence[int] | None = None) -> Any:
    """Append the portable kernel call of the ATen operator ``op`` to ``method``.

    ``op`` may also be an ``OutKernel`` (a kernel outside ATen, ``quantized.py``): it is its
    own out variant, and ``out`` must be given (no meta kernel makes its out tensor).

    ``args`` / ``kwargs``: the functional operator's arguments, tensors as value indices
    of ``method``.  ``out``: the value index of the out tensor, or a sequence of them for
    an operator with several outputs (a list output: the tensors of that list); None
    makes them from torch's meta kernels.  Returns the out tensor's index, or a tuple
    of indices when there are several.  Raises ``UnsupportedConfigError`` when the
    runtime has no kernel for ``op`` (module docstring).
    """
    target = op if isinstance(op, OutKernel) else out_variant(op)
    where = kernel_name(op)
    bound = _bind(op, args, kwargs or {})
    out_args = [a for a in target._schema.arguments if a.is_out]
    if out is None:
        if isinstance(op, OutKernel):
            raise XnnquantError(f"{where}: a kernel outside ATen has no meta kernel here: pass out=")
        outs = _meta_outputs(method, op, bound)
    else:
        outs = [_tensor_index(method, o, where) for o in ([out] if isinstance(out, (int, np.integer)) else out)]
    list_out = len(out_args) == 1 and str(out_args[0].type) == "List[Tensor]"
    if not list_out and len(outs) != len(out_args):
        raise XnnquantError(f"{where}: {kernel_name(target)} writes {len(out_args)} out tensor(s), got {len(outs)}")
    out_values = iter([method.tensor_list(outs)] if list_out else outs)
    # arguments the out variant lacks (a factory's dtype=, layout=...) are carried by the out tensor
    given = {name: value for name, value in bound.items() if name in {a.name for a in target._schema.arguments}}
    indices, written = [], []
    for arg in target._schema.arguments:
        if arg.is_out:
            written.append(next(out_values))
            indices.append(written[-1])
        elif arg.name in given:
            indices.append(_argument(method, arg, given[arg.name], where))
        elif arg.has_default_value():
            indices.append(_argument(method, arg, arg.default_value, where))
        else:
            raise XnnquantError(f"{where}: argument {arg.name!r} is required (its arguments: "
                                f"{', '.join(a.name for a in op._schema.arguments)})")
    indices.append(written[0] if len(written) == 1 else method.tensor_list(written))
    name, _, overload = kernel_name(target).partition(".")
    method.kernel_call(name, overload, indices)
    return outs[0] if len(outs) == 1 and not list_out else tuple(outs)
