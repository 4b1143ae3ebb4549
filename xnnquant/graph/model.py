"""What a graph holds: values (with their quantization parameters) and nodes.

These are plain records.  ``Graph`` (builder.py) creates them, ``writer.py`` turns them
into flatbuffer tables, ``reader.py`` makes them from payload bytes.  Ids are the
``id_out`` of the schema: the number nodes use to name a value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..constants import XNN_INVALID_VALUE_ID, XNN_VALUE_FLAG_EXTERNAL_INPUT, XNN_VALUE_FLAG_EXTERNAL_OUTPUT
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..packing.int4 import unpack_int4
from ..rounding import bf16_bits_to_float32
from ..tensor import QuantizedTensor

#: The schema's "no value" id (a missing bias, an internal value's external_id).
INVALID_ID = XNN_INVALID_VALUE_ID


@dataclass(eq=False)
class Deferred:
    """Constant data made only when a payload is written (streaming export).

    ``make()`` returns the value's ``QuantizedTensor`` (quantized datatypes) or its float
    array (fp32 / fp16), of ``datatype`` and ``dims`` (blockwise: ``group_size``,
    per-channel: ``channel_dim``).  Everything the flatbuffer needs follows from those,
    so a graph of deferred constants is written without a single weight in memory: the
    writer calls ``make`` for one value at a time (see writer.payload_chunks).  ``source``
    names what the data is made from, for messages.
    """

    datatype: Datatype
    dims: tuple[int, ...]
    make: Callable[[], Any]
    source: str
    group_size: int | None = None
    channel_dim: int = 0

    def __len__(self) -> int:
        return self.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of data XNNPACK reads (4-bit rows padded to whole bytes)."""
        bits = storage(self.datatype).bits
        count = int(np.prod(self.dims, dtype=np.int64))
        if bits == 4:
            k = self.dims[-1]
            return (count // k) * ((k + 1) // 2) if k else 0
        return count * bits // 8

    @property
    def num_scales(self) -> int:
        """Scales of a per-channel (``dims[channel_dim]``) or blockwise value, else 0."""
        if self.group_size:
            return self.dims[0] * (self.dims[1] // self.group_size)
        return self.dims[self.channel_dim] if storage(self.datatype).quantized else 0

    def produce(self) -> QuantizedTensor | np.ndarray:
        """``make()``, checked against what the graph was told (a mismatch names ``source``)."""
        made = self.make()
        if storage(self.datatype).quantized:
            ok = (isinstance(made, QuantizedTensor) and made.datatype is self.datatype and made.shape == self.dims
                  and (made.group_size or None) == self.group_size and (made.channel_dim or 0) == self.channel_dim)
            got = repr(made) if isinstance(made, QuantizedTensor) else type(made).__name__
        else:
            made = np.asarray(made)
            want = np.dtype(storage(self.datatype).numpy_dtype)
            ok = made.dtype == want and made.shape == self.dims
            got = f"{made.dtype} {made.shape}"
        if not ok:
            raise XnnquantError(f"{self.source}: made {got}, but the graph holds {self.datatype.name} "
                                f"{self.dims}" + (f" in groups of {self.group_size}" if self.group_size else ""))
        return made


ConstantData = bytes | memoryview | Deferred


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@dataclass(frozen=True)
class PerTensorQuant:
    """One scale and zero point for the whole tensor (qint8, quint8, qint32)."""

    scale: float
    zero_point: int


@dataclass(frozen=True, eq=False)
class PerChannelQuant:
    """One scale per slice along ``channel_dim`` (qcint8, qcint4, qcint32).

    ``scale``: float32 ``(dims[channel_dim],)``.  ``scale_buffer_idx`` / ``num_scales`` are
    the ExecuTorch 1.4.1 fields (scales kept as constant data); 0 in payloads we write.
    """

    scale: np.ndarray
    channel_dim: int
    scale_buffer_idx: int = 0
    num_scales: int = 0

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PerChannelQuant) and _same_array(self.scale, other.scale)
                and (self.channel_dim, self.scale_buffer_idx, self.num_scales)
                == (other.channel_dim, other.scale_buffer_idx, other.num_scales))


@dataclass(frozen=True, eq=False)
class PerChannelGroupQuant:
    """One scale per block of ``group_size`` elements of a row (qbint4).

    ``scale``: float32 ``(C * K // group_size,)`` flat row-major ``[C][K // group_size]``,
    each value exactly a bf16.  ``scale_bf16``: the same as uint16 bf16 bit patterns, or
    None when the payload lacks them.  ``scale_buffer_idx`` / ``num_scales``: see
    ``PerChannelQuant``.
    """

    scale: np.ndarray
    channel_dim: int
    group_size: int
    scale_bf16: np.ndarray | None = None
    scale_buffer_idx: int = 0
    num_scales: int = 0

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PerChannelGroupQuant) and _same_array(self.scale, other.scale)
                and _same_array(self.scale_bf16, other.scale_bf16)
                and (self.channel_dim, self.group_size, self.scale_buffer_idx, self.num_scales)
                == (other.channel_dim, other.group_size, other.scale_buffer_idx, other.num_scales))


@dataclass(frozen=True)
class PerTokenDynamicQuant:
    """Rows quantized at run time (qdint8); a row is the last ``num_nonbatch_dims`` dims."""

    num_nonbatch_dims: int


QuantParams = PerTensorQuant | PerChannelQuant | PerChannelGroupQuant | PerTokenDynamicQuant


@dataclass(eq=False)
class Value:
    """One tensor of the graph.

    ``constant`` holds the bytes XNNPACK reads (None for activations, or for an ExecuTorch
    constant whose ``named_key`` has not been resolved).  ``external_id`` is None for
    internal values.  ``dq_datatype`` is the legacy runtime-schema field (Datatype.invalid
    unless an old payload set it).
    """

    id: int
    datatype: Datatype
    dims: tuple[int, ...]
    external_id: int | None = None
    flags: int = 0
    constant: ConstantData | None = None
    quant: QuantParams | None = None
    named_key: str | None = None
    dq_datatype: Datatype = Datatype.invalid

    @property
    def is_input(self) -> bool:
        return bool(self.flags & XNN_VALUE_FLAG_EXTERNAL_INPUT)

    @property
    def is_output(self) -> bool:
        return bool(self.flags & XNN_VALUE_FLAG_EXTERNAL_OUTPUT)

    @property
    def is_constant(self) -> bool:
        return self.constant is not None or self.named_key is not None

    def _key(self) -> tuple[Any, ...]:
        return (self.id, self.datatype, self.dims, self.external_id, self.flags, self.constant,
                self.quant, self.named_key, self.dq_datatype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Value) and self._key() == other._key()

    def array(self) -> np.ndarray:
        """A float constant as an array of shape ``dims`` (float32 or float16)."""
        if self.datatype not in (Datatype.fp32, Datatype.fp16):
            raise XnnquantError(
                f"value {self.id}: array() is for fp32/fp16 constants: got {self.datatype.name} "
                "(use quantized_tensor())"
            )
        data = self._data()
        return np.frombuffer(data, dtype=np.dtype(storage(self.datatype).numpy_dtype).newbyteorder("<")).astype(
            storage(self.datatype).numpy_dtype).reshape(self.dims)

    def quantized_tensor(self) -> QuantizedTensor | None:
        """The constant as a ``QuantizedTensor`` (codes in the logical shape), or None.

        None for float values and for quantized activations (no constant bytes).  The zero
        point is the one XNNPACK uses: the serialized one per tensor, 8 for 4-bit types
        (whose codes are returned signed, stored nibble - 8, so it reads as 0), else 0.
        """
        if self.quant is None or not self.is_constant:
            return None
        if isinstance(self.constant, Deferred):
            made = self.constant.produce()
            return made if isinstance(made, QuantizedTensor) else None
        facts = storage(self.datatype)
        data = self._data()
        count = int(np.prod(self.dims, dtype=np.int64))
        if facts.bits == 4:
            k = self.dims[-1] if self.dims else 1
            rows = count // k if k else 0
            packed = np.frombuffer(data, np.uint8).reshape(rows, (k + 1) // 2)
            codes = unpack_int4(packed, k).reshape(self.dims)
        else:
            codes = np.frombuffer(data, np.dtype(facts.numpy_dtype).newbyteorder("<")).astype(
                facts.numpy_dtype).reshape(self.dims)
        q = self.quant
        if isinstance(q, PerTensorQuant):
            return QuantizedTensor(self.datatype, codes, np.float32(q.scale), int(q.zero_point))
        if isinstance(q, PerChannelQuant):
            return QuantizedTensor(self.datatype, codes, q.scale, 0, channel_dim=q.channel_dim)
        if isinstance(q, PerChannelGroupQuant):
            scale = q.scale
            if scale.size == 0 and q.scale_bf16 is not None:
                scale = bf16_bits_to_float32(q.scale_bf16)
            blocks = self.dims[1] // q.group_size
            return QuantizedTensor(self.datatype, codes, scale.reshape(self.dims[0], blocks), 0,
                                   channel_dim=q.channel_dim, group_size=q.group_size)
        raise XnnquantError(f"value {self.id}: {type(q).__name__} values carry no constant data")

    def _data(self) -> bytes | memoryview:
        if isinstance(self.constant, Deferred):
            made = self.constant.produce()
            if isinstance(made, QuantizedTensor):
                return made.to_bytes()
            return made.astype(made.dtype.newbyteorder("<")).tobytes()
        if self.constant is None:
            if self.named_key is not None:
                raise XnnquantError(
                    f"value {self.id}: its bytes live in the program's named data under key "
                    f"{self.named_key!r}: pass named_data= to load()"
                )
            raise XnnquantError(f"value {self.id} is not a constant: it has no data")
        return self.constant


@dataclass(eq=False)
class Node:
    """One operation.

    ``kind`` is the ``XNodeUnion`` member name (e.g. ``"XNNAdd"``).  ``inputs`` are value
    ids in the order of the table's input fields, trailing optional inputs (bias, the
    unused inputs of a concatenation) left out; ``outputs`` likewise.  ``params`` holds the
    table's remaining fields (vectors as tuples); ``output_min``/``output_max`` are None
    when the node carries no ``OutputMinMax``.
    """

    kind: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict)
    flags: int = 0
    debug_handle: int = 0
    output_min: float | None = None
    output_max: float | None = None

    def _key(self) -> tuple[Any, ...]:
        # float params compared by bit pattern, so NaN == NaN and -0.0 != 0.0
        def norm(v: Any) -> Any:
            if isinstance(v, float):
                return ("f", np.float32(v).tobytes())
            return v
        return (self.kind, self.inputs, self.outputs, sorted((k, norm(v)) for k, v in self.params.items()),
                self.flags, self.debug_handle, norm(self.output_min), norm(self.output_max))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and self._key() == other._key()



@dataclass(frozen=True)
class LoadInfo:
    """What ``load`` read about a payload besides its values and nodes.

    ``Graph.load_info`` holds one for a graph read back, None for a graph built here.
    """

    identifier: str  # file identifier of the flatbuffer: "XN01" or "XN00"
    version: str  # XNNGraph.version (written back when the graph is written again)
    num_externs: int  # XNNGraph.num_externs as declared (validation checks it)
    inline_constants: bool  # a bare flatbuffer: constants inline in the legacy constant_buffer
    named_keys: tuple[str, ...] = ()  # named-data keys the constants refer to (ExecuTorch 1.4.1)
    missing_named_keys: tuple[str, ...] = ()  # those not given in named_data: their values have no bytes
