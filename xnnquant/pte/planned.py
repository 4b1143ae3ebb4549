"""The memory a program asks the runtime for when a method loads, checked before it does.

ExecuTorch allocates each of a method's planned arenas (``ExecutionPlan.non_const_buffer_sizes``,
``memory.py``) whole when the method loads, at its dynamic dims' upper bounds: a
``Dim("seq", max=2**30)`` plans gigabytes for one input.  The 1.4.1 pybindings then fail
with ``std::bad_alloc`` (a ``MemoryError``), or the system kills the process.  A method
whose arenas together exceed the machine's physical memory is refused before that
(``check_fits``), saying how much it would take.
"""

from __future__ import annotations

import os

from ..errors import XnnquantError
from . import program_generated as fb

GIB = 2**30


def planned_bytes(flatbuffer: bytes) -> dict[str, int]:
    """Method name -> the bytes of its planned arenas together, from a ``Program`` flatbuffer
    already checked (``read_pte``) or written here."""
    root = fb.Program.GetRootAs(flatbuffer, 0)
    out = {}
    for p in range(root.ExecutionPlanLength()):
        plan = root.ExecutionPlan(p)
        name = plan.Name()
        sizes = [int(plan.NonConstBufferSizes(k)) for k in range(plan.NonConstBufferSizesLength())]
        out[name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)] = sum(sizes)
    return out


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(planned: dict[str, int], what: str, hint: str = "") -> None:
    """``XnnquantError`` when a method of ``what`` plans more memory than this machine has
    (``planned``: ``planned_bytes``' result); ``hint`` ends the message."""
    limit = physical_memory()
    if limit is None:
        return
    for method, size in planned.items():
        if size > limit:
            raise XnnquantError(
                f"{what}: method {method!r} plans {size / GIB:.3g} GiB ({size} bytes) of memory, which the runtime "
                f"allocates when it loads the method, and this machine has {limit / GIB:.3g} GiB; expected a plan "
                f"that fits{hint or ' (a dynamic dim plans its memory at its upper bound: lower its max)'}")


def runtime_memory_error(what: str, planned: dict[str, int]) -> XnnquantError:
    """The error for the runtime's ``std::bad_alloc`` (``MemoryError``) while loading ``what``."""
    sizes = ", ".join(f"{m!r} {s / GIB:.3g} GiB" for m, s in planned.items())
    return XnnquantError(f"{what}: the runtime could not allocate the memory the program plans ({sizes or 'none'}; "
                         "a dynamic dim plans its memory at its upper bound): expected a plan that fits in free "
                         "memory")
