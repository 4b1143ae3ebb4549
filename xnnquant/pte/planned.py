"""The memory a program asks the runtime for when a method loads, checked before it does.

ExecuTorch allocates each of a method's planned arenas (``ExecutionPlan.non_const_buffer_sizes``,
``memory.py``) whole when the method loads, at its dynamic dims' upper bounds: a
``Dim("seq", max=2**30)`` plans gigabytes for one input.  The 1.4.1 pybindings then fail
with ``std::bad_alloc`` (a ``MemoryError``), or the system kills the process.  A method
whose arenas together exceed a memory is refused before that (``check_fits``), saying how
much it would take and whose memory it was checked against:

* loading here (``pte.run``, ``graph.run``): this machine's physical memory, where it loads;
* exporting (``xq.export``): the memory of the device the program is for when the export is
  given it (``memory=``, ``memory_bytes``), else this machine's, and the report says which
  (``MemoryCheck``): the same export made on a 64 GB workstation and on a 4 GB CI box
  otherwise gives two answers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import PlannedMemoryError, XnnquantError
from . import program_generated as fb

GIB = 2**30
#: The units ``memory_bytes`` reads (case ignored), in bytes.
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
         "TiB": 2**40}
_UNITS = {unit.lower(): size for unit, size in UNITS.items()}


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


def memory_bytes(value: Any, name: str = "memory") -> int | None:
    """``memory=``: None, a number of bytes > 0, or a string of a number and a unit (``"4GiB"``,
    ``"512 MB"``; ``UNITS``, case ignored); ``XnnquantError`` for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]+)\s*", value)
        if found and found.group(2).lower() in _UNITS:
            size = int(float(found.group(1)) * _UNITS[found.group(2).lower()])
            if size > 0:
                return size
    elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise XnnquantError(f"{name} must be the memory of the device the program is for: got {value!r}, expected a "
                        "number of bytes > 0 or a string such as '4GiB' or '512 MB' (units: "
                        f"{', '.join(UNITS)})")


@dataclass(frozen=True)
class MemoryCheck:
    """What an export's memory check compared: each method's planned bytes (``planned``), the
    memory it was checked against (``limit``, None when this machine does not say) and whose
    memory that is (``target``: given as ``memory=``; else this machine's)."""

    planned: dict[str, int]
    limit: int | None
    target: bool

    @property
    def whose(self) -> str:
        return "the target's memory (memory=)" if self.target else "this machine's physical memory"

    def as_dict(self) -> dict[str, Any]:
        return {"planned_bytes": dict(self.planned), "limit_bytes": self.limit,
                "checked_against": "memory=" if self.target else "this machine"}

    def __str__(self) -> str:
        plans = ", ".join(f"{m!r} {_size(b)}" for m, b in self.planned.items()) or "none"
        if self.limit is None:
            return f"planned memory: {plans}; not checked ({self.whose} is unknown here)"
        hint = "" if self.target else " (memory= checks against the target's instead)"
        return f"planned memory: {plans}; fits {self.whose}, {_size(self.limit)}{hint}"


def _size(n: int) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB else f"{n / 2**20:.3g} MiB"


def check_fits(planned: dict[str, int], what: str, hint: str = "", limit: int | None = None,
               target: bool = False) -> MemoryCheck:
    """``PlannedMemoryError`` when a method of ``what`` plans more memory than ``limit`` bytes: the
    memory of the device the program is for (``target``, from ``memory=``), or by default
    this machine's physical memory (``physical_memory``); ``planned``: ``planned_bytes``'
    result; ``hint`` ends the message.  Returns what was compared."""
    if limit is None:
        limit, target = physical_memory(), False
    done = MemoryCheck(dict(planned), limit, target)
    if limit is None:
        return done
    has = (f"the target has {limit / GIB:.3g} GiB (memory={limit})" if target else
           f"this machine has {limit / GIB:.3g} GiB")
    for method, size in planned.items():
        if size > limit:
            raise PlannedMemoryError(
                f"{what}: method {method!r} plans {size / GIB:.3g} GiB ({size} bytes) of memory, which the runtime "
                f"allocates when it loads the method, and {has}; expected a plan that fits"
                f"{hint or ' (a dynamic dim plans its memory at its upper bound: lower its max)'}")
    return done


def runtime_memory_error(what: str, planned: dict[str, int]) -> XnnquantError:
    """The error for the runtime's ``std::bad_alloc`` (``MemoryError``) while loading ``what``."""
    sizes = ", ".join(f"{m!r} {s / GIB:.3g} GiB" for m, s in planned.items())
    return XnnquantError(f"{what}: the runtime could not allocate the memory the program plans ({sizes or 'none'}; "
                         "a dynamic dim plans its memory at its upper bound): expected a plan that fits in free "
                         "memory")
