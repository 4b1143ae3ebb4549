"""XNNPACK's C API through ctypes: library loading, prototypes, status checks.

The library is executorch's ``_portable_lib`` extension, found through the installed
``executorch`` package (never a fixed path).  It exports XNNPACK's C API; loading it with
``ctypes.CDLL`` does not import torch.  ``load_library()`` returns the loaded library with
``argtypes``/``restype`` declared for every function this package calls, after a
successful ``xnn_initialize``.  Other modules declare further functions with
``declare(name, restype, *argtypes)``.

XNNPACK keeps raw pointers to what it is given (static tensor data, scales, callback
structs) and may read up to ``XNN_EXTRA_BYTES`` past the end of an input.  ``padded`` copies an
array into a buffer with that slack; callers keep such buffers alive (see
``subgraph.Runtime.keepalive``) for as long as XNNPACK may read them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_bool,
    c_float,
    c_int,
    c_int32,
    c_size_t,
    c_uint16,
    c_uint32,
    c_void_p,
)
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import XNN_ALLOCATION_ALIGNMENT, XNN_EXTRA_BYTES
from ..errors import XnnquantError, missing_extra

# enum xnn_profile_info
PROFILE_NUM_OPERATORS = 0
PROFILE_OPERATOR_NAME = 1
PROFILE_OPERATOR_TIMING = 2

#: enum xnn_status
STATUS_NAMES: dict[int, str] = {
    0: "xnn_status_success",
    1: "xnn_status_uninitialized",
    2: "xnn_status_invalid_parameter",
    3: "xnn_status_invalid_state",
    4: "xnn_status_unsupported_parameter",
    5: "xnn_status_unsupported_hardware",
    6: "xnn_status_out_of_memory",
    7: "xnn_status_reallocation_required",
    8: "xnn_status_deprecated",
}

# --- C structs ----------------------------------------------------------------------


class QuantizationParams(Structure):
    """``struct xnn_quantization_params``: 8 bytes, ``{int32 zero_point; float scale}``."""

    _fields_ = [("zero_point", c_int32), ("scale", c_float)]


class ExternalValue(Structure):
    """``struct xnn_external_value``: ``{uint32 id; void* data}`` (16 bytes on 64-bit)."""

    _fields_ = [("id", c_uint32), ("data", c_void_p)]


class WeightsCacheLookUpKey(Structure):
    """``struct xnn_weights_cache_look_up_key``."""

    _fields_ = [
        ("seed", c_uint32),
        ("kernel", c_void_p),
        ("bias", c_void_p),
        ("fingerprint_id", c_uint32),
    ]


LOOK_UP_FN = CFUNCTYPE(c_size_t, c_void_p, POINTER(WeightsCacheLookUpKey))
RESERVE_SPACE_FN = CFUNCTYPE(c_void_p, c_void_p, c_size_t)
LOOK_UP_OR_INSERT_FN = CFUNCTYPE(c_size_t, c_void_p, POINTER(WeightsCacheLookUpKey), c_void_p, c_size_t)
IS_FINALIZED_FN = CFUNCTYPE(c_bool, c_void_p)
OFFSET_TO_ADDR_FN = CFUNCTYPE(c_void_p, c_void_p, c_size_t)
DELETE_CACHE_FN = CFUNCTYPE(c_int, c_void_p)


class WeightsCacheProvider(Structure):
    """``struct xnn_weights_cache_provider``: a context pointer and six callbacks.

    XNNPACK keeps a pointer to this struct and calls the callbacks while it creates
    operators; the struct and the CFUNCTYPE objects in it must outlive the runtime.
    """

    _fields_ = [
        ("context", c_void_p),
        ("look_up", LOOK_UP_FN),
        ("reserve_space", RESERVE_SPACE_FN),
        ("look_up_or_insert", LOOK_UP_OR_INSERT_FN),
        ("is_finalized", IS_FINALIZED_FN),
        ("offset_to_addr", OFFSET_TO_ADDR_FN),
        ("delete_cache", DELETE_CACHE_FN),
    ]


# --- prototypes -----------------------------------------------------------------------

_p = c_void_p  # opaque handles: xnn_subgraph_t, xnn_runtime_t, xnn_operator_t, ...
_pp = POINTER(c_void_p)
_u32, _sz = c_uint32, c_size_t
_dims = POINTER(c_size_t)

#: name -> (restype, argtypes).  Every function called through ``load_library()``.
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "xnn_initialize": (c_int, (_p,)),
    # subgraph
    "xnn_create_subgraph": (c_int, (_u32, _u32, _pp)),
    "xnn_delete_subgraph": (c_int, (_p,)),
    "xnn_define_tensor_value": (c_int, (_p, c_int, _sz, _dims, _p, _u32, _u32, POINTER(_u32))),
    "xnn_define_quantized_tensor_value": (
        c_int, (_p, c_int, c_int32, c_float, _sz, _dims, _p, _u32, _u32, POINTER(_u32))),
    "xnn_define_channelwise_quantized_tensor_value_v2": (
        c_int, (_p, c_int, c_int32, POINTER(c_float), _sz, _sz, _dims, _p, _u32, _u32, POINTER(_u32))),
    "xnn_define_blockwise_quantized_tensor_value": (
        c_int, (_p, c_int, c_int32, POINTER(c_uint16), _sz, _sz, _sz, _dims, _p, _u32, _u32, POINTER(_u32))),
    "xnn_define_dynamically_quantized_tensor_value": (
        c_int, (_p, c_int, _sz, _sz, _dims, _u32, _u32, POINTER(_u32))),
    "xnn_define_convert": (c_int, (_p, _u32, _u32, _u32)),
    "xnn_define_fully_connected": (c_int, (_p, c_float, c_float, _u32, _u32, _u32, _u32, _u32)),
    # runtime
    "xnn_create_runtime_v4": (c_int, (_p, _p, _p, _p, _u32, _pp)),
    "xnn_reshape_runtime": (c_int, (_p,)),
    "xnn_setup_runtime_v2": (c_int, (_p, _sz, POINTER(ExternalValue))),
    "xnn_invoke_runtime": (c_int, (_p,)),
    "xnn_delete_runtime": (c_int, (_p,)),
    "xnn_get_runtime_profiling_info": (c_int, (_p, c_int, _sz, _p, POINTER(_sz))),
    # operators
    "xnn_create_convert_nc_f32_qd8": (c_int, (_u32, _pp)),
    "xnn_reshape_convert_nc_f32_qd8": (c_int, (_p, _sz, _sz, _sz, _sz, _p)),
    "xnn_setup_convert_nc_f32_qd8": (
        c_int, (_p, POINTER(c_float), POINTER(ctypes.c_int8), POINTER(c_float), POINTER(QuantizationParams))),
    "xnn_run_operator": (c_int, (_p, _p)),
    "xnn_delete_operator": (c_int, (_p,)),
}


def library_path() -> Path:
    """Path of executorch's ``_portable_lib`` extension, which exports XNNPACK's C API.

    Raises ``MissingExtraError`` (naming the ``xnnpack`` extra) without executorch.
    """
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise missing_extra("xnnpack", "executorch", "reaching the real XNNPACK")
    for root in spec.submodule_search_locations:
        folder = Path(root) / "extension" / "pybindings"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            candidate = folder / f"_portable_lib{suffix}"
            if candidate.is_file():
                return candidate
    raise missing_extra("xnnpack", "executorch", "reaching the real XNNPACK (its _portable_lib was not found)")


@functools.cache
def load_library() -> ctypes.CDLL:
    """The loaded XNNPACK library, every prototype declared, ``xnn_initialize`` done.

    Cached: later calls return the same ``CDLL``.
    """
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise XnnquantError(f"could not load XNNPACK from {path}: {exc}") from None
    for name, (restype, argtypes) in PROTOTYPES.items():
        _declare_on(lib, name, restype, argtypes)
    check(lib.xnn_initialize(None), "xnn_initialize")
    return lib


def _declare_on(lib: ctypes.CDLL, name: str, restype: Any, argtypes: tuple[Any, ...]) -> Any:
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise XnnquantError(f"the XNNPACK in executorch does not export {name}: expected executorch==1.4.1") from None
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def declare(name: str, restype: Any, *argtypes: Any) -> Any:
    """Declare one more C function of the library and return it (for other modules)."""
    return _declare_on(load_library(), name, restype, argtypes)


def executorch_threadpool(threads: int) -> c_void_p:
    """ExecuTorch's process-wide ``pthreadpool_t`` with ``threads`` threads (what a program's
    delegates run on: ``executorch::extension::threadpool::get_pthreadpool``).

    Resizing replaces the pool: a runtime made on the pool of another size must be
    deleted before this is called with a new size.
    """
    lib = load_library()
    prefix = "_ZN10executorch9extension10threadpool"
    get_pool = _declare_on(lib, f"{prefix}14get_threadpoolEv", c_void_p, ())
    count = _declare_on(lib, "_ZNK10executorch9extension10threadpool10ThreadPool16get_thread_countEv",
                        ctypes.c_size_t, (c_void_p,))
    reset = _declare_on(lib, f"{prefix}10ThreadPool24_unsafe_reset_threadpoolEj", c_bool, (c_void_p, ctypes.c_uint32))
    get_pthreadpool = _declare_on(lib, f"{prefix}15get_pthreadpoolEv", c_void_p, ())
    pool = get_pool()
    if not pool or (count(pool) != threads and not reset(pool, threads)):
        raise XnnquantError(f"could not set ExecuTorch's thread pool to {threads} threads")
    return c_void_p(get_pthreadpool())


def check(status: int, call: str) -> None:
    """Raise ``XnnquantError`` naming ``call`` and the status when ``status`` is not success."""
    if status != 0:
        name = STATUS_NAMES.get(status, "unknown status")
        raise XnnquantError(f"XNNPACK call {call} failed: got {name} ({status}), expected xnn_status_success (0)")


def dims_array(shape: tuple[int, ...]) -> ctypes.Array:
    """``size_t[len(shape)]`` holding ``shape`` (XNNPACK copies dims, keeps no pointer)."""
    return (c_size_t * max(len(shape), 1))(*shape)


def padded(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, ``XNN_ALLOCATION_ALIGNMENT``-aligned copy of ``array`` followed by ``XNN_EXTRA_BYTES`` of zeros.

    Returns a view of the data (same dtype and shape) whose ``.base`` owns the slack, so
    keeping the view alive keeps the whole buffer alive.
    """
    array = np.ascontiguousarray(array)
    raw = np.zeros(array.nbytes + XNN_EXTRA_BYTES + XNN_ALLOCATION_ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % XNN_ALLOCATION_ALIGNMENT
    view = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    view[...] = array
    return view


def pointer(array: np.ndarray | None) -> c_void_p:
    """``void*`` to the first element of ``array`` (NULL for None)."""
    return c_void_p(None if array is None else array.ctypes.data)


def typed_pointer(array: np.ndarray, ctype: Any) -> Any:
    """``ctype*`` to the first element of ``array``."""
    return array.ctypes.data_as(POINTER(ctype))


__all__ = [
    "ExternalValue",
    "QuantizationParams",
    "WeightsCacheLookUpKey",
    "WeightsCacheProvider",
    "check",
    "declare",
    "dims_array",
    "executorch_threadpool",
    "library_path",
    "load_library",
    "padded",
    "pointer",
    "typed_pointer",
]
