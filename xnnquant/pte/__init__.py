"""ExecuTorch programs (``.pte``) and data files (``.ptd``).

* ``builder`` / ``writer``: writing programs (``ProgramBuilder``): methods, their values
  (``values``), delegates, constants, named data; memory planning (``memory``), the
  extended header (``header``), the ET12 schema (``program.fbs``, generated code in
  ``program_generated``); ``portable``: ATen operators as ExecuTorch portable-kernel calls;
* ``reader``: every XNNPACK delegate of a program as a ``Graph`` (``read_pte``, ``read_ptd``);
* ``run``: running a program's methods on ExecuTorch's runtime, capturing what a delegate
  is fed, and checking each delegate against the reference interpreter (``verify_pte``).

Writing and reading a ``.pte`` imports neither torch nor executorch; ``portable`` imports
torch, ``run`` and ``.ptd`` files executorch, on first use.
"""

from .builder import Chunked, MethodBuilder, ProgramBuilder
from .portable import portable_call
from .reader import Delegate, ProgramError, PteProgram, is_pte, read_ptd, read_pte
from .run import Session, delegate_io, method_inputs, run_method, verify_pte
from .values import ScalarType, ShapeDynamism

__all__ = ["Chunked", "Delegate", "MethodBuilder", "ProgramBuilder", "ProgramError", "PteProgram", "ScalarType",
           "Session", "ShapeDynamism", "delegate_io", "is_pte", "method_inputs", "portable_call", "read_ptd",
           "read_pte", "run_method", "verify_pte"]
