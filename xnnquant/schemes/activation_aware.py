"""Activation-aware weight quantization: codes and scales chosen for the layer's outputs.

The weight-only methods (``search``) minimise ``|w - wq|**2``.  A linear layer's output
error on inputs ``X`` is ``|X (w - wq)^T|**2``, and inputs are far from uniform: a few
channels carry most of the energy.  These methods take calibration inputs (a
``Calibration``, or a float array ``(tokens, in_features)``) and minimise the output error
on them (``calibration`` explains why ``G = X^T X`` is all they need):

==========  ===========================================================================
method      what it does
==========  ===========================================================================
``act_mse``  scale search only: each group's scale (bf16 candidates, as ``mse``) for the
            least ``e^T G_gg e``, ``G_gg`` the group's diagonal block of ``G`` (for
            per-channel weights, whose group is the whole row: ``sum_k G_kk e_k**2``).
            Codes are then plain rounding, as for ``mse``.
``gptq``    error compensation (``gptq``): columns quantized one by one, each rounding
            error pushed onto the columns not yet quantized, in decreasing order of input
            energy; each group's scale chosen when its first column comes up, for the
            least loss left after compensation; then a least-squares re-fit of each
            row's scales with the codes fixed.  ``G`` is dampened by ``GPTQ_DAMP`` of its
            mean diagonal.
==========  ===========================================================================

The result is an ordinary ``QuantizedTensor`` of the requested datatype: codes in range,
zero point 0, positive normal float32 scales (bf16 values for qbint4).
"""

from __future__ import annotations

import numpy as np

from ..arrays import ArrayInput
from ..datatypes import Datatype, storage
from ..errors import XnnquantError
from . import kernels
from .calibration import Calibration, as_calibration
from .gptq import GptqSettings, dampened, gptq
from .weighted_search import diagonal_cost, quadratic_cost, search_scales

#: ``act_mse`` dampening (fraction of the mean of ``diag(G)``): keeps every group's
#: block positive definite when some inputs are always zero.
ACT_MSE_DAMP = 0.01
#: Rows per chunk of the per-channel search, sized for the cache (candidates x rows x K).
_CHUNK_ELEMENTS = 1 << 21


def act_mse_scales(w: np.ndarray, h: np.ndarray, group_size: int, qmin: int, qmax: int,
                   bf16: bool) -> np.ndarray:
    """``act_mse`` scales of ``w`` float64 ``[C, K]`` for the (dampened) Gram ``h`` ``(K, K)``:
    float32 ``(C, K // group_size)``."""
    c, k = w.shape
    n_groups = k // group_size
    out = np.empty((c, n_groups), np.float32)
    if group_size == k:  # per channel: diagonal weights, rows in chunks
        cost = diagonal_cost(np.diag(h))
        step = max(1, _CHUNK_ELEMENTS // (40 * k))
        for start in range(0, c, step):
            out[start:start + step, 0] = search_scales(w[start:start + step], cost, qmin, qmax, bf16)
        return out
    for group in range(n_groups):
        cols = slice(group * group_size, (group + 1) * group_size)
        out[:, group] = search_scales(w[:, cols], quadratic_cost(h[cols, cols]), qmin, qmax, bf16)
    return out


def quantize_linear(w: np.ndarray, calibration: Calibration | ArrayInput, datatype: Datatype, group_size: int | None,
                    method: str, settings: GptqSettings | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of a linear weight ``w`` float32 ``[C, K]`` by ``method``.

    ``datatype``: qbint4 (with ``group_size``), qcint4 or qcint8 (``group_size`` None).
    Returns codes ``[C, K]`` of the datatype's integer type and scales float32,
    ``(C, K // group_size)`` for qbint4 (bf16 values), ``(C,)`` per channel.
    """
    if w.ndim != 2:
        raise XnnquantError(
            f"method {method!r} quantizes linear weights: got shape {w.shape}, expected a 2-D [out_features, "
            "in_features] weight (per channel: axis=0)"
        )
    c, k = w.shape
    cal = as_calibration(calibration, k)
    facts = storage(datatype)
    bf16 = datatype is Datatype.qbint4
    g = k if group_size is None else group_size
    w64 = w.astype(np.float64)
    if method == "act_mse":
        scales = act_mse_scales(w64, dampened(cal.gram, ACT_MSE_DAMP), g, facts.code_min, facts.code_max, bf16)
        # codes as every method rounds them (the kernel of quantize(w, scale=...))
        codes = kernels.quantize(w, g, scales.reshape(-1), 0, facts.code_min, facts.code_max, facts.numpy_dtype)
    elif method == "gptq":
        settings = settings or GptqSettings()
        start = None
        if group_size is None:  # one group per row: its full quadratic search would cost C K^2 per candidate
            start = act_mse_scales(w64, dampened(cal.gram, settings.damp), g, facts.code_min, facts.code_max, bf16)
        found, scales = gptq(w64, cal.gram, g, facts.code_min, facts.code_max, bf16, settings, start)
        codes = found.astype(facts.numpy_dtype)
    else:
        raise AssertionError(method)
    scales = scales if group_size is not None else scales[:, 0]
    return codes.reshape(c, k), np.ascontiguousarray(scales, np.float32)
