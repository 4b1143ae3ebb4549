"""Stage ``write``: the program's bytes, and whether the runtime can allocate its planned memory.

Takes the ``Exported`` (``lower.py`` or ``quantize.py``) and the options; writes its bytes once
(the ``.pte`` of a mixed program, the payload of a pure one: both kept on the ``Exported``) and
sets ``Exported.memory_check``, refusing a program whose planned memory (``pte.planned``) does
not fit the device's memory (``memory=``) or, without it, this machine's.  A streaming export
skips this stage: it reads and quantizes its weights when it is saved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exported import Exported
from ..options import ExportOptions
from ..report import stage

if TYPE_CHECKING:
    from ...pte.planned import MemoryCheck


def write(exported: Exported, options: ExportOptions, timings: dict[str, float]) -> None:
    """Write ``exported``'s bytes (timed as ``write``), then check its planned memory."""
    with stage("write", timings):
        exported.to_pte() if exported.mixed else exported.to_bytes()
    exported.memory_check = check_planned(exported, options)


def check_planned(exported: Exported, options: ExportOptions) -> MemoryCheck:
    """Refuse a program whose planned memory (at its dynamic dims' bounds) the runtime could not
    allocate (``pte.planned``): a mixed program's arenas, a pure one's inputs and outputs (the
    runtime plans those; XNNPACK sizes its own memory at the sizes it runs); against
    ``memory=`` when given (and this machine's too when the self-check will load a mixed
    program here), else this machine's.  Returns the ``MemoryCheck``."""
    import numpy as np

    from ...pte.planned import check_fits, planned_bytes

    if exported.mixed:
        planned = planned_bytes(exported.to_pte())
    else:
        planned = {"forward": sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
                                  for t in exported.inputs + exported.outputs)}
    dims = sorted({str(d) for t in exported.inputs + exported.outputs for d in t.dynamic if d is not None})
    lower = (f" (its dynamic dims plan their memory at their upper bounds: {', '.join(dims)}; lower their max)"
             if dims else "")
    then = options.memory_hint
    if options.memory is None:
        return check_fits(planned, "the exported program", lower + "; memory= checks against the target device's "
                          "memory instead of this machine's" + then)
    done = check_fits(planned, "the exported program", lower + then, options.memory, target=True)
    if options.check and exported.mixed:
        check_fits(planned, "the exported program's self-check", lower + "; the self-check loads the program on "
                   "this machine: check=False skips it" + then)
    return done
