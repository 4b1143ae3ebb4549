"""Quantization schemes: floats in, ``QuantizedTensor`` (codes, scales, zero points) out.

One module per scheme, each with the same verbs ``choose_qparams``, ``quantize`` and
``dequantize``:

================  ==========================  ======================================
module            datatypes                   scales
================  ==========================  ======================================
``per_tensor``    qint8, quint8               one, asymmetric by default
``per_channel``   qcint8, qcint4              one per channel, symmetric
``blockwise``     qbint4                      one bf16 per (channel, group), symmetric
``bias``          qint32, qcint32             input scale x weight scale
``per_token``     qdint8                      one per row, as XNNPACK computes it
================  ==========================  ======================================

``search`` chooses symmetric scales ("minmax" or the least-squares "mse" search) and
``granularity`` says which elements share a scale.  Nothing here knows about bytes.

Activation-aware methods ("act_mse", "gptq") of ``per_channel`` and ``blockwise`` take
``calibration=``: ``calibration.Calibration`` accumulates the input statistics,
``activation_aware`` dispatches, ``weighted_search`` and ``gptq`` do the work.
"""

from . import (
    activation_aware,
    bias,
    blockwise,
    calibration,
    gptq,
    granularity,
    per_channel,
    per_tensor,
    per_token,
    search,
    weighted_search,
)
from .calibration import Calibration, CalibrationWarning
from .granularity import PerChannel, PerGroup, PerTensor, PerToken

quantize_per_tensor = per_tensor.quantize
quantize_per_channel = per_channel.quantize
quantize_blockwise = blockwise.quantize
quantize_bias = bias.quantize
quantize_per_token = per_token.quantize

__all__ = [
    "Calibration",
    "CalibrationWarning",
    "PerChannel",
    "PerGroup",
    "PerTensor",
    "PerToken",
    "activation_aware",
    "bias",
    "blockwise",
    "calibration",
    "gptq",
    "granularity",
    "per_channel",
    "per_tensor",
    "per_token",
    "quantize_bias",
    "quantize_blockwise",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_per_token",
    "search",
    "weighted_search",
]
