"""Single XNNPACK operators run through the operator API (create, reshape, setup, run).

``convert_f32_qd8`` is the oracle for the library's own per-token quantizer: it returns
what XNNPACK's ``convert_nc_f32_qd8`` operator computes, bit for bit.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..arrays import ArrayInput, as_float32, to_numpy
from ..constants import XNN_EXTRA_QUANTIZATION_PARAMS
from ..datatypes import Datatype
from ..errors import XnnquantError
from ..tensor import QuantizedTensor
from . import _capi


def convert_f32_qd8(x: ArrayInput) -> QuantizedTensor:
    """Per-row dynamic quantization of ``x`` to qdint8, computed by XNNPACK itself.

    ``x``: float ``(..., K)`` (fp32, fp16 or bf16; finite; K >= 1), numpy or torch.  Every
    row (last axis) gets its own scale and zero point.  Returns a ``QuantizedTensor`` with
    ``datatype=qdint8``, ``codes`` int8 of the shape of ``x``, ``scale`` float32 ``(M,)``
    and ``zero_point`` int32 ``(M,)`` where ``M = prod(x.shape[:-1])``,
    ``num_nonbatch_dims=1``; ``dequantize() = (codes - zero_point) * scale``.

    Runs ``xnn_create_convert_nc_f32_qd8`` / ``xnn_reshape_...`` / ``xnn_setup_...`` /
    ``xnn_run_operator`` on one thread.  The ``xnn_quantization_params`` output array
    (``{int32 zero_point; float scale}`` per row) has ``M + 15`` entries, because XNNPACK
    writes ``XNN_EXTRA_QUANTIZATION_PARAMS`` padding entries after the last row.
    """
    shape = to_numpy(x, "x").shape  # before as_float32, which widens a scalar to (1,)
    if not shape or shape[-1] == 0:
        raise XnnquantError(f"x must have shape (..., K) with K >= 1: got shape {shape}")
    data = as_float32(x, "x")
    k = data.shape[-1]
    rows = data.reshape(-1, k)
    m = rows.shape[0]
    codes = np.zeros((m, k), np.int8)
    params = (_capi.QuantizationParams * (m + XNN_EXTRA_QUANTIZATION_PARAMS))()
    if m:
        _run_convert_f32_qd8(rows, codes, params)
    raw = np.frombuffer(memoryview(params), dtype=np.dtype([("zero_point", "<i4"), ("scale", "<f4")]), count=m)
    return QuantizedTensor(
        datatype=Datatype.qdint8,
        codes=codes.reshape(data.shape),
        scale=raw["scale"].copy(),
        zero_point=raw["zero_point"].astype(np.int32),
        num_nonbatch_dims=1,
    )


def _run_convert_f32_qd8(rows: np.ndarray, codes: np.ndarray, params: ctypes.Array) -> None:
    """Fill ``codes`` (int8 ``(M, K)``) and ``params`` (``M + 15`` entries) from ``rows``
    (float32 ``(M, K)``, M >= 1) with XNNPACK's f32 -> qd8 convert operator."""
    lib = _capi.load_library()
    m, k = rows.shape
    source = _capi.padded(rows)  # XNNPACK may read EXTRA_BYTES past the last row
    op = ctypes.c_void_p()
    _capi.check(lib.xnn_create_convert_nc_f32_qd8(0, ctypes.byref(op)), "xnn_create_convert_nc_f32_qd8")
    try:
        _capi.check(
            lib.xnn_reshape_convert_nc_f32_qd8(op, m, k, k, k, None), "xnn_reshape_convert_nc_f32_qd8"
        )
        _capi.check(
            lib.xnn_setup_convert_nc_f32_qd8(
                op,
                _capi.typed_pointer(source, ctypes.c_float),
                _capi.typed_pointer(codes, ctypes.c_int8),
                None,  # row sums: only written by operators created with a row-sum flag
                params,
            ),
            "xnn_setup_convert_nc_f32_qd8",
        )
        _capi.check(lib.xnn_run_operator(op, None), "xnn_run_operator(convert_nc_f32_qd8)")
    finally:
        lib.xnn_delete_operator(op)
