"""Errors raised for bad input.

Every error the library raises because of what a caller passed is an
``XnnquantError`` (itself a ``ValueError``).  Messages follow one shape:
*what* was wrong, what was *given*, what is *expected*.
"""

from __future__ import annotations

from types import FrameType
from typing import Any


class XnnquantError(ValueError):
    """Base of every error raised for bad input."""


class UnsupportedConfigError(XnnquantError):
    """A configuration the real XNNPACK rejects or computes wrongly."""


class SelfCheckError(XnnquantError):
    """An export's lowered graph does not compute what its module computes (``xq.export``'s
    self-check): a fault of the export, not of the caller's input; the message names the
    first diverging node, its ATen op and module path."""


class PayloadError(XnnquantError):
    """Malformed or inconsistent XNNGraph payload bytes."""


class ProgramError(XnnquantError):
    """Malformed, truncated or unsupported ExecuTorch program (``.pte``) or data file (``.ptd``)
    (``xnnquant.pte``)."""


class RuntimeCrashError(XnnquantError):
    """The real runtime died (a signal such as SIGSEGV) while running a payload in an
    isolated process; ``signal_number`` is the signal (``None`` for a plain exit) and
    ``log`` what the runtime process logged during the call."""

    def __init__(self, message: str, signal_number: int | None = None, log: str = "") -> None:
        super().__init__(message)
        self.signal_number = signal_number
        self.log = log


class RuntimeTimeoutError(RuntimeCrashError):
    """The isolated runtime did not finish within the time allowed and was stopped."""


class PlannedMemoryError(XnnquantError):
    """A program plans more memory than the device it is for has (``memory=``, or this
    machine's): the runtime allocates the planned arenas whole when the method loads."""


class OutputFileError(XnnquantError, OSError):
    """A file could not be written (a missing directory, no permission, a full disk): the
    message names the path given and the system's reason.  Also an ``OSError``."""


class MissingExtraError(XnnquantError, ImportError):
    """An optional dependency (an extra of the package) is not installed."""


def missing_extra(extra: str, package: str, purpose: str) -> MissingExtraError:
    """Error for a missing optional dependency, with the install command."""
    return MissingExtraError(
        f"{purpose} needs the {package!r} package, which is not installed: "
        f"install the extra with  pip install 'xnnquant[{extra}]'"
    )


def import_torch(purpose: str, extra: str = "torch") -> Any:
    """The ``torch`` module, or ``MissingExtraError`` saying that ``purpose`` needs it and which
    extra installs it."""
    try:
        import torch
    except ImportError:
        raise missing_extra(extra, "torch", purpose) from None
    return torch


def warn_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside this package: the caller's own
    line, however many of the library's calls (wrappers, passes) lie between."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
