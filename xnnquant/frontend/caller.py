"""What an export owes its caller: it never writes into the caller's tensors or module.

Exporting runs the module's own forward in two places, the self-check (``selfcheck.py``)
and calibration on the module itself (``eager.py``).  A forward may write into what it is
given (``x.mul_(2)``) or into its buffers (a running statistic, a cache); those runs get
copies of the inputs (``copies``), and every buffer the forward changed is put back as it
was, object and values (``buffers_kept``).  A forward that writes into a parameter is
refused before anything runs (``refuse_parameter_writes``): a program's weights are
constants.

An input the forward writes into is carried as ExecuTorch carries it
(``exir/passes/insert_write_back_for_buffers_pass.py``, ``exir/emit/_emit_program.py``):
its new value is one more output of the program, before the module's own outputs, one
per written input in the order of ``mutated_inputs``; the runtime copies each input into
its planned memory, so running the program leaves the caller's tensor as it was (measured
on ExecuTorch 1.4.1's own flow: ``forward(x)`` with ``x.mul_(2)`` returns ``(2x, y)``);
``name_mutated_inputs`` names those outputs in the ``Exported``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedConfigError

if TYPE_CHECKING:
    from .exported import Exported


def copies(inputs: Any) -> tuple[Any, ...]:
    """Each tensor of ``inputs`` as a new tensor of the same values, strides kept (what a
    forward may write into); other values as they are."""
    import torch

    return tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs)


@contextmanager
def buffers_kept(module: Any = None, tensors: Iterable[Any] = ()) -> Iterator[None]:
    """Run a forward of ``module``; afterwards every buffer is the object it was, holding the
    values it held, and so is each of ``tensors`` (tensors its forward updates that are no
    buffers of it: a cache object's tensors, which torch.export lifts as constants).  Only
    the tensors written into are copied back."""
    import torch

    owned = [] if module is None else [(owner, name, tensor) for owner in module.modules()
                                       for name, tensor in owner._buffers.items()]
    owned += [(None, "", tensor) for tensor in tensors]
    saved = [(owner, name, tensor, tensor._version, tensor.detach().clone()) for owner, name, tensor in owned
             if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, tensor, version, values in saved:
                if owner is not None:
                    owner._buffers[name] = tensor
                if tensor._version != version:
                    tensor.copy_(values)


def refuse_parameter_writes(program: Any) -> None:
    """``UnsupportedConfigError`` when the traced ``ExportedProgram`` writes into a parameter."""
    written = sorted(set(getattr(program.graph_signature, "parameters_to_mutate", {}).values()))
    if written:
        raise UnsupportedConfigError(
            f"the module's forward writes into its parameter(s) {', '.join(map(repr, written))}: a program's weights "
            "are constants, and a forward that changes them computes something else at each call; expected a forward "
            "that leaves its parameters as they are")


def mutated_inputs(program: Any) -> list[int]:
    """The user inputs (by position) the traced and decomposed ``ExportedProgram`` writes into,
    in the order their new values lead its outputs (module docstring)."""
    from torch.export.graph_signature import OutputKind

    sig = program.graph_signature
    positions = {name: i for i, name in enumerate(sig.user_inputs)}
    return [positions[spec.target] for spec in sig.output_specs
            if spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in positions]


def name_mutated_inputs(exported: Exported, mutated: list[int]) -> None:
    """Name the outputs that carry the new values of the inputs the forward writes into
    (``mutated_inputs``): ``Exported.mutated_inputs``, and each such output ``"x (written by forward)"``."""
    names = [exported.inputs[k].name for k in mutated]
    exported.mutated_inputs = names
    for k, name in enumerate(names):
        exported.outputs[k] = replace(exported.outputs[k], name=f"{name} (written by forward)")
