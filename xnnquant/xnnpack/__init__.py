"""The real XNNPACK (as shipped in ``executorch==1.4.1``), reached through its C API.

Needs the ``xnnpack`` extra; without it every entry point raises ``MissingExtraError``.

* ``convert_f32_qd8(x)``: XNNPACK's own f32 -> qdint8 per-row quantization (formerly
  ``quantize_per_token``, a name that stays as a deprecated alias).
* ``fully_connected(x, weight, bias, dynamic=...)``: float-output linear layer.
* ``static_fully_connected(x, weight, bias, output_scale=...)``: the all-int8 path.
* ``last_operators()``: the XNNPACK operators the last layer ran.
* ``capture_packed_weights(weight, bias)``: the bytes XNNPACK packs for its GEMM kernel,
  and the tile parameters it chose (``PrepackedCache`` hands packed bytes back to it).
* ``load_library()``, ``Subgraph``, ``Runtime``: for modules that build their own graphs
  (e.g. with a weights cache).
"""

import warnings
from typing import Any

from ._capi import library_path, load_library
from .capture import CapturedWeights, PrepackedCache, capture_packed_weights, capture_runtime_packed_weights
from .fully_connected import fully_connected, last_operators, last_timings_us, static_fully_connected
from .operators import convert_f32_qd8
from .subgraph import Runtime, Subgraph

__all__ = [
    "CapturedWeights",
    "PrepackedCache",
    "Runtime",
    "Subgraph",
    "capture_packed_weights",
    "capture_runtime_packed_weights",
    "convert_f32_qd8",
    "fully_connected",
    "last_operators",
    "last_timings_us",
    "library_path",
    "load_library",
    "static_fully_connected",
]


def __getattr__(name: str) -> Any:
    if name == "quantize_per_token":  # the old name, shared with xq.quantize_per_token
        warnings.warn("xnnquant.xnnpack.quantize_per_token is deprecated: use xnnquant.xnnpack.convert_f32_qd8 "
                      "(XNNPACK's operator; xnnquant.quantize_per_token is the library's own quantizer)",
                      DeprecationWarning, stacklevel=2)
        return convert_f32_qd8
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
