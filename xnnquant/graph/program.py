"""Running XNNGraph payloads on the real XNNPACK, through the ExecuTorch 1.4.1 runtime.

``to_pte`` wraps a payload into a ``.pte`` program; ``run`` executes it with
``executorch.runtime`` and returns numpy arrays.

How a payload becomes a program (``xnnquant.pte.builder``, no torch or executorch
needed): one method ``forward`` whose values are a tensor per external input, then a
tensor per external output (shape, dtype, dim order); one ``XnnpackBackend`` delegate
holding the payload in a segment of its own; one ``DelegateCall`` taking the inputs and
giving the outputs; the inputs and outputs planned in memory as ExecuTorch plans them.
The payload's constants go into the program's named-data segments, one per constant, each
named by its ``constant_data`` entry (``writer.named_payload``): ExecuTorch's XNNPACK
backend frees a delegate's bytes after building its runtime, and XNNPACK keeps pointers
into them for constants it does not pack, so a program with its constants inside the
payload runs only when loaded from bytes in memory; loaded from a file it reads freed
memory.  ``constants="inline"`` keeps them in the payload (the bytes ExecuTorch 1.4.1
writes for that payload, ``LoweredBackendModule.buffer(extract_delegate_segments=True)``;
a test compares them).  Named data that an ExecuTorch-written payload references by
``named_key`` goes into named-data segments as given.

External ids order the arguments: inputs, then outputs, each by ascending external id
(the runtime sorts them so), which is the order of ``Graph.inputs`` / ``Graph.outputs``.
torch and executorch are imported by ``run`` on first use (the ``xnnpack`` extra).

Other sizes: XNNPACK computes every value's dims again from the tensors it is given on
each call, so one payload runs at any input size whose dims are at most its values'
dims.  The program must then declare its input and output tensors ``DYNAMIC_BOUND`` at
those dims (``to_pte(dynamic=True)``; ``run`` always does): a ``STATIC`` tensor refuses
any other shape, and ExecuTorch plans the memory of a bounded tensor at its declared
dims and refuses a larger element count.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from .. import arguments
from ..arrays import ArrayInput, contiguous, to_numpy
from ..constants import XNNPACK_BACKEND_ID
from ..datatypes import Datatype, storage
from ..errors import PayloadError, UnsupportedConfigError, XnnquantError, missing_extra
from .reader import checked_named_data
from .shapes import within

if TYPE_CHECKING:
    from ..pte.builder import Payload, ProgramBuilder
    from .builder import Graph
    from .model import Node, Value

#: Loaded programs kept ready to execute, most recently used last.
METHOD_CACHE_SIZE = 16
#: Set in an isolated worker process (``worker.py``): the runtime's log of each call goes
#: to this file, which the parent reads when the worker dies.
_CALL_LOG: str | None = None

#: Datatypes an external (input or output) value may have, and the numpy dtype of the
#: buffer the runtime exchanges for it.  qdint8 is never external; per-channel and
#: blockwise datatypes are constant-only.
EXTERNAL_DTYPES: dict[Datatype, np.dtype] = {
    d: np.dtype(storage(d).numpy_dtype)
    for d in (Datatype.fp32, Datatype.fp16, Datatype.qint8, Datatype.quint8, Datatype.qint32)
}


class TensorSpec(NamedTuple):
    """Shape, numpy dtype and dim order of one external input or output.

    ``shape`` is the tensor's logical (torch) shape; ``dim_order`` lists its dims from
    outermost to innermost in memory (None: contiguous).  ExecuTorch's XNNPACK delegate
    takes contiguous tensors and 4-D ``(0, 2, 3, 1)`` (channels-last) ones; for the latter
    the payload's external value holds the dims in memory order ``[N, H, W, C]``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    dim_order: tuple[int, ...] | None = None


class _HasToBytes(Protocol):
    def to_bytes(self) -> bytes: ...


PayloadLike = bytes | bytearray | memoryview | str | os.PathLike[str] | _HasToBytes
SpecLike = TensorSpec | tuple[Sequence[int], Any] | tuple[Sequence[int], Any, Sequence[int] | None]
#: The dim orders a delegate input or output may have besides the contiguous one.
CHANNELS_LAST = (0, 2, 3, 1)


def _import_torch_executorch() -> Any:
    """The modules ``run`` needs, or ``MissingExtraError``."""
    try:
        import torch
        from executorch.runtime import Runtime  # noqa: F401
    except ImportError:
        raise missing_extra("xnnpack", "executorch", "running a payload on the real XNNPACK") from None
    return torch


def _payload_bytes(payload: PayloadLike) -> bytes:
    """``payload`` as bytes: bytes-like, a path to a payload file, or a ``Graph``."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, (str, os.PathLike)):
        path = arguments.path(payload, "payload")
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise PayloadError(f"cannot read payload file {os.fspath(path)!r}: {exc}") from None
    if not isinstance(payload, (int, float, complex, np.number)) and callable(getattr(payload, "to_bytes", None)):
        data = payload.to_bytes()  # a Graph or an Exported
        if isinstance(data, (bytes, bytearray, memoryview)):
            return bytes(data)
    raise XnnquantError(f"payload must be bytes, a path or a Graph: got {arguments.shown(payload)}")


def _load_checked(payload: bytes, named_data: Mapping[str, bytes] | None, validate: bool) -> Any:
    """``load(payload)``, refusing payloads whose named data is missing.

    The 1.4.1 runtime dereferences a null named-data map when a payload names keys and the
    program has no named data at all (the process dies), so this is checked up front.
    """
    from . import load  # the package exports it; imported here to avoid a cycle

    graph = load(payload, named_data=named_data, validate=validate)
    info = graph.load_info
    if info is not None and info.missing_named_keys:
        keys = info.missing_named_keys
        raise PayloadError(
            f"the payload's constants live in named data: got no bytes for {len(keys)} of its "
            f"{len(info.named_keys)} keys (first {keys[0]!r}), expected named_data={{key: bytes}} "
            "holding all of them"
        )
    return graph


def external_specs(graph: Graph) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Input and output specs of a ``Graph``, in external-id order.

    The index output of ``XNNArgMaxPooling2d`` is labelled fp32 in payloads, but XNNPACK
    writes 32-bit indices into it; it is declared int64, as ExecuTorch does, and the
    runtime widens the indices into that buffer.
    """
    ids = [v.external_id for v in map(graph.value, graph.inputs + graph.outputs) if v.external_id is not None]
    if ids and max(ids) >= len(ids) and len(set(ids)) == len(ids):  # gaps (not duplicates, a separate fault)
        raise UnsupportedConfigError(
            f"the payload leaves delegate arguments unused (external ids {ids}, as ExecuTorch 1.4.1 writes "
            "for weight-only linears): it runs only inside its own program (xnnquant.pte.run.run_method)"
        )
    index_outputs = {n.outputs[1] for n in graph.nodes if n.kind == "XNNArgMaxPooling2d" and len(n.outputs) > 1}
    return ([_value_spec(graph.value(i), "input") for i in graph.inputs],
            [TensorSpec(tuple(int(d) for d in graph.value(i).dims), np.dtype(np.int64))
             if i in index_outputs else _value_spec(graph.value(i), "output") for i in graph.outputs])


def _value_spec(value: Value, role: str) -> TensorSpec:
    datatype = Datatype(value.datatype)
    if datatype not in EXTERNAL_DTYPES:
        raise UnsupportedConfigError(
            f"external {role} value {value.id} has datatype {datatype.name}: "
            f"expected one of {', '.join(d.name for d in EXTERNAL_DTYPES)}"
        )
    return TensorSpec(tuple(int(d) for d in value.dims), EXTERNAL_DTYPES[datatype])


def _as_specs(given: Sequence[SpecLike], role: str) -> list[TensorSpec]:
    """User-given ``(shape, dtype)`` pairs, dtype a numpy dtype or a ``Datatype``."""
    specs = []
    for i, item in enumerate(arguments.items(given, f"{role}s", "(shape, dtype) pairs")):
        try:
            shape, dtype, *rest = item
            shape = tuple(int(d) for d in shape)
            order = None if not rest or rest[0] is None else tuple(int(d) for d in rest[0])
            if len(rest) > 1:
                raise ValueError
        except (TypeError, ValueError):
            raise XnnquantError(f"{role}s[{i}] must be a (shape, dtype) pair or a (shape, dtype, dim_order) "
                                f"triple: got {item!r}") from None
        if order == tuple(range(len(shape))):
            order = None
        if order is not None and (order != CHANNELS_LAST or len(shape) != 4):
            raise UnsupportedConfigError(
                f"{role}s[{i}] has dim order {order}: ExecuTorch's XNNPACK delegate takes contiguous tensors "
                f"and 4-D channels-last ones {CHANNELS_LAST}")
        if isinstance(dtype, Datatype):
            if dtype not in EXTERNAL_DTYPES:
                raise UnsupportedConfigError(
                    f"{role}s[{i}] has datatype {dtype.name}: expected one of "
                    f"{', '.join(d.name for d in EXTERNAL_DTYPES)}"
                )
            dtype = EXTERNAL_DTYPES[dtype]
        dtype = np.dtype(dtype)
        if dtype not in EXTERNAL_DTYPES.values() and not (role == "output" and dtype == np.int64):
            raise UnsupportedConfigError(
                f"{role}s[{i}] has dtype {dtype}: expected one of "
                f"{', '.join(str(d) for d in EXTERNAL_DTYPES.values())}"
            )
        if any(d < 0 for d in shape):
            raise XnnquantError(f"{role}s[{i}] has a negative dimension: got shape {shape}")
        specs.append(TensorSpec(shape, dtype, order))
    return specs


#: Prefix of the named-data keys of a one-delegate program's constants.
CONSTANT_KEY_PREFIX = "xnnquant.constant."


def to_pte(payload: PayloadLike, inputs: Sequence[SpecLike] | None = None,
           outputs: Sequence[SpecLike] | None = None, *,
           named_data: Mapping[str, bytes] | None = None, validate: bool = True,
           dynamic: bool = False, constants: str = "named") -> bytes:
    """The ``.pte`` program that runs ``payload`` as its only delegate call.

    ``inputs`` / ``outputs``: ``(shape, dtype)`` pairs (or ``(shape, dtype, dim_order)``
    triples, see ``TensorSpec``) in external-id order, dtype a numpy dtype or a
    ``Datatype``, one per external value of the payload; each one left ``None`` is read
    from the payload with ``load``.  Other shapes than the payload's dims are allowed
    (XNNPACK reshapes its externals to the tensors it is given), as long as the outputs
    declared are the shapes XNNPACK then computes.  A channels-last spec declares that
    dim order in the program: the runtime then hands the delegate the tensor's memory
    as ``[N, H, W, C]``, the payload value's dims.

    ``named_data``: key -> bytes for constants the payload references by ``named_key``
    (payloads written by ExecuTorch 1.4.1 itself); they go into the program's
    named-data segment.  ``validate=False`` skips ``load``'s validation (to
    probe what the runtime itself refuses).  Returns the program bytes (a ``*.pte``),
    the same whether or not ExecuTorch's own ``XnnpackBackend`` has been imported.

    ``dynamic=True`` declares every input and output tensor of the program
    ``DYNAMIC_BOUND`` with the given shapes as upper bounds, memory planned at those
    bounds: the program then runs at any smaller sizes (each dim of an input at most the
    declared one), as ExecuTorch's own flow declares a ``torch.export`` program with
    dynamic dims.  Above the bound the runtime refuses the call (ExecuTorch checks the
    element count of each input against its planned capacity).  ``False``: ``STATIC``
    tensors, which refuse any other shape.

    ``constants``: ``"named"`` (default: the payload's constants as named data, see the
    module docstring) or ``"inline"`` (kept in the payload: safe only for a program loaded
    from bytes in memory).
    """
    validate, dynamic = arguments.flag(validate, "validate"), arguments.flag(dynamic, "dynamic")
    if constants not in ("named", "inline"):
        raise XnnquantError(f"constants must be 'named' or 'inline': got {arguments.shown(constants)}")
    named_data = checked_named_data(named_data)
    data = _payload_bytes(payload)
    graph = _load_checked(data, named_data, validate)
    found_in, found_out = external_specs(graph)
    in_specs = _as_specs(inputs, "input") if inputs is not None else found_in
    out_specs = _as_specs(outputs, "output") if outputs is not None else found_out
    for role, given, found in (("input", in_specs, found_in), ("output", out_specs, found_out)):
        if len(given) != len(found):
            raise XnnquantError(
                f"to_pte needs one spec per external {role} of the payload: "
                f"got {len(given)}, expected {len(found)}"
            )
    if constants == "inline" or _has_no_inline_constants(data):
        return _build_pte(data, in_specs, out_specs, named_data, dynamic)
    from . import writer

    data, own = writer.named_payload(_as_read(graph), CONSTANT_KEY_PREFIX)
    return _program(data, in_specs, out_specs, named_data, dynamic, own).to_bytes()


def _as_read(graph: Any) -> Any:
    """A loaded ``graph`` set to be written in the form it was read: scales that the payload
    kept in its constant segment (``scale_buffer_idx``, ExecuTorch 1.4.1's form) stay
    constant data, so that ``to_pte(g.to_bytes())`` is ``pte_chunks(g)`` byte for byte (read
    back without this, they went into the flatbuffer's ``scale`` lists)."""
    from .targets import Target

    if any(getattr(v.quant, "scale_buffer_idx", 0) for v in graph.values):
        graph.target, graph.scales_in_segment = Target.ET_1_4_1, True
    return graph


def _has_no_inline_constants(payload: bytes) -> bool:
    """True when the payload's constant segment is empty (its constants, if any, are named)."""
    from .header import XNNHeader

    try:
        return XNNHeader.from_bytes(payload).constant_data_size == 0
    except XnnquantError:  # no header: the legacy form, constants inline in the flatbuffer
        return False


def _program(payload: Payload, inputs: list[TensorSpec], outputs: list[TensorSpec],
             named_data: Mapping[str, bytes] | None, dynamic: bool = False,
             constants: Sequence[tuple[str, Any]] = ()) -> ProgramBuilder:
    """The one-delegate program running ``payload`` (module docstring); ``constants``: its
    constants as named data, in entry order (``writer.named_payload``)."""
    from ..pte.builder import ProgramBuilder

    if not outputs:
        raise PayloadError("the payload has no external output: a program must return something")
    program = ProgramBuilder()
    named = named_data or {}
    for key in sorted(named):
        program.add_named_data(key, named[key])
    for key, blob in constants:
        program.add_named_data(key, blob)
    method = program.method("forward")

    def tensor(spec: TensorSpec) -> int:
        return method.tensor(spec.dtype, spec.shape, dim_order=spec.dim_order, dynamic=dynamic)

    args = [method.input(tensor(spec)) for spec in inputs]
    results = [method.output(tensor(spec)) for spec in outputs]
    method.delegate_call(method.delegate(XNNPACK_BACKEND_ID, payload), args, results)
    return program


def _build_pte(data: bytes, inputs: list[TensorSpec], outputs: list[TensorSpec],
               named_data: Mapping[str, bytes] | None, dynamic: bool = False) -> bytes:
    return _program(data, inputs, outputs, named_data, dynamic).to_bytes()


def pte_chunks(graph: Any, inputs: Sequence[SpecLike] | None = None,
               outputs: Sequence[SpecLike] | None = None, dynamic: bool = False) -> Iterator[bytes | memoryview]:
    """The ``.pte`` of a ``Graph``, piece by piece; the pieces joined are
    ``to_pte(graph.to_bytes())``, but for a graph with ``scales_in_segment`` each constant
    is made and passed on when the writer reaches its named-data segment
    (``writer.named_payload``), one value at a time.  ``inputs`` / ``outputs`` /
    ``dynamic``: as for ``to_pte``.
    """
    from . import writer

    found_in, found_out = external_specs(graph)
    in_specs = _as_specs(inputs, "input") if inputs is not None else found_in
    out_specs = _as_specs(outputs, "output") if outputs is not None else found_out
    payload, named = writer.named_payload(graph, CONSTANT_KEY_PREFIX)  # validates the graph
    yield from _program(payload, in_specs, out_specs, None, dynamic, named).chunks()


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Collect the runtime's log while the block runs.

    ExecuTorch's pybindings send the log through ``std::cerr``, which they redirect to
    Python's ``sys.stderr`` during a call; native code may also write to file
    descriptor 2.  Both are captured.  Yields a list that holds the text once the block
    has ended.
    """
    captured: list[str] = []
    if _CALL_LOG is not None:  # in an isolated worker: a file the parent reads if the process dies
        open(_CALL_LOG, "wb").close()
        sink = open(_CALL_LOG, "a+b")  # noqa: SIM115 - closed below
        python_side: Any = open(_CALL_LOG, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    else:
        sink, python_side = tempfile.TemporaryFile(), io.StringIO()  # noqa: SIM115 - closed below
    with sink, python_side:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stderr(python_side):
                yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            python_side.flush()
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            captured.append(text if _CALL_LOG is not None else python_side.getvalue() + text)


class _ShapeRules(NamedTuple):
    """What the output shapes at other input sizes follow from (no constant data kept)."""

    nodes: tuple[Node, ...]
    constants: dict[int, tuple[int, ...]]  # dims of each constant value
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @classmethod
    def of(cls, graph: Any) -> _ShapeRules:
        return cls(tuple(graph.nodes), {v.id: tuple(v.dims) for v in graph.values if v.is_constant},
                   tuple(graph.inputs), tuple(graph.outputs))

    def output_specs(self, arrays: Sequence[np.ndarray], inputs: list[TensorSpec],
                     outputs: list[TensorSpec]) -> list[TensorSpec]:
        """The outputs' specs for inputs ``arrays`` (checked against ``inputs``): ``outputs``
        at the declared sizes, else the dims XNNPACK's reshape step gives, each checked to
        fit its output's declared dims (the program's planned capacity)."""
        if all(a.shape == spec.shape for a, spec in zip(arrays, inputs)):
            return outputs
        from .shapes import propagate

        known = {**self.constants, **{vid: tuple(a.shape) for vid, a in zip(self.inputs, arrays)}}
        dims = propagate(self.nodes, known)
        specs = []
        for k, (vid, declared) in enumerate(zip(self.outputs, outputs)):
            if not within(dims[vid], declared.shape):
                raise XnnquantError(
                    f"at input shapes {[tuple(a.shape) for a in arrays]} output {k} would have shape {dims[vid]}, "
                    f"which does not fit its dims {declared.shape} (the program is planned at the payload's dims)"
                )
            specs.append(TensorSpec(dims[vid], declared.dtype))
        return specs


class _Loaded(NamedTuple):
    program: Any  # executorch.runtime.Program; keeps the method's memory alive
    method: Any  # executorch.runtime.Method
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    shapes: _ShapeRules


_methods: collections.OrderedDict[bytes, _Loaded] = collections.OrderedDict()


def _digest(data: bytes, named_data: Mapping[str, bytes] | None, validate: bool) -> bytes:
    """What identifies a runnable program: the payload, its named data, the check level."""
    h = hashlib.sha256(data)
    h.update(b"validated" if validate else b"unchecked")
    named = named_data or {}
    for key in sorted(named):
        h.update(hashlib.sha256(key.encode()).digest() + hashlib.sha256(named[key]).digest())
    return h.digest()


def _loaded_method(data: bytes, named_data: Mapping[str, bytes] | None, validate: bool) -> _Loaded:
    """Program, ``forward`` method and input specs running ``data``, from a small LRU cache.

    A hit skips ``load``, building the ``.pte`` and the runtime's own set-up (weight
    packing), leaving only the execution.
    """
    key = _digest(data, named_data, validate)
    if key in _methods:
        _methods.move_to_end(key)
        return _methods[key]
    graph = _load_checked(data, named_data, validate)
    in_specs, out_specs = external_specs(graph)
    pte = _build_pte(data, in_specs, out_specs, named_data, dynamic=True)
    from executorch.runtime import Runtime

    from ..pte.planned import check_fits, planned_bytes, runtime_memory_error

    planned = planned_bytes(pte)
    check_fits(planned, "the payload's program", " (the program plans the inputs and outputs at the payload's dims)")
    with _captured_stderr() as log:
        try:
            program = Runtime.get().load_program(pte)
            method = program.load_method("forward")
        except RuntimeError as exc:
            failure: Exception | None = exc
        except MemoryError:
            raise runtime_memory_error("the payload's program", planned) from None
        else:
            failure = None
    if failure is not None:
        raise UnsupportedConfigError(
            f"the ExecuTorch runtime refused the payload: {failure}; runtime log: "
            f"{_log_summary(log[0])}"
        ) from None
    _methods[key] = _Loaded(program, method, in_specs, out_specs, _ShapeRules.of(graph))
    while len(_methods) > METHOD_CACHE_SIZE:
        _methods.popitem(last=False)
    return _methods[key]


def _log_summary(log: str) -> str:
    """The runtime's error lines (without CPU-probe chatter), or the whole log."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and "cpuinfo" not in ln]
    return " | ".join(lines[-12:]) if lines else "(empty)"


def _check_inputs(inputs: Sequence[ArrayInput], specs: list[TensorSpec]) -> list[np.ndarray]:
    if not isinstance(inputs, (list, tuple)) or len(inputs) != len(specs):
        got = f"{len(inputs)} arrays" if isinstance(inputs, (list, tuple)) else arguments.shown(inputs)
        raise XnnquantError(
            f"run needs one array per external input, in a list: got {got}, expected {len(specs)} "
            f"({', '.join(f'{s.shape} {s.dtype}' for s in specs)})"
        )
    arrays = []
    for i, (x, spec) in enumerate(zip(inputs, specs)):
        arr = to_numpy(x, f"inputs[{i}]")
        # smaller dims run too (the payload's dims are upper bounds); a zero-size dim
        # aborts the 1.4.1 pybindings while they wrap the tensor (SIGABRT)
        if arr.dtype != spec.dtype or not within(arr.shape, spec.shape) or 0 in arr.shape:
            raise XnnquantError(
                f"inputs[{i}] does not match the payload's external input {i}: got shape "
                f"{tuple(arr.shape)} {arr.dtype}, expected {spec.shape} {spec.dtype} (or smaller dims, each "
                "at least 1: the program is planned at the payload's dims)"
            )
        arrays.append(contiguous(arr))
    return arrays


def run(payload: PayloadLike, inputs: Sequence[ArrayInput], *,
        named_data: Mapping[str, bytes] | None = None, validate: bool = True,
        isolate: bool = False, timeout: float | None = None) -> list[np.ndarray]:
    """Execute ``payload`` on the real XNNPACK (ExecuTorch 1.4.1 runtime).

    ``inputs``: one array per external input, in external-id order, each with the dtype
    of that input (fp32 -> float32, fp16 -> float16, qint8 -> int8, quint8 -> uint8,
    qint32 -> int32; nothing is converted silently) and its shape, or a smaller one: the
    same rank, each dim between 1 and the payload's (a dynamic sequence length; the
    payload's dims are upper bounds, and each output's shape is what XNNPACK computes
    from the inputs).  Larger inputs raise ``XnnquantError``.  ``named_data``
    and ``validate``: see ``to_pte``.  Returns one freshly allocated array per external
    output, in external-id order, with the same dtype rules (argmax-pooling indices:
    int64).

    ``isolate=True`` runs the payload in a worker process (``worker.py``): a payload
    that crashes the runtime raises ``RuntimeCrashError`` (with the signal and the
    runtime's last log lines) instead of killing the caller, and a call that takes
    longer than ``timeout`` seconds (default ``worker.DEFAULT_TIMEOUT``) raises
    ``RuntimeTimeoutError``.  The payload is loaded and the inputs are checked in the
    caller first, so every other error is the same as in-process.  The worker starts on
    the first isolated call (importing torch and executorch: seconds) and is reused.

    Raises ``UnsupportedConfigError`` when the runtime refuses the payload, with the
    runtime's own log lines in the message.  Loaded programs are cached by the payload's
    bytes (and named data), so running the same payload again costs only the execution.
    """
    validate, isolate = arguments.flag(validate, "validate"), arguments.flag(isolate, "isolate")
    timeout = arguments.seconds(timeout)
    if timeout is not None and not isolate:
        raise XnnquantError(f"timeout= limits the isolated runtime: got timeout={timeout:g} with isolate=False "
                            "(pass isolate=True to stop a call that runs too long)")
    named_data = checked_named_data(named_data)
    data = _payload_bytes(payload)
    if not isolate:
        return _run_in_process(data, inputs, named_data, validate)
    from .worker import DEFAULT_TIMEOUT, worker

    graph = _load_checked(data, named_data, validate)
    in_specs, out_specs = external_specs(graph)
    arrays = _check_inputs(inputs, in_specs)
    out_specs = _ShapeRules.of(graph).output_specs(arrays, in_specs, out_specs)
    return worker().run(data, named_data, validate, arrays, [(s.shape, s.dtype) for s in out_specs],
                        DEFAULT_TIMEOUT if timeout is None else timeout)


def _run_in_process(data: bytes, inputs: Sequence[ArrayInput], named_data: Mapping[str, bytes] | None,
                    validate: bool, into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
    """``run`` in this process; outputs copied into ``into`` when given (else fresh arrays)."""
    torch = _import_torch_executorch()
    loaded = _loaded_method(data, named_data, validate)
    arrays = _check_inputs(inputs, loaded.inputs)
    expected = loaded.shapes.output_specs(arrays, loaded.inputs, loaded.outputs)
    with _captured_stderr() as log:
        try:
            results = loaded.method.execute([torch.from_numpy(a) for a in arrays])
        except RuntimeError as exc:
            failure: Exception | None = exc
        else:
            failure = None
    if failure is not None:
        raise UnsupportedConfigError(
            f"the ExecuTorch runtime failed to execute the payload: {failure}; runtime log: "
            f"{_log_summary(log[0])}"
        ) from None
    for k, (r, spec) in enumerate(zip(results, expected)):
        if tuple(r.shape) != spec.shape:  # the shape rules and the runtime disagree: never a silent reshape
            raise XnnquantError(f"the runtime returned output {k} of shape {tuple(r.shape)}, the shape rules "
                                f"give {spec.shape}")
    if into is None:
        return [np.array(r.numpy(), copy=True) for r in results]
    for slot, r in zip(into, results):
        slot[...] = r.numpy()
    return list(into)
