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

from typing import Any

import numpy as np

from ..arrays import is_int
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..tensor import QuantizedTensor
from .checks import Method, check_method, float_input, normalize_axis, user_scales
from .granularity import PerChannel
from .search import choose_scales, quantize_blocks

DATATYPE_BY_BITS: dict[int, Datatype] = {8: Datatype.qcint8, 4: Datatype.qcint4}


def _datatype(bits: Any) -> Datatype:
    if not is_int(bits) or int(bits) not in DATATYPE_BY_BITS:
        raise XnnquantError(f"unsupported bits for per-channel quantization: got {bits!r}, expected 8 or 4")
    return DATATYPE_BY_BITS[int(bits)]


def _prepare(w: Any, bits: Any, axis: Any, method: Any) -> tuple[np.ndarray, Datatype, PerChannel, Method]:
    arr = float_input(w, "w", min_rank=1)
    return arr, _datatype(bits), PerChannel(normalize_axis(axis, arr.ndim)), check_method(method)


def choose_qparams(w: Any, bits: int = 8, axis: int = 0, method: Method = "minmax") -> np.ndarray:
    """Per-channel scales of ``w``: float32 ``(w.shape[axis],)``, each a positive normal float."""
    arr, datatype, granularity, method = _prepare(w, bits, axis, method)
    facts = storage(datatype)
    return choose_scales(granularity.blocks(arr), facts.code_min, facts.code_max, method)


def quantize(w: Any, bits: int = 8, axis: int = 0, method: Method = "minmax", *,
             scale: Any = None) -> QuantizedTensor:
    """Quantize ``w`` (any rank >= 1, fp32/fp16/bf16) per channel along ``axis``.

    ``scale`` (float32 ``(C,)``, positive normal), when given, is used as is instead of
    ``method``.

    Returns a qcint8 (``bits=8``) or qcint4 (``bits=4``) ``QuantizedTensor``: int8 codes in
    the shape of ``w``, scale float32 ``(C,)``, zero point 0, ``channel_dim = axis``.
    """
    arr, datatype, granularity, method = _prepare(w, bits, axis, method)
    facts = storage(datatype)
    blocks = granularity.blocks(arr)
    if scale is None:
        scales = choose_scales(blocks, facts.code_min, facts.code_max, method)
    else:
        scales = user_scales(scale, granularity.scale_shape(arr.shape))
    codes = quantize_blocks(blocks, scales, facts.code_min, facts.code_max, facts.numpy_dtype)
    return QuantizedTensor(
        datatype, granularity.unblocks(codes, arr.shape), scales, 0,
        channel_dim=granularity.axis, meta={"method": method if scale is None else "given"},
    )


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``codes * scale[channel]`` as float32, in the logical shape."""
    if qt.datatype not in DATATYPE_BY_BITS.values():
        raise XnnquantError(f"not a per-channel weight: got {qt.datatype.name}, expected qcint8 or qcint4")
    return qt.dequantize()
