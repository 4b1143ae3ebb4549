"""xnnquant: quantize weights for XNNPACK and write the exact bytes XNNPACK reads.

Data flows one way: ``schemes`` (floats -> codes and scales) -> ``packing`` (codes and
scales -> bytes) -> ``graph`` (bytes -> XNNGraph payload).  ``xnnquant.xnnpack`` reaches
the real XNNPACK shipped in executorch, to check those bytes and numbers.
"""

from . import graph, packing

# torch is imported only when ``export`` or ``verify`` runs.
from .datatypes import STORAGE, Datatype, QuantParamsKind, from_xnn_c, storage, to_xnn_c
from .errors import (
    MissingExtraError,
    PayloadError,
    RuntimeCrashError,
    RuntimeTimeoutError,
    UnsupportedConfigError,
    XnnquantError,
)
from .frontend import (
    AccuracyWarning,
    Exported,
    FallbackWarning,
    OptionWarning,
    PerformanceWarning,
    StaticInt8,
    check,
    export,
)
from .frontend.divergence import VerifyReport, verify
from .llm import LLM, Generation, export_llm, generate
from .schemes import (
    Calibration,
    CalibrationWarning,
    quantize_bias,
    quantize_blockwise,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)
from .tensor import QuantizedTensor

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "STORAGE",
    "AccuracyWarning",
    "Calibration",
    "CalibrationWarning",
    "Datatype",
    "Exported",
    "FallbackWarning",
    "Generation",
    "MissingExtraError",
    "OptionWarning",
    "PayloadError",
    "PerformanceWarning",
    "QuantParamsKind",
    "QuantizedTensor",
    "RuntimeCrashError",
    "RuntimeTimeoutError",
    "StaticInt8",
    "UnsupportedConfigError",
    "VerifyReport",
    "XnnquantError",
    "check",
    "export",
    "export_llm",
    "from_xnn_c",
    "generate",
    "graph",
    "packing",
    "quantize_bias",
    "quantize_blockwise",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_per_token",
    "storage",
    "to_xnn_c",
    "verify",
]
