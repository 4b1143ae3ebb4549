"""xnnquant: quantize weights for XNNPACK and write the exact bytes XNNPACK reads.

Data flows one way: ``schemes`` (floats -> codes and scales) -> ``packing`` (codes and
scales -> bytes) -> ``graph`` (bytes -> XNNGraph payload).  ``xnnquant.xnnpack`` reaches
the real XNNPACK shipped in executorch, to check those bytes and numbers.
"""

from . import graph, packing

# ``xq.export`` and ``xq.verify`` are functions, while ``xnnquant.export`` (the front end)
# and ``xnnquant.verify`` (``xnnquant verify``'s helpers) are modules.  Importing a module
# binds its name in this package only the first time, so each module is imported here
# before the function of the same name is bound; later imports leave the functions be.
# Import the modules' contents with ``from xnnquant.export import lowering`` (``import
# xnnquant.export.lowering as m`` resolves ``xnnquant.export`` to the function).
# torch is imported only when ``export`` or ``verify`` runs.
from . import verify as _verify_module  # noqa: F401  (imported first, see above)
from .datatypes import STORAGE, Datatype, QuantParamsKind, from_xnn_c, storage, to_xnn_c
from .errors import (
    MissingExtraError,
    PayloadError,
    RuntimeCrashError,
    RuntimeTimeoutError,
    UnsupportedConfigError,
    XnnquantError,
)
from .export import Exported, export
from .export.divergence import VerifyReport, verify
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
    "STORAGE",
    "Calibration",
    "CalibrationWarning",
    "Datatype",
    "Exported",
    "MissingExtraError",
    "PayloadError",
    "QuantParamsKind",
    "QuantizedTensor",
    "RuntimeCrashError",
    "RuntimeTimeoutError",
    "UnsupportedConfigError",
    "VerifyReport",
    "XnnquantError",
    "export",
    "from_xnn_c",
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
