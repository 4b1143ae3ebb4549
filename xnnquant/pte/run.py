"""Running ExecuTorch programs, and checking each XNNPACK delegate against the interpreter.

``run_method(program, method, inputs)`` runs a method of a ``.pte`` on the real ExecuTorch
1.4.1 runtime.  ``delegate_io(program, delegate, inputs)`` returns what the program feeds
one of its XNNPACK delegates and what that delegate returns, when the method runs on
``inputs``.  ``verify_pte`` runs each method on random inputs and compares every delegate's
outputs with the reference interpreter's on the same (captured) inputs.

How a delegate's inputs are captured.  Between delegates a program may run other kernels
(ExecuTorch's portable ops), constants of the program may be delegate arguments, and
memory planning reuses buffers, so the inputs cannot be recomputed outside the runtime
without re-implementing it.  Instead the runtime computes them: the method is cut just
after the instruction that calls the delegate, and the cut method returns the
delegate's argument values (its inputs, then its outputs) instead of the method's
outputs.  Nothing else changes, so every value up to that call is what the real program
computes; memory planning guarantees a call's inputs are still intact when it runs and
do not share memory with its outputs.  The cut program is made with ExecuTorch's own
serializer: ``executorch.exir._serialize._deserialize_pte_binary`` (the program as
``executorch.exir.schema`` dataclasses, segments and named data restored), the
instruction list and ``outputs`` of one ``ExecutionPlan`` edited, then
``_serialize_pte_binary``.  A delegate argument's position is the external id of the
payload value it feeds (the XNNPACK runtime indexes the call's arguments by external id).
Methods with control flow (``JumpFalseCall``) or several chains are refused.

Programs are loaded with ``executorch.extension.pybindings.portable_lib
._load_for_executorch_from_buffer``, which also takes one ``.ptd`` data file.  A program that
calls ExecuTorch's quantized kernels (``quantized_decomposed::*``, e.g. a quantized embedding
table) is loaded after ``import executorch.kernels.quantized``, which registers them
(``quantized.load_quantized_kernels``); a device runtime must link them (``quantized_ops_lib``).

What this checks, and what it cannot: that each payload computes, on the real runtime and
inside its program, what its own values and nodes say (the reference interpreter).  A
lowering that wrote the wrong numbers into a payload passes; comparing the program with
the eager model catches that (see ``xnnquant.torchao`` on weight-only linears).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import arguments
from ..arrays import contiguous, to_numpy
from ..errors import ProgramError, UnsupportedConfigError, XnnquantError, missing_extra
from ..graph.divergence import TOLERANCE
from ..graph.worker import DEFAULT_TIMEOUT, worker
from .quantized import load_kernels
from .reader import Delegate, PteProgram, Source, read_pte

#: ExecuTorch ScalarType codes -> numpy dtypes (runtime/core/portable_type/scalar_type.h).
SCALAR_TYPES: dict[int, np.dtype] = {
    0: np.dtype(np.uint8), 1: np.dtype(np.int8), 2: np.dtype(np.int16), 3: np.dtype(np.int32),
    4: np.dtype(np.int64), 5: np.dtype(np.float16), 6: np.dtype(np.float32), 7: np.dtype(np.float64),
    11: np.dtype(np.bool_),
}
#: Integer inputs of random test data are drawn from [0, RANDOM_INT_HIGH): small enough to be
#: valid token ids, indices or lengths for most models.
RANDOM_INT_HIGH = 8


def _portable_lib() -> Any:
    try:
        import torch  # noqa: F401  (the pybindings need torch loaded first)
        from executorch.extension.pybindings import portable_lib
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "running ExecuTorch programs") from None
    return portable_lib


def _as_program(program: PteProgram | Source, data_files: Any) -> PteProgram:
    if isinstance(program, PteProgram):
        if not (isinstance(data_files, (list, tuple)) and not data_files):
            raise XnnquantError(f"data_files= goes with a .pte's bytes or path: a PteProgram has read its data files "
                                f"already (read_pte(path, data_files)); got {arguments.shown(data_files)}")
        return program
    return read_pte(program, data_files, need_delegate=False)


def _data_map(program: PteProgram) -> bytes | None:
    if len(program.data_files) > 1:
        raise UnsupportedConfigError(
            f"the ExecuTorch runtime's Python loader takes one data file: got {len(program.data_files)}"
        )
    return _runtime_bytes(program)[1]


def _runtime_bytes(program: PteProgram) -> tuple[bytes, bytes | None]:
    """The program's bytes and its data file's, as ``bytes`` the runtime's loader takes.

    The loader keeps pointers into them, not references, so they must live as long as the
    program (a temporary copy of a mapped file crashed it): they are kept on the program.
    """
    kept = program.__dict__.get("_runtime_bytes")
    if kept is None:
        data = program.data if isinstance(program.data, bytes) else bytes(program.data)
        files = program.data_files
        kept = (data, None if not files else files[0] if isinstance(files[0], bytes) else bytes(files[0]))
        object.__setattr__(program, "_runtime_bytes", kept)
    return kept


@contextlib.contextmanager
def _runtime_errors(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:
        raise UnsupportedConfigError(f"the ExecuTorch runtime failed {what}: {exc}") from None
    except MemoryError:  # std::bad_alloc: a plan larger than the free memory (planned.py)
        raise XnnquantError(f"the ExecuTorch runtime ran out of memory {what}: expected a program whose planned "
                            "memory fits in free memory (a dynamic dim plans its memory at its upper bound)") from None


def _load(program_bytes: bytes, data_map: bytes | None, operators: Sequence[str] = ()) -> Any:
    """The runtime's module; both buffers must outlive it (see ``_runtime_bytes``).  A program
    calling ExecuTorch's quantized kernels (``operators``) has them registered first."""
    lib = _portable_lib()
    load_kernels(operators)
    from .planned import check_fits, planned_bytes
    from .runtime_log import quiet

    quiet()  # the runtime's informational and known-benign lines held back (runtime_log.py)

    check_fits(planned_bytes(program_bytes), "the program")
    with _runtime_errors("to load the program"):
        return lib._load_for_executorch_from_buffer(program_bytes, data_map)


@dataclass(frozen=True)
class InputSpec:
    """Shape and numpy dtype of one method input."""

    shape: tuple[int, ...]
    dtype: np.dtype


def method_inputs(program: PteProgram | Source, method: str, data_files: Any = ()) -> list[InputSpec]:
    """The shapes and dtypes a method takes, from the runtime's ``MethodMeta``."""
    program = _as_program(program, data_files)
    _check_method(program, method)
    module = _load(_runtime_bytes(program)[0], _data_map(program), program.operators)
    meta = module.method_meta(method)
    specs = []
    for i in range(meta.num_inputs()):
        try:
            info = meta.input_tensor_meta(i)
        except (IndexError, RuntimeError):
            raise UnsupportedConfigError(f"method {method!r} input {i} is not a tensor: only tensor inputs "
                                         "are supported") from None
        if info.dtype() not in SCALAR_TYPES:
            raise UnsupportedConfigError(f"method {method!r} input {i} has ExecuTorch scalar type {info.dtype()}: "
                                         f"expected one of {sorted(SCALAR_TYPES)}")
        specs.append(InputSpec(tuple(int(d) for d in info.sizes()), SCALAR_TYPES[info.dtype()]))
    return specs


def random_method_inputs(specs: Sequence[InputSpec], seed: int = 0) -> list[np.ndarray]:
    """Standard-normal floats, integers in ``[0, RANDOM_INT_HIGH)``, random booleans."""
    rng = np.random.default_rng(seed)
    out = []
    for spec in specs:
        if spec.dtype.kind == "f":
            out.append(rng.standard_normal(spec.shape).astype(spec.dtype))
        elif spec.dtype.kind == "b":
            out.append(rng.integers(0, 2, spec.shape).astype(bool))
        else:
            out.append(rng.integers(0, RANDOM_INT_HIGH, spec.shape).astype(spec.dtype))
    return out


def _check_method(program: PteProgram, method: Any) -> None:
    if not isinstance(method, str) or method not in program.methods:
        raise XnnquantError(f"no method {arguments.shown(method)} in the program: it has {', '.join(program.methods)}")


def _execute(module: Any, method: str, inputs: Sequence[Any]) -> list[np.ndarray]:
    import torch

    tensors = []
    for i, x in enumerate(arguments.items(inputs, "inputs", "arrays")):
        # a torch tensor is passed as it is: its strides may lay it out in a declared dim order
        array = to_numpy(x, f"inputs[{i}]")
        if array.dtype not in SCALAR_TYPES.values():
            raise XnnquantError(f"inputs[{i}] must be an array of one of the dtypes "
                                f"{', '.join(str(d) for d in SCALAR_TYPES.values())}: got {arguments.shown(array)}")
        if array.size == 0:  # the runtime checks an empty tensor's strides too: contiguous ones, not numpy's 0s
            x = torch.empty(array.shape, dtype=getattr(torch, str(array.dtype)))
        tensors.append(x if isinstance(x, torch.Tensor) else torch.from_numpy(contiguous(array)))
    with _runtime_errors(f"to run method {method!r}"):
        results = module.run_method(method, tensors)
    # a constant method returns ints, floats or bools as they are
    return [np.array(r.numpy(), copy=True) if isinstance(r, torch.Tensor) else r for r in results]


def run_method(program: PteProgram | Source, method: str, inputs: Sequence[Any],
               data_files: Any = ()) -> list[np.ndarray]:
    """Outputs of ``method`` on the real runtime, as numpy arrays (inputs: arrays or tensors)."""
    program = _as_program(program, data_files)
    _check_method(program, method)
    return _execute(_load(_runtime_bytes(program)[0], _data_map(program), program.operators), method, inputs)


class Session:
    """One loaded program whose methods keep their state between calls (a KV cache): each
    call of a method runs on the values the previous calls left in its state tensors, and
    ``reset()`` loads the program again, which puts the file's initial values back.

    ``session.run("forward", inputs)`` (arrays or tensors) returns the outputs as numpy
    arrays; ``run_method`` instead loads the program anew for every call.
    """

    def __init__(self, program: PteProgram | Source, data_files: Any = ()) -> None:
        self.program = _as_program(program, data_files)
        self._module: Any = None
        self.reset()

    def reset(self) -> None:
        """Load the program again: every state holds its initial values."""
        self._module = None  # the runtime frees the old method before loading the new one
        self._module = _load(_runtime_bytes(self.program)[0], _data_map(self.program), self.program.operators)

    def run(self, method: str, inputs: Sequence[Any]) -> list[np.ndarray]:
        _check_method(self.program, method)
        return _execute(self._module, method, inputs)

    def input_sizes(self, method: str, index: int) -> tuple[int, ...]:
        """The sizes input ``index`` of ``method`` takes at most (its dynamic dims' bounds), from
        the runtime's ``MethodMeta``."""
        _check_method(self.program, method)
        return tuple(int(d) for d in self._module.method_meta(method).input_tensor_meta(index).sizes())


class _Cutter:
    """The program as ExecuTorch's dataclasses, cut after a delegate call on request."""

    def __init__(self, program: PteProgram) -> None:
        from executorch.exir._serialize import _deserialize_pte_binary

        self.program = program
        try:
            self.pte_file = _deserialize_pte_binary(_runtime_bytes(program)[0])
        except Exception as exc:  # struct.error, UnicodeDecodeError, ...: it trusts what it reads
            raise ProgramError(f"the program is malformed: ExecuTorch's deserializer cannot read it "
                               f"({type(exc).__name__}: {str(exc)[:200]})") from None
        self.plans = {plan.name: plan for plan in self.pte_file.program.execution_plan}

    def call_site(self, delegate: Delegate) -> tuple[int, list[int]]:
        """(instruction index, argument value indices) of the first call of ``delegate``."""
        from executorch.exir.schema import DelegateCall, JumpFalseCall

        plan = self.plans[delegate.method]
        if len(plan.chains) != 1:
            raise UnsupportedConfigError(f"method {delegate.method!r} has {len(plan.chains)} chains: capturing a "
                                         "delegate's inputs needs one")
        instructions = plan.chains[0].instructions
        if any(isinstance(i.instr_args, JumpFalseCall) for i in instructions):
            raise UnsupportedConfigError(f"method {delegate.method!r} has control flow: capturing a delegate's "
                                         "inputs needs a straight-line method")
        for at, instruction in enumerate(instructions):
            args = instruction.instr_args
            if isinstance(args, DelegateCall) and args.delegate_index == delegate.index:
                return at, list(args.args)
        raise XnnquantError(f"delegate {delegate.name} is never called by its method")

    def cut(self, method: str, keep: int, outputs: list[int]) -> bytes:
        """Program bytes whose ``method`` runs its first ``keep`` instructions and returns the
        values ``outputs``."""
        from executorch.exir._serialize import _serialize_pte_binary

        plan = self.plans[method]
        chain = plan.chains[0]
        saved = chain.instructions, plan.outputs, chain.outputs
        chain.instructions, plan.outputs, chain.outputs = chain.instructions[:keep], outputs, outputs
        try:
            return bytes(_serialize_pte_binary(copy.copy(self.pte_file), extract_delegate_segments=True))
        except Exception as exc:  # what the deserializer read does not serialize again
            raise ProgramError(f"the program is malformed: ExecuTorch's serializer cannot write it back cut after a "
                               f"delegate call ({type(exc).__name__}: {str(exc)[:200]})") from None
        finally:
            chain.instructions, plan.outputs, chain.outputs = saved


def delegate_io(program: PteProgram | Source, delegate: Delegate | str, inputs: Sequence[Any],
                data_files: Any = (), *, _cutter: _Cutter | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(inputs, outputs) of ``delegate`` when its method runs on ``inputs`` on the real runtime.

    ``delegate``: one of ``program.delegates`` or its name (``"forward/0"``).  The inputs
    and outputs are in the payload's order (``graph.inputs`` / ``graph.outputs``), as
    numpy arrays.  How they are captured: see the module docstring.
    """
    program = _as_program(program, data_files)
    if not isinstance(delegate, (str, Delegate)):
        raise XnnquantError(f"delegate must be one of program.delegates or its name ('forward/0'): got "
                            f"{arguments.shown(delegate)}")
    if isinstance(delegate, str):
        found = [d for d in program.delegates if d.name == delegate]
        if not found:
            raise XnnquantError(f"no XNNPACK delegate {delegate!r}: the program has "
                                f"{', '.join(d.name for d in program.delegates)}")
        delegate = found[0]
    cutter = _cutter or _Cutter(program)
    at, args = cutter.call_site(delegate)
    graph = delegate.graph
    slots = [graph.value(i).external_id for i in graph.inputs + graph.outputs]
    if any(s is None or s >= len(args) for s in slots):
        raise XnnquantError(f"delegate {delegate.name}: its external ids {slots} do not fit the "
                            f"{len(args)} arguments its method passes")
    cut = cutter.cut(delegate.method, at + 1, [args[s] for s in slots])
    values = _execute(_load(cut, _data_map(program), program.operators), delegate.method, inputs)
    n = len(graph.inputs)
    return values[:n], values[n:]


@dataclass(frozen=True)
class DelegateCheck:
    """One delegate, checked: the interpreter against the runtime on the inputs its program
    fed it.

    ``errors``: per output, ``max |runtime - interpreter| / max |interpreter|``.
    ``alone_identical``: the payload run alone (``xnnquant.graph.run``, its named data as
    read by ``read_pte``) gave exactly the outputs it gave inside the program; None when
    it cannot run alone (a payload with unused delegate arguments, see
    ``graph.rules._check_externals``).
    ``node_error``: when the outputs differ by more than ``TOLERANCE`` (a deep graph
    with dynamically quantized layers amplifies float ties from layer to layer), the
    worst relative error of any node computed by the interpreter on the runtime's own
    intermediate values (``xq.verify``'s node-by-node check), which then stands for the
    delegate; None when not needed or when the payload cannot be re-run with extra outputs.
    """

    name: str
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    errors: tuple[float, ...]
    alone_identical: bool | None
    node_error: float | None = None

    @property
    def judged_errors(self) -> tuple[float, ...]:
        """What the delegate is judged by: ``(node_error,)`` when there is one, else ``errors``."""
        return self.errors if self.node_error is None else (self.node_error,)


#: End-to-end relative error above which a delegate is also checked node by node: the one
#: tolerance of every comparison with the interpreter.
NODE_CHECK_ABOVE = TOLERANCE


def _fit_to_payload(graph: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The captured inputs in the payload's declared dims when only the rank differs (a
    0-d program constant feeds a payload value declared ``[1]``; XNNPACK reshapes its
    externals to the tensors it is given, the interpreter takes the declared dims)."""
    out = []
    for vid, x in zip(graph.inputs, arrays):
        dims = graph.value(vid).dims
        out.append(x.reshape(dims) if x.shape != tuple(dims) and x.size == int(np.prod(dims)) else x)
    return out


def check_delegates(program: PteProgram, method: str, inputs: Sequence[Any]) -> list[DelegateCheck]:
    """Every XNNPACK delegate of ``method``, checked on what the method feeds it for ``inputs``."""
    from ..graph import interpret, run
    from ..graph.divergence import relative_errors

    cutter = _Cutter(program)
    checks = []
    for delegate in program.method_delegates(method):
        ins, outs = delegate_io(program, delegate, inputs, _cutter=cutter)
        ins = _fit_to_payload(delegate.graph, ins)
        reference = interpret(delegate.graph, ins)
        graph = delegate.graph
        ids = [graph.value(i).external_id for i in graph.inputs + graph.outputs]
        identical: bool | None = None
        if ids == list(range(len(ids))):
            alone = run(delegate.payload, ins, named_data={k: bytes(v) for k, v in delegate.named_data.items()})
            identical = all(a.shape == o.shape and a.tobytes() == o.tobytes() for a, o in zip(alone, outs))
        errors = tuple(relative_errors(reference, outs))
        node_error = None
        # the exposed copies are written by Graph, constants from named data included: a
        # delegate whose constants live in the program's named data is checked the same way
        if max(errors, default=0.0) > NODE_CHECK_ABOVE and identical is not None:
            from ..graph.divergence import first_divergence

            try:
                _, _, node_error = first_divergence(graph, list(ins), [], tolerance=math.inf)
            except XnnquantError:
                node_error = None
        checks.append(DelegateCheck(delegate.name, tuple(x.shape for x in ins), tuple(o.shape for o in outs),
                                    errors, identical, node_error))
    return checks


def verify_pte(source: PteProgram | Source, data_files: Any = (), seed: int = 0, *,
               isolate: bool = False, timeout: float | None = None) -> tuple[list[float], str]:
    """Run every method of a ``.pte`` on the real runtime with random inputs (see
    ``random_method_inputs``), and check each XNNPACK delegate against the reference
    interpreter on the inputs the method fed it (``check_delegates``).

    Returns every delegate output's relative error and a report, one line per method and
    per delegate.  A delegate whose payload, run alone, does not give exactly what it gave
    inside the program counts as an infinite error.

    ``isolate=True`` does all of it in the runtime's worker process (``graph.worker``,
    as ``graph.run(..., isolate=True)``): what the runtime and the libraries it loads
    write goes to the worker's log, a program that crashes the runtime raises
    ``RuntimeCrashError`` with the signal and the log's last lines, one that runs past
    ``timeout`` seconds (default ``DEFAULT_TIMEOUT``) ``RuntimeTimeoutError``.
    """
    seed = arguments.integer(seed, "seed", low=0)
    isolate = arguments.flag(isolate, "isolate")
    timeout = arguments.seconds(timeout)
    if timeout is not None and not isolate:
        raise XnnquantError(f"timeout= limits the isolated runtime: got timeout={timeout:g} with isolate=False "
                            "(pass isolate=True to stop a call that runs too long)")
    program = _as_program(source, data_files)
    if isolate:
        data, data_map = _runtime_bytes(program)  # a mapped file's view cannot be pickled
        checked: tuple[list[float], str] = worker().call(
            verify_pte, (data, [] if data_map is None else [data_map], seed),
            DEFAULT_TIMEOUT if timeout is None else timeout, "verifying the program")
        return checked
    errors: list[float] = []
    lines = []
    for method in program.methods:
        inputs = random_method_inputs(method_inputs(program, method), seed)
        outputs = run_method(program, method, inputs)
        lines.append(f"method {method}: inputs {', '.join(str(x.shape) for x in inputs)} -> outputs "
                     f"{', '.join(str(y.shape) for y in outputs)} on the ExecuTorch runtime")
        for check in check_delegates(program, method, inputs):
            errors.extend([float("inf")] if check.alone_identical is False else check.judged_errors)
            alone = {True: "identical", False: "DIFFERENT", None: "not possible (unused delegate arguments)"}[
                check.alone_identical]
            worst = max(check.errors, default=0.0)
            node = "" if check.node_error is None else (
                f"; node by node on the runtime's own values: worst relative error {check.node_error:.3g}")
            lines.append(f"  delegate {check.name}: inputs {', '.join(map(str, check.input_shapes))} "
                         f"captured from the program; interpreter vs runtime: max relative error {worst:.3g}"
                         f"{node}; payload run alone: {alone}")
        if not program.method_delegates(method):
            lines.append("  no XNNPACK delegate")
    return errors, "\n".join(lines)
