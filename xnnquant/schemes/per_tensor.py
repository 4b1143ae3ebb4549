"""Static per-tensor quantization: qint8 and quint8, one scale and one zero point.

Asymmetric by default (torchao's and PyTorch's min-max rule, in float32)::

    lo, hi = min(0, min(x)), max(0, max(x))
    scale  = (hi - lo) / (qmax - qmin)
    zp     = clamp(qmin - round_half_even(lo / scale), qmin, qmax)

``symmetric=True`` gives ``scale = max|x| / ((qmax - qmin) / 2)`` with the zero point in
the middle of the range (0 for qint8, 128 for quint8).  A tensor of zeros gets scale 1.0;
scales below the smallest normal float32 are clamped up to it.  A caller-given scale and
zero point are used exactly as given (both or neither).
Codes: ``clamp(round_half_even(x * (1 / scale)) + zp, qmin, qmax)``.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import numpy as np

from ..arguments import flag, is_plain_int, shown
from ..arrays import ArrayInput
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..rounding import round_half_even
from ..tensor import QuantizedTensor
from . import kernels
from .checks import float_source, positive_normal, user_scale, user_zero_point
from .search import finish_scales, half_range

DATATYPES = (Datatype.qint8, Datatype.quint8)


def _datatype(dtype: object) -> Datatype:
    """``dtype``: a ``Datatype``, its wire value or its name, of qint8 or quint8."""
    datatype = None
    if is_plain_int(dtype) and int(cast(int, dtype)) in {d.value for d in DATATYPES}:
        datatype = Datatype(int(cast(int, dtype)))
    elif isinstance(dtype, str) and dtype in {d.name for d in DATATYPES}:
        datatype = Datatype[dtype]
    if datatype is None:
        given = repr(dtype) if isinstance(dtype, (str, Datatype)) or is_plain_int(dtype) else shown(dtype)
        raise XnnquantError(
            f"unsupported per-tensor datatype: got {given}, expected Datatype.qint8 or Datatype.quint8"
        )
    return datatype


def choose_qparams(x: ArrayInput, dtype: Datatype = Datatype.qint8, symmetric: bool = False) -> tuple[np.ndarray, int]:
    """(scale float32 ``()``, zero point int) of ``x`` for ``dtype``."""
    arr = float_source(x, "x", min_rank=0)
    return _choose(arr, _datatype(dtype), flag(symmetric, "symmetric"))


def _choose(arr: np.ndarray, datatype: Datatype, symmetric: bool) -> tuple[np.ndarray, int]:
    """``arr``: any float dtype, C-contiguous, not yet checked for finiteness."""
    facts = storage(datatype)
    qmin, qmax = facts.code_min, facts.code_max
    if symmetric:
        absmax = kernels.block_absmax(arr, arr.size, (arr, "x"))
        scale = finish_scales(absmax / half_range(qmin, qmax), absmax == 0, bf16=False)
        return scale.reshape(()), (qmin + qmax + 1) // 2
    low, high = kernels.value_range(arr, (arr, "x"))
    lo = np.minimum(low, np.float32(0))
    hi = np.maximum(high, np.float32(0))
    with np.errstate(over="ignore"):
        raw = (hi - lo) / np.float32(qmax - qmin)
    if not np.isfinite(raw):
        raise XnnquantError(
            f"x has a range that overflows float32: got min {lo:.9g}, max {hi:.9g}, expected max - min to be finite"
        )
    scale = positive_normal(np.asarray(raw, np.float32), np.asarray(hi == lo))
    zp = np.clip(qmin - round_half_even(lo / scale), qmin, qmax)
    return scale, int(zp)


def quantize(x: ArrayInput, dtype: Datatype = Datatype.qint8, *positional: Any, scale: ArrayInput | None = None,
             zero_point: object = None, symmetric: bool = False) -> QuantizedTensor:
    """Quantize ``x`` (any rank up to 6, fp32/fp16/bf16) with one scale and zero point.

    ``scale`` and ``zero_point`` (both or neither), when given, are used as is;
    ``symmetric`` chooses the scale otherwise.  They are keyword-only, as the other
    schemes' options are; passing them positionally (the former signature) still works,
    with a ``DeprecationWarning``.

    Returns a qint8 (int8 codes) or quint8 (uint8 codes) ``QuantizedTensor`` shaped like
    ``x``, scale float32 ``()``, zero point an int in the codes' range.
    """
    if positional:
        scale, zero_point, symmetric = _deprecated_positional(positional, scale, zero_point, symmetric)
    arr = float_source(x, "x", min_rank=0)
    datatype = _datatype(dtype)
    facts = storage(datatype)
    symmetric = flag(symmetric, "symmetric")
    if (scale is None) != (zero_point is None):
        raise XnnquantError(
            f"give both scale and zero_point or neither: got scale={scale!r}, zero_point={zero_point!r}"
        )
    if scale is None:
        scale_arr, zp = _choose(arr, datatype, symmetric)
    else:
        scale_arr = user_scale(scale)
        if scale_arr.shape != ():
            raise XnnquantError(f"a per-tensor scale must be one number: got shape {scale_arr.shape}")
        zp = user_zero_point(zero_point, datatype)
    codes = kernels.quantize(arr, max(arr.size, 1), scale_arr.reshape(1), zp, facts.code_min, facts.code_max,
                             facts.numpy_dtype, None if scale is None else (arr, "x"))
    return QuantizedTensor(datatype, codes, scale_arr, zp)


_KEYWORDS = ("scale", "zero_point", "symmetric")


def _deprecated_positional(given: tuple[Any, ...], scale: ArrayInput | None, zero_point: object,
                           symmetric: bool) -> tuple[Any, Any, bool]:
    """``quantize(x, dtype, scale, zero_point, symmetric)``, the former signature."""
    if len(given) > len(_KEYWORDS):
        raise XnnquantError(f"quantize takes at most 5 positional arguments: got {2 + len(given)}")
    names = _KEYWORDS[:len(given)]
    warnings.warn(f"per-tensor quantize: pass {', '.join(names)} by keyword ({names[0]}=...); positional use "
                  "is deprecated", DeprecationWarning, stacklevel=3)
    keywords = dict(zip(_KEYWORDS, (scale, zero_point, symmetric)))
    for name, value in zip(names, given):
        if keywords[name] is not (None if name != "symmetric" else False):
            raise XnnquantError(f"quantize got {name} both by position and by keyword")
        keywords[name] = value
    return keywords["scale"], keywords["zero_point"], bool(keywords["symmetric"])


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``(codes - zero_point) * scale`` as float32, in the logical shape."""
    if qt.datatype not in DATATYPES:
        raise XnnquantError(f"not a per-tensor tensor: got {qt.datatype.name}, expected qint8 or quint8")
    return qt.dequantize()
