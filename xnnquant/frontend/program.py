"""``AtenProgram``: the exported program as passes and lowerings see it.

It holds a copy of the ``torch.export`` graph (passes rewrite it freely; the caller's
program is never changed) and the tensors its placeholders stand for:

* ``constants``: placeholder name -> tensor, for parameters, buffers and lifted constants,
  and for the tensors passes make (a batch-norm-folded filter, a folded constant);
* ``origins``: placeholder name -> the module's own name of the tensor it came from
  (``"layer.0.weight"``), which names report rows and refusals;
* ``stored``: placeholder name -> the name to read its values by in a streaming export's
  weight file (only the module's own parameters and buffers: a tensor a pass computed
  from them has none);
* ``inputs``: the user inputs' placeholder names, in order (``input_names``: as the
  module's program names them).

``module_path(node)`` is the module a node was traced in (``nn_module_stack``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UnsupportedConfigError, XnnquantError
from .streaming import WeightFile, meta_tensor_refusal


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

    @classmethod
    def of(cls, program: Any, weight_file: WeightFile | None = None) -> AtenProgram:
        """The ``AtenProgram`` of a ``torch.export.ExportedProgram`` (its graph copied)."""
        import torch

        sig = program.graph_signature
        if getattr(sig, "buffers_to_mutate", None):
            raise UnsupportedConfigError(
                f"the module mutates buffers ({', '.join(sorted(sig.buffers_to_mutate.values()))}): "
                "a delegate cannot hold state; export the module in eval mode without in-place buffer updates")
        graph = torch.fx.Graph()
        copied: dict[Any, Any] = {}
        results, _ = graph.graph_copy(program.graph, copied, return_output_node=True)
        graph.output(results)
        named = {**program.state_dict, **getattr(program, "constants", {})}
        sources = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                   **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
        out = cls(graph, weight_file=weight_file)
        for old in program.graph.nodes:  # the copy may rename a node (``input`` -> ``input_1``)
            if old.op != "placeholder":
                continue
            name = copied[old].name
            if old.name in sources:
                origin = sources[old.name]
                out.constants[name] = named[origin]
                out.origins[name] = origin
                out.stored[name] = origin
            elif old.name in sig.user_inputs:
                out.inputs.append(name)
                out.input_names[name] = old.name
            else:
                raise UnsupportedConfigError(f"placeholder {old.name!r} is neither an input nor a weight")
        return out

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

    def origin(self, node: Any) -> str | None:
        """The module's own name of the tensor a constant placeholder stands for."""
        return self.origins.get(getattr(node, "name", ""))

    # ----------------------------------------------------------------- values

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
            raise XnnquantError(meta_tensor_refusal(what, self.origins.get(placeholder)))
        return self.weight_file.array(name, tuple(int(d) for d in tensor.shape), what)
