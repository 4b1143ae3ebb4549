"""The front end: a ``torch.nn.Module`` to one XNNPACK graph (``xq.export``).

``export`` runs ``torch.export``, decomposes to core ATen, and lowers node by node onto
``xnnquant.graph.Graph`` through one lowering per ATen op, registered by op family
(``linear``, ``conv``, ``pooling``, ``elementwise``, ``activations``, ``normalization``,
``shape``; see ``registry``).  Weights go through ``quantize.quantize_weight``; the
result is an ``Exported`` with the payload, a ``.pte`` and a per-weight report.

Importing this package does not import torch: ``export`` does, on first call.
"""

from .api import export, load_lowerings
from .exported import Exported
from .options import SchemeKind, WeightScheme
from .report import ReportRow

__all__ = ["Exported", "ReportRow", "SchemeKind", "WeightScheme", "export", "load_lowerings"]
