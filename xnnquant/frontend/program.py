"""``AtenProgram``: the exported program as passes and lowerings see it.

It holds a copy of the ``torch.export`` graph (passes rewrite it freely; the caller's
program is never changed) and the tensors its placeholders stand for:

* ``constants``: placeholder name -> tensor, for parameters, buffers and lifted constants,
  and for the tensors passes make (a batch-norm-folded filter, a folded constant);
* ``origins``: placeholder name -> the module's own name of the tensor it came from
  (``"layer.0.weight"``), which names report rows and refusals;
* ``stored``: placeholder name -> the name to read its values by in a streaming export's
  weight file (only the module's own parameters and buffers: a tensor a pass computed
  from them has none; a tied tensor: the name the file holds, ``find_tied``);
* ``inputs``: the user inputs' placeholder names, in order (``input_names``: as the
  module's program names them);
* ``state``: placeholder name -> the values a buffer the module mutates holds when it is
  exported (a KV cache): method state of the ``.pte``, read and written by the program,
  never a constant (no pass folds it, no delegate embeds it).  The graph's first
  ``len(mutated)`` outputs are the buffers' values after the call (torch.export's
  buffer mutations), ``mutated`` naming each one's state placeholder; ``user_outputs``
  are the rest;
* ``ranges``: the range of each dynamic size symbol (torch.export's ``range_constraints``,
  the unbacked sizes a program reads from tensors, ``tensor.item()``, among them).

Dynamic sizes.  A dim torch.export traced as symbolic (``dynamic_shapes=``) is a
``torch.SymInt``; ``size(d)`` gives ``Size(bound, expr)``: the largest value its range
allows (the size the graph's values and the program's memory are planned at) and its
sympy expression (``s27``, ``s27 - 1``, ``3*s27``).  A symbol without an upper bound is
refused: ExecuTorch plans memory at the bound.

``module_path(node)`` is the module a node was traced in (``nn_module_stack``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import UnsupportedConfigError, XnnquantError
from .streaming import WeightFile, absent_buffer, meta_tensor_refusal


def _buffer_name(origin: str, tensor: Any, named: dict[str, Any]) -> str:
    """The name of the buffer a lifted constant ``origin`` is the tensor of (torch.export
    lifts a buffer reached through a plain Python object as a constant), else ``origin``."""
    if ".lifted_tensor_" not in f".{origin}" or tensor.device.type == "meta":
        return origin
    return next((name for name, t in named.items() if ".lifted_tensor_" not in f".{name}"
                 and t.device == tensor.device and t.data_ptr() == tensor.data_ptr() and t.shape == tensor.shape),
                origin)


class Size(NamedTuple):
    """One dim: its largest value, and its sympy expression when it is dynamic (else None)."""

    bound: int
    expr: Any = None


@dataclass
class AtenProgram:
    """A copy of an exported program's graph and its tensors (see the module docstring)."""

    graph: Any  # torch.fx.Graph
    constants: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    stored: dict[str, str] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    weight_file: WeightFile | None = None
    #: placeholder name -> the user input's name in the module's program (the copy renames
    #: a few, e.g. ``input`` -> ``input_1``)
    input_names: dict[str, str] = field(default_factory=dict)
    ranges: dict[Any, Any] = field(default_factory=dict)
    #: size symbol (``"s27"``) -> the name the user gave its ``torch.export.Dim`` (``"seq"``)
    dim_names: dict[str, str] = field(default_factory=dict)
    #: placeholder name -> initial values of a buffer the program mutates (module docstring)
    state: dict[str, Any] = field(default_factory=dict)
    #: state placeholder names, in the order of the graph's first outputs (their final values)
    mutated: list[str] = field(default_factory=list)
    #: state placeholder name -> the module's own tensor (what its eager forward updates)
    live: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, program: Any, weight_file: WeightFile | None = None, weight_prefix: str = "") -> AtenProgram:
        """The ``AtenProgram`` of a ``torch.export.ExportedProgram`` (its graph copied).
        ``weight_prefix``: the path of the module whose names the weight file holds (a wrapper's
        ``"model."``: the file names ``"lm_head.weight"`` what the program calls
        ``"model.lm_head.weight"``)."""
        import torch

        from .functional import _buffers, buffer_updates, functionalize, inline_grad_wrappers

        sig = program.graph_signature
        updates = buffer_updates(program)  # in-place buffer updates torch's decompositions did not make functional
        mutations = [spec for spec in sig.output_specs if spec.kind.name == "BUFFER_MUTATION"]
        assert all(spec.kind.name == "BUFFER_MUTATION" for spec in sig.output_specs[:len(mutations)]), \
            "torch.export lists the buffer updates before the user outputs"
        known = ("BUFFER_MUTATION", "USER_OUTPUT", "USER_INPUT_MUTATION")  # an input's new value: an output
        if any(spec.kind.name not in known for spec in sig.output_specs):
            kinds = sorted({spec.kind.name for spec in sig.output_specs} - set(known))
            raise UnsupportedConfigError(f"the program's outputs include {', '.join(kinds)}: expected the module's "
                                         "outputs and its buffer updates only")
        graph = torch.fx.Graph()
        copied: dict[Any, Any] = {}
        results, _ = graph.graph_copy(program.graph, copied, return_output_node=True)
        graph.output(results)
        inline_grad_wrappers(graph, program.graph_module)
        updated: list[tuple[str, Any]] = []
        if updates:
            held = _buffers(program)
            buffer_of = {copied[n]: copied[n].name for n in program.graph.nodes
                         if n.op == "placeholder" and n.name in held}
            updated = functionalize(graph, [copied[n] for n in updates], buffer_of)
            output = next(n for n in graph.nodes if n.op == "output")
            items = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
            output.args = ((*[value for _, value in updated], *items),)
        named = {**program.state_dict, **getattr(program, "constants", {})}
        sources = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                   **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
        out = cls(graph, weight_file=weight_file, ranges=dict(getattr(program, "range_constraints", {}) or {}))
        for old in program.graph.nodes:  # the copy may rename a node (``input`` -> ``input_1``)
            if old.op != "placeholder":
                continue
            name = copied[old].name
            if old.name in sources:
                origin = sources[old.name]
                if any(spec.target == origin for spec in mutations) or any(b == name for b, _ in updated):
                    live = named[origin]
                    out.state[name] = live.detach().clone()  # the values when exported
                    out.live[name] = live
                    origin = _buffer_name(origin, live, named)
                else:
                    out.constants[name] = named[origin]
                out.origins[name] = origin
                out.stored[name] = origin.removeprefix(weight_prefix)
            elif old.name in sig.user_inputs:
                out.inputs.append(name)
                out.input_names[name] = old.name
            else:
                raise UnsupportedConfigError(f"placeholder {old.name!r} is neither an input nor a weight")
        by_origin = {sources[old.name]: copied[old].name for old in program.graph.nodes
                     if old.op == "placeholder" and copied[old].name in out.state}
        out.mutated = [by_origin[spec.target] for spec in mutations] + [name for name, _ in updated]
        return out

    def user_outputs(self) -> list[Any]:
        """The items of the graph's output node that the module returns (the buffers' final
        values, the first ``len(mutated)``, left out)."""
        output = next(n for n in self.graph.nodes if n.op == "output")
        items = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
        return list(items[len(self.mutated):])

    def state_updates(self) -> list[tuple[Any, Any]]:
        """(state placeholder node, the node of its value after the call), one per mutated buffer."""
        output = next(n for n in self.graph.nodes if n.op == "output")
        items = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        return [(placeholders[name], item) for name, item in zip(self.mutated, items)]

    def is_state(self, node: Any) -> bool:
        """True for a placeholder standing for method state (a buffer the program mutates)."""
        return getattr(node, "op", None) == "placeholder" and node.name in self.state

    # ------------------------------------------------------------------ sizes

    def name_dims(self, spec: Any, module: Any) -> None:
        """Learn the names of the ``torch.export.Dim``s of ``spec`` (torch.export's
        ``dynamic_shapes``: per input a ``{dim: Dim}`` dict or a per-dim sequence, the inputs
        given as a sequence or by ``forward``'s argument names) from the sizes they became."""
        import inspect

        if spec is None:
            return
        if isinstance(spec, dict) and callable(getattr(module, "forward", None)):
            params = list(inspect.signature(module.forward).parameters)
            spec = [spec.get(name) for name in params[: len(self.inputs)]]
        if not isinstance(spec, (list, tuple)):
            return
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        for name, dims in zip(self.inputs, spec):
            shape = getattr(placeholders[name].meta.get("val"), "shape", ())
            items = dims.items() if isinstance(dims, dict) else enumerate(dims or ())
            for d, dim in items:
                if dim is not None and hasattr(dim, "__name__") and int(d) < len(shape) and \
                        not isinstance(shape[int(d)], int):
                    self.dim_names.setdefault(str(shape[int(d)].node.expr), str(dim.__name__))

    def size(self, d: Any, what: str) -> Size:
        """``Size`` of dim ``d`` (an int or a ``torch.SymInt``) of ``what``."""
        if isinstance(d, int):
            return Size(int(d))
        from torch.utils._sympy.value_ranges import bound_sympy

        expr = cancelled(d.node.expr)
        if expr.is_number:
            fixed = [s for s in getattr(d.node._expr, "free_symbols", ()) if s in self.ranges]
            if fixed:  # a guard added after torch.export fixed a dynamic dim (lowerings read none)
                raise XnnquantError(f"{what}: dynamic dim {self.dim_names.get(str(fixed[0]), fixed[0])} was fixed at "
                                    f"its traced size while exporting, so the program would take that size only: a "
                                    "fault of the export; please report it")
            return Size(int(expr))
        upper = bound_sympy(expr, self.ranges).upper
        try:
            bound = int(upper)  # torch's "no bound" (int_oo) is no integer
        except (TypeError, ValueError, OverflowError, AttributeError):
            bound = -1
        if bound < 0:
            raise XnnquantError(
                f"{what} has a dynamic dim {expr} with no upper bound: ExecuTorch plans memory at the bound; "
                "give its torch.export.Dim a max (Dim('seq', max=512))")
        if bound >= 2**31:
            raise XnnquantError(
                f"{what} has a dynamic dim {expr} with upper bound {bound}: ExecuTorch holds a size in 32 bits; "
                f"expected a max of at most {2**31 - 1} (and one whose planned memory fits)")
        return Size(bound, expr)

    def shape(self, val: Any, what: str) -> tuple[Size, ...]:
        """The ``Size`` of every dim of ``val`` (a tensor or fake tensor)."""
        shape = getattr(val, "shape", None)
        if shape is None:
            raise XnnquantError(f"{what} is not a tensor: got {type(val).__name__}")
        return tuple(self.size(d, what) for d in shape)

    # ------------------------------------------------------------------ nodes

    def is_constant(self, node: Any) -> bool:
        """True for a placeholder that stands for a tensor (not a user input)."""
        return getattr(node, "op", None) == "placeholder" and node.name in self.constants

    def add_constant(self, tensor: Any, name: str, origin: str | None = None) -> Any:
        """A new placeholder standing for ``tensor`` (a pass's result), before every other node."""
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            node = self.graph.placeholder(self._fresh(name))
        node.meta["val"] = tensor
        self.constants[node.name] = tensor
        if origin is not None:
            self.origins[node.name] = origin
        return node

    def _fresh(self, name: str) -> str:
        taken = {n.name for n in self.graph.nodes}
        candidate, k = name, 1
        while candidate in taken:
            k += 1
            candidate = f"{name}_{k}"
        return candidate

    @staticmethod
    def module_path(node: Any) -> str:
        """The module ``node`` was traced in (``nn_module_stack``), '' at the top level."""
        stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
        return str(list(stack.values())[-1][0]) if stack else ""

    def layer_path(self, weight: str, node: Any) -> str:
        """The layer a filter belongs to, as report rows and calibration statistics name it:
        the module's name of the tensor placeholder ``weight`` stands for, without
        ``.weight`` ('' for the exported module's own ``weight``), or, for a tensor with no
        name of its own, the module ``node`` (the layer's ATen node) was traced in."""
        name = self.origins.get(weight)
        if name is None:
            return self.module_path(node)
        if name == "weight":  # the exported module itself is the layer
            return ""
        return name[: -len(".weight")] if name.endswith(".weight") else name

    def origin(self, node: Any) -> str | None:
        """The module's own name of the tensor a constant placeholder stands for."""
        return self.origins.get(getattr(node, "name", ""))

    # ----------------------------------------------------------------- values

    def find_tied(self, module: Any, weight_prefix: str = "") -> None:
        """Read a tied tensor by the name the weight file holds it under.  One parameter of
        ``module`` known by several names (a language model's output layer tied to its token
        table) is saved once, under one of them, and torch.export may name it by another."""
        if self.weight_file is None:
            return
        held = self.weight_file.file.tensors
        names: dict[int, list[str]] = {}
        for name, tensor in (*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)):
            names.setdefault(id(tensor), []).append(name.removeprefix(weight_prefix))
        by_name = {name: group for group in names.values() for name in group}
        for placeholder, name in self.stored.items():
            if name not in held:
                self.stored[placeholder] = next((n for n in by_name.get(name, ()) if n in held), name)

    def stored_tensor(self, placeholder: str) -> Any:
        """The values of a streaming export's meta constant ``placeholder``, read from the
        weight file as the module's dtype (a float tensor read as float32, checked finite), or
        None when the file does not hold it.  A tensor the file holds with another shape, or a
        float one stored as integers or the other way round, is refused by ``WeightFile``'s
        checks, naming the tensor."""
        import torch

        tensor = self.constants[placeholder] if placeholder in self.constants else self.state[placeholder]
        name = self.stored.get(placeholder)
        file = self.weight_file
        if file is None or name is None or name not in file.file.tensors:
            return None
        shape = tuple(int(d) for d in tensor.shape)
        what = f"the module's {self.origins.get(placeholder, placeholder)!r} ({tensor.dtype})"
        if tensor.dtype.is_floating_point:
            values = file.array(name, shape, what)
        else:
            info = file.check(name, shape, what, floating=False)
            values = np.array(file.file.read(info.name))
        values = np.ascontiguousarray(values)
        if not values.flags.writeable:  # a mapped file's view, which torch warns of: one tensor's copy
            values = values.copy()
        return torch.from_numpy(values).to(tensor.dtype)

    def array(self, placeholder: str, what: str) -> np.ndarray:
        """The float32 values of the constant ``placeholder`` stands for (read from the weight
        file for a streaming export's meta tensors)."""
        import torch

        tensor = self.constants[placeholder]
        if tensor.device.type != "meta":
            return tensor.detach().to(torch.float32).contiguous().numpy()
        name = self.stored.get(placeholder)
        if self.weight_file is None:
            raise XnnquantError(f"{what} is on the meta device: its values are needed here (pass state_dict= with a "
                                "safetensors file holding the module's tensors)")
        if name is None:
            raise XnnquantError(meta_tensor_refusal(what, self.origins.get(placeholder), self.weight_file))
        if name not in self.weight_file.file.tensors:
            raise XnnquantError(f"{what}: " + absent_buffer(name, self.weight_file))
        return self.weight_file.array(name, tuple(int(d) for d in tensor.shape), what)


def cancelled(expr: Any) -> Any:
    """``expr`` with its quotients of sizes cancelled: torch infers a view's -1 as
    ``(32*s - 32)/(16*s - 16)``, which is 2 at every size."""
    import sympy

    if not isinstance(expr, sympy.Basic) or expr.is_number or not any(p.exp.is_negative for p in expr.atoms(sympy.Pow)):
        return expr
    simpler = sympy.cancel(expr)
    return simpler if simpler.is_number else expr


def node_dtype(node: Any) -> str:
    """The dtype of the value an FX node computes (``"float32"``, ``"int64"``, ...; ``""`` for a
    node without a tensor value)."""
    return str(getattr(node.meta.get("val"), "dtype", "")).removeprefix("torch.")


def has_no_elements(node: Any) -> bool:
    """True for a value with no elements (a static dim of 0)."""
    return any(isinstance(d, int) and d == 0 for d in getattr(node.meta.get("val"), "shape", ()))
