"""Blockwise int4 weights (qbint4): one bf16 scale per ``(out_channel, group)``.

``w`` is a linear weight ``[C, K]`` (out_features, in_features); each row is cut into
``K // group_size`` groups of ``group_size`` consecutive columns, and each group gets its
own scale.  Codes lie in [-8, 7] with zero point 0 (storage adds 8 to each nibble).

Scales are rounded to bf16 (to nearest, ties to even) *before* the codes are computed,
and ``scale`` holds those bf16-exact values as float32 ``(C, K // group_size)``.  Every
XNNPACK runtime then uses exactly the scales the codes were computed against: the one in
executorch 1.4.1 reads the float32 list and converts it to bf16 by a biased truncation
that leaves bf16-exact values unchanged, earlier runtimes read the bf16 list.

``group_size`` must be a positive multiple of 32 (XNNPACK's least block size) that
divides ``K``.  ``group_size == K`` is allowed, but then per-channel int4 (qcint4, float32
scales, no bf16 rounding) is the better choice: same codes budget, more exact scales.

Scales come from ``method`` (see ``search``): ``"minmax"`` is ``bf16(max|group| / 7.5)``,
``"mse"`` searches each group's bf16 scale for the least squared error.  All-zero groups
get scale 1.0; scales below the smallest normal float32 are clamped up to it.
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput, as_float32, is_int
from ..constants import XNN_MIN_BLOCKSIZE
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from ..tensor import QuantizedTensor
from . import activation_aware, kernels
from .calibration import Calibration
from .checks import ACTIVATION_AWARE_METHODS, Method, check_calibration_use, check_method, float_source, user_scales
from .granularity import PerGroup
from .search import finish_scales, half_range, mse_scales, range_scales

_FACTS = storage(Datatype.qbint4)


def valid_group_sizes(in_features: int) -> list[int]:
    """Every group size XNNPACK accepts for ``in_features`` columns."""
    return [g for g in range(XNN_MIN_BLOCKSIZE, in_features + 1, XNN_MIN_BLOCKSIZE) if in_features % g == 0]


def _prepare(w: ArrayInput, group_size: object, method: object, *,
             any_divisor: bool = False) -> tuple[np.ndarray, PerGroup, Method]:
    arr = float_source(w, "w", min_rank=2, max_rank=2)
    in_features = arr.shape[1]
    size = int(group_size) if is_int(group_size) else 0
    if any_divisor:
        if not 0 < size <= in_features or in_features % size:
            raise XnnquantError(f"group_size must be a positive divisor of the row length: got group_size="
                                f"{group_size!r}, row length {in_features}")
        return arr, PerGroup(size), check_method(method)
    valid = valid_group_sizes(in_features)
    if size not in valid:
        listed = ", ".join(map(str, valid)) if valid else (
            f"none: in_features must be a multiple of {XNN_MIN_BLOCKSIZE} for blockwise int4; use per-channel int4"
        )
        raise XnnquantError(
            f"group_size must be a multiple of {XNN_MIN_BLOCKSIZE} that divides in_features: "
            f"got group_size={group_size!r}, in_features={in_features} (valid: {listed})"
        )
    return arr, PerGroup(size), check_method(method)


def choose_qparams(w: ArrayInput, group_size: int = 32, method: Method = "minmax", *, bf16: bool = True,
                   calibration: Calibration | ArrayInput | None = None) -> np.ndarray:
    """Scales of ``w`` ``[C, K]``: float32 ``(C, K // group_size)``, each exactly a bf16 value.

    ``bf16=False`` gives the scales ``method`` chooses when they are kept in float32
    instead (the min-max scale unrounded; the search scoring float32 candidates): a
    baseline for experiments, which qbint4 cannot store (pair it with
    ``quantize_codes``).  For ``method="gptq"`` the scales are those of GPTQ's own codes:
    rounding ``w`` to them (``quantize(w, scale=...)``) does not give those codes.
    """
    if calibration is not None or method in ACTIVATION_AWARE_METHODS:
        if not bf16:
            raise XnnquantError(
                f"bf16=False is for the weight-only methods: got method {method!r}, expected 'minmax', 'mse' or 'range'"
            )
        return quantize(w, group_size, method, calibration=calibration).scale
    arr, granularity, method = _prepare(w, group_size, method)
    return _scales(arr, granularity, method, bf16).reshape(granularity.scale_shape(arr.shape))


def _scales(arr: np.ndarray, granularity: PerGroup, method: str, bf16: bool = True) -> np.ndarray:
    """Flat float32 scales ``(C * K // group_size,)`` of ``arr`` by ``method``."""
    qmin, qmax = _FACTS.code_min, _FACTS.code_max
    if method == "mse":
        return mse_scales(granularity.blocks(as_float32(arr, "w")), qmin, qmax, bf16=bf16)
    if method == "range":
        return range_scales(granularity.blocks(as_float32(arr, "w")), qmin, qmax, bf16=bf16)
    absmax = kernels.block_absmax(arr, granularity.group_size, (arr, "w"))
    return finish_scales(absmax / half_range(qmin, qmax), absmax == 0, bf16=bf16)


def quantize_codes(w: ArrayInput, scale: ArrayInput, group_size: int = 32) -> np.ndarray:
    """The int4 codes of ``w`` ``[C, K]`` for any positive scales float32 ``(C, K // group_size)``.

    ``codes[r, k] = clip(round_half_even(w[r, k] / scale[r, k // group_size]), -8, 7)``,
    the rule ``quantize`` applies, as int8 ``[C, K]``.  Unlike ``quantize(w, scale=...)``
    the scales need not be bf16 values: for comparing scale roundings in experiments.
    """
    arr, granularity, _ = _prepare(w, group_size, "minmax")
    flat_scale = user_scales(scale, granularity.scale_shape(arr.shape), bf16=False).reshape(-1)
    return kernels.quantize(arr, granularity.group_size, flat_scale, 0, _FACTS.code_min, _FACTS.code_max,
                            _FACTS.numpy_dtype, (arr, "w"))


def quantize(w: ArrayInput, group_size: int = 32, method: Method = "minmax", *,
             scale: ArrayInput | None = None, calibration: Calibration | ArrayInput | None = None) -> QuantizedTensor:
    """Quantize ``w`` ``[C, K]`` (fp32/fp16/bf16) to qbint4.

    ``scale`` (float32 ``(C, K // group_size)``, positive normal bf16 values), when
    given, is used as is instead of ``method``.  ``calibration`` (a ``Calibration`` or
    float ``(tokens, K)``) goes with the activation-aware methods ``"act_mse"`` and
    ``"gptq"`` (``activation_aware``), and only with them.

    Returns int8 codes ``[C, K]`` in [-8, 7], scale float32 ``(C, K // group_size)`` (bf16
    values), zero point 0, ``channel_dim = 0``, ``group_size``.
    """
    arr, granularity, method = _prepare(w, group_size, method)
    check_calibration_use(method, calibration, scale)
    return _quantize(arr, granularity, method, scale, calibration)


def quantize_groups(w: ArrayInput, group_size: int, method: Method = "minmax") -> QuantizedTensor:
    """qbint4's numbers (codes in [-8, 7], bf16-exact scales, zero point 0) for ``w`` ``[C, K]``
    in groups of any ``group_size`` that divides K, by a weight-only ``method`` ("minmax" or
    "mse").  ``quantize`` keeps to XNNPACK's group sizes (multiples of 32); ExecuTorch's
    quantized embedding kernels take any (``frontend/passes/embeddings.py``).
    """
    arr, granularity, method = _prepare(w, group_size, method, any_divisor=True)
    if method in ACTIVATION_AWARE_METHODS:
        raise XnnquantError(f"quantize_groups takes a weight-only method: got {method!r}, expected 'minmax', 'mse' "
                            "or 'range'")
    return _quantize(arr, granularity, method, None, None)


def _quantize(arr: np.ndarray, granularity: PerGroup, method: str, scale: ArrayInput | None,
              calibration: Calibration | ArrayInput | None) -> QuantizedTensor:
    """The qbint4 ``QuantizedTensor`` of the checked ``arr`` (``quantize``'s arguments)."""
    if calibration is not None:
        codes, scales = activation_aware.quantize_linear(as_float32(arr, "w"), calibration, Datatype.qbint4,
                                                         granularity.group_size, method)
        return QuantizedTensor(Datatype.qbint4, codes, scales, 0, channel_dim=0, group_size=granularity.group_size,
                               meta={"method": method})
    g, qmin, qmax, dtype = granularity.group_size, _FACTS.code_min, _FACTS.code_max, _FACTS.numpy_dtype
    scale_shape = granularity.scale_shape(arr.shape)
    if scale is not None:
        flat_scale = user_scales(scale, scale_shape, bf16=True).reshape(-1)
        codes = kernels.quantize(arr, g, flat_scale, 0, qmin, qmax, dtype, (arr, "w"))
    elif method == "minmax":
        codes, flat_scale = kernels.minmax_quantize(arr, g, qmin, qmax, dtype, (arr, "w"), bf16=True)
    else:
        flat_scale = _scales(arr, granularity, method)
        codes = kernels.quantize(arr, g, flat_scale, 0, qmin, qmax, dtype)
    return QuantizedTensor(
        Datatype.qbint4, codes, flat_scale.reshape(scale_shape), 0,
        channel_dim=0, group_size=granularity.group_size, meta={"method": method if scale is None else "given"},
    )


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """``codes * scale[row, column // group_size]`` as float32 ``[C, K]``."""
    if qt.datatype is not Datatype.qbint4:
        raise XnnquantError(f"not a blockwise weight: got {qt.datatype.name}, expected qbint4")
    return qt.dequantize()
