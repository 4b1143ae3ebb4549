"""Fully connected layers run by the real XNNPACK, built as one-node subgraphs.

``fully_connected`` covers the float-output paths ExecuTorch uses for linear layers,
``static_fully_connected`` the all-int8 path, ``last_operators`` names what ran.

Measured on XNNPACK 1adaa7c7 (executorch 1.4.1) on an x86-64 AMD EPYC with AVX2 (no
AVX-512), against a float64 reference built from the integer codes, over
M in {1, 2, 3, 5, 17}, N in {1, 7, 16, 33} and odd K in
(1, 3, 5, 7, 9, 15, 17, 31, 33, 63, 65, 67, 127, 129, 255), with bias, the input buffer
followed by floats of value 1000 (``benchmarks/measure_xnnpack_odd_k.py`` reproduces the
table; the tests re-check the refusals and the failure itself):

===============  =====================  ==================================================
weight           path                   odd K
===============  =====================  ==================================================
qcint8           dynamic (qdint8 x)     correct
qcint8           weight-only (fp32 x)   correct
qcint4           dynamic                **wrong** (295 of 300; K = 1, N = 1 crashes):
                                        the fused per-row quantization reads K + 1
                                        floats per row (the row plus the first value of
                                        the next row, or whatever follows the last row),
                                        so a row's scale and zero point change when that
                                        extra value lies outside the row's range; with
                                        zeros after the input, M = 1 happens to be
                                        right.  Refused for every odd K.
qcint4           weight-only            correct for K >= 3 (and K = 1 when N >= 2); a
                                        1 x 1 filter crashes XNNPACK while it packs the
                                        weights (segfault).  The 1 x 1 case is refused.
qbint4           dynamic                cannot occur: K is a multiple of the group size,
                                        itself a multiple of 32.
qbint4           weight-only            refused by XNNPACK for every K (fp32 input with a
                                        qbint4 filter: xnn_status_invalid_parameter).
fp32 (float)     weight-only            correct
===============  =====================  ==================================================

Transposed filters (``transpose_weights=True``, the filter given as ``[K, N]``):
qcint8 (channel_dim 1) correct on both paths; qcint4 weight-only crashes XNNPACK
(segfault at runtime creation) and is refused; qcint4 dynamic reads the ``[K, N]`` codes
as one continuous nibble stream (rows not padded to whole bytes), which equals
``QuantizedTensor.to_bytes()`` only for even N, so odd N is refused (odd K is refused as
above); qbint4 is rejected with channel_dim 0 and, with channel_dim 1, computes wrong
results unless N == K / 2, so it is refused.

The weight-only path adds the fp32 bias *before* multiplying by the per-channel weight
scale, y = (sum_k x q + b) * scale; ``fully_connected`` therefore hands XNNPACK
``bias / scale`` there (the dynamic path takes the bias as is).

Operators chosen on that machine (``last_operators()``; XNNPACK picks the signed QD8 or
the unsigned QDU8 input variant by CPU, so other CPUs may differ):
qcint8 "Fully Connected (NC, QD8, F32, QC8W) GEMM" / "Fully Connected (NC, F32, QC8W) GEMM";
qcint4 "Fully Connected (NC, QDU8, F32, QC4W) GEMM" / "Fully Connected (NC, F32, QC4W) GEMM";
qbint4 "Fully Connected (NC, QD8, F32, QB4W) GEMM"; float "Fully Connected (NC, F32) GEMM";
static int8 "Fully Connected (NC, QS8, QC8W) GEMM".  The fp32 -> qdint8 Convert is fused into the
GEMM and does not appear as an operator of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import ArrayInput, as_float32
from ..constants import (
    FLT_MIN,
    XNN_FLAG_TRANSPOSE_WEIGHTS,
    XNN_INVALID_VALUE_ID,
    XNN_MIN_BLOCKSIZE,
    XNN_VALUE_FLAG_EXTERNAL_INPUT,
    XNN_VALUE_FLAG_EXTERNAL_OUTPUT,
)
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import check_bf16_exact
from ..tensor import QuantizedTensor
from . import _capi
from .subgraph import Runtime, Subgraph

FLOAT_OUTPUT_WEIGHTS = (Datatype.qcint8, Datatype.qcint4, Datatype.qbint4)
_X, _Y = 0, 1  # external ids of the input and the output
_last: tuple[str, ...] = ()
_last_timings: tuple[int, ...] = ()


def last_operators() -> tuple[str, ...]:
    """Names of the XNNPACK operators the last ``fully_connected`` or
    ``static_fully_connected`` call ran, from runtime profiling, e.g.
    ``("Fully Connected (NC, QDU8, F32, QB4W) GEMM",)``."""
    return _last


def last_timings_us() -> tuple[int, ...]:
    """Time of each operator of ``last_operators()`` in that (single, first) invocation,
    microseconds, as XNNPACK's runtime profiling measured it."""
    return _last_timings


def fully_connected(
    x: ArrayInput,
    weight: QuantizedTensor | ArrayInput,
    bias: ArrayInput | None = None,
    *,
    dynamic: bool = True,
    transpose_weights: bool = False,
    weights_cache: Any = None,
) -> np.ndarray:
    """``y = x @ dequantize(weight).T + bias``, computed by XNNPACK.

    ``x``: float ``(M, K)``.  ``weight``: a ``QuantizedTensor`` (qcint8, qcint4 or
    qbint4) or a float array, logical shape ``(N, K)`` (``(K, N)`` with
    ``transpose_weights``).  ``bias``: float ``(N,)`` or None.  Returns float32 ``(M, N)``.

    ``dynamic=True`` quantizes x to qdint8 per row inside XNNPACK (Convert node);
    ``dynamic=False`` feeds x as fp32 (weight-only quantization; a float weight needs this).
    ``weights_cache`` (a ``_capi.WeightsCacheProvider``) is handed to
    ``xnn_create_runtime_v4``; its ``is_finalized`` must answer true by the time the
    runtime is set up, right after creation (XNNPACK refuses to set up an operator whose
    cache is not finalized).
    Configurations XNNPACK rejects or computes wrongly raise ``UnsupportedConfigError``;
    the module docstring lists what was measured.
    """
    data = _matrix(x, "x")
    m, k = data.shape
    if isinstance(weight, QuantizedTensor):
        n = _check_quantized_weight(weight, k, transpose_weights, dynamic)
    else:
        w = _matrix(weight, "weight")
        if dynamic:
            raise UnsupportedConfigError(
                "a float weight runs on the fp32 path: got dynamic=True, expected dynamic=False "
                "(XNNPACK has no qdint8-input fully connected with an fp32 filter)"
            )
        n = _check_k(w.shape, k, transpose_weights)
    b = None if bias is None else as_float32(bias, "bias")
    if b is not None and b.shape != (n,):
        raise XnnquantError(f"bias must have shape (N,) = ({n},): got {b.shape}")

    with Subgraph(2) as sg:
        x_id = sg.tensor(Datatype.fp32, (m, k), external_id=_X, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        if dynamic:
            q_id = sg.dynamic_tensor((m, k), num_nonbatch_dims=1)
            sg.convert(x_id, q_id)
            x_id = q_id
        if isinstance(weight, QuantizedTensor):
            w_id = _define_weight(sg, weight, transpose_weights)
            if b is not None and not dynamic:
                b = (b / weight.scale).astype(np.float32)  # XNNPACK scales after adding the bias
        else:
            w_id = sg.tensor(Datatype.fp32, w.shape, w)
        b_id = XNN_INVALID_VALUE_ID if b is None else sg.tensor(Datatype.fp32, (n,), b)
        y_id = sg.tensor(Datatype.fp32, (m, n), external_id=_Y, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        flags = XNN_FLAG_TRANSPOSE_WEIGHTS if transpose_weights else 0
        sg.fully_connected(x_id, w_id, b_id, y_id, flags=flags)
        runtime = Runtime(sg, weights_cache=weights_cache)
    out = np.zeros((m, n), np.float32)
    _run(runtime, _capi.padded(data), out)
    return out


def static_fully_connected(
    x: QuantizedTensor,
    weight: QuantizedTensor,
    bias: QuantizedTensor | None = None,
    *,
    output_scale: float,
    output_zero_point: int = 0,
    weights_cache: Any = None,
) -> QuantizedTensor:
    """The all-integer fully connected layer: qint8 x, qcint8 weight, qcint32 bias, qint8 y.

    ``x``: qint8 ``(M, K)`` (per-tensor scale and zero point).  ``weight``: qcint8
    ``(N, K)``, channel_dim 0, zero point 0.  ``bias``: qcint32 ``(N,)`` whose scale is
    ``x.scale * weight.scale``, or None.  Returns the qint8 ``(M, N)`` codes XNNPACK
    computes, with ``scale=output_scale`` and ``zero_point=output_zero_point``:
    ``y = clamp(rint(acc * (s_x * s_w[n] / s_y)) + z_y, -128, 127)``,
    ``acc = sum_k (x - z_x) * w + bias`` (int32).
    """
    if not isinstance(x, QuantizedTensor) or x.datatype is not Datatype.qint8 or x.codes.ndim != 2:
        raise XnnquantError(f"x must be a 2-D qint8 QuantizedTensor: got {x!r}")
    if not isinstance(weight, QuantizedTensor) or weight.datatype is not Datatype.qcint8:
        raise XnnquantError(f"weight must be a qcint8 QuantizedTensor: got {weight!r}")
    m, k = x.shape
    if m == 0 or k == 0:
        raise XnnquantError(f"x must be non-empty: got shape {x.shape}")
    n = _check_quantized_weight(weight, k, False, False)
    x_scale, x_zero = float(x.scale), int(np.asarray(x.zero_point))  # QuantizedTensor checked its range
    _check_scales(np.float32(x_scale), "x scale")
    _check_scales(np.float32(output_scale), "output_scale")
    if not -128 <= output_zero_point <= 127:
        raise XnnquantError(f"output_zero_point must be in [-128, 127]: got {output_zero_point}")
    requant = np.float32(x_scale) * weight.scale / np.float32(output_scale)
    if np.any(requant >= 256):
        raise UnsupportedConfigError(
            f"XNNPACK needs x_scale * weight_scale / output_scale < 256: got {float(requant.max())}"
        )
    if bias is not None:
        _check_static_bias(bias, n, np.float32(x_scale) * weight.scale)

    with Subgraph(2) as sg:
        x_id = sg.quantized_tensor(Datatype.qint8, (m, k), x_scale, x_zero, external_id=_X,
                                   flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        w_id = sg.channelwise_tensor(Datatype.qcint8, (n, k), weight.scale, 0, 0, weight.codes)
        b_id = XNN_INVALID_VALUE_ID
        if bias is not None:
            b_id = sg.channelwise_tensor(Datatype.qcint32, (n,), bias.scale, 0, 0, bias.codes.astype(np.int32))
        y_id = sg.quantized_tensor(Datatype.qint8, (m, n), float(output_scale), int(output_zero_point),
                                   external_id=_Y, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        sg.fully_connected(x_id, w_id, b_id, y_id)
        runtime = Runtime(sg, weights_cache=weights_cache)
    out = np.zeros((m, n), np.int8)
    _run(runtime, _capi.padded(x.codes), out)
    return QuantizedTensor(Datatype.qint8, out, np.float32(output_scale), int(output_zero_point))


# --- checks --------------------------------------------------------------------------


def _matrix(a: ArrayInput, name: str) -> np.ndarray:
    """``a`` as float32 ``(rows, cols)`` with both >= 1."""
    arr = as_float32(a, name)
    if arr.ndim != 2 or 0 in arr.shape:
        raise XnnquantError(f"{name} must be a non-empty 2-D float array: got shape {np.shape(a)}")
    return arr


def _check_k(shape: tuple[int, ...], k: int, transpose: bool) -> int:
    """N of a weight of ``shape`` (``(N, K)``, or ``(K, N)`` when transposed) after checking K."""
    if len(shape) != 2:
        raise XnnquantError(f"weight must be 2-D: got shape {shape}")
    w_k, n = (shape[0], shape[1]) if transpose else (shape[1], shape[0])
    if w_k != k:
        layout = "(K, N)" if transpose else "(N, K)"
        raise XnnquantError(f"weight {layout} does not match x (M, K={k}): got weight shape {shape}")
    return n


def _check_scales(scale: np.ndarray, name: str) -> None:
    """XNNPACK accepts only positive, normal float32 scales."""
    s = np.asarray(scale, np.float32)
    bad = ~(np.isfinite(s) & (s >= FLT_MIN))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0]) if s.ndim else ()
        raise XnnquantError(f"{name} must be positive normal floats: got {s[where]} at index {where}")


def _check_quantized_weight(weight: QuantizedTensor, k: int, transpose: bool, dynamic: bool) -> int:
    """Validate a quantized weight for the float-output paths; returns N."""
    dt = weight.datatype
    if dt not in FLOAT_OUTPUT_WEIGHTS:
        names = ", ".join(d.name for d in FLOAT_OUTPUT_WEIGHTS)
        raise UnsupportedConfigError(f"weight datatype {dt.name} is not supported here: expected one of {names}")
    n = _check_k(weight.shape, k, transpose)
    _check_scales(weight.scale, f"{dt.name} weight scale")
    if dt is Datatype.qbint4:
        _check_blockwise(weight, transpose, dynamic)
        return n
    expected_dim = 1 if transpose else 0
    if weight.channel_dim != expected_dim:
        raise XnnquantError(
            f"{dt.name} weight channel_dim must be the output-channel axis: got {weight.channel_dim}, "
            f"expected {expected_dim} for a {'(K, N)' if transpose else '(N, K)'} weight"
        )
    if dt is Datatype.qcint4:
        _check_qcint4(n, k, transpose, dynamic)
    return n


def _check_blockwise(weight: QuantizedTensor, transpose: bool, dynamic: bool) -> None:
    if transpose:
        raise UnsupportedConfigError(
            "transposed qbint4 weights are not supported: XNNPACK rejects them with channel_dim 0 "
            "and computes wrong results with channel_dim 1 (right only when N == K / 2); "
            "pass the weight as (N, K)"
        )
    if not dynamic:
        raise UnsupportedConfigError(
            "qbint4 weights need the qdint8 input: got dynamic=False, and XNNPACK rejects an fp32 "
            "input with a blockwise filter (xnn_status_invalid_parameter)"
        )
    g = weight.group_size or 0
    if g < XNN_MIN_BLOCKSIZE or g % XNN_MIN_BLOCKSIZE:
        raise UnsupportedConfigError(
            f"XNNPACK needs a qbint4 group_size that is a multiple of {XNN_MIN_BLOCKSIZE}: got {g}")
    check_bf16_exact(weight.scale, "qbint4 scales")


def _check_qcint4(n: int, k: int, transpose: bool, dynamic: bool) -> None:
    if dynamic and k % 2:
        raise UnsupportedConfigError(
            f"qcint4 weights with odd K on the dynamic path are computed wrongly by XNNPACK: got K={k}. "
            "Its fused per-row quantization reads K + 1 floats (one past each row), so a row's scale "
            "and zero point depend on the next row. Pad K to an even count with a zero column "
            "in x and a zero code column in the weight, which leaves the result unchanged"
        )
    if transpose and not dynamic:
        raise UnsupportedConfigError(
            "transposed qcint4 weights on the weight-only path crash XNNPACK while it packs them: "
            "pass the weight as (N, K)"
        )
    if transpose and n % 2:
        raise UnsupportedConfigError(
            f"transposed qcint4 weights need an even N: got N={n}. XNNPACK reads a (K, N) 4-bit filter "
            "as one continuous nibble stream, while QuantizedTensor.to_bytes pads each row to whole bytes"
        )
    if not dynamic and n == 1 and k == 1:
        raise UnsupportedConfigError("a 1 x 1 qcint4 weight crashes XNNPACK while it packs the weights")


def _check_static_bias(bias: QuantizedTensor, n: int, expected_scale: np.ndarray) -> None:
    if not isinstance(bias, QuantizedTensor) or bias.datatype is not Datatype.qcint32 or bias.shape != (n,):
        raise XnnquantError(f"bias must be a qcint32 QuantizedTensor of shape ({n},): got {bias!r}")
    if np.any(np.asarray(bias.zero_point) != 0):
        raise XnnquantError(f"qcint32 bias zero_point must be 0: got {bias.zero_point}")
    if not np.allclose(bias.scale, expected_scale, rtol=1e-6, atol=0):
        worst = int(np.argmax(np.abs(bias.scale - expected_scale) / expected_scale))
        raise XnnquantError(
            "bias scale must be x_scale * weight_scale per channel: "
            f"got {bias.scale[worst]} at channel {worst}, expected {expected_scale[worst]}"
        )


# --- building and running -----------------------------------------------------------


def _define_weight(sg: Subgraph, weight: QuantizedTensor, transpose: bool) -> int:
    """Static filter value of ``weight``: its ``to_bytes()`` data, XNNPACK zero point 8 for
    4-bit codes (the stored nibble is code + 8), scales as XNNPACK reads them."""
    dt, shape = weight.datatype, weight.shape
    data = np.frombuffer(weight.to_bytes(), np.uint8)
    if dt is Datatype.qbint4:
        assert weight.group_size is not None  # every qbint4 QuantizedTensor has one
        return sg.blockwise_tensor((shape[0], shape[1]), check_bf16_exact(weight.scale, "qbint4 scales").bits,
                                   weight.group_size, 8, data)
    zero_point = 8 if dt is Datatype.qcint4 else 0
    return sg.channelwise_tensor(dt, shape, weight.scale, 1 if transpose else 0, zero_point, data)


def _run(runtime: Runtime, x: np.ndarray, out: np.ndarray) -> None:
    """Run ``runtime`` once with input ``x`` and output ``out``; record the operators."""
    global _last, _last_timings
    with runtime:
        runtime.run({_X: x, _Y: out})
        _last = runtime.operator_names()
        _last_timings = runtime.operator_timings_us()
