"""The front end: a ``torch.nn.Module`` to an XNNPACK program (``xq.export``).

Data flows one way::

    module --torch.export--> ExportedProgram --AtenProgram.of--> passes/ --lowering/--> Graph
                                                                   rewrites   one function per ATen op,
                                                                   with guards  one LoweringContext

``api`` runs the stages (``stages/``, one module each); ``options`` parses every argument
once; ``weights`` is the one weight policy (the scheme table and the fallback rule);
``calibration`` gathers the linears' input statistics; ``streaming`` reads a meta module's
weights from a safetensors file; ``static_int8`` turns the float graph into a full-integer
int8 one; ``selfcheck`` compares the result with the module; ``exported`` is what
``xq.export`` returns, ``report`` what it reports and warns of; ``divergence`` is ``xq.verify``.

Importing this package does not import torch: ``export`` does, on first call.
"""

from .api import check, export
from .exported import Exported, TensorIO
from .options import StaticInt8
from .report import AccuracyWarning, CheckReport, FallbackWarning, OptionWarning, PerformanceWarning, ReportRow
from .weights import SchemeKind, WeightScheme

__all__ = ["AccuracyWarning", "CheckReport", "Exported", "FallbackWarning", "OptionWarning", "PerformanceWarning",
           "ReportRow", "SchemeKind", "StaticInt8", "TensorIO", "WeightScheme", "check", "export"]
