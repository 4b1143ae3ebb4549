"""The real XNNPACK (as shipped in ``executorch==1.4.1``), reached through its C API.

Needs the ``xnnpack`` extra; without it every entry point raises ``MissingExtraError``.

* ``quantize_per_token(x)``: XNNPACK's own f32 -> qdint8 per-row quantization.
* ``load_library()``: the configured ``ctypes.CDLL`` (for modules that call more of the API).
"""

from ._capi import library_path, load_library
from .capture import capture_packed_weights
from .operators import quantize_per_token

__all__ = ["capture_packed_weights", "library_path", "load_library", "quantize_per_token"]
