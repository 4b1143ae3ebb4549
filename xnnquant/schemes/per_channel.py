"""Symmetric per-channel weights: qcint8 (8 bits) and qcint4 (4 bits).

One float32 scale per index of ``axis`` (0 for linear and conv weights ``[OC, ...]``,
3 for XNNPACK's depthwise ``[1, KH, KW, OC]``); zero point 0 in the codes' signed domain.
qcint4 codes lie in [-8, 7]; storage adds 8 to each nibble (``QuantizedTensor.to_bytes``).

Scales come from ``method`` (see ``search``): ``"minmax"`` is
``max|w[c]| / 127.5`` for 8 bits and ``/ 7.5`` for 4 bits (torchao's symmetric rule),
``"mse"`` searches each channel's scale for the least squared error.  All-zero
channels get scale 1.0; scales below the smallest normal float32 are clamped up to it.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput, as_float32, is_int
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..tensor import QuantizedTensor
from . import activation_aware, kernels
from .calibration import Calibration
from .checks import (
    ACTIVATION_AWARE_METHODS,
    Method,
    check_calibration_use,
    check_method,
    float_source,
    normalize_axis,
    user_scales,
)
from .granularity import PerChannel
from .search import finish_scales, half_range, mse_scales, range_scales

DATATYPE_BY_BITS: dict[int, Datatype] = {8: Datatype.qcint8, 4: Datatype.qcint4}


def _datatype(bits: object) -> Datatype:
    if not is_int(bits) or int(bits) not in DATATYPE_BY_BITS:
        raise XnnquantError(f"unsupported bits for per-channel quantization: got {bits!r}, expected 8 or 4")
    return DATATYPE_BY_BITS[int(bits)]


def _prepare(w: ArrayInput, bits: object, axis: object,
             method: object) -> tuple[np.ndarray, Datatype, PerChannel, Method]:
    arr = float_source(w, "w", min_rank=1)
    return arr, _datatype(bits), PerChannel(normalize_axis(axis, arr.ndim)), check_method(method)


def choose_qparams(w: ArrayInput, bits: int = 8, axis: int = 0, method: Method = "minmax", *,
                   calibration: Calibration | ArrayInput | None = None) -> np.ndarray:
    """Per-channel scales of ``w``: float32 ``(w.shape[axis],)``, each a positive normal float.

    For ``method="gptq"`` these are the scales of GPTQ's own codes (see ``quantize``).
    """
    if calibration is not None or method in ACTIVATION_AWARE_METHODS:
        return quantize(w, bits, axis, method, calibration=calibration).scale
    arr, datatype, granularity, method = _prepare(w, bits, axis, method)
    return _scales(arr, np.ascontiguousarray(granularity.blocks(arr)), datatype, method)


def _scales(arr: np.ndarray, blocks: np.ndarray, datatype: Datatype, method: str) -> np.ndarray:
    """float32 ``(C,)`` scales of ``blocks`` ``(C, rest)`` (``arr`` regrouped) by ``method``."""
    facts = storage(datatype)
    if method == "mse":
        as_float32(arr, "w")  # raises for a non-finite value, naming its index in arr
        return mse_scales(as_float32(blocks, "w", finite=False), facts.code_min, facts.code_max)
    if method == "range":
        as_float32(arr, "w")
        return range_scales(as_float32(blocks, "w", finite=False), facts.code_min, facts.code_max)
    absmax = kernels.block_absmax(blocks, blocks.shape[1], (arr, "w"))
    return finish_scales(absmax / half_range(facts.code_min, facts.code_max), absmax == 0, bf16=False)


def quantize(w: ArrayInput, bits: int = 8, axis: int = 0, method: Method = "minmax", *,
             scale: ArrayInput | None = None, calibration: Calibration | ArrayInput | None = None) -> QuantizedTensor:
    """Quantize ``w`` (any rank >= 1, fp32/fp16/bf16) per channel along ``axis``.

    ``scale`` (float32 ``(C,)``, positive normal), when given, is used as is instead of
    ``method``.  ``calibration`` (a ``Calibration`` or float ``(tokens, K)``) goes with the
    activation-aware methods ``"act_mse"`` and ``"gptq"`` (``activation_aware``), and only
    with them; those take a linear weight ``[C, K]`` with ``axis=0``.

    Returns a qcint8 (``bits=8``) or qcint4 (``bits=4``) ``QuantizedTensor``: int8 codes in
    the shape of ``w``, scale float32 ``(C,)``, zero point 0, ``channel_dim = axis``.
    """
    arr, datatype, granularity, method = _prepare(w, bits, axis, method)
    check_calibration_use(method, calibration, scale)
    if calibration is not None:
        if granularity.axis != 0:
            raise XnnquantError(
                f"method {method!r} quantizes linear weights per output channel: got axis={axis}, expected axis=0"
            )
        codes, scales = activation_aware.quantize_linear(as_float32(arr, "w"), calibration, datatype, None, method)
        return QuantizedTensor(datatype, codes, scales, 0, channel_dim=0, meta={"method": method})
    facts = storage(datatype)
    blocks = np.ascontiguousarray(granularity.blocks(arr))
    qmin, qmax, dtype, row = facts.code_min, facts.code_max, facts.numpy_dtype, blocks.shape[1]
    if scale is not None:
        scales = user_scales(scale, granularity.scale_shape(arr.shape))
        codes = kernels.quantize(blocks, row, scales, 0, qmin, qmax, dtype, (arr, "w"))
    elif method == "minmax":
        codes, scales = kernels.minmax_quantize(blocks, row, qmin, qmax, dtype, (arr, "w"))
    else:
        scales = _scales(arr, blocks, datatype, method)
        codes = kernels.quantize(blocks, row, scales, 0, qmin, qmax, dtype)
    return QuantizedTensor(
        datatype, granularity.unblocks(codes, arr.shape), scales, 0,
        channel_dim=granularity.axis, meta={"method": method if scale is None else "given"},
    )


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``codes * scale[channel]`` as float32, in the logical shape."""
    if qt.datatype not in DATATYPE_BY_BITS.values():
        raise XnnquantError(f"not a per-channel weight: got {qt.datatype.name}, expected qcint8 or qcint4")
    return qt.dequantize()
