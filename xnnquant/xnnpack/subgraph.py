"""Owning wrappers for an XNNPACK subgraph and the runtime built from it.

``Subgraph`` defines values and nodes; every array whose pointer it hands to XNNPACK
(static data, scales) goes into ``Subgraph.keepalive``.  ``Runtime`` takes that list
over, together with the weights cache, so nothing XNNPACK may still read is freed
while the runtime lives.  Both are context managers and release their C object once.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ..constants import XNN_FLAG_BASIC_PROFILING, XNN_INVALID_VALUE_ID
from ..datatypes import Datatype, to_xnn_c
from ..errors import XnnquantError
from . import _capi


class Subgraph:
    """An ``xnn_subgraph_t`` with ``num_externals`` external value ids (0 .. n-1)."""

    def __init__(self, num_externals: int) -> None:
        self.lib = _capi.load_library()
        self.handle = ctypes.c_void_p()
        self.keepalive: list[Any] = []
        _capi.check(
            self.lib.xnn_create_subgraph(num_externals, 0, ctypes.byref(self.handle)), "xnn_create_subgraph"
        )

    # --- values ----------------------------------------------------------------------

    def _static(self, data: np.ndarray | None) -> ctypes.c_void_p:
        """Pointer to a padded copy of ``data`` that lives as long as this subgraph."""
        if data is None:
            return ctypes.c_void_p(None)
        buffer = _capi.padded(data)
        self.keepalive.append(buffer)
        return _capi.pointer(buffer)

    def _value_id(self, call: str, status: int, value_id: ctypes.c_uint32) -> int:
        _capi.check(status, call)
        return int(value_id.value)

    def tensor(self, datatype: Datatype, shape: tuple[int, ...], data: np.ndarray | None = None,
               external_id: int = XNN_INVALID_VALUE_ID, flags: int = 0) -> int:
        """A float (or unquantized) value; ``data`` makes it static."""
        out = ctypes.c_uint32()
        status = self.lib.xnn_define_tensor_value(
            self.handle, to_xnn_c(datatype), len(shape), _capi.dims_array(shape),
            self._static(data), external_id, flags, ctypes.byref(out))
        return self._value_id("xnn_define_tensor_value", status, out)

    def quantized_tensor(self, datatype: Datatype, shape: tuple[int, ...], scale: float, zero_point: int,
                         data: np.ndarray | None = None, external_id: int = XNN_INVALID_VALUE_ID,
                         flags: int = 0) -> int:
        """A per-tensor quantized value (qint8, quint8, qint32)."""
        out = ctypes.c_uint32()
        status = self.lib.xnn_define_quantized_tensor_value(
            self.handle, to_xnn_c(datatype), zero_point, scale, len(shape), _capi.dims_array(shape),
            self._static(data), external_id, flags, ctypes.byref(out))
        return self._value_id("xnn_define_quantized_tensor_value", status, out)

    def channelwise_tensor(self, datatype: Datatype, shape: tuple[int, ...], scale: np.ndarray,
                           channel_dim: int, zero_point: int, data: np.ndarray) -> int:
        """A static per-channel value (qcint8, qcint4, qcint32); ``scale`` float32 ``(shape[channel_dim],)``."""
        scales = _capi.padded(np.asarray(scale, np.float32))
        self.keepalive.append(scales)  # XNNPACK keeps the pointer until it packs the weights
        out = ctypes.c_uint32()
        status = self.lib.xnn_define_channelwise_quantized_tensor_value_v2(
            self.handle, to_xnn_c(datatype), zero_point, _capi.typed_pointer(scales, ctypes.c_float),
            len(shape), channel_dim, _capi.dims_array(shape), self._static(data),
            XNN_INVALID_VALUE_ID, 0, ctypes.byref(out))
        return self._value_id("xnn_define_channelwise_quantized_tensor_value_v2", status, out)

    def blockwise_tensor(self, shape: tuple[int, int], scale_bf16_bits: np.ndarray, block_size: int,
                         zero_point: int, data: np.ndarray, channel_dim: int = 0) -> int:
        """A static qbint4 value; ``scale_bf16_bits`` uint16 ``(N, K // block_size)``."""
        scales = _capi.padded(np.asarray(scale_bf16_bits, np.uint16))
        self.keepalive.append(scales)
        out = ctypes.c_uint32()
        status = self.lib.xnn_define_blockwise_quantized_tensor_value(
            self.handle, to_xnn_c(Datatype.qbint4), zero_point, _capi.typed_pointer(scales, ctypes.c_uint16),
            len(shape), channel_dim, block_size, _capi.dims_array(shape), self._static(data),
            XNN_INVALID_VALUE_ID, 0, ctypes.byref(out))
        return self._value_id("xnn_define_blockwise_quantized_tensor_value", status, out)

    def dynamic_tensor(self, shape: tuple[int, ...], num_nonbatch_dims: int = 1) -> int:
        """An internal qdint8 value, quantized per row while the runtime runs."""
        out = ctypes.c_uint32()
        status = self.lib.xnn_define_dynamically_quantized_tensor_value(
            self.handle, to_xnn_c(Datatype.qdint8), len(shape), num_nonbatch_dims, _capi.dims_array(shape),
            XNN_INVALID_VALUE_ID, 0, ctypes.byref(out))
        return self._value_id("xnn_define_dynamically_quantized_tensor_value", status, out)

    # --- nodes -----------------------------------------------------------------------

    def convert(self, input_id: int, output_id: int) -> None:
        _capi.check(self.lib.xnn_define_convert(self.handle, input_id, output_id, 0), "xnn_define_convert")

    def fully_connected(self, input_id: int, filter_id: int, bias_id: int, output_id: int, flags: int = 0,
                        output_min: float = -np.inf, output_max: float = np.inf) -> None:
        _capi.check(
            self.lib.xnn_define_fully_connected(
                self.handle, output_min, output_max, input_id, filter_id, bias_id, output_id, flags),
            "xnn_define_fully_connected",
        )

    # --- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        if self.handle:
            self.lib.xnn_delete_subgraph(self.handle)
            self.handle = ctypes.c_void_p()

    def __enter__(self) -> Subgraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Runtime:
    """An ``xnn_runtime_t`` created from a ``Subgraph`` (no workspace sharing).

    ``threads``: 1 runs on the calling thread; more runs on ExecuTorch's thread pool,
    resized to that many threads (the pool programs run on).

    ``weights_cache``: None, a ``_capi.WeightsCacheProvider`` (passed by reference) or any
    ``void*``-compatible ctypes object.  It is kept alive with the subgraph's buffers.
    ``profiling`` sets ``XNN_FLAG_BASIC_PROFILING`` so ``operator_names()`` works.
    """

    def __init__(self, subgraph: Subgraph, *, weights_cache: Any = None, profiling: bool = True,
                 flags: int = 0, threads: int = 1) -> None:
        self.lib = subgraph.lib
        self.handle = ctypes.c_void_p()
        self.keepalive: list[Any] = [*subgraph.keepalive, weights_cache]
        cache_arg = ctypes.byref(weights_cache) if isinstance(weights_cache, ctypes.Structure) else weights_cache
        if profiling:
            flags |= XNN_FLAG_BASIC_PROFILING
        pool = _capi.executorch_threadpool(threads) if threads > 1 else None
        _capi.check(
            self.lib.xnn_create_runtime_v4(subgraph.handle, cache_arg, None, pool, flags, ctypes.byref(self.handle)),
            "xnn_create_runtime_v4",
        )

    def run(self, externals: dict[int, np.ndarray]) -> None:
        """Reshape, set up and invoke with ``externals`` (external id -> C-contiguous buffer).

        Input buffers should come from ``_capi.padded`` (XNNPACK may read past their end);
        output buffers are written in place.
        """
        for external_id, array in externals.items():
            if not array.flags.c_contiguous:
                raise XnnquantError(f"external value {external_id} must be C-contiguous")
        values = (_capi.ExternalValue * len(externals))(
            *(_capi.ExternalValue(i, array.ctypes.data) for i, array in sorted(externals.items()))
        )
        _capi.check(self.lib.xnn_reshape_runtime(self.handle), "xnn_reshape_runtime")
        _capi.check(self.lib.xnn_setup_runtime_v2(self.handle, len(externals), values), "xnn_setup_runtime_v2")
        _capi.check(self.lib.xnn_invoke_runtime(self.handle), "xnn_invoke_runtime")

    def _profile(self, what: int) -> bytes:
        size = ctypes.c_size_t(0)
        status = self.lib.xnn_get_runtime_profiling_info(self.handle, what, 0, None, ctypes.byref(size))
        if status == 0:
            return b""  # nothing to report (no operators)
        if status != 6:  # xnn_status_out_of_memory: the required size is in `size`
            _capi.check(status, "xnn_get_runtime_profiling_info")
        buffer = ctypes.create_string_buffer(size.value)
        _capi.check(
            self.lib.xnn_get_runtime_profiling_info(self.handle, what, size.value, buffer, ctypes.byref(size)),
            "xnn_get_runtime_profiling_info",
        )
        return buffer.raw

    def operator_names(self) -> tuple[str, ...]:
        """Names of the operators the runtime runs, in order, e.g.
        ``"Fully Connected (NC, QDU8, F32, QC8W) GEMM"`` (type, then microkernel kind)."""
        raw = self._profile(_capi.PROFILE_OPERATOR_NAME)
        return tuple(name.decode() for name in raw.split(b"\0") if name)

    def operator_timings_us(self) -> tuple[int, ...]:
        """Time of each operator in the last invocation, microseconds, same order as names."""
        raw = self._profile(_capi.PROFILE_OPERATOR_TIMING)
        return tuple(int(t) for t in np.frombuffer(raw, np.uint64))

    def close(self) -> None:
        if self.handle:
            self.lib.xnn_delete_runtime(self.handle)
            self.handle = ctypes.c_void_p()
        self.keepalive = []

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
