"""Streaming export: a module on the ``meta`` device, its weights in a safetensors file.

``xq.export(module, inputs, state_dict="model.safetensors")`` lowers a module whose
parameters and buffers hold no data (built on ``torch.device("meta")``), so the float
model is never in memory.  Every layer weight becomes a ``graph.Deferred`` constant:
it is read from the file (one tensor at a time, ``files.safetensors``), quantized and written
into the payload's constant segment only when the payload is written (``Exported.save``),
and its report row (bytes, SQNR) is filled in then.  The graph has its scales in the
constant segment (``Graph(scales_in_segment=True)``, target 1.4.1), so its flatbuffer
depends on shapes alone; the same module exported with its weights in memory gives the
same bytes.

Other constants the lowering needs (norm weights, biases, tables, masks) are read when
lowered, and those a mixed program's portable kernels read (a token embedding table, float32)
when the program is emitted, at full size; they are small next to the layer weights of the
models this is for.  Values computed from the module's tensors ahead of time (a lowering folding an op
on a parameter) cannot be read from the file and are refused, naming the tensor.

Parameters must be on meta.  A buffer may hold data: one the module computes when it is
built (a rotary ``inv_freq``, non-persistent, so absent from checkpoints) is taken from the
module, and values folded from it alone are computed ahead of time as in memory
(``passes.constants``).  Such a buffer left on meta is refused by name, saying so.  A fold
may also read small tensors the file holds (``passes.constants.FOLD_READ_BYTES``).  The
example inputs are traced on meta, as the parameters are.

Before anything is written, every tensor the graph reads is checked against the file:
present, of the module's shape, floating point.  A tensor whose bytes turn out bad while
the payload is written (a non-finite value) stops the writing with an error naming it,
and ``save`` leaves no partial file.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import XnnquantError
from ..files.safetensors import SafetensorsFile, ShardedSafetensors, TensorInfo, open_checkpoint
from ..graph import Deferred
from ..tensor import QuantizedTensor
from .report import ReportRow

if TYPE_CHECKING:
    from .weights import WeightScheme

#: Bytes of weights the disk is asked to read ahead of the one being quantized (about
#: 4 float32 MLP weights of a 1B Llama).
READ_AHEAD_BYTES = 256 << 20
#: Bytes of tensors, in file order, read while torch.export traces the module and
#: ExecuTorch is imported, before any weight is asked for (models are usually stored in
#: the order their layers run): the disk is otherwise idle then (README, "Performance").
WARM_START_BYTES = 1 << 30


def _read_requests(file: SafetensorsFile | ShardedSafetensors, requests: queue.SimpleQueue[str | None]) -> None:
    """The reader thread: warm each tensor named in ``requests`` until ``None`` comes.  A
    read that fails changes nothing: the export's own read of that tensor reports it."""
    while (name := requests.get()) is not None:
        with contextlib.suppress(OSError, XnnquantError):
            file.warm(name)

#: safetensors dtypes a weight may have (read as float32).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")

Layout = Callable[[np.ndarray], np.ndarray]


class WeightFile:
    """The safetensors file a streaming export reads its tensors from."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.file = open_checkpoint(path)  # one file, or a sharded checkpoint's index
        self.order: list[str] = []  # the layer weights, in the order they are written
        self._ahead = 0  # weights up to this position have been handed to the reader
        self._requests: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        # a daemon thread: a process that ends (an export that failed, say) does not wait
        # for reads nobody needs; it stops when this WeightFile goes
        threading.Thread(target=_read_requests, args=(self.file, self._requests), daemon=True,
                         name="xnnquant-read-ahead").start()
        weakref.finalize(self, self._requests.put, None)
        budget = WARM_START_BYTES  # read while torch.export traces the module (see the constant)
        for name in self.file.tensors:
            if budget <= 0:
                break
            self._requests.put(name)
            budget -= self.file.nbytes(name)

    def read_ahead(self, position: int) -> None:
        """Have the disk read the weights after ``position``, ``READ_AHEAD_BYTES`` of them,
        into the page cache while this thread goes on: the reader thread reads them
        (``SafetensorsFile.warm``).  One weight ahead, asked with ``posix_fadvise`` from
        here, left a cold-input export a whole read of its input slower than a warm one."""
        budget = READ_AHEAD_BYTES
        for i in range(position + 1, len(self.order)):
            if budget <= 0:
                break
            budget -= self.file.nbytes(self.order[i])
            if i > self._ahead:
                self._requests.put(self.order[i])
                self._ahead = i

    @property
    def path(self) -> str:
        return str(self.file.path)

    def check(self, name: str, shape: tuple[int, ...], what: str) -> TensorInfo:
        """The file's tensor ``name`` after checking that it fits ``what`` (of ``shape``)."""
        info = self.file.info(name)
        if info.shape != shape:
            raise XnnquantError(f"{self.path}: tensor {name!r} has shape {info.shape}, but {what} has shape {shape}")
        if info.dtype not in FLOAT_DTYPES:
            raise XnnquantError(f"{self.path}: tensor {name!r} is {info.dtype}, but {what} needs a floating-point "
                                f"tensor ({', '.join(FLOAT_DTYPES)})")
        return info

    def array(self, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
        """Tensor ``name`` read now, as float32 (a copy), checked finite (``finite``)."""
        self.check(name, shape, what)
        return self.finite(name, self.file.read(name).astype(np.float32, copy=False))

    def finite(self, name: str, values: np.ndarray) -> np.ndarray:
        """``values`` of tensor ``name``, or ``XnnquantError`` naming the file, the tensor and the
        first non-finite value (what an export of the module with its weights in memory refuses)."""
        bad = ~np.isfinite(values)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise XnnquantError(f"{self.path}: tensor {name!r} is not finite (NaN or inf, {int(bad.sum())} value(s), "
                                f"first {values.ravel()[first]} at flat index {first}): a program computed from it "
                                "would be too; expected finite values")
        return values

    def weight(self, name: str, shape: tuple[int, ...], path: str, scheme: WeightScheme, method: str, note: str,
               layout: Layout | None, axis: int, rows: list[ReportRow]) -> Deferred:
        """A layer weight as a ``Deferred`` constant: read, laid out, quantized when written.

        A report row is appended now (bytes known, SQNR ``nan``) and replaced with the
        measured one each time the weight is made (found by identity: rows may be put before it).
        """
        self.check(name, shape, f"the weight of {path!r}")
        from .weights import weight_sqnr

        dims = laid_out_shape(shape, layout)
        row = [ReportRow(path, dims, str(scheme), scheme.stored_nbytes(dims, axis), math.nan, note)]
        rows.append(row[0])
        where = f"{self.path}: tensor {name!r}"
        position = len(self.order)
        self.order.append(name)

        def make() -> QuantizedTensor | np.ndarray:
            self.read_ahead(position)  # the disk reads the next weights while this one is quantized
            weight = self.finite(name, self.file.read(name).astype(np.float32, copy=False))
            if layout is not None:
                weight = np.ascontiguousarray(layout(weight))
            try:
                stored = scheme.quantize(weight, method, None, axis=axis)
            except XnnquantError as exc:
                raise XnnquantError(f"{where}: {exc}") from None
            at = next(i for i, r in enumerate(rows) if r is row[0])
            row[0] = rows[at] = ReportRow(path, dims, str(scheme), scheme.stored_nbytes(dims, axis),
                                          weight_sqnr(weight, stored), note)
            return stored

        return Deferred(scheme.datatype, dims, make, where, group_size=scheme.group_size, channel_dim=axis)


def laid_out_shape(shape: tuple[int, ...], layout: Layout | None) -> tuple[int, ...]:
    """The shape ``layout`` gives an array of ``shape``, found on a stand-in of no memory."""
    if layout is None:
        return shape
    stand_in = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape, (0,) * len(shape))
    return tuple(int(d) for d in layout(stand_in).shape)


def meta_tensor_refusal(what: str, name: str | None, file: WeightFile | None = None) -> str:
    """Why a meta tensor that is not one of the file's tensors cannot be read (computed from
    the module's tensor ``name``, when known; ``file``: the weight file, to say whether it
    holds ``name``)."""
    if name and file is not None and name not in file.file.tensors:
        return f"{what} is computed from {name!r}: " + absent_buffer(name, file)
    origin = f" (computed from {name!r})" if name else ""
    return (f"{what} is on the meta device{origin}: a streaming export reads parameters and buffers as they are "
            "stored, and this value is computed from them ahead of time")


def absent_buffer(name: str, file: WeightFile) -> str:
    """What to do about the module's meta tensor ``name`` that ``file`` does not hold."""
    return (f"{name!r} is on the meta device and {file.path!r} does not hold it (a buffer the module computes "
            "when it is built, such as a rotary embedding's inv_freq, is not saved with the weights); expected "
            "it to hold data: build the submodule that owns it outside torch.device('meta') (a streaming export "
            "takes the values of buffers that hold data from the module)")


def is_meta(x: Any) -> bool:
    return getattr(getattr(x, "device", None), "type", None) == "meta"
