"""XNNPACK's own packed GEMM weights, captured through a custom weights-cache provider.

When a fully-connected operator is created with a weights cache, XNNPACK asks the cache
for room (``reserve_space``), zeroes it, packs the weights there for the micro-kernel it
selected, and hands the buffer back (``look_up_or_insert``).  The providers here are
ctypes structs of Python callbacks:

* ``capture_packed_weights``: operator API (``xnn_create_fully_connected_nc_<op>``);
  ``look_up`` always misses, ``look_up_or_insert`` copies the bytes out, the operator is
  deleted, nothing is run.
* ``capture_runtime_packed_weights``: the same through ``xnn_create_runtime_v4`` on the
  subgraph ExecuTorch builds for a linear layer; the runtime chooses the operator.
* ``PrepackedCache``: the other direction, a cache whose ``look_up`` always hits and
  serves a ``pack_gemm`` buffer, so XNNPACK skips packing at load time.

The tile parameters of the selected kernel are not exported by XNNPACK.  They are deduced
from the capture: the ``kernel_configs()`` row gemm-config.c selects on this CPU (from
/proc/cpuinfo), or else any row of the operator, whose ``pack_gemm`` bytes equal the
captured ones.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from ctypes import POINTER, byref, c_float, c_size_t, c_uint8, c_uint16, c_uint32, c_void_p
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..arrays import ArrayInput, as_float32
from ..constants import (
    XNN_ALLOCATION_ALIGNMENT,
    XNN_INVALID_VALUE_ID,
    XNN_VALUE_FLAG_EXTERNAL_INPUT,
    XNN_VALUE_FLAG_EXTERNAL_OUTPUT,
)
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError, XnnquantError
from ..packing.gemm import pack_gemm
from ..packing.gemm_configs import DYNAMIC_OPERATORS, KernelConfig, kernel_configs, runtime_config, select_config
from ..packing.int4 import pack_int4
from ..rounding import check_bf16_exact
from ..tensor import QuantizedTensor
from . import _capi

#: A GEMM weight: quantized, or a float array.
WeightInput = QuantizedTensor | ArrayInput
SIZE_MAX = ctypes.c_size_t(-1).value
STATUS_UNSUPPORTED_HARDWARE = 5

#: operator -> (weight datatype, C argument kinds between (input_stride, output_stride) and bias)
_OPERATORS: dict[str, tuple[Datatype | None, tuple[str, ...]]] = {
    "f32": (None, ("kernel",)),
    "qd8_f32_qc8w": (Datatype.qcint8, ("scale", "kernel")),
    "qdu8_f32_qc8w": (Datatype.qcint8, ("scale", "kernel")),
    "qd8_f32_qc4w": (Datatype.qcint4, ("zero_point", "scale", "kernel")),
    "qdu8_f32_qc4w": (Datatype.qcint4, ("zero_point", "scale", "kernel")),
    "qd8_f32_qb4w": (Datatype.qbint4, ("block_size", "zero_point", "bf16_scale", "kernel")),
    "qdu8_f32_qb4w": (Datatype.qbint4, ("block_size", "zero_point", "bf16_scale", "kernel")),
}
_CTYPES = {"kernel": c_void_p, "scale": POINTER(c_float), "zero_point": c_uint8,
           "block_size": c_size_t, "bf16_scale": POINTER(c_uint16)}


@dataclass(frozen=True)
class CapturedWeights:
    """The packed buffer XNNPACK wrote for one operator, and what it says about the kernel."""

    operator: str  # e.g. "qdu8_f32_qc4w": XNNPACK's xnn_create_fully_connected_nc_<operator>
    data: np.ndarray  # uint8 (size,): the whole reserved buffer, size a multiple of XNN_ALLOCATION_ALIGNMENT
    seed: int  # xnn_weights_cache_look_up_key.seed (N ^ K ^ nr ^ kr ^ sr ^ extra bytes ^ op type)
    fingerprint_id: int
    seconds: float  # wall time of the xnn_create_fully_connected_nc_* call
    config: KernelConfig | None = field(default=None)  # tile parameters, when deduced


class _Cache:
    """A weights-cache provider whose callbacks keep every buffer XNNPACK packs into.

    The ctypes struct, the CFUNCTYPE objects and the buffers all live on this object; keep
    it alive for as long as XNNPACK may call back or read (here: until the operator is
    deleted).
    """

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []
        self.inserted: list[tuple[int, int, bytes]] = []  # (seed, fingerprint_id, bytes)
        self._callbacks = (
            _capi.LOOK_UP_FN(lambda ctx, key: SIZE_MAX),
            _capi.RESERVE_SPACE_FN(self._reserve),
            _capi.LOOK_UP_OR_INSERT_FN(self._insert),
            _capi.IS_FINALIZED_FN(lambda ctx: False),
            _capi.OFFSET_TO_ADDR_FN(self._address),
            _capi.DELETE_CACHE_FN(lambda ctx: 0),
        )
        self.provider = _capi.WeightsCacheProvider(None, *self._callbacks)

    def _reserve(self, ctx: Any, size: int) -> int:
        raw = np.zeros(size + XNN_ALLOCATION_ALIGNMENT, np.uint8)
        self.buffers.append(raw)
        return raw.ctypes.data + (-raw.ctypes.data) % XNN_ALLOCATION_ALIGNMENT

    def _insert(self, ctx: Any, key: Any, ptr: int, size: int) -> int:
        k = key.contents
        self.inserted.append((int(k.seed), int(k.fingerprint_id), ctypes.string_at(ptr, size)))
        return len(self.inserted) - 1

    def _address(self, ctx: Any, offset: int) -> int | None:
        return None


class PrepackedCache:
    """A weights-cache provider that serves one buffer packed ahead of time.

    Every ``look_up`` hits (offset 0) and ``offset_to_addr`` returns the buffer, so
    XNNPACK skips packing and reads ``data`` as its packed weights; ``is_finalized`` is
    true, and nothing is ever inserted (``look_up_or_insert`` and ``reserve_space`` fail).
    Meant for a runtime or operator with exactly one packed-weights operand.  Pass
    ``provider`` as the weights cache; keep this object alive while XNNPACK may read.
    ``hits`` counts the look-ups served.
    """

    def __init__(self, data: np.ndarray) -> None:
        self.data = _capi.padded(np.asarray(data, np.uint8).reshape(-1))
        self.hits = 0
        self._callbacks = (
            _capi.LOOK_UP_FN(self._look_up),
            _capi.RESERVE_SPACE_FN(lambda ctx, size: None),
            _capi.LOOK_UP_OR_INSERT_FN(lambda ctx, key, ptr, size: SIZE_MAX),
            _capi.IS_FINALIZED_FN(lambda ctx: True),
            _capi.OFFSET_TO_ADDR_FN(lambda ctx, offset: self.data.ctypes.data),
            _capi.DELETE_CACHE_FN(lambda ctx: 0),
        )
        self.provider = _capi.WeightsCacheProvider(None, *self._callbacks)

    def _look_up(self, ctx: Any, key: Any) -> int:
        self.hits += 1
        return 0


def capture_packed_weights(weight: WeightInput, bias: ArrayInput | None = None, *, operator: str | None = None,
                           deduce: bool = True) -> CapturedWeights:
    """Create XNNPACK's fully-connected operator for ``weight`` and return its packed weights.

    ``weight``: float ``(N, K)`` (operator ``f32``) or a ``QuantizedTensor`` qcint8 /
    qcint4 / qbint4 with output channels first.  ``bias``: float ``(N,)`` or None.
    ``operator``: ``"f32"``, ``"qd8_f32_qc8w"``, ``"qdu8_f32_qc8w"``, ``"qd8_f32_qc4w"``,
    ``"qdu8_f32_qc4w"``, ``"qd8_f32_qb4w"`` or ``"qdu8_f32_qb4w"`` (``UnsupportedConfigError``
    when this CPU has no kernel for it); None picks the unsigned-input (qdu8) operator and
    falls back to the signed one (qd8) when this CPU has no qdu8 kernel (as XNNPACK's
    subgraph does).  4-bit kernels get
    ``pack_int4`` rows and kernel zero point 8, as ExecuTorch passes them.  With
    ``deduce``, ``config`` names the ``kernel_configs()`` row whose bytes match.
    """
    chosen = _resolve_operator(weight, operator)
    try:
        captured = _capture(chosen, weight, bias)
    except _Unsupported:
        if operator is not None or not chosen.startswith("qdu8"):
            raise UnsupportedConfigError(f"XNNPACK has no {chosen} kernel for this CPU") from None
        return capture_packed_weights(weight, bias, operator="qd8" + chosen[4:], deduce=deduce)
    if not deduce:
        return captured
    config = deduce_config(captured, weight, bias)
    return CapturedWeights(captured.operator, captured.data, captured.seed, captured.fingerprint_id,
                           captured.seconds, config)


def capture_runtime_packed_weights(weight: WeightInput, bias: ArrayInput | None = None) -> CapturedWeights:
    """Build the subgraph ExecuTorch builds for a linear layer, create its runtime with
    ``xnn_create_runtime_v4`` and a capturing weights cache, and return what it packed.

    Float weights: fp32 input -> FullyConnected(fp32 filter) -> fp32.  Quantized weights:
    fp32 input -> Convert -> qdint8 -> FullyConnected(filter) -> fp32, with 4-bit filters
    as ``pack_int4`` rows and zero point 8, as ExecuTorch passes them.  The runtime decides
    which operator runs (e.g. signed or unsigned input); ``operator`` is read back from the
    runtime's profiling names ("Fully Connected (NC, QDU8, F32, QC4W) GEMM" ->
    "qdu8_f32_qc4w") and ``config`` deduced from the bytes.  Nothing is run.
    """
    from .subgraph import Runtime, Subgraph

    arrays = _arguments(weight, bias)
    n, k = arrays["shape"]
    cache = _Cache()
    with Subgraph(2) as graph:
        x = graph.tensor(Datatype.fp32, (1, k), external_id=0, flags=XNN_VALUE_FLAG_EXTERNAL_INPUT)
        y = graph.tensor(Datatype.fp32, (1, n), external_id=1, flags=XNN_VALUE_FLAG_EXTERNAL_OUTPUT)
        b = XNN_INVALID_VALUE_ID if arrays["bias"] is None else graph.tensor(Datatype.fp32, (n,), arrays["bias"])
        if not isinstance(weight, QuantizedTensor):
            graph.fully_connected(x, graph.tensor(Datatype.fp32, (n, k), arrays["kernel"]), b, y)
        else:
            q = graph.dynamic_tensor((1, k))
            graph.convert(x, q)
            zero_point = 8 if weight.bits == 4 else 0
            if weight.datatype is Datatype.qbint4:
                f = graph.blockwise_tensor((n, k), arrays["bf16_scale"], arrays["block_size"], zero_point,
                                           arrays["kernel"])
            else:
                f = graph.channelwise_tensor(weight.datatype, (n, k), arrays["scale"], 0, zero_point,
                                             arrays["kernel"])
            graph.fully_connected(q, f, b, y)
        start = time.perf_counter()
        with Runtime(graph, weights_cache=cache.provider) as runtime:
            seconds = time.perf_counter() - start
            names = runtime.operator_names()
    operator = _operator_from_names(names)
    if len(cache.inserted) != 1:
        raise XnnquantError(f"the runtime inserted {len(cache.inserted)} packed buffers into the cache: expected 1")
    seed, fingerprint, data = cache.inserted[0]
    captured = CapturedWeights(operator, np.frombuffer(data, np.uint8).copy(), seed, fingerprint, seconds)
    return CapturedWeights(operator, captured.data, seed, fingerprint, seconds, deduce_config(captured, weight, bias))


def _operator_from_names(names: tuple[str, ...]) -> str:
    """"Fully Connected (NC, QDU8, F32, QC4W) GEMM" -> "qdu8_f32_qc4w"; "(NC, F32)" -> "f32"."""
    for name in names:
        if name.startswith("Fully Connected (NC, "):
            types = name[len("Fully Connected (NC, "):name.index(")")].split(", ")
            return "_".join(t.lower() for t in types)
    raise XnnquantError(f"the runtime runs no fully-connected operator: got operators {names}")


def deduce_config(captured: CapturedWeights, weight: WeightInput,
                  bias: ArrayInput | None = None) -> KernelConfig | None:
    """The configuration behind ``captured``: the first candidate whose ``pack_gemm`` bytes
    equal ``captured.data`` (None when none does).

    Candidates: the branch gemm-config.c selects for ``captured.operator`` on this CPU
    (``selected_config``; for f32 also its small-nr "nr2" table), then every other row of
    the operator.  Rows whose bytes are identical (same ``nr``/``kr``/``sr``/``planes``,
    different ``mr``) cannot be told apart by their bytes; the CPU's own branch wins.
    """
    flags, uarch = cpu_features()
    own = [select_config(captured.operator, flags, uarch, nr2=nr2) for nr2 in (False, True)]
    others = [c for c in kernel_configs() if c.operator == captured.operator and c not in own]
    for config in [c for c in own if c is not None] + others:
        try:
            ours = pack_gemm(weight, bias, config=config)
        except XnnquantError:
            continue
        if ours.size == captured.data.size and np.array_equal(ours, captured.data):
            return config
    return None


def cpu_features(cpuinfo: str | None = None) -> tuple[frozenset[str], str]:
    """A CPU's /proc/cpuinfo flags and its micro-architecture as XNNPACK's configs see it.

    ``cpuinfo``: the text of /proc/cpuinfo (None: this machine's).  The uarch is "zen" for
    AMD family 0x17 models below 0x30 and Hygon family 0x18 (what cpuinfo calls zen /
    dhyana), "zen4" / "zen5" for those cores, "" otherwise.  Empty flags when
    /proc/cpuinfo is unreadable (not Linux).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset(), ""
    fields: dict[str, str] = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = frozenset(fields.get("flags", "").split())
    vendor, family = fields.get("vendor_id", ""), int(fields.get("cpu family", "0") or 0)
    model = int(fields.get("model", "0") or 0)
    uarch = ""
    if (vendor == "AuthenticAMD" and family == 0x17 and model < 0x30) or (vendor == "HygonGenuine" and family == 0x18):
        uarch = "zen"
    elif vendor == "AuthenticAMD" and family == 0x19 and (0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F
                                                           or 0xA0 <= model <= 0xAF):
        uarch = "zen4"
    elif vendor == "AuthenticAMD" and family == 0x1A:
        uarch = "zen5"
    return flags, uarch


def selected_configs() -> dict[str, KernelConfig | None]:
    """Per operator, the ``kernel_configs()`` row gemm-config.c selects on this CPU.

    Keys are the operators of ``capture_packed_weights`` plus ``"f32 nr2"`` (the small-nr
    f32 table XNNPACK switches to when ``xnn_use_nr2`` holds).  None: no kernel.
    """
    flags, uarch = cpu_features()
    out = {op: select_config(op, flags, uarch) for op in _OPERATORS}
    out["f32 nr2"] = select_config("f32", flags, uarch, nr2=True)
    return out


def runtime_configs() -> dict[str, KernelConfig | None]:
    """Per dynamically quantized weight layout ("qc8w", "qc4w", "qb4w"), the kernel a
    subgraph runs on this CPU (``gemm_configs.runtime_config``)."""
    flags, uarch = cpu_features()
    return {weights: runtime_config(weights, flags, uarch) for weights in DYNAMIC_OPERATORS}


class _Unsupported(Exception):
    """XNNPACK returned xnn_status_unsupported_hardware."""


def _resolve_operator(weight: WeightInput, operator: str | None) -> str:
    datatype = weight.datatype if isinstance(weight, QuantizedTensor) else None
    if operator is None:
        names = {None: "f32", Datatype.qcint8: "qdu8_f32_qc8w", Datatype.qcint4: "qdu8_f32_qc4w",
                 Datatype.qbint4: "qdu8_f32_qb4w"}
        if datatype not in names:
            raise UnsupportedConfigError(f"no fully-connected operator for {datatype.name} weights")  # type: ignore[union-attr]
        return names[datatype]
    if operator not in _OPERATORS:
        raise XnnquantError(f"unknown operator: got {operator!r}, expected one of {sorted(_OPERATORS)}")
    expected = _OPERATORS[operator][0]
    if expected != datatype:
        got = "float" if datatype is None else datatype.name
        want = "float" if expected is None else expected.name
        raise XnnquantError(f"operator {operator} takes {want} weights: got {got}")
    return operator


def creation_seconds(weight: WeightInput, bias: ArrayInput | None = None, *, operator: str, repeat: int = 3,
                     prepacked: np.ndarray | None = None) -> float:
    """Fastest of ``repeat`` wall times of ``xnn_create_fully_connected_nc_<operator>``,
    operator deleted after each.

    Without ``prepacked``: no weights cache, XNNPACK allocates and packs on its own (its
    load-time packing cost, as a device pays it).  With ``prepacked`` (a ``pack_gemm``
    buffer): served through ``PrepackedCache``, so XNNPACK skips packing.
    """
    operator = _resolve_operator(weight, operator)
    arrays = _arguments(weight, bias)
    cache = None if prepacked is None else PrepackedCache(prepacked)
    try:
        return min(_create(operator, arrays, cache)[1] for _ in range(max(1, repeat)))
    except _Unsupported:
        raise UnsupportedConfigError(f"XNNPACK has no {operator} kernel for this CPU") from None


def _capture(operator: str, weight: QuantizedTensor | ArrayInput, bias: ArrayInput | None) -> CapturedWeights:
    """Run ``xnn_create_fully_connected_nc_<operator>`` with a capturing cache."""
    cache = _Cache()
    _, seconds = _create(operator, _arguments(weight, bias), cache)
    if len(cache.inserted) != 1:
        raise XnnquantError(f"{operator} inserted {len(cache.inserted)} packed buffers into the cache: expected 1")
    seed, fingerprint, data = cache.inserted[0]
    return CapturedWeights(operator, np.frombuffer(data, np.uint8).copy(), seed, fingerprint, seconds)


def _create(operator: str, arrays: dict[str, Any], cache: _Cache | PrepackedCache | None) -> tuple[int, float]:
    """Create (then delete) the operator; returns (status, seconds of the create call).

    Raises ``_Unsupported`` for xnn_status_unsupported_hardware, ``XnnquantError`` for any
    other failure.  ``arrays`` (from ``_arguments``) and ``cache`` outlive the call.
    """
    lib = _capi.load_library()
    kinds = _OPERATORS[operator][1]
    name = f"xnn_create_fully_connected_nc_{operator}"
    create: Callable[..., int] = _capi.declare(
        name, ctypes.c_int, c_size_t, c_size_t, c_size_t, c_size_t, *(_CTYPES[k] for k in kinds),
        POINTER(c_float), c_float, c_float, c_uint32, c_void_p, POINTER(c_void_p))
    n, k = arrays["shape"]
    args = [_argument(kind, arrays) for kind in kinds]
    bias_ptr = None if arrays["bias"] is None else _capi.typed_pointer(arrays["bias"], c_float)
    provider = None if cache is None else ctypes.cast(byref(cache.provider), c_void_p)
    op = c_void_p()
    start = time.perf_counter()
    status = create(k, n, k, n, *args, bias_ptr, c_float(-np.inf), c_float(np.inf), 0, provider, byref(op))
    seconds = time.perf_counter() - start
    if op.value:
        lib.xnn_delete_operator(op)
    if status == STATUS_UNSUPPORTED_HARDWARE:
        raise _Unsupported(operator)
    _capi.check(status, name)
    return status, seconds


def _arguments(weight: QuantizedTensor | ArrayInput, bias: ArrayInput | None) -> dict[str, Any]:
    """C-ready arrays: kernel bytes as XNNPACK reads them, scales, bias (float32 or None)."""
    out: dict[str, Any] = {}
    if isinstance(weight, QuantizedTensor):
        if weight.codes.ndim != 2:
            raise XnnquantError(f"GEMM weights must be 2-D (N, K): got shape {weight.shape}")
        out["shape"] = weight.shape
        if weight.bits == 4:
            out["kernel"] = _capi.padded(pack_int4(weight.codes))
        else:
            out["kernel"] = _capi.padded(weight.codes.astype(np.int8))
        if weight.datatype is Datatype.qbint4:
            out["bf16_scale"] = _capi.padded(check_bf16_exact(weight.scale, "qbint4 scales").bits)
            out["block_size"] = int(weight.group_size)  # type: ignore[arg-type]
        else:
            out["scale"] = _capi.padded(weight.scale.astype(np.float32))
    else:
        w = as_float32(weight, "weight")
        if w.ndim != 2:
            raise XnnquantError(f"GEMM weights must be 2-D (N, K): got shape {w.shape}")
        out["shape"] = w.shape
        out["kernel"] = _capi.padded(w)
    out["bias"] = None if bias is None else _capi.padded(as_float32(bias, "bias").reshape(-1))
    if out["bias"] is not None and out["bias"].shape != (out["shape"][0],):
        raise XnnquantError(f"bias must have shape (N,) = ({out['shape'][0]},): got {out['bias'].shape}")
    return out


def _argument(kind: str, arrays: dict[str, Any]) -> Any:
    if kind == "kernel":
        return _capi.pointer(arrays["kernel"])
    if kind == "zero_point":
        return 8
    if kind == "block_size":
        return arrays["block_size"]
    if kind == "bf16_scale":
        return _capi.typed_pointer(arrays["bf16_scale"], c_uint16)
    return _capi.typed_pointer(arrays["scale"], c_float)


__all__ = [
    "CapturedWeights",
    "PrepackedCache",
    "capture_packed_weights",
    "capture_runtime_packed_weights",
    "cpu_features",
    "creation_seconds",
    "deduce_config",
    "runtime_configs",
    "selected_configs",
]
