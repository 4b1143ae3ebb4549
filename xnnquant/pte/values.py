"""The values of an ExecuTorch program method (``EValue`` in program.fbs), as frozen dataclasses.

A method keeps one table of values; instructions, inputs and outputs name them by index.
Each class here is one member of the ``KernelTypes`` union, with the tag it is written
with::

    1 Null   2 Int   3 Bool   4 Double   5 Tensor   6 String   7 IntList   8 DoubleList
    9 BoolList   10 TensorList   11 OptionalTensorList

``IntList``, ``TensorList`` and ``OptionalTensorList`` hold value indices (the runtime
boxes them; -1 is None in an ``OptionalTensorList``); ``DoubleList`` and ``BoolList``
hold the items.  ``MethodBuilder.int_list`` makes the ``Int`` values an ``IntList``
points at.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..errors import XnnquantError


class ScalarType(enum.IntEnum):
    """Element type of a tensor: c10's numbers, as scalar_type.fbs declares them."""

    BYTE = 0
    CHAR = 1
    SHORT = 2
    INT = 3
    LONG = 4
    HALF = 5
    FLOAT = 6
    DOUBLE = 7
    BOOL = 11
    BFLOAT16 = 15
    UINT16 = 27
    UINT32 = 28
    UINT64 = 29


#: numpy dtype of each scalar type (the buffer the runtime exchanges for such a tensor).
NUMPY_DTYPES: dict[ScalarType, np.dtype] = {
    ScalarType.BYTE: np.dtype(np.uint8), ScalarType.CHAR: np.dtype(np.int8), ScalarType.SHORT: np.dtype(np.int16),
    ScalarType.INT: np.dtype(np.int32), ScalarType.LONG: np.dtype(np.int64), ScalarType.HALF: np.dtype(np.float16),
    ScalarType.FLOAT: np.dtype(np.float32), ScalarType.DOUBLE: np.dtype(np.float64),
    ScalarType.BOOL: np.dtype(np.bool_), ScalarType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    ScalarType.UINT16: np.dtype(np.uint16), ScalarType.UINT32: np.dtype(np.uint32),
    ScalarType.UINT64: np.dtype(np.uint64),
}
_BY_DTYPE = {dtype: st for st, dtype in NUMPY_DTYPES.items()}


def scalar_type(dtype: ScalarType | np.dtype | type | str) -> ScalarType:
    """``dtype`` (a ``ScalarType``, or anything ``np.dtype`` takes) as a ``ScalarType``."""
    if isinstance(dtype, ScalarType):
        return dtype
    try:
        found = _BY_DTYPE.get(np.dtype(dtype))
    except TypeError:
        found = None
    if found is None:
        raise XnnquantError(f"no ExecuTorch scalar type for dtype {dtype!r}: expected one of "
                            f"{', '.join(str(d) for d in _BY_DTYPE)}")
    return found


class ShapeDynamism(enum.IntEnum):
    """``TensorShapeDynamism``: whether a tensor's sizes are fixed or upper bounds."""

    STATIC = 0
    DYNAMIC_BOUND = 1
    DYNAMIC_UNBOUND = 2


@dataclass(frozen=True)
class Null:
    """None (an absent optional argument)."""


@dataclass(frozen=True)
class Int:
    value: int


@dataclass(frozen=True)
class Bool:
    value: bool


@dataclass(frozen=True)
class Double:
    value: float


@dataclass(frozen=True)
class String:
    value: str


@dataclass(frozen=True)
class IntList:
    """Indices of ``Int`` values."""

    items: tuple[int, ...]


@dataclass(frozen=True)
class DoubleList:
    items: tuple[float, ...]


@dataclass(frozen=True)
class BoolList:
    items: tuple[bool, ...]


@dataclass(frozen=True)
class TensorList:
    """Indices of ``Tensor`` values."""

    items: tuple[int, ...]


@dataclass(frozen=True)
class OptionalTensorList:
    """Indices of ``Tensor`` values, -1 for None."""

    items: tuple[int, ...]


@dataclass(frozen=True)
class Tensor:
    """A tensor value.

    ``sizes``: logical (torch) sizes, upper bounds when ``dynamism`` is DYNAMIC_BOUND;
    ``dim_order``: dims from outermost to innermost in memory (``(0, 2, 3, 1)``:
    channels-last).  ``constant``: index into the program's constant segment (0: not a
    constant).  ``planned``: the memory planner gives it a place in arena 1 (a constant
    or an unplanned tensor has none; the caller then supplies an unplanned input's
    memory).  ``state``: index into the program's mutable data (0: none): the tensor is
    method state, planned memory that the runtime fills with that data when it loads the
    method and that keeps its values from one call of the method to the next.
    """

    scalar_type: ScalarType
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]
    dynamism: ShapeDynamism = ShapeDynamism.STATIC
    constant: int = 0
    planned: bool = True
    state: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the data at ``sizes``: numel x element size."""
        return math.prod(self.sizes) * NUMPY_DTYPES[self.scalar_type].itemsize


EValue = (Null | Int | Bool | Double | String | IntList | DoubleList | BoolList | TensorList | OptionalTensorList
          | Tensor)
