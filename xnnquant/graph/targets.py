"""Which schema a payload is written for: the node kinds a graph may use.

=============  ==========================================  ============================
target         node kinds                                  read by
=============  ==========================================  ============================
``"xn01"``     the XN01 schema's 37 (tags 1..37)           every XNNPACK delegate runtime
``"1.4.1"``    also the 10 that ExecuTorch 1.4.1 appended  ExecuTorch 1.4.1 and later
               (tags 38..47: XNNConcatenate5,
               XNNConvTranspose2d, XNNReciprocalSquareRoot,
               XNNLog, XNNGelu, XNNTanh, XNNExp, XNNSin,
               XNNCopy, XNNCos)
=============  ==========================================  ============================

Both write the file identifier ``XN01`` (as ExecuTorch 1.4.1 itself does).  A graph that
uses only XN01 kinds gives the same bytes under either target; the generated code of
``schema_141.fbs`` is used only for graphs that use a 1.4.1 kind.  ``"seed"`` is accepted
as another spelling of ``"xn01"`` (issue 14 used that name).
"""

from __future__ import annotations

from enum import Enum

from ..errors import XnnquantError
from .layout import ET141_NODE_KINDS, XN01_NODE_KINDS

#: Other spellings accepted by ``Target.parse``.
ALIASES = {"seed": "xn01"}


class Target(str, Enum):
    """A runtime generation whose schema a payload keeps to."""

    XN01 = "xn01"
    ET_1_4_1 = "1.4.1"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object) -> Target:
        """``Target`` from itself or its string (``"xn01"``, ``"seed"``, ``"1.4.1"``)."""
        if isinstance(value, Target):
            return value
        if isinstance(value, str):
            text = ALIASES.get(value.strip().lower(), value.strip().lower())
            for target in cls:
                if target.value == text:
                    return target
        valid = ", ".join(repr(t.value) for t in cls)
        raise XnnquantError(f"unknown target: got {value!r}, expected one of {valid} ('seed' = 'xn01')")

    @property
    def node_kinds(self) -> frozenset[str]:
        """Names of the ``XNodeUnion`` members a graph for this target may use."""
        if self is Target.XN01:
            return frozenset(XN01_NODE_KINDS)
        return frozenset(XN01_NODE_KINDS + ET141_NODE_KINDS)

    @property
    def uses_later_kinds(self) -> bool:
        """True when the target reads node kinds beyond the XN01 schema."""
        return self is not Target.XN01
