"""Building an ExecuTorch program (``.pte``): methods, their values and instructions, data.

``ProgramBuilder`` holds what is program-wide (the constant segment, named data, the
methods); ``MethodBuilder`` one method's value table, inputs, outputs, operators,
delegates and instructions, in the order they are added.  ``to_bytes`` / ``chunks``
plan each method's memory (``memory.py``) and write the file (``writer.py``)::

    p = ProgramBuilder()
    m = p.method("forward")
    x = m.input(m.tensor(np.float32, (2, 3)))
    y = m.tensor(np.float32, (2, 3))
    m.delegate_call(m.delegate("XnnpackBackend", payload), [x], [y])
    m.output(y)
    pte = p.to_bytes()

Nothing here imports torch or executorch; ``portable.py`` turns ATen operators into
``kernel_call``s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import XnnquantError
from .values import (
    NUMPY_DTYPES,
    Bool,
    BoolList,
    Double,
    DoubleList,
    EValue,
    Int,
    IntList,
    Null,
    OptionalTensorList,
    ScalarType,
    ShapeDynamism,
    String,
    Tensor,
    TensorList,
    scalar_type,
)

#: Bytes as stored (a bytearray given is copied into bytes: it could change later).
Blob = bytes | memoryview
BytesLike = bytes | bytearray | memoryview
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Chunked:
    """Bytes given piece by piece (a payload too large to hold at once): ``size`` bytes in
    all, the pieces produced while the program is written.  ``chunks`` is iterated once."""

    size: int
    chunks: Iterable[bytes | memoryview] = field(repr=False)


Payload = Blob | Chunked


@dataclass(frozen=True)
class KernelCall:
    """Call ``operators[op_index]`` on the values ``args``."""

    op_index: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class DelegateCall:
    """Execute ``delegates[delegate_index]`` on the values ``args`` (inputs, then outputs)."""

    delegate_index: int
    args: tuple[int, ...]


Instruction = KernelCall | DelegateCall


@dataclass(frozen=True)
class Delegate:
    """A backend's payload: ``backend_id`` (e.g. ``"XnnpackBackend"``), the bytes it
    compiles at method load, and its compile specs ``(key, value bytes)``."""

    backend_id: str
    payload: Payload = field(repr=False)
    compile_specs: tuple[tuple[str, bytes], ...] = ()


def _text(value: str, what: str) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise XnnquantError(f"{what} must be a str without NUL characters: got {value!r}")
    return value


class MethodBuilder:
    """One method of a program: values, inputs, outputs, operators, delegates, instructions.

    Every ``add`` method returns the index of what it added.  ``container`` is the pair of
    pytree specs (inputs, outputs) written as the method's ``ContainerMetadata``; None
    writes the specs of a ``forward(*inputs)`` returning a tuple (``pytree.py``).
    """

    def __init__(self, program: ProgramBuilder, name: str) -> None:
        self.program = program
        self.name = _text(name, "a method name")
        self.values: list[EValue] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        self.operators: list[tuple[str, str]] = []
        self.delegates: list[Delegate] = []
        self.instructions: list[Instruction] = []
        self.container: tuple[str, str] | None = None

    # ------------------------------------------------------------------ values

    def value(self, value: EValue) -> int:
        """Append ``value`` to the value table (its indices checked); returns its index."""
        if isinstance(value, (IntList, TensorList, OptionalTensorList)):
            want: type = Int if isinstance(value, IntList) else Tensor
            for item in value.items:
                if isinstance(value, OptionalTensorList) and item == -1:
                    continue
                self._check_index(item, f"{type(value).__name__} item", want)
        self.values.append(value)
        return len(self.values) - 1

    def null(self) -> int:
        return self.value(Null())

    def int_value(self, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not -2**63 <= value < 2**63:
            raise XnnquantError(f"an Int value must be an int in the int64 range: got {value!r}")
        return self.value(Int(int(value)))

    def bool_value(self, value: bool) -> int:
        if not isinstance(value, (bool, np.bool_)):
            raise XnnquantError(f"a Bool value must be a bool: got {value!r}")
        return self.value(Bool(bool(value)))

    def double(self, value: float) -> int:
        return self.value(Double(float(value)))

    def string(self, value: str) -> int:
        return self.value(String(_text(value, "a String value")))

    def int_list(self, items: Sequence[int]) -> int:
        """An ``IntList`` of ``items``: each int becomes an ``Int`` value of its own, appended
        first (the list holds their indices, which is how the runtime reads it)."""
        return self.value(IntList(tuple(self.int_value(item) for item in items)))

    def double_list(self, items: Sequence[float]) -> int:
        return self.value(DoubleList(tuple(float(x) for x in items)))

    def bool_list(self, items: Sequence[bool]) -> int:
        return self.value(BoolList(tuple(bool(x) for x in items)))

    def tensor_list(self, tensors: Sequence[int]) -> int:
        return self.value(TensorList(tuple(tensors)))

    def optional_tensor_list(self, tensors: Sequence[int | None]) -> int:
        return self.value(OptionalTensorList(tuple(-1 if t is None else t for t in tensors)))

    def tensor(self, dtype: ScalarType | np.dtype | type | str, sizes: Sequence[int], *,
               dim_order: Sequence[int] | None = None, dynamic: bool = False,
               data: np.ndarray | None = None, planned: bool = True) -> int:
        """A tensor value of ``sizes`` (logical, torch's order) and element type ``dtype``.

        ``dim_order``: memory order of the dims, outermost first (None: contiguous).
        ``dynamic``: the sizes are upper bounds (DYNAMIC_BOUND), memory planned at them.
        ``data``: a constant (array of ``sizes``, any numpy dtype that casts exactly to
        ``dtype``'s), stored in the constant segment in ``dim_order``'s memory order.
        ``planned=False``: no memory planned (an input whose memory the caller gives).
        """
        st = scalar_type(dtype)
        sizes = tuple(sizes)
        if not all(isinstance(d, (int, np.integer)) and 0 <= d <= _INT32_MAX for d in sizes):
            raise XnnquantError(f"tensor sizes must be ints in [0, 2**31): got {sizes}")
        order = tuple(range(len(sizes))) if dim_order is None else tuple(int(d) for d in dim_order)
        if sorted(order) != list(range(len(sizes))):
            raise XnnquantError(f"dim_order must be a permutation of the {len(sizes)} dims: got {order}")
        sizes = tuple(int(d) for d in sizes)
        dynamism = ShapeDynamism.DYNAMIC_BOUND if dynamic else ShapeDynamism.STATIC
        constant = 0
        if data is not None:
            array = np.asarray(data)
            if array.shape != sizes:
                raise XnnquantError(f"constant data has shape {array.shape}, expected the tensor's sizes {sizes}")
            if dynamic:
                raise XnnquantError("a constant tensor cannot be dynamic: its data fixes its sizes")
            stored = np.array(array.transpose(order), dtype=NUMPY_DTYPES[st], order="C")  # 0-d stays 0-d
            if not np.array_equal(stored.astype(array.dtype), array.transpose(order),
                                  equal_nan=array.dtype.kind in "fc"):
                raise XnnquantError(f"constant data of dtype {array.dtype} does not cast exactly to {st.name}")
            constant = self.program.constant(stored.tobytes())
        return self.value(Tensor(st, sizes, order, dynamism, constant, planned and constant == 0))

    def state(self, data: np.ndarray, *, dtype: ScalarType | np.dtype | type | str | None = None,
              dim_order: Sequence[int] | None = None) -> int:
        """A tensor of method state: planned memory holding ``data`` (its initial values, any
        array; the element type ``dtype``, else ``data``'s) when the method is loaded, and
        whatever the method's instructions last wrote into it from one call to the next.  A
        fresh load of the method starts from ``data`` again.  Its memory is never shared.

        The initial values are stored once per program for equal bytes (the mutable data
        segment, ``writer.SegmentLayout``)."""
        array = np.asarray(data)
        st = scalar_type(array.dtype if dtype is None else dtype)
        sizes = tuple(int(d) for d in array.shape)
        order = tuple(range(len(sizes))) if dim_order is None else tuple(int(d) for d in dim_order)
        if sorted(order) != list(range(len(sizes))):
            raise XnnquantError(f"dim_order must be a permutation of the {len(sizes)} dims: got {order}")
        stored = np.array(array.transpose(order), dtype=NUMPY_DTYPES[st], order="C")
        if not np.array_equal(stored.astype(array.dtype), array.transpose(order), equal_nan=array.dtype.kind in "fc"):
            raise XnnquantError(f"state data of dtype {array.dtype} does not cast exactly to {st.name}")
        index = self.program.mutable_data(stored.tobytes())
        return self.value(Tensor(st, sizes, order, ShapeDynamism.STATIC, 0, True, index))

    # ------------------------------------------------------------------ signature

    def input(self, value: int) -> int:
        """Mark ``value`` as the next input of the method; returns it."""
        self.inputs.append(self._check_index(value, "an input"))
        return value

    def output(self, value: int) -> int:
        """Mark ``value`` as the next output of the method; returns it."""
        self.outputs.append(self._check_index(value, "an output"))
        return value

    # ------------------------------------------------------------------ instructions

    def operator(self, name: str, overload: str = "") -> int:
        """Index of the operator ``name.overload`` (e.g. ``"aten::add"``, ``"out"``), added once."""
        key = (_text(name, "an operator name"), _text(overload, "an operator overload"))
        if key not in self.operators:
            self.operators.append(key)
        return self.operators.index(key)

    def kernel_call(self, name: str, overload: str, args: Sequence[int]) -> None:
        """Call the kernel ``name.overload`` on the values ``args`` (the schema's arguments
        in order, out tensors included, then the returned value)."""
        checked = tuple(self._check_index(a, f"argument {i} of {name}.{overload}") for i, a in enumerate(args))
        self.instructions.append(KernelCall(self.operator(name, overload), checked))

    def delegate(self, backend_id: str, payload: BytesLike | Chunked,
                 compile_specs: Sequence[tuple[str, bytes]] = ()) -> int:
        """Index of a new delegate running ``payload`` on the backend ``backend_id``."""
        if not isinstance(payload, (bytes, bytearray, memoryview, Chunked)):
            raise XnnquantError(f"a delegate payload must be bytes or Chunked: got {type(payload).__name__}")
        specs = tuple((_text(k, "a compile spec key"), bytes(v)) for k, v in compile_specs)
        stored = bytes(payload) if isinstance(payload, bytearray) else payload
        self.delegates.append(Delegate(_text(backend_id, "a backend id"), stored, specs))
        return len(self.delegates) - 1

    def delegate_call(self, delegate: int, inputs: Sequence[int], outputs: Sequence[int]) -> None:
        """Execute delegate ``delegate`` with the values ``inputs`` and ``outputs``."""
        if not 0 <= delegate < len(self.delegates):
            raise XnnquantError(f"delegate_call names delegate {delegate}: the method has {len(self.delegates)}")
        args = tuple(self._check_index(a, "a delegate argument", Tensor) for a in (*inputs, *outputs))
        self.instructions.append(DelegateCall(delegate, args))

    def _check_index(self, index: int, what: str, kind: type | None = None) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self.values):
            raise XnnquantError(f"{what} must be a value index in [0, {len(self.values)}): got {index!r}")
        if kind is not None and not isinstance(self.values[index], kind):
            raise XnnquantError(f"{what} must be a {kind.__name__} value: value {index} is a "
                                f"{type(self.values[index]).__name__}")
        return int(index)


class ProgramBuilder:
    """A program: its methods, its constant segment and its named data."""

    def __init__(self) -> None:
        self.methods: list[MethodBuilder] = []
        #: constant tensor data by constant index; index 0 is the empty placeholder that
        #: non-constant tensors point at
        self.constants: list[bytes] = [b""]
        #: initial values of method state (``MethodBuilder.state``) by index, each distinct
        #: once; index 0 is the empty placeholder that tensors without state point at
        self.mutable: list[bytes] = [b""]
        self.named_data: dict[str, Payload] = {}

    def method(self, name: str = "forward") -> MethodBuilder:
        """A new method called ``name``."""
        if any(m.name == name for m in self.methods):
            raise XnnquantError(f"the program already has a method {name!r}")
        self.methods.append(MethodBuilder(self, name))
        return self.methods[-1]

    def constant(self, data: bytes) -> int:
        """Index of a new constant holding ``data`` (a tensor's bytes in memory order)."""
        self.constants.append(bytes(data))
        return len(self.constants) - 1

    def mutable_data(self, data: bytes) -> int:
        """Index of the initial values ``data`` of a state tensor (equal bytes: one index)."""
        data = bytes(data)
        for index, held in enumerate(self.mutable):
            if index and len(held) == len(data) and held == data:
                return index
        self.mutable.append(data)
        return len(self.mutable) - 1

    def add_named_data(self, key: str, data: BytesLike | Chunked) -> None:
        """A blob found by ``key`` (XNNPACK delegates name their constants so), bytes or
        ``Chunked`` (made when written); the same key twice must carry the same bytes."""
        if isinstance(data, Chunked) and isinstance(key, str):
            _text(key, "a named data key")
            if key in self.named_data:
                raise XnnquantError(f"named data {key!r} was added twice")
            self.named_data[key] = data
            return
        if not isinstance(key, str) or not isinstance(data, (bytes, bytearray, memoryview)):
            raise XnnquantError(f"named data must map str keys to bytes: got {type(key).__name__} -> "
                                f"{type(data).__name__}")
        _text(key, "a named data key")
        if key in self.named_data and self.named_data[key] != data:
            raise XnnquantError(f"named data {key!r} was added twice with different bytes")
        self.named_data[key] = bytes(data) if isinstance(data, bytearray) else data

    def chunks(self) -> Iterator[Blob]:
        """The ``.pte`` piece by piece (``writer.program_chunks``)."""
        from .writer import program_chunks

        return program_chunks(self)

    def to_bytes(self) -> bytes:
        """The ``.pte`` file."""
        return b"".join(self.chunks())
