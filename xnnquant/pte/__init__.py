"""ExecuTorch programs (``.pte``) and data files (``.ptd``).

* ``reader``: every XNNPACK delegate of a program as a ``Graph`` (``read_pte``, ``read_ptd``);
* ``run``: running a program's methods on ExecuTorch's runtime, capturing what a delegate
  is fed, and checking each delegate against the reference interpreter (``verify_pte``).

torch and executorch are imported on first use.
"""

from .reader import Delegate, ProgramError, PteProgram, is_pte, read_ptd, read_pte
from .run import delegate_io, method_inputs, run_method, verify_pte

__all__ = ["Delegate", "ProgramError", "PteProgram", "delegate_io", "is_pte", "method_inputs", "read_ptd",
           "read_pte", "run_method", "verify_pte"]
