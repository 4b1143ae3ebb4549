"""``QuantizedTensor``: integer codes plus the parameters that give them meaning.

It is what every scheme returns and what the graph builder stores.  ``codes`` are kept
in the logical shape and in the signed domain of the datatype (int4 codes are in
[-8, 7]); the bytes XNNPACK reads come from ``to_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .arrays import ArrayInput, as_int_codes
from .datatypes import Datatype, ScaleKind, ZeroPoint, storage
from .errors import XnnquantError
from .packing.int4 import pack_int4_bytes


def check_zero_point(datatype: Datatype, zero_point: ArrayInput, scale_shape: tuple[int, ...] = ()) -> np.ndarray:
    """``zero_point`` as int64 (shape ``()`` or ``scale_shape``), checked against the
    datatype's convention (``StorageFacts.zero_point``); ``XnnquantError`` otherwise.

    Free (qint8, quint8) and per-row (qdint8) zero points lie in the code range; every
    other type is symmetric: zero point 0.  For the 4-bit types that is 0 in the signed
    codes [-8, 7] a ``QuantizedTensor`` holds; the stored nibble is code + 8, which XNNPACK
    reads with its zero point 8, so 8 is never a zero point of these codes.
    """
    datatype = Datatype(datatype)
    facts = storage(datatype)
    zp = as_int_codes(zero_point, "zero_point")
    if zp.shape not in ((), scale_shape):
        raise XnnquantError(f"{datatype.name} zero_point has the wrong shape: got {zp.shape}, "
                            f"expected () or the scale's {scale_shape}")
    if facts.zero_point in (ZeroPoint.FREE, ZeroPoint.RUNTIME):
        bad = (zp < facts.code_min) | (zp > facts.code_max)
        expected = f"{facts.code_min} to {facts.code_max}"
    else:
        bad = zp != 0
        expected = "0 (signed codes in [-8, 7]; storage adds 8 to each nibble)" if facts.bits == 4 else "0"
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0]) if zp.ndim else ()
        at = f" at index {where}" if where else ""
        raise XnnquantError(f"zero_point is out of range for {datatype.name}: got {zp[where]}{at}, expected {expected}")
    return zp


def packed_nbytes(datatype: Datatype, shape: tuple[int, ...]) -> int:
    """Bytes of the codes of a ``datatype`` tensor of ``shape`` as XNNPACK reads them: 4-bit
    codes take ``ceil(K / 2)`` bytes a row (K the last dim), the others their itemsize a code."""
    facts = storage(datatype)
    if facts.bits == 4:
        return math.prod(shape[:-1]) * ((shape[-1] + 1) // 2) if shape else 1
    return math.prod(shape) * np.dtype(facts.numpy_dtype).itemsize


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """Codes, scales and zero points of one quantized tensor.

    ``dequantize() = (codes - zero_point) * scale``, with ``scale`` and ``zero_point``
    broadcast by granularity:

    ==========  ==========================  =============================
    scale kind  ``scale`` shape             broadcast along
    ==========  ==========================  =============================
    tensor      ``()``                      everything
    channel     ``(shape[channel_dim],)``   ``channel_dim``
    group       ``(C, K // group_size)``    rows, then blocks of K
    runtime     ``(rows,)``                 leading ``ndim - num_nonbatch_dims`` dims
    ==========  ==========================  =============================
    """

    datatype: Datatype
    codes: np.ndarray
    scale: np.ndarray
    zero_point: int | np.ndarray = 0
    channel_dim: int | None = None
    group_size: int | None = None
    num_nonbatch_dims: int | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        facts = storage(self.datatype)
        object.__setattr__(self, "datatype", Datatype(self.datatype))
        if not facts.quantized:
            raise XnnquantError(f"QuantizedTensor needs a quantized datatype: got {self.datatype.name}")
        codes = np.asarray(self.codes)
        if codes.dtype != np.dtype(facts.numpy_dtype):
            raise XnnquantError(
                f"{self.datatype.name} codes must be {facts.numpy_dtype}: got dtype {codes.dtype}"
            )
        object.__setattr__(self, "codes", codes)
        object.__setattr__(self, "scale", np.asarray(self.scale, dtype=np.float32))
        expected = self._expected_scale_shape()
        if self.scale.shape != expected:
            raise XnnquantError(
                f"{self.datatype.name} scale has the wrong shape: got {self.scale.shape}, expected {expected}"
            )
        check_zero_point(self.datatype, self.zero_point, self.scale.shape)

    def _expected_scale_shape(self) -> tuple[int, ...]:
        kind = storage(self.datatype).scale
        shape = self.codes.shape
        if kind is ScaleKind.TENSOR:
            return ()
        if kind is ScaleKind.CHANNEL:
            if self.channel_dim is None or not 0 <= self.channel_dim < len(shape):
                raise XnnquantError(
                    f"{self.datatype.name} needs channel_dim in [0, {len(shape)}): got {self.channel_dim}"
                )
            return (shape[self.channel_dim],)
        if kind is ScaleKind.GROUP_BF16:
            if len(shape) != 2:
                raise XnnquantError(f"qbint4 codes must be 2-D [C, K]: got shape {shape}")
            if not self.group_size or shape[1] % self.group_size:
                raise XnnquantError(
                    f"group_size must divide K: got group_size={self.group_size}, K={shape[1]}"
                )
            return (shape[0], shape[1] // self.group_size)
        nonbatch = self.num_nonbatch_dims if self.num_nonbatch_dims is not None else 1
        if not 0 <= nonbatch <= len(shape):
            raise XnnquantError(f"num_nonbatch_dims must be in [0, {len(shape)}]: got {nonbatch}")
        return (int(np.prod(shape[: len(shape) - nonbatch], dtype=np.int64)),)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape, e.g. ``(out_features, in_features)``."""
        return tuple(self.codes.shape)

    @property
    def bits(self) -> int:
        return storage(self.datatype).bits

    def _broadcast(self, per: np.ndarray) -> np.ndarray:
        """``per`` (scale-shaped) expanded so it broadcasts against ``codes``."""
        kind = storage(self.datatype).scale
        per = np.asarray(per)
        if kind is ScaleKind.TENSOR or per.ndim == 0:
            return per
        shape = self.codes.shape
        if kind is ScaleKind.CHANNEL:
            view = [1] * len(shape)
            view[self.channel_dim] = shape[self.channel_dim]  # type: ignore[index]
            return per.reshape(view)
        if kind is ScaleKind.GROUP_BF16:
            return np.repeat(per, self.group_size, axis=1)  # type: ignore[arg-type]
        nonbatch = self.num_nonbatch_dims if self.num_nonbatch_dims is not None else 1
        return per.reshape(shape[: len(shape) - nonbatch] + (1,) * nonbatch)

    def dequantize(self) -> np.ndarray:
        """``(codes - zero_point) * scale`` as float32, in the logical shape."""
        zp = self._broadcast(np.asarray(self.zero_point, dtype=np.float32))
        centered = self.codes.astype(np.float32) - zp
        return (centered * self._broadcast(self.scale)).astype(np.float32)

    @property
    def nbytes(self) -> int:
        """Length of ``to_bytes()``, known without packing (``packed_nbytes``)."""
        return packed_nbytes(self.datatype, self.codes.shape)

    def to_bytes(self) -> bytes:
        """Constant data exactly as XNNPACK reads it.

        8- and 32-bit codes: little-endian, row-major in the logical shape.  4-bit codes:
        ``pack_int4`` along the last axis (``ceil(K / 2)`` bytes per row, see there), packed
        straight into the bytes returned (``pack_int4_bytes``).
        """
        if self.datatype is Datatype.qdint8:
            raise XnnquantError(
                "qdint8 values are never constant data: XNNPACK quantizes them per token at run time"
            )
        if self.bits == 4:
            return pack_int4_bytes(self.codes)
        return np.ascontiguousarray(self.codes, self.codes.dtype.newbyteorder("<")).tobytes()

    def __repr__(self) -> str:
        extra = "".join(
            f", {k}={getattr(self, k)}"
            for k in ("channel_dim", "group_size", "num_nonbatch_dims")
            if getattr(self, k) is not None
        )
        return f"QuantizedTensor({self.datatype.name}, shape={self.shape}, scale{self.scale.shape}{extra})"
