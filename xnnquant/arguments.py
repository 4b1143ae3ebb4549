"""Checks of the plain arguments of public functions: flags, integers, numbers, integer
sequences, paths, time limits, choices.

Each check returns the argument in the type the function works with, or raises
``XnnquantError`` saying which argument was wrong, what was given and what is expected.
Nothing is coerced silently: a float is not an integer (``1.5`` is not truncated, ``2.0``
is refused too), a bool is neither an integer nor a number, a string is not a sequence of
integers, and an array is not a flag.  Arrays have their own checks (``arrays.py``), and so
do weight schemes, payload bytes and programs (their own modules).
"""

from __future__ import annotations

import math
import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import XnnquantError

#: The longest time limit the platform's waits take (``threading.TIMEOUT_MAX``, about 292
#: years on Linux); a larger one overflows ``select``'s ``time_t``.
MAX_SECONDS = threading.TIMEOUT_MAX
#: Characters of a given value's ``repr`` quoted in a message.
SHOWN = 60


#: Types whose ``repr`` says what they are: quoted without their type's name.
PLAIN = (str, bytes, bool, int, float, complex, tuple, list, type(None))


def shown(value: Any) -> str:
    """``value`` as a message quotes it: a short ``repr``, after its type's name unless the
    ``repr`` says it (``'ab'``, ``2.5``, ``(1, 2)``); an array's shape and dtype."""
    if isinstance(value, np.ndarray):
        return f"ndarray of shape {value.shape} {value.dtype}"
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "shape"):
        return f"{type(value).__name__} of shape {tuple(value.shape)} {getattr(value, 'dtype', '')}".rstrip()
    try:
        text = repr(value)
    except Exception:  # a repr that fails says nothing more than the type
        text = "?"
    if len(text) > SHOWN:
        text = text[:SHOWN - 3] + "..."
    return text if type(value) in PLAIN else f"{type(value).__name__} {text}"


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool: ``True`` or ``False`` (numpy's too), nothing else."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise XnnquantError(f"{name} must be True or False: got {shown(value)}")


def is_plain_int(value: Any) -> bool:
    """True for a Python or numpy integer, never for a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound may be None): a Python or numpy
    integer, never a bool or a float."""
    if not is_plain_int(value):
        raise XnnquantError(f"{name} must be an integer: got {shown(value)}")
    out = int(value)
    if (low is not None and out < low) or (high is not None and out > high):
        raise XnnquantError(f"{name} is out of range: got {out}, expected {_range(low, high)}")
    return out


def number(value: Any, name: str, *, finite: bool = False, low: float | None = None, nan: bool = False) -> float:
    """``value`` as a float: a Python or numpy real number (not a bool, not complex, not an
    array), not NaN unless ``nan``; ``finite``: not infinite either; ``low``: at least that."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise XnnquantError(f"{name} must be a real number: got {shown(value)}")
    out = float(value)
    if math.isnan(out) and nan:
        return out
    if math.isnan(out) or (finite and math.isinf(out)) or (low is not None and out < low):
        expected = ("a finite number" if finite else "a number") + ("" if low is None else f" >= {low:g}")
        raise XnnquantError(f"{name} is out of range: got {out!r}, expected {expected}"
                            f"{', not NaN' if math.isnan(out) else ''}")
    return out


def integers(value: Any, name: str, *, length: int | None = None, low: int | None = None,
             high: int | None = None) -> tuple[int, ...]:
    """``value`` as a tuple of ints, each in ``[low, high]``: a list, tuple, range or 1-D
    integer array (not a string or bytes); ``length``: exactly that many."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        items: Sequence[Any] = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        items = value
    else:
        raise XnnquantError(f"{name} must be a sequence of integers: got {shown(value)}")
    if length is not None and len(items) != length:
        raise XnnquantError(f"{name} must hold {length} integers: got {len(items)} ({shown(value)})")
    out = []
    for i, item in enumerate(items):
        if not is_plain_int(item):
            raise XnnquantError(f"{name} must be a sequence of integers: got {shown(item)} at index {i}")
        k = operator.index(item)
        if (low is not None and k < low) or (high is not None and k > high):
            raise XnnquantError(f"{name}[{i}] is out of range: got {k}, expected {_range(low, high)}")
        out.append(k)
    return tuple(out)


def items(value: Any, name: str, what: str = "items") -> list[Any]:
    """``value`` as a list: a list or a tuple of ``what`` (not a string, an array, a mapping,
    a set or an iterator, whose order or length a caller cannot have meant)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    raise XnnquantError(f"{name} must be a list or tuple of {what}: got {shown(value)}")


def path(value: Any, name: str = "path") -> Path:
    """``value`` as a ``Path``: a non-empty ``str`` or ``os.PathLike`` of ``str``."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text and "\0" not in text:
            return Path(text)
    raise XnnquantError(f"{name} must be a file path (a non-empty str or os.PathLike): got {shown(value)}")


def seconds(value: Any, name: str = "timeout") -> float | None:
    """A time limit: None (the default limit) or a number of seconds in ``(0, MAX_SECONDS]``."""
    if value is None:
        return None
    out = number(value, name, nan=True)
    if not 0 < out <= MAX_SECONDS:  # NaN too
        raise XnnquantError(f"{name} is out of range: got {out!r}, expected a number of seconds > 0 and at most "
                            f"{MAX_SECONDS:g} (or None)")
    return out


def spelling(value: Any) -> str | None:
    """The spelling of an option as every option of xnnquant compares it: a string with its
    case and surrounding spaces ignored (``"MSE "`` is ``"mse"``); None for a non-string."""
    return value.strip().lower() if isinstance(value, str) else None


def choice(value: Any, name: str, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices`` (compared with ``==`` after a type check, so an
    array or an unhashable value is refused, not compared element-wise)."""
    for option in choices:
        if isinstance(value, type(option)) and value == option:
            return option
    raise XnnquantError(f"{name} must be one of {', '.join(map(repr, choices))}: got {shown(value)}")


def _range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"{low} to {high}"
    return f">= {low}" if low is not None else f"<= {high}"
