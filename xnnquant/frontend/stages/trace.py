"""Stage ``export``: the module and its example inputs checked, then traced by torch.export.

Takes ``module`` (a ``torch.nn.Module`` in eval mode with float32 parameters, or a saved
``torch.export.ExportedProgram``), ``example_inputs`` and the parsed ``ExportOptions``; gives
the module to run (None for a saved program: nothing to run or compare with) and torch.export's
``ExportedProgram``, not yet decomposed (``decompose.py``).  A streaming export's weight file is
opened here too (``weight_file``), before the module is traced on the meta device.

torch is imported here, on first use; ``import xnnquant`` does not import it.
"""

from __future__ import annotations

from typing import Any

from ...errors import XnnquantError, import_torch
from ..options import ExportOptions


def torch_or_refuse() -> Any:
    """The ``torch`` module, or ``MissingExtraError`` naming the extra to install."""
    return import_torch("exporting a torch module")


def check_module(torch: Any, module: Any) -> None:
    """``XnnquantError`` unless ``module`` is a ``torch.nn.Module`` in eval mode whose parameters
    are finite float32 (and whose floating-point buffers are float32 and finite)."""
    if not isinstance(module, torch.nn.Module):
        raise XnnquantError(f"module must be a torch.nn.Module or an ExportedProgram: got {type(module).__name__}")
    if module.training:
        raise XnnquantError(
            f"{type(module).__name__} is in training mode: call module.eval() before exporting (batch norm and "
            "dropout compute differently in training)")
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in items:
            if tensor.dtype.is_floating_point and tensor.dtype != torch.float32:
                raise XnnquantError(
                    f"{kind} {name!r} is {tensor.dtype}: xnnquant exports float32 modules (call module.float())")
            if kind == "parameter" and not tensor.dtype.is_floating_point:
                raise XnnquantError(f"parameter {name!r} is {tensor.dtype}: expected a float32 module")
            real = tensor.dtype.is_floating_point and tensor.device.type != "meta"
            if real and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).nonzero()[0].tolist()[0]) if tensor.dim() else 0
                raise XnnquantError(f"{kind} {name!r} is not finite (NaN or inf, first at flat index {bad}): a program "
                                    "computed from it would be too; expected finite values")


#: dtypes a program input may have (float32 ones may feed XNNPACK directly; the others go
#: through ExecuTorch's portable kernels first).
INPUT_DTYPES = ("float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def check_inputs(torch: Any, example_inputs: Any) -> tuple[Any, ...]:
    """``example_inputs`` as a tuple of dense tensors of ``INPUT_DTYPES``, on the CPU or on
    ``meta`` (a module built on meta traces there; what needs values says so later)."""
    from ...arrays import check_plain_tensor

    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise XnnquantError(
            f"example_inputs must be a tuple of tensors, the module's positional inputs: got "
            f"{type(example_inputs).__name__}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise XnnquantError(f"example_inputs[{i}] must be a torch.Tensor: got {type(x).__name__}")
        check_plain_tensor(x, f"example_inputs[{i}]", meta=True)
        if str(x.dtype).removeprefix("torch.") not in INPUT_DTYPES:
            raise XnnquantError(f"example_inputs[{i}] is {x.dtype}: expected one of {', '.join(INPUT_DTYPES)}")
    return tuple(example_inputs)


def traced(module: Any, example_inputs: Any, options: ExportOptions) -> tuple[Any, Any]:
    """(the module or None for a saved program, torch.export's ``ExportedProgram`` of it)."""
    torch = torch_or_refuse()
    if isinstance(module, torch.export.ExportedProgram):
        if example_inputs is not None:
            raise XnnquantError("example_inputs= goes with a torch.nn.Module: a saved program (ExportedProgram) "
                                "carries its own example inputs; pass none")
        if options.calibration is not None:
            raise XnnquantError("calibration= needs the torch.nn.Module itself (not a saved program) to run it")
        return None, module
    from ..evaluation import torch_threads

    with torch_threads(1):  # one small op a parameter: threads would only wait for each other
        check_module(torch, module)
    inputs = check_inputs(torch, example_inputs)
    if options.state_dict is not None:  # shapes and dtypes only: traced with the meta parameters
        inputs = tuple(x.to("meta") for x in inputs)
    if options.calibration is not None:
        options.calibration.check_fits(inputs)
    spec = options.dynamic_shapes
    if isinstance(spec, (list, tuple)) and len(spec) == len(inputs) and takes_varargs(module):
        from ..batches import by_signature

        spec = by_signature(module, list(spec))  # one spec per input, as the docstring says
    from ..batches import without_stack_traces

    try:
        with without_stack_traces():  # nothing reads them: a third of the trace's time
            program = torch.export.export(module, inputs, dynamic_shapes=spec, strict=False)
    except XnnquantError:  # the module's own refusal (xnnquant.llm's attention), as it is
        raise
    except Exception as exc:  # torch's tracing errors come in many types; say where they came from
        what = " with these dynamic_shapes" if options.dynamic_shapes is not None else ""
        raise XnnquantError(f"torch.export.export failed on {type(module).__name__}{what}: "
                            f"{type(exc).__name__}: {exc}") from exc
    return module, program


def takes_varargs(module: Any) -> bool:
    """True when ``module.forward`` takes ``*args``."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)


def weight_file(options: ExportOptions, module: Any) -> Any:
    """A streaming export's ``streaming.WeightFile`` (``state_dict=``), its module checked to hold
    no weights of its own; None without ``state_dict=``."""
    if options.state_dict is None:
        return None
    from ..streaming import WeightFile

    found = WeightFile(options.state_dict)
    if isinstance(module, torch_or_refuse().nn.Module):  # before tracing on meta
        check_streamed(module, found.path)
    return found


def check_streamed(module: Any, path: str) -> None:
    """A streaming export's module holds no weights of its own: every parameter is on
    ``meta``.  A buffer may hold data (one the file lacks: a non-persistent buffer such as a
    rotary ``inv_freq``, made outside ``torch.device('meta')``); its values are the module's."""
    for name, tensor in module.named_parameters():
        if tensor.device.type != "meta":
            raise XnnquantError(
                f"state_dict= (xnnquant export --weights-from) reads the module's tensors from {path!r}, but {name!r} "
                f"holds data of its own (on {tensor.device.type}): build the module on the meta device (with "
                "torch.device('meta'): ...), or export it without state_dict=")
