"""The options of ``xq.export``, parsed once at the API boundary.

``weights`` is a string such as ``"qb4w:32"``; ``WeightScheme.parse`` turns it into a
frozen dataclass whose ``__str__`` gives the string back (for reports), and refuses a
bad spelling by listing the valid forms:

==========  ====================================  =====================================
spelling    weights of a linear                   activations entering it
==========  ====================================  =====================================
``fp32``    float32                               float32
``qc8w``    int8, one float32 scale per channel   int8 per token, at run time (qdint8)
``qc4w``    int4, one float32 scale per channel   int8 per token, at run time (qdint8)
``qb4w:G``  int4, one bf16 scale per G columns    int8 per token, at run time (qdint8)
==========  ====================================  =====================================

G is a multiple of 32 (XNNPACK's least block size).  Convolutions take what XNNPACK 1.4.1
computes (see ``conv.py``): ``qc8w`` becomes a per-image dynamically quantized int8
convolution; depthwise convolutions and the 4-bit schemes have no XNNPACK kernel, so such
layers are refused unless ``fallback=`` names a scheme they can take.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..constants import XNN_MIN_BLOCKSIZE
from ..datatypes import Datatype
from ..errors import XnnquantError

VALID_FORMS = "'fp32', 'qc8w', 'qc4w' or 'qb4w:G' with G a multiple of 32 (e.g. 'qb4w:32')"


class SchemeKind(str, Enum):
    """The kinds of weight scheme (``WeightScheme.kind``)."""

    FP32 = "fp32"
    QC8W = "qc8w"
    QC4W = "qc4w"
    QB4W = "qb4w"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class WeightScheme:
    """How the weights of a layer are stored (see the module docstring)."""

    kind: SchemeKind
    group_size: int | None = None

    def __post_init__(self) -> None:
        blockwise = self.kind is SchemeKind.QB4W
        if blockwise != (self.group_size is not None):
            raise XnnquantError(f"group_size goes with qb4w only: got kind {self.kind}, group_size {self.group_size}")
        if blockwise and (self.group_size < XNN_MIN_BLOCKSIZE or self.group_size % XNN_MIN_BLOCKSIZE):  # type: ignore[operator]
            raise XnnquantError(
                f"qb4w group size must be a positive multiple of {XNN_MIN_BLOCKSIZE}: got {self.group_size} "
                f"(valid forms: {VALID_FORMS})")

    def __str__(self) -> str:
        return f"qb4w:{self.group_size}" if self.kind is SchemeKind.QB4W else self.kind.value

    @classmethod
    def parse(cls, value: Any, name: str = "weights") -> WeightScheme:
        """``WeightScheme`` from itself or its spelling (case and spaces ignored)."""
        if isinstance(value, WeightScheme):
            return value
        if isinstance(value, str):
            text = value.strip().lower().replace(" ", "")
            head, sep, tail = text.partition(":")
            if not sep and head in {k.value for k in SchemeKind} - {"qb4w"}:
                return cls(SchemeKind(head))
            if sep and head == "qb4w" and tail.isdigit():
                return cls(SchemeKind.QB4W, int(tail))
        raise XnnquantError(f"unknown {name} scheme: got {value!r}, expected {VALID_FORMS}")

    @property
    def is_quantized(self) -> bool:
        return self.kind is not SchemeKind.FP32

    @property
    def is_4bit(self) -> bool:
        return self.kind in (SchemeKind.QC4W, SchemeKind.QB4W)

    @property
    def datatype(self) -> Datatype:
        """The weight's datatype: fp32, qcint8, qcint4 or qbint4."""
        return {SchemeKind.FP32: Datatype.fp32, SchemeKind.QC8W: Datatype.qcint8,
                SchemeKind.QC4W: Datatype.qcint4, SchemeKind.QB4W: Datatype.qbint4}[self.kind]


FP32 = WeightScheme(SchemeKind.FP32)
