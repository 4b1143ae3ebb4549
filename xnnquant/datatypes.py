"""The datatype enum (schema wire values) and one table of storage facts.

``Datatype`` carries the values of the XN01 schema's ``XNNDatatype``.  XNNPACK's C
``enum xnn_datatype`` numbers the same types differently (qbint4 is 10 on the wire
and 12 in C), so the mapping to C is an explicit table, never arithmetic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .arguments import is_plain_int, shown
from .errors import XnnquantError


class Datatype(enum.IntEnum):
    """``XNNDatatype`` of the XN01 schema, with its wire values."""

    invalid = 0
    fp32 = 1
    fp16 = 2
    qint8 = 3
    quint8 = 4
    qint32 = 5
    qcint8 = 6
    qcint32 = 7
    qcint4 = 8
    qdint8 = 9
    qbint4 = 10


class QuantParamsKind(enum.IntEnum):
    """``XNNQuantParams`` union of the schema, with its type tags (0 = none)."""

    none = 0
    PerChannelQuant = 1
    PerTensorQuant = 2
    PerTokenDynamicQuant = 3
    PerChannelGroupQuant = 4


class ZeroPoint(enum.Enum):
    """How a datatype's zero point is chosen."""

    NONE = "none"  # not quantized
    FREE = "free"  # any value in the code range, stored in PerTensorQuant
    ZERO = "zero"  # must be 0
    EIGHT = "eight"  # 4-bit: the runtime hands XNNPACK zero point 8 (unsigned nibbles)
    RUNTIME = "runtime"  # computed per row by XNNPACK when the graph runs


class ScaleKind(enum.Enum):
    """Which scales a datatype carries."""

    NONE = "none"
    TENSOR = "one fp32 scale"
    CHANNEL = "one fp32 scale per channel"
    GROUP_BF16 = "one bf16 scale per (channel, group)"
    RUNTIME = "one fp32 scale per row, computed at run time"


@dataclass(frozen=True)
class StorageFacts:
    """What XNNPACK stores and expects for one datatype.

    ``code_min``/``code_max`` are in the domain of ``QuantizedTensor.codes`` (signed for
    the 4-bit types, whose stored nibble is code + 8).
    """

    bits: int
    signed: bool
    code_min: int
    code_max: int
    zero_point: ZeroPoint
    scale: ScaleKind
    quant_params: QuantParamsKind
    xnn_c_value: int  # value of the same type in XNNPACK's C enum xnn_datatype
    numpy_dtype: str  # dtype of QuantizedTensor.codes (or of the float data)

    @property
    def quantized(self) -> bool:
        return self.quant_params is not QuantParamsKind.none


_I8, _I32 = (-(2**7), 2**7 - 1), (-(2**31), 2**31 - 1)
QP = QuantParamsKind

#: One row per datatype (one line each, however wide).  XNNPACK C values are those of XNNPACK 1adaa7c7.
STORAGE: dict[Datatype, StorageFacts] = {
    Datatype.fp32: StorageFacts(32, True, 0, 0, ZeroPoint.NONE, ScaleKind.NONE, QP.none, 1, "float32"),
    Datatype.fp16: StorageFacts(16, True, 0, 0, ZeroPoint.NONE, ScaleKind.NONE, QP.none, 2, "float16"),
    Datatype.qint8: StorageFacts(8, True, *_I8, ZeroPoint.FREE, ScaleKind.TENSOR, QP.PerTensorQuant, 3, "int8"),
    Datatype.quint8: StorageFacts(8, False, 0, 255, ZeroPoint.FREE, ScaleKind.TENSOR, QP.PerTensorQuant, 4, "uint8"),
    Datatype.qint32: StorageFacts(32, True, *_I32, ZeroPoint.ZERO, ScaleKind.TENSOR, QP.PerTensorQuant, 5, "int32"),
    Datatype.qcint8: StorageFacts(8, True, *_I8, ZeroPoint.ZERO, ScaleKind.CHANNEL, QP.PerChannelQuant, 6, "int8"),
    Datatype.qcint32: StorageFacts(32, True, *_I32, ZeroPoint.ZERO, ScaleKind.CHANNEL, QP.PerChannelQuant, 7, "int32"),
    Datatype.qcint4: StorageFacts(4, True, -8, 7, ZeroPoint.EIGHT, ScaleKind.CHANNEL, QP.PerChannelQuant, 8, "int8"),
    Datatype.qdint8: StorageFacts(8, True, *_I8, ZeroPoint.RUNTIME, ScaleKind.RUNTIME, QP.PerTokenDynamicQuant, 9, "int8"),  # noqa: E501
    Datatype.qbint4: StorageFacts(4, True, -8, 7, ZeroPoint.EIGHT, ScaleKind.GROUP_BF16, QP.PerChannelGroupQuant, 12, "int8"),  # noqa: E501
}

#: XNNPACK's C ``enum xnn_datatype`` at commit 1adaa7c7, for the types the schema has and
#: the ones it lacks (qpint8 and later), so a C value read back can be named.
XNN_C_DATATYPE: dict[str, int] = {
    "invalid": 0, "fp32": 1, "fp16": 2, "qint8": 3, "quint8": 4, "qint32": 5,
    "qcint8": 6, "qcint32": 7, "qcint4": 8, "qdint8": 9, "qpint8": 10, "int32": 11,
    "qbint4": 12, "pfp32": 13, "bf16": 14, "qduint8": 15, "pfp16": 16, "pqint8": 17,
    "qcint2": 18,
}


def storage(datatype: Datatype | int) -> StorageFacts:
    """Storage facts of ``datatype``; ``XnnquantError`` for invalid or unknown values."""
    if isinstance(datatype, Datatype) and datatype in STORAGE:
        return STORAGE[datatype]
    if is_plain_int(datatype) and int(datatype) in {d.value for d in STORAGE}:
        return STORAGE[Datatype(int(datatype))]
    valid = ", ".join(f"{d.name}={d.value}" for d in STORAGE)
    given = repr(datatype) if is_plain_int(datatype) else shown(datatype)
    raise XnnquantError(f"unknown datatype: got {given}, expected one of {valid}")


def datatype_of(value: Datatype | int) -> Datatype:
    """``value`` (a ``Datatype``, or its wire value as an int) as a valid ``Datatype``."""
    storage(value)
    return Datatype(int(value))


def to_xnn_c(datatype: Datatype | int) -> int:
    """The value of ``datatype`` in XNNPACK's C ``enum xnn_datatype``."""
    if Datatype(datatype) is Datatype.invalid:
        return 0
    return storage(datatype).xnn_c_value


def from_xnn_c(value: int) -> Datatype:
    """The schema ``Datatype`` of a C ``enum xnn_datatype`` value."""
    for datatype, facts in STORAGE.items():
        if facts.xnn_c_value == value:
            return datatype
    if value == 0:
        return Datatype.invalid
    names = {v: k for k, v in XNN_C_DATATYPE.items()}
    raise XnnquantError(
        f"XNNPACK datatype {value} ({names.get(value, 'unknown')}) has no XN01 wire value: "
        f"expected one of {sorted(f.xnn_c_value for f in STORAGE.values())}"
    )
