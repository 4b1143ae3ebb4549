"""The ExecuTorch program of an export: XNNPACK delegates and portable kernel calls, in one method.

``emit`` writes the ``forward`` method of a ``.pte`` from the partitioned ``AtenProgram``
(``passes/partition.py``) and the lowered delegates, in the order the partition gives::

    inputs (any dtype ExecuTorch has; the example's dim order, bounded when dynamic)
    portable nodes of phase 0  ->  delegate 0  ->  portable nodes of phase 1  ->  delegate 1 ...
    outputs

A portable node becomes a call of ExecuTorch's portable kernel for its ATen op
(``pte.portable.portable_call``: the out variant, arguments in schema order, the out tensor
made from torch's meta kernel), and a quantized embedding lookup (``passes/embeddings.py``)
the calls of ``pte.quantized.embedding_call`` on its table's codes, scales and guard; a
constant it reads becomes a constant tensor of the program; a static size it reads is the
traced int, and a dynamic one is computed when the program runs, where it is first needed:
``aten::sym_size.int`` reads a tensor's dim into an ``Int`` value, and arithmetic on sizes
(``operator.mul``, ``torch.sym_max``, ...) is ExecuTorch's ``executorch_prim::`` kernels on
``Int`` values (``SIZE_KERNELS``); a size read from a tensor (``tensor.item()``, an input
position) is ``aten::_local_scalar_dense``.  A delegate reads the tensors of its input nodes
and writes new float32 tensors for its output nodes (``lowering.walk.Lowered``).
Memory is planned by the program builder from the instructions' order.

State.  A buffer the module mutates (``AtenProgram.state``) is a state tensor of the method
(``MethodBuilder.state``: planned, its initial values the buffer's when exported, kept from
one call to the next).  Nodes and delegates read it as any tensor.  Its new value is
written in place when that is exact, else copied into it after the last instruction::

    in place   index_put(old, [None, .., idx, ..], values) of a state (or of such a write
               of it: a chain), idx one 1-D integer index, values of the state's shape
               but idx's length at that dim (a KV cache update):
               aten::index_put_(state, indices, values, false), nothing copied.  Exact
               when every other reader of the old value runs before the write
               (``inplace_writes``); the kernel fails the method for an index out of
               range.
    otherwise  the new value is computed into a tensor of its own, then
               aten::copy_(state, new value) ends the method.

(Over 500 lines, one module: ``_Emitter`` writes one method in the program's order, and each of
its parts, operands, sizes, portable calls, in-place writes, delegates, reads and adds to the
same values of that method; apart, each would take the whole emitter.)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..constants import XNNPACK_BACKEND_ID
from ..errors import UnsupportedConfigError, XnnquantError
from ..graph import NamedPayload
from ..pte.builder import MethodBuilder, ProgramBuilder
from .exported import TensorIO
from .lowering.walk import Lowered, declared_dim_order
from .passes.partition import PARTITION, PHASE, PORTABLE, SIZE, WHY
from .program import AtenProgram, Size

#: Arithmetic on sizes, by its traced target's name: the ``executorch_prim`` kernel computing it.
SIZE_KERNELS = {"add": "add.Scalar", "sub": "sub.Scalar", "mul": "mul.Scalar", "floordiv": "floordiv.Scalar",
                "mod": "mod.Scalar", "neg": "neg.Scalar", "truediv": "truediv.Scalar", "sym_max": "sym_max.Scalar",
                "sym_min": "sym_min.Scalar", "eq": "eq.Scalar", "gt": "gt.Scalar", "ge": "ge.Scalar",
                "lt": "lt.Scalar", "le": "le.Scalar"}


@dataclass(frozen=True)
class Placement:
    """Where one ATen node runs (the delegation report): its op, node name, module path,
    ``where`` ("XNNPACK delegate k" or "portable kernels") and why it is not in XNNPACK."""

    op: str
    node: str
    module: str
    where: str
    why: str = ""


def placements(program: AtenProgram) -> list[Placement]:
    """The delegation report of a partitioned program: one entry per call node."""
    from .lowering import op_name

    out = []
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        part = node.meta.get(PARTITION, PORTABLE)
        if part == SIZE:
            continue
        where = f"XNNPACK delegate {part}" if part >= 0 else "portable kernels"
        out.append(Placement(op_name(node.target), node.name, AtenProgram.module_path(node), where,
                             node.meta.get(WHY, "") if part < 0 else ""))
    return out


def _dtype(val: Any) -> str:
    return str(getattr(val, "dtype", "float32")).removeprefix("torch.")


def input_specs(program: AtenProgram) -> list[TensorIO]:
    """The program's inputs as the method declares them (any dtype, the example's dim order)."""
    from .lowering.walk import _dynamic_dims

    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs = []
    for name in program.inputs:
        val = placeholders[name].meta.get("val")
        what = f"input {program.input_names.get(name, name)!r}"
        sizes = program.shape(val, what)
        if any(s.bound == 0 for s in sizes) and placeholders[name].users:  # an empty cat operand is read by none
            raise XnnquantError(f"{what} has no elements (shape {tuple(s.bound for s in sizes)}): the runtime "
                                "cannot run a value of size 0; expected every dim >= 1")
        specs.append(TensorIO(program.input_names.get(name, name), tuple(s.bound for s in sizes), _dtype(val),
                              declared_dim_order(val), _dynamic_dims(program, sizes)))
    return specs


def output_specs(program: AtenProgram) -> list[TensorIO]:
    """The program's outputs as the method declares them."""
    from .lowering.walk import _dynamic_dims

    specs = []
    for i, item in enumerate(program.user_outputs()):
        val = getattr(item, "meta", {}).get("val")
        if not hasattr(val, "shape"):
            raise XnnquantError(f"output {i} is not a tensor (got {type(val).__name__}): a program returns tensors")
        sizes = program.shape(val, f"output {i}")
        specs.append(TensorIO(f"output {i}", tuple(s.bound for s in sizes), _dtype(val), declared_dim_order(val),
                              _dynamic_dims(program, sizes)))
    return specs


def _number_dtype(number: Any, t: Any, wide: bool, name: str) -> Any:
    """The dtype of the 0-dim tensor standing for ``number`` (``_Emitter.numbers_as_tensors``)."""
    import torch

    if isinstance(number, bool):
        return torch.bool
    if t in (torch.float16, torch.bfloat16):
        raise XnnquantError(f"argument {name!r} is the number {number!r} with {t} operands: torch rounds such a "
                            "number to the operands' type in some kernels and not in others, so a portable kernel "
                            "could compute another result; expected float32 operands (or the number as a tensor "
                            "of their type)")
    if not isinstance(number, (int, float)):
        raise XnnquantError(f"argument {name!r} is {number!r} ({type(number).__name__}) where the op takes a tensor: "
                            "expected a tensor, or a bool, int or float")
    integral = t is not None and not t.is_floating_point and not t.is_complex and t is not torch.bool
    if isinstance(number, int) and integral and torch.iinfo(t).min <= number <= torch.iinfo(t).max:
        return t
    if isinstance(number, int) and not wide and (t is None or not t.is_floating_point):
        return torch.int64
    return torch.float64 if wide else torch.float32


class _Emitter:
    def __init__(self, program: AtenProgram, method: MethodBuilder) -> None:
        self.program = program
        self.method = method
        self.sizes: dict[Any, Any] = {}  # size expression -> its value (``sizes.computed``)
        self.values: dict[Any, Any] = {}  # ATen node -> value index (or tuple of them)
        self.constants: dict[str, int] = {}
        self.tables: dict[int, tuple[int, int, int]] = {}  # id(QuantizedEmbedding) -> (codes, scales, guard)
        self.copies: dict[tuple[int, tuple[int, ...]], int] = {}  # (value, dim order) -> its copy in that order
        self.inplace: dict[Any, Any] = {}  # index_put node -> the state placeholder it writes in place

    def tensor_of(self, spec: TensorIO) -> int:
        return self.method.tensor(spec.dtype, spec.shape, dim_order=spec.dim_order, dynamic=bool(spec.dynamic))

    def operand(self, node: Any) -> Any:
        """What a portable kernel is given for ``node``: a value index, or a size's traced int."""
        if node in self.values:
            return self.values[node]
        if self.program.is_constant(node):
            if node.name not in self.constants:
                tensor = self.program.constants[node.name]
                if tensor.device.type != "meta":
                    data = tensor.detach().contiguous().numpy()
                elif str(tensor.dtype) == "torch.float32":  # a streaming export's: read from its file now
                    data = self.program.array(node.name, f"{node.name!r}, which the portable kernels read")
                else:
                    raise XnnquantError(f"the portable kernels read {node.name!r} ({tensor.dtype}), which a streaming "
                                        "export holds on the meta device: only float32 tensors are read from the "
                                        "weight file; export the module with its weights in memory")
                self.constants[node.name] = self.method.tensor(_dtype(tensor), tuple(data.shape), data=data)
            return self.constants[node.name]
        val = node.meta.get("val")
        if isinstance(val, (int, float, bool)):
            return val
        if type(val).__name__ == "SymInt":
            size: Size = self.program.size(val, f"size {node.name}")
            if size.expr is None:
                return size.bound
            self.values[node] = self.size(node, size)
            return self.values[node]
        raise XnnquantError(f"no value for {node.name}: it is neither computed before nor a constant")

    def size(self, node: Any, size: Size) -> Any:
        """A dynamic size as a ``RuntimeInt``: its ``Int`` value, computed by the kernels that
        read it from a tensor or do its arithmetic (module docstring)."""
        import torch

        from ..pte.portable import RuntimeInt

        if node.target is torch.ops.aten.sym_size.int and node.args[0] not in self.values:
            from .sizes import computed  # a value a delegate computes later: its size from the inputs'

            return computed(size.expr, self.program, self.method, self.operand, self.sizes)

        m = self.method
        hint = node.meta["val"].node.hint
        out = m.int_value(int(hint) if hint is not None else size.bound)  # rewritten when the program runs
        if node.target is torch.ops.aten.sym_size.int:
            m.kernel_call("aten::sym_size", "int", [self.operand(node.args[0]), m.int_value(int(node.args[1])), out])
            return RuntimeInt(out, size.bound)
        if node.target in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            m.kernel_call("aten::_local_scalar_dense", "", [self.operand(node.args[0]), out])
            return RuntimeInt(out, size.bound)
        kernel = SIZE_KERNELS.get(getattr(node.target, "__name__", ""))
        if kernel is None:
            raise UnsupportedConfigError(f"{node.name} computes a dynamic size with {node.target}, which ExecuTorch's "
                                         "portable kernels do not compute")
        args = []
        for arg in node.args:
            value = self.operand(arg) if hasattr(arg, "op") else arg
            args.append(value.index if isinstance(value, RuntimeInt) else m.int_value(int(value)))
        name, _, overload = kernel.partition(".")
        m.kernel_call(f"executorch_prim::{name}", overload, [*args, out])
        return RuntimeInt(out, size.bound)

    def portable(self, node: Any) -> None:
        import torch

        from ..pte.portable import portable_call
        from .passes.embeddings import QuantizedEmbedding

        if isinstance(node.target, QuantizedEmbedding):
            self.values[node] = self.quantized_embedding(node, node.target)
            return
        if node in self.inplace:
            self.values[node] = self.write_in_place(node)
            return
        args = torch.fx.node.map_arg(node.args, self.operand)
        kwargs = torch.fx.node.map_arg(node.kwargs, self.operand)
        try:
            args, kwargs = self.contiguous_operands(node, *self.numbers_as_tensors(node, args, kwargs))
            self.values[node] = portable_call(self.method, node.target, args, kwargs, out=self.results(node))
        except XnnquantError as exc:
            where = AtenProgram.module_path(node) or "<top level>"
            raise UnsupportedConfigError(f"{node.target} (node {node.name}, module {where}) runs on ExecuTorch's "
                                         f"portable kernels, and cannot: {exc}") from None

    def write_in_place(self, node: Any) -> int:
        """``index_put(old, indices, values)`` as ``aten::index_put_`` on the state ``old`` holds
        (module docstring); returns the state's value index."""
        m = self.method
        state = self.operand(node.args[0])
        indices = m.optional_tensor_list([None if i is None else self.relaid(self.operand(i))
                                          for i in node.args[1]])
        values = self.relaid(self.operand(node.args[2]))
        m.kernel_call("aten::index_put_", "", [state, indices, values, m.bool_value(False), state])
        return int(state)

    def write_back(self) -> None:
        """After the last instruction: each state whose new value was not written in place
        takes it (``aten::copy_``)."""
        m = self.method
        for placeholder, value in self.program.state_updates():
            state, new = self.values[placeholder], self.operand(value)
            if new != state:
                m.kernel_call("aten::copy_", "", [state, self.relaid(new), m.bool_value(False), state])

    def contiguous_operands(self, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                            ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with every tensor in another dim order than contiguous (a
        channels-last input or delegate output) copied contiguous (``relaid``): a portable
        node reads and writes contiguous tensors.  Measured on 1.4.1: its kernels refuse
        operands of mixed dim orders (0x12), ``permute_copy`` and ``expand_copy`` refuse a
        channels-last input, and ``unsqueeze_copy`` of one into a contiguous out ran and gave
        118 of 120 elements wrong."""
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return args, kwargs
        kinds = {a.name: str(a.type) for a in schema.arguments}
        positional = [a.name for a in schema.arguments if not a.kwarg_only]

        def fixed(name: str, value: Any) -> Any:
            kind = kinds.get(name, "")
            if "Tensor" not in kind or value is None:
                return value
            if isinstance(value, (list, tuple)):
                return type(value)(None if v is None else self.relaid(v) for v in value)
            return self.relaid(value)

        return (tuple(fixed(name, v) for name, v in zip(positional, args)),
                {name: fixed(name, v) for name, v in kwargs.items()})

    def relaid(self, index: int, order: tuple[int, ...] | None = None) -> int:
        """Tensor ``index`` in dim order ``order`` (None: contiguous), copied by
        ``dim_order_ops::_clone_dim_order`` when it is in another (once per tensor and order)."""
        from ..pte.portable import portable_call
        from ..pte.quantized import kernel
        from ..pte.values import ShapeDynamism, Tensor

        value = self.method.values[index]
        if not isinstance(value, Tensor):
            return index
        order = tuple(range(len(value.sizes))) if order is None else tuple(order)
        if tuple(value.dim_order) == order:
            return index
        key = (index, order)
        if key not in self.copies:
            out = self.method.tensor(value.scalar_type, value.sizes, dim_order=order,
                                     dynamic=value.dynamism == ShapeDynamism.DYNAMIC_BOUND)
            portable_call(self.method, kernel("_clone_dim_order.out"), (index,), {"dim_order": list(order)}, out=out)
            self.copies[key] = out
        return self.copies[key]

    def numbers_as_tensors(self, node: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with a number where ``node``'s op takes a tensor made a 0-dim
        tensor.  torch traces ``x + 1`` as ``add.Tensor(x, 1)``, and a kernel's tensor
        arguments are value indices: the number would name another value of the method (a
        wrong program: ``1`` is the method's second value).  The tensor holds the number in
        the type torch computes the op in (the operands' promoted type ``t``), so that the
        kernel, which promotes its operands' types, computes in it too:

            number   t                          0-dim tensor
            bool     any                        bool
            int      an int type that holds it  t
            int      float64 (or a float64      float64
            float    result)                    float64
            int      float32                    float32
            float    float32, an int type,      float32
                     bool, none
            int      bool, none, too narrow     int64
            any      float16, bfloat16          refused: torch rounds the number to t in
                                                some kernels and not in others (measured:
                                                bf16 + 3001 rounds it, bf16 * 0.1 does
                                                not), so no one type matches every op

        A dynamic size (a ``RuntimeInt``) becomes one at run time (``aten::scalar_tensor``)."""
        import numpy as np
        import torch

        from ..pte.portable import RuntimeInt, portable_call

        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return tuple(args), dict(kwargs)
        slots = {a.name for a in schema.arguments if str(a.type) in ("Tensor", "Optional[Tensor]")}
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        given = {**dict(zip(positional, node.args)), **node.kwargs}
        mapped = {**dict(zip(positional, args)), **kwargs}
        numbers = [name for name in slots if name in given and mapped[name] is not None
                   and not hasattr(getattr(given[name], "meta", {}).get("val"), "shape")]
        if not numbers:
            return tuple(args), dict(kwargs)
        t: Any = None  # the tensor operands' promoted type
        for item in given.values():
            for operand in item if isinstance(item, (list, tuple)) else (item,):
                val: Any = getattr(operand, "meta", {}).get("val")
                if hasattr(val, "shape"):
                    t = val.dtype if t is None else torch.promote_types(t, val.dtype)
        wide = torch.float64 in (t, getattr(node.meta.get("val"), "dtype", None))
        for name in numbers:
            value = mapped[name]
            dtype = _number_dtype(value.bound if isinstance(value, RuntimeInt) else value, t, wide, name)
            if isinstance(value, RuntimeInt):
                mapped[name] = portable_call(self.method, torch.ops.aten.scalar_tensor.default, (value,),
                                             {"dtype": dtype})
            else:
                kind = str(dtype).removeprefix("torch.")
                mapped[name] = self.method.tensor(kind, (), data=np.array(value, dtype=kind))
        return tuple(mapped[name] for name in positional[:len(args)]), \
            {name: mapped[name] for name in kwargs}

    def quantized_embedding(self, node: Any, table: Any) -> int:
        """A lookup in a quantized table (a ``QuantizedEmbedding``): its codes, scales and guard as constants (once per
        table), then the kernel calls (``pte.quantized.embedding_call``)."""
        import numpy as np

        from ..pte.quantized import embedding_call

        m = self.method
        if id(table) not in self.tables:
            codes, scales = table.weight(), table.scales()
            guard = np.zeros((table.shape[0], 1), np.bool_)
            self.tables[id(table)] = (m.tensor(codes.dtype, codes.shape, data=codes),
                                      m.tensor(scales.dtype, scales.shape, data=scales),
                                      m.tensor(np.bool_, guard.shape, data=guard))
        codes_index, scales_index, guard_index = self.tables[id(table)]
        low, high = table.scheme.quant_range
        out = self.results(node)
        assert isinstance(out, int)
        return embedding_call(m, table.scheme.bits, codes_index, scales_index, self.operand(node.args[0]), out,
                              quant_min=low, quant_max=high, guard=guard_index)

    def results(self, node: Any) -> int | list[int]:
        """The out tensors of a portable node, as torch traced its results (dtype; sizes at the
        bounds of their dynamic dims, then bounded), contiguous (``contiguous_operands``)."""
        from .lowering.walk import _dynamic_dims

        vals = node.meta.get("val")
        several = isinstance(vals, (tuple, list))
        outs = []
        for k, val in enumerate(vals if several else (vals,)):
            sizes = self.program.shape(val, f"result {k} of {node.name}")
            spec = TensorIO(node.name, tuple(s.bound for s in sizes), _dtype(val), tuple(range(len(sizes))),
                            _dynamic_dims(self.program, sizes))
            outs.append(self.tensor_of(spec))
        return outs if several else outs[0]

    def delegate(self, lowered: Lowered, payload: NamedPayload) -> None:
        """A delegate call: the tensors of its input nodes in, new tensors for its output nodes;
        ``payload``'s constants become the program's named data."""
        m = self.method
        for key, blob in payload.named:
            m.program.add_named_data(key, blob)
        if len(lowered.inputs) != len(lowered.input_nodes):
            raise XnnquantError(f"a delegate declares {len(lowered.inputs)} inputs for {len(lowered.input_nodes)} "
                                "input nodes (its lowering refused one); expected one each")
        # each in the dim order the delegate declares (XNNPACK fails a delegate given another: 0x1)
        inputs = [self.relaid(self.operand(node), spec.dim_order)
                  for node, spec in zip(lowered.input_nodes, lowered.inputs)]
        outputs = [self.tensor_of(spec) for spec in lowered.outputs]
        for node, index in zip(lowered.output_nodes, outputs):
            self.values[node] = index
        m.delegate_call(m.delegate(XNNPACK_BACKEND_ID, payload.payload), inputs, outputs)


def emit(program: AtenProgram, delegates: Sequence[Lowered | None], payloads: Sequence[NamedPayload | None],
         inputs: Sequence[TensorIO], outputs: Sequence[TensorIO]) -> ProgramBuilder:
    """The ``ProgramBuilder`` of the partitioned ``program`` (module docstring); ``delegates[k]``
    is the delegate of phase k, ``payloads[k]`` its payload and named constants."""
    builder = ProgramBuilder()
    emitter = _Emitter(program, builder.method("forward"))
    m = emitter.method
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name, spec in zip(program.inputs, inputs):
        emitter.values[placeholders[name]] = m.input(emitter.tensor_of(spec))
    for name, initial in program.state.items():
        emitter.values[placeholders[name]] = m.state(initial.detach().contiguous().numpy())
    emitter.inplace = inplace_writes(program)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    last = max([n.meta.get(PHASE, 0) for n in calls] + [len(delegates) - 1], default=0)
    for phase in range(last + 1):
        for node in calls:
            part = node.meta.get(PARTITION, PORTABLE)
            if part != PORTABLE or node.meta.get(PHASE, 0) != phase:
                continue
            if node.target is operator.getitem:
                emitter.values[node] = emitter.values[node.args[0]][node.args[1]]
            else:
                emitter.portable(node)
        lowered = delegates[phase] if phase < len(delegates) else None
        payload = payloads[phase] if phase < len(payloads) else None
        if lowered is not None:
            assert payload is not None, f"delegate {phase} has no payload"
            emitter.delegate(lowered, payload)
    states = {emitter.values[placeholders[name]] for name in program.state}
    used: set[int] = set()
    for item in program.user_outputs():
        index = emitter.operand(item)
        if index in used or index in m.inputs or index in emitter.constants.values() or index in states:
            index = emitter.values[item] = _copy(m, index)  # an output is written once, by its own value
        used.add(index)
        m.output(index)
    if program.state:  # after the outputs' copies: they read the values of this call
        emitter.write_back()
    return builder


def inplace_writes(program: AtenProgram) -> dict[Any, Any]:
    """The ``index_put`` nodes that write into a state in place (``_Emitter.write_in_place``):
    node -> the state placeholder.  A write qualifies when it runs on the portable kernels,
    its input is a state or such a write of one, ``accumulate`` is false, it has one index
    (1-D, integer) and ``values`` of the input's shape at every other dim, and every other
    reader of its input (but sizes, which do not change) runs before it, as ``emit`` orders
    the program (portable nodes of a phase in graph order, then that phase's delegate)."""
    import torch

    order = {node: k for k, node in enumerate(program.graph.nodes)}

    def position(node: Any) -> tuple[float, int, int]:
        part = node.meta.get(PARTITION, PORTABLE)
        if node.op == "output":
            return (float("inf"), 0, 0)
        if part >= 0:
            return (node.meta.get(PHASE, 0), 1, 0)
        return (node.meta.get(PHASE, 0), 0, order[node])

    writes: dict[Any, Any] = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.index_put.default:
            continue
        old = node.args[0]
        state = old if program.is_state(old) else writes.get(old)
        if state is None or node.meta.get(PARTITION, PORTABLE) != PORTABLE:
            continue
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        indexed = [(d, i) for d, i in enumerate(node.args[1]) if i is not None]
        if accumulate or len(indexed) != 1:
            continue
        dim, index = indexed[0]
        have, want, ids = (getattr(n.meta.get("val"), "shape", None) for n in (node.args[2], old, index))
        index_dtype = getattr(index.meta.get("val"), "dtype", None)
        if have is None or want is None or ids is None or len(ids) != 1 or \
                index_dtype not in (torch.int64, torch.int32) or len(have) != len(want) or \
                node.args[2].meta["val"].dtype != old.meta["val"].dtype or \
                any(str(h) != str(ids[0] if d == dim else w) for d, (h, w) in enumerate(zip(have, want))):
            continue
        readers = [u for u in old.users if u is not node and not (u.op == "call_function" and _reads_size_only(u))]
        if all(position(u) < position(node) for u in readers):
            writes[node] = state
    return writes


def _reads_size_only(node: Any) -> bool:
    """True for a node that reads only its input's sizes (``sym_size``)."""
    import torch

    return node.target is torch.ops.aten.sym_size.int


def _copy(method: MethodBuilder, index: int) -> int:
    import torch

    from ..pte.portable import portable_call

    result = portable_call(method, torch.ops.aten.clone.default, (index,))
    assert isinstance(result, int)
    return result

