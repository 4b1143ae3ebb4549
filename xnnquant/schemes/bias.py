"""Bias of a static int8 layer: qint32 (per-tensor weights) or qcint32 (per-channel weights).

XNNPACK adds the int32 bias to the int32 accumulator of ``sum(x_q * w_q)``, so the bias
scale is the accumulator's: ``scale = input_scale * weight_scale`` (float32 product),
zero point 0::

    code = saturate_int32(round_half_even(b * (1 / scale)))

A scalar ``weight_scale`` gives qint32 (scale ``()``), a ``(C,)`` one gives qcint32
(scale ``(C,)``, ``channel_dim = 0``).  Every product must be a positive normal float32,
since XNNPACK rejects any other scale.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput, first_not_positive_normal
from ..constants import FLT_MIN
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..rounding import round_half_even
from ..tensor import QuantizedTensor
from .checks import float_input, reciprocal, user_scale

_I32_MIN, _I32_MAX = storage(Datatype.qint32).code_min, storage(Datatype.qint32).code_max


def _scale_of(value: ArrayInput, name: str) -> np.ndarray:
    """A scale given as a number, an array, or a ``QuantizedTensor`` (its ``scale``)."""
    return user_scale(value.scale if isinstance(value, QuantizedTensor) else value, name)


def choose_qparams(b: ArrayInput, input_scale: ArrayInput, weight_scale: ArrayInput) -> tuple[Datatype, np.ndarray]:
    """(qint32 or qcint32, scale float32 ``()`` or ``(C,)``) for bias ``b`` ``(C,)``."""
    arr = float_input(b, "b", min_rank=1, max_rank=1)
    return _choose(arr, input_scale, weight_scale)


def _choose(arr: np.ndarray, input_scale: ArrayInput, weight_scale: ArrayInput) -> tuple[Datatype, np.ndarray]:
    s_in = _scale_of(input_scale, "input_scale")
    if s_in.shape != ():
        raise XnnquantError(f"input_scale must be one number: got shape {s_in.shape}")
    s_w = _scale_of(weight_scale, "weight_scale")
    if s_w.ndim == 0:
        datatype = Datatype.qint32
    elif s_w.shape == arr.shape:
        datatype = Datatype.qcint32
    else:
        raise XnnquantError(
            f"weight_scale must be one number or one per output channel: got shape {s_w.shape}, "
            f"expected () or {arr.shape}"
        )
    with np.errstate(over="ignore", under="ignore"):
        scale = (s_in * s_w).astype(np.float32)
    bad = first_not_positive_normal(scale.reshape(-1))
    if bad is not None:
        (where,) = bad
        raise XnnquantError(
            f"bias scale input_scale * weight_scale must be a positive normal float32: got "
            f"{scale.reshape(-1)[where]:.9g} (channel {where}), expected a finite value >= {FLT_MIN:.9g}"
        )
    return datatype, scale


def quantize(b: ArrayInput, input_scale: ArrayInput, weight_scale: ArrayInput) -> QuantizedTensor:
    """Quantize bias ``b`` ``(C,)`` (fp32/fp16/bf16): int32 codes ``(C,)``, zero point 0."""
    arr = float_input(b, "b", min_rank=1, max_rank=1)
    datatype, scale = _choose(arr, input_scale, weight_scale)
    with np.errstate(over="ignore"):
        rounded = round_half_even(arr * reciprocal(scale))
    # float64 for the clamp: float32 cannot hold 2**31 - 1, so clipping there would overflow.
    codes = np.clip(rounded.astype(np.float64), _I32_MIN, _I32_MAX).astype(np.int32)
    channel_dim = 0 if datatype is Datatype.qcint32 else None
    return QuantizedTensor(datatype, codes, scale, 0, channel_dim=channel_dim)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``codes * scale`` as float32 ``(C,)``."""
    if qt.datatype not in (Datatype.qint32, Datatype.qcint32):
        raise XnnquantError(f"not a bias: got {qt.datatype.name}, expected qint32 or qcint32")
    return qt.dequantize()
