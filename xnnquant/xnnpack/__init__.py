"""The real XNNPACK (as shipped in ``executorch==1.4.1``), reached through its C API.

Needs the ``xnnpack`` extra; without it every entry point raises ``MissingExtraError``.

* ``quantize_per_token(x)``: XNNPACK's own f32 -> qdint8 per-row quantization.
* ``fully_connected(x, weight, bias, dynamic=...)``: float-output linear layer.
* ``static_fully_connected(x, weight, bias, output_scale=...)``: the all-int8 path.
* ``last_operators()``: the XNNPACK operators the last layer ran.
* ``capture_packed_weights(weight, bias)``: the bytes XNNPACK packs for its GEMM kernel,
  and the tile parameters it chose (``PrepackedCache`` hands packed bytes back to it).
* ``load_library()``, ``Subgraph``, ``Runtime``: for modules that build their own graphs
  (e.g. with a weights cache).
"""

from ._capi import library_path, load_library
from .capture import CapturedWeights, PrepackedCache, capture_packed_weights, capture_runtime_packed_weights
from .fully_connected import fully_connected, last_operators, last_timings_us, static_fully_connected
from .operators import quantize_per_token
from .runtime import Runtime, Subgraph

__all__ = [
    "CapturedWeights",
    "PrepackedCache",
    "capture_packed_weights",
    "capture_runtime_packed_weights",
    "Runtime",
    "Subgraph",
    "fully_connected",
    "last_operators",
    "last_timings_us",
    "library_path",
    "load_library",
    "quantize_per_token",
    "static_fully_connected",
]
