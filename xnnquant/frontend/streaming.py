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

A 2-D layer weight or embedding table quantized into codes is read and quantized a piece
of rows at a time (``by_rows``, ``PIECE_BYTES`` of floats), with the codes, scales and SQNR
of the whole: a 128k-token table is 1 GB of float32.

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
#: the order their layers run): the disk is otherwise idle then (docs/benchmarks.md, "Performance").
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

    def check(self, name: str, shape: tuple[int, ...], what: str, floating: bool = True) -> TensorInfo:
        """The file's tensor ``name`` after checking that it fits ``what`` (of ``shape``, a
        floating-point tensor, or an integer or bool one when not ``floating``)."""
        info = self.file.info(name)
        if info.shape != shape:
            raise XnnquantError(f"{self.path}: tensor {name!r} has shape {info.shape}, but {what} has shape {shape}")
        if (info.dtype in FLOAT_DTYPES) != floating:
            kinds = f"a floating-point tensor ({', '.join(FLOAT_DTYPES)})" if floating else "an integer or bool tensor"
            raise XnnquantError(f"{self.path}: tensor {name!r} is {info.dtype}, but {what} needs {kinds}")
        return info

    def array(self, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
        """Tensor ``name`` read now, as float32 (a copy), checked finite (``finite``)."""
        self.check(name, shape, what)
        return self.finite(name, self.file.read(name).astype(np.float32, copy=False))

    def finite(self, name: str, values: np.ndarray, offset: int = 0) -> np.ndarray:
        """``values`` of tensor ``name`` (its flat values from ``offset`` on), or ``XnnquantError``
        naming the file, the tensor and the first non-finite value, with the count of them among
        ``values`` (what an export of the module with its weights in memory refuses)."""
        bad = ~np.isfinite(values)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise XnnquantError(f"{self.path}: tensor {name!r} is not finite (NaN or inf, {int(bad.sum())} value(s), "
                                f"first {values.ravel()[first]} at flat index {offset + first}): a program computed "
                                "from it would be too; expected finite values")
        return values

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of the 2-D tensor ``name``, as float32, checked finite."""
        mapped = self.file.read(name)  # mapped afresh: its pages leave memory with this piece
        return self.finite(name, mapped[lo:hi].astype(np.float32, copy=False), lo * int(np.prod(mapped.shape[1:])))

    def weight(self, name: str, shape: tuple[int, ...], path: str, scheme: WeightScheme, method: str, note: str,
               layout: Layout | None, axis: int, rows: list[ReportRow]) -> Deferred:
        """A layer weight as a ``Deferred`` constant: read, laid out, quantized when written.

        A report row is appended now (bytes known, SQNR ``nan``) and replaced with the
        measured one each time the weight is made (found by identity: rows may be put before it).
        """
        self.check(name, shape, f"the weight of {path!r}")
        from .weight_sqnr import weight_sqnr
        from .weights import SchemeKind

        dims = laid_out_shape(shape, layout)
        row = [ReportRow(path, dims, str(scheme), scheme.stored_nbytes(dims, axis), math.nan, note)]
        rows.append(row[0])
        where = f"{self.path}: tensor {name!r}"
        position = len(self.order)
        self.order.append(name)

        def make() -> QuantizedTensor | np.ndarray:
            self.read_ahead(position)  # the disk reads the next weights while this one is quantized
            def quantize(weight: np.ndarray) -> Any:
                try:
                    return scheme.quantize(weight, method, None, axis=axis)
                except XnnquantError as exc:
                    raise XnnquantError(f"{where}: {exc}") from None

            if layout is None and axis == 0 and len(shape) == 2 and scheme.kind is not SchemeKind.FP32:
                stored, sqnr = by_rows(lambda lo, hi: self.rows(name, lo, hi), shape, quantize)  # codes by rows
            else:
                weight = self.finite(name, self.file.read(name).astype(np.float32, copy=False))
                if layout is not None:
                    weight = np.ascontiguousarray(layout(weight))
                stored = quantize(weight)
                sqnr = weight_sqnr(weight, stored)
            at = next(i for i, r in enumerate(rows) if r is row[0])
            row[0] = rows[at] = ReportRow(path, dims, str(scheme), scheme.stored_nbytes(dims, axis), sqnr, note)
            return stored

        return Deferred(scheme.datatype, dims, make, where, group_size=scheme.group_size, channel_dim=axis)


#: Float32 bytes of a streamed 2-D tensor read and quantized at a time (``by_rows``): a
#: larger one (a 128k-token table or the output layer tied to it: 1 GB) goes by pieces of rows.
PIECE_BYTES = 128 << 20


def by_rows(read: Callable[[int, int], np.ndarray], shape: tuple[int, ...],
            quantize: Callable[[np.ndarray], Any]) -> tuple[QuantizedTensor, float]:
    """``quantize`` of the float32 rows ``read(0, rows)`` of a ``shape`` tensor and its
    ``weight_sqnr``, made a piece of rows at a time: at most ``PIECE_BYTES`` of floats, in
    whole pieces of ``weight_sqnr``'s sums.  The schemes given here (per output channel on
    axis 0, or in groups along each row) make each row's codes and scales from that row
    alone, so the codes, scales and figure are those of the whole tensor at once (a test
    compares)::

        rows 0 .. p-1     -> codes[0:p],  scale[0:p],  sums of weight_sqnr's pieces
        rows p .. 2p-1    -> codes[p:2p], ...
        ...                  one float piece in memory at a time; codes filled in place
    """
    from .weight_sqnr import sqnr_of, sqnr_rows, sqnr_sums

    rows, width = shape[0], int(np.prod(shape[1:]))
    step = sqnr_rows(width)
    piece = max(step, PIECE_BYTES // (4 * max(1, width)) // step * step)
    out: QuantizedTensor | None = None
    codes = scale = np.empty(0)
    sums = []
    for lo in range(0, max(rows, 1), piece):  # an empty tensor: one piece of no rows
        hi = min(rows, lo + piece)
        values = read(lo, hi)
        part = quantize(values)
        sums.append(sqnr_sums(values, part))
        del values
        if hi - lo == rows:
            return part, sqnr_of(sums[0])
        if out is None:  # the whole tensor's codes and scales, filled piece by piece
            codes = np.empty((rows, *part.codes.shape[1:]), part.codes.dtype)
            scale = np.empty((rows, *np.shape(part.scale)[1:]), np.float32)
            out = part
        if np.ndim(part.zero_point):
            raise XnnquantError("by_rows takes schemes of zero point 0")  # pragma: no cover (symmetric schemes)
        codes[lo:hi], scale[lo:hi] = part.codes, part.scale
    assert out is not None
    return (QuantizedTensor(out.datatype, codes, scale, 0, channel_dim=0, group_size=out.group_size, meta=out.meta),
            sqnr_of(np.concatenate(sums)))


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
            "it to hold data: build the submodule that owns it outside torch.device('meta'), or, when that "
            "submodule has parameters, give the buffer its values (owner.register_buffer(name, values, "
            "persistent=False)); a streaming export takes the values of buffers that hold data from the module")


def is_meta(x: Any) -> bool:
    return getattr(getattr(x, "device", None), "type", None) == "meta"
