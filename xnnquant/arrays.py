"""Accepting numpy arrays and torch tensors alike.

torch is optional: it is only touched when the caller hands in a tensor, and is
never imported here.  Every helper states the dtype of what it returns.
"""

from __future__ import annotations

from typing import TypeAlias, TypeGuard

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .constants import FLT_MIN
from .errors import XnnquantError

#: An array argument: a numpy array (bf16 as ``ml_dtypes.bfloat16``), a torch tensor (read
#: through ``.detach().cpu()``), a number or a nested sequence of numbers.  Each function
#: says which dtypes and shapes it takes.
ArrayInput: TypeAlias = npt.ArrayLike

_FLOAT_KINDS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """True for a Python or numpy integer, never for a bool (a bool is an int to Python)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_plain_tensor(x: object, name: str, *, meta: bool = False) -> None:
    """``XnnquantError`` unless the torch tensor ``x`` holds its values densely in this
    process's memory: the strided layout (not sparse or nested), not a quantized dtype, on
    the CPU (or on the ``meta`` device, which holds no values, when ``meta``)."""
    layout = str(getattr(x, "layout", "torch.strided")).removeprefix("torch.")
    device = str(getattr(getattr(x, "device", None), "type", "cpu"))
    if layout != "strided" or getattr(x, "is_nested", False):
        what = "nested" if getattr(x, "is_nested", False) else layout
        raise XnnquantError(f"{name} is a {what} tensor: expected a dense one (x.to_dense())")
    if getattr(x, "is_quantized", False):
        raise XnnquantError(f"{name} is a quantized torch tensor ({getattr(x, 'dtype', '')}): expected its float "
                            "values (x.dequantize())")
    if device != "cpu" and not (meta and device == "meta"):
        why = "holds no values" if device == "meta" else "is not in this process's memory"
        raise XnnquantError(f"{name} is on the {device} device, which {why}: expected a tensor on the CPU")


def _from_torch(x: object, name: str = "x") -> np.ndarray | None:
    """A numpy view or copy of a torch tensor, or None when ``x`` is not one."""
    if type(x).__module__.split(".")[0] != "torch" or not hasattr(x, "detach"):
        return None
    check_plain_tensor(x, name)
    t = x.detach()
    if str(t.dtype) == "torch.bfloat16":
        # numpy has no bf16; reinterpret the 16-bit patterns as ml_dtypes.bfloat16.
        import torch  # only reached when the caller already uses torch

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype numpy has not (float8, uint16, ...), a tensor subclass
        raise XnnquantError(f"{name} cannot be read as a numpy array: {type(x).__name__} of {t.dtype} "
                            f"({exc})") from None


def contiguous(x: ArrayInput, dtype: npt.DTypeLike | None = None) -> np.ndarray:
    """``x`` as a C-contiguous numpy array (a copy only when it is not one), its rank kept:
    a 0-d array stays 0-d (``np.ascontiguousarray`` makes it shape ``(1,)``)."""
    return np.asarray(x, dtype=dtype, order="C")


def to_numpy(x: ArrayInput, name: str = "x") -> np.ndarray:
    """``x`` (numpy array, torch tensor, or nested sequence) as a numpy array, dtype kept."""
    converted = _from_torch(x, name)
    if converted is not None:
        return converted
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise XnnquantError(f"{name} must be an array or tensor: got {type(x).__name__} ({exc})") from None


def as_float32(x: ArrayInput, name: str = "x", *, finite: bool = True) -> np.ndarray:
    """``x`` as a float32 numpy array.

    Accepts fp32, fp16 and bf16 (numpy, ml_dtypes or torch) and float64.  Integer or
    other inputs raise, since a caller quantizing an int tensor has mixed something up.
    With ``finite``, NaN or Inf raise and the message says where the first one is.
    """
    out = np.asarray(float_array(x, name), dtype=np.float32, order="C")  # keeps rank 0, unlike ascontiguousarray
    if finite:
        check_finite(out, name)
    return out


def float_array(x: ArrayInput, name: str = "x") -> np.ndarray:
    """``x`` as a numpy array of its own float dtype (fp32, fp16, bf16 or float64), unconverted.

    Integer or other inputs raise, as in ``as_float32``; values are not checked.
    """
    arr = to_numpy(x, name)
    if arr.dtype not in _FLOAT_KINDS:
        raise XnnquantError(
            f"{name} must be a floating-point array: got dtype {arr.dtype}, "
            "expected float32, float16 or bfloat16"
        )
    return arr


def check_finite(x: np.ndarray, name: str = "x") -> None:
    """Raise when ``x`` holds NaN or Inf, naming the first offending index."""
    bad = ~np.isfinite(x)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise XnnquantError(
            f"{name} must be finite: got {x[where]} at index {where} "
            f"({int(bad.sum())} non-finite value(s) in all)"
        )


def first_not_positive_normal(scale: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first value of ``scale`` that is not a positive normal float32, or None.

    XNNPACK refuses a scale that is NaN, infinite, zero, negative or subnormal (below
    ``FLT_MIN``); every scale check of the project asks this one question.
    """
    as32 = np.asarray(scale).astype(np.float32)
    bad = ~(np.isfinite(as32) & (as32 >= FLT_MIN))
    if not bad.any():
        return None
    return tuple(int(i) for i in np.argwhere(bad)[0]) if as32.ndim else ()


def as_int_codes(codes: ArrayInput, name: str = "codes") -> np.ndarray:
    """Integer codes as an int64 numpy array; floats are accepted only when integral."""
    arr = to_numpy(codes, name)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind == "b":
        raise XnnquantError(f"{name} must be integers: got dtype bool")
    if arr.dtype.kind == "f" or arr.dtype in _FLOAT_KINDS:
        f = arr.astype(np.float64)
        if not np.all(np.isfinite(f)) or np.any(f != np.round(f)):
            bad = np.argwhere(~np.isfinite(f) | (f != np.round(np.nan_to_num(f))))[0]
            idx = tuple(int(i) for i in bad)
            raise XnnquantError(f"{name} must be integers: got {f[idx]} at index {idx}")
        return f.astype(np.int64)
    raise XnnquantError(f"{name} must be an integer array: got dtype {arr.dtype}")
