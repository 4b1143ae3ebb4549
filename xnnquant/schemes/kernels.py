"""Fused, chunked kernels behind the quantizers: the reference's codes and scales, fast.

The reference functions (``search.minmax_scales``, ``search.quantize_blocks``,
``rounding.quantize_values``) compute one step at a time over the whole tensor: max|x|
per block, scale, reciprocal, multiply, round, clip, cast, each a pass through memory
with a temporary as large as the input.  Here the input is cut into pieces of about
``CHUNK_ELEMENTS`` values, each piece goes through every step while it sits in the
cache, and the pieces are spread over the cores (``parallel.for_ranges``).

A piece is either whole blocks (``block <= CHUNK_ELEMENTS``) or part of one block::

    small blocks   | b0 b1 ... bk-1 | bk ... b2k-1 | ...      k = CHUNK_ELEMENTS // block
    large blocks   | block 0: part 0 | part 1 | ... | block 1: part 0 | ...

The results are bit for bit the reference's, because every step is the same float32
operation on the same values, each its own ufunc call (so no multiply-add is fused):

* ``max|x|`` per block is a ``maximum.reduceat`` over the bit patterns of ``|x|`` read as
  uint32: for non-negative floats the patterns order as the values do, NaN's pattern lies
  above +inf's, and integer maxima are faster than float ones;
* scales: ``search.finish_scales`` of ``max|x| / half_range``, elementwise, so a piece's
  scales are the whole tensor's;
* codes: ``clip(rint(x * (1 / scale)) + zero_point, qmin, qmax)`` cast to the code dtype.

Each piece takes one of two paths: numpy ufuncs, one pass over the piece per step, or,
when numba is installed (``jit``), compiled loops (``compute.loops``): the maxima of the
piece's blocks, their scales and reciprocals, then the codes, each block as whole vectors
of 32 values (``compute.vectors``), the same float32 operations in the same order, so the
same bits (the tests run both paths).  8-bit codes only take the compiled path.  torch
kernels for the same pieces (``amax``, ``mul``, ``round``) were measured on this
project's 2-core Zen 2: called from the pool's threads they took twice numpy's CPU time,
and called from one thread with torch's own OpenMP threads several times more on a busy
machine (its workers spin while they wait), so there is no torch path.

Inputs may be float32, float16, bfloat16 or float64 (each piece is widened to float32
as ``arrays.as_float32`` would widen the whole).  A non-finite value makes the kernel
raise ``arrays.check_finite``'s error for ``origin``, the caller's array and its name
(the kernels may see a reshaped copy, the error names the index the caller knows).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np

from ..arrays import check_finite
from ..compute import jit
from ..compute.parallel import for_ranges
from .checks import reciprocal
from .search import finish_scales, half_range

#: Values per piece: 1 MiB of float32.  Measured on Zen 2 (512 KiB L2, 16 MiB L3): pieces
#: of 2**16 values spend more on the per-piece work (scales of 2048 blocks: ~100 us)
#: than pieces of 2**18 lose to L3; 2**20 is slower again.
CHUNK_ELEMENTS = 1 << 18


class _Cut(NamedTuple):
    """How ``size`` values in blocks of ``block`` are cut into pieces."""

    size: int
    block: int
    piece: int  # values per piece: a multiple of block, or a part of one block
    parts: int  # pieces per block: 1 when pieces hold whole blocks

    @classmethod
    def of(cls, size: int, block: int) -> _Cut:
        if block <= CHUNK_ELEMENTS:
            return cls(size, block, (CHUNK_ELEMENTS // block) * block, 1)
        parts = -(-block // CHUNK_ELEMENTS)
        return cls(size, block, -(-block // parts), parts)

    @property
    def pieces(self) -> int:
        if self.parts == 1:
            return -(-self.size // self.piece)
        return (self.size // self.block) * self.parts

    def bounds(self, i: int) -> tuple[int, int]:
        """Element range ``[start, stop)`` of piece ``i``."""
        if self.parts == 1:
            return i * self.piece, min(self.size, (i + 1) * self.piece)
        b, j = divmod(i, self.parts)
        start = b * self.block + j * self.piece
        return start, min(start + self.piece, (b + 1) * self.block)


class _Scratch:
    """A thread's float32 buffers of one piece: ``work`` for temporaries, ``wide`` for
    an input piece widened to float32 (only when the input is not float32)."""

    def __init__(self, size: int, widen: bool) -> None:
        self.work = np.empty(size, np.float32)
        self.wide = np.empty(size, np.float32) if widen else None
        self._ceilings: dict[tuple[str, int], np.ndarray] = {}

    def ceiling(self, dtype: str, value: int, size: int) -> np.ndarray:
        """``size`` copies of ``value`` as ``dtype``: ``np.minimum`` against an array is
        several times faster than against a scalar."""
        key = (dtype, value)
        if key not in self._ceilings:
            self._ceilings[key] = np.full(len(self.work), value, dtype)
        return self._ceilings[key][:size]

    def float32(self, x: np.ndarray) -> np.ndarray:
        """A piece of the input as float32: itself, or widened into ``wide``."""
        if self.wide is None:
            return x
        out = self.wide[: x.size]
        with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, then refused
            np.copyto(out, x, casting="unsafe")
        return out


def _run(cut: _Cut, dtype: np.dtype, piece_kernel: Callable[[int, int, _Scratch], bool]) -> bool:
    """Run ``piece_kernel(start, stop, scratch)`` on every piece; False if any returned False."""
    finite = [True]

    def kernel(lo: int, hi: int) -> None:
        scratch = _Scratch(cut.piece, dtype != np.float32)
        for i in range(lo, hi):
            start, stop = cut.bounds(i)
            if not piece_kernel(start, stop, scratch):
                finite[0] = False

    for_ranges(kernel, cut.pieces, 1)
    return finite[0]


#: The caller's array and its name, for the error that names a non-finite value's index.
Origin = tuple[np.ndarray, str]


def _raise_non_finite(origin: Origin) -> None:
    with np.errstate(over="ignore"):
        check_finite(np.asarray(origin[0], np.float32), origin[1])
    raise AssertionError("a kernel saw a non-finite value that check_finite did not find")


def _flat(x: np.ndarray) -> np.ndarray:
    assert x.flags.c_contiguous, "kernels take C-contiguous arrays"
    return x.reshape(-1)


def block_absmax(x: np.ndarray, block: int, origin: Origin) -> np.ndarray:
    """``max|x|`` of each block of ``block`` consecutive values -> float32 ``(x.size // block,)``.

    ``x``: C-contiguous float array whose size is a multiple of ``block``.
    """
    flat, cut = _flat(x), _Cut.of(x.size, block)
    n_blocks = x.size // block
    parts = np.zeros((n_blocks, cut.parts), np.uint32)
    starts = np.arange(0, cut.piece, block) if cut.parts == 1 else None
    loops = jit.loops()

    def piece(start: int, stop: int, scratch: _Scratch) -> bool:
        if loops is not None:  # float32 maxima written as their bit patterns: the same order
            xf = scratch.float32(flat[start:stop])
            n = (stop - start) // block if cut.parts == 1 else 1
            m = np.empty(n, np.float32)
            if not loops.block_absmax(xf.reshape(n, -1), m):
                return False
            b, j = divmod(start, block)
            parts[b : b + n, j // cut.piece] = m.view(np.uint32)
            return True
        a = np.abs(scratch.float32(flat[start:stop]), out=scratch.work[: stop - start]).view(np.uint32)
        if cut.parts == 1:
            first = start // block
            m = np.maximum.reduceat(a, starts[: (stop - start) // block])  # type: ignore[index]
            parts[first : first + len(m), 0] = m
        else:
            b, j = divmod(start, block)
            parts[b, j // cut.piece] = a.max()
        return True

    finite = _run(cut, x.dtype, piece)
    absmax = parts.max(axis=1).view(np.float32)
    if not (finite and np.isfinite(absmax).all()):
        _raise_non_finite(origin)
    return absmax


def quantize(x: np.ndarray, block: int, scale: np.ndarray, zero_point: int, qmin: int, qmax: int,
             dtype: str, origin: Origin | None = None) -> np.ndarray:
    """Codes of ``x`` for one scale per block: ``x.shape`` of ``dtype``.

    ``x``: C-contiguous float array, size a multiple of ``block``; ``scale``: float32
    ``(x.size // block,)``, positive normal.  Each code is
    ``clip(rint(x * (1 / scale)) + zero_point, qmin, qmax)``, as ``rounding.quantize_values``.
    With ``origin``, a non-finite value of ``x`` raises (each piece's min and max are
    checked); without, the caller has checked ``x`` already.
    """
    flat, cut = _flat(x), _Cut.of(x.size, block)
    inv = reciprocal(np.asarray(scale, np.float32).reshape(-1))
    codes = np.empty(x.size, dtype)
    zp = np.float32(zero_point)
    loops = _loops_for(codes)

    def piece(start: int, stop: int, scratch: _Scratch) -> bool:
        xf = scratch.float32(flat[start:stop])
        if loops is not None:
            if origin is not None and not loops.value_range(xf)[2]:
                return False
            n = (stop - start) // block if cut.parts == 1 else 1
            first = start // block
            loops.block_codes(xf.reshape(n, -1), inv[first : first + n], zp, np.float32(qmin), np.float32(qmax),
                              codes[start:stop].reshape(n, -1))
            return True
        if origin is not None and not (np.isfinite(xf.min()) and np.isfinite(xf.max())):
            return False
        t = scratch.work[: stop - start]
        with np.errstate(over="ignore"):  # a product beyond float32 is +-inf, clipped to qmin / qmax
            if cut.parts == 1:
                first, n = start // block, (stop - start) // block
                np.multiply(xf.reshape(n, block), inv[first : first + n, None], out=t.reshape(n, block))
            else:
                np.multiply(xf, inv[start // block], out=t)
        _round_clip_cast(t, zp, qmin, qmax, codes[start:stop])
        return True

    if not _run(cut, x.dtype, piece):
        _raise_non_finite(origin)  # type: ignore[arg-type]
    return codes.reshape(x.shape)


def _loops_for(codes: np.ndarray) -> ModuleType | None:
    """The compiled loops, for 8-bit codes (wider codes take the numpy path)."""
    return jit.loops() if codes.dtype.itemsize == 1 else None


def _round_clip_cast(t: np.ndarray, zp: np.float32, qmin: int, qmax: int, out: np.ndarray) -> None:
    """``out[:] = clip(rint(t) + zp, qmin, qmax)``, ``t`` float32 overwritten."""
    np.rint(t, out=t)
    if zp:
        np.add(t, zp, out=t)
    np.clip(t, qmin, qmax, out=t)
    np.copyto(out, t, casting="unsafe")


def minmax_quantize(x: np.ndarray, block: int, qmin: int, qmax: int, dtype: str, origin: Origin, *,
                    bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Min-max scales and codes of ``x`` in one pass -> (codes ``x.shape`` of ``dtype``,
    scale float32 ``(x.size // block,)``).

    The same as ``search.minmax_scales`` then ``search.quantize_blocks`` on
    ``x.reshape(-1, block)``.  Blocks larger than a piece take two passes (max, then codes).
    """
    if block > CHUNK_ELEMENTS:
        absmax = block_absmax(x, block, origin)
        scale = finish_scales(absmax / half_range(qmin, qmax), absmax == 0, bf16)
        return quantize(x, block, scale, 0, qmin, qmax, dtype), scale
    flat, cut = _flat(x), _Cut.of(x.size, block)
    codes = np.empty(x.size, dtype)
    scales = np.empty(x.size // block, np.float32)
    starts = np.arange(0, cut.piece, block)
    half = half_range(qmin, qmax)
    loops = _loops_for(codes)

    def piece(start: int, stop: int, scratch: _Scratch) -> bool:
        first, n = start // block, (stop - start) // block
        xf = scratch.float32(flat[start:stop])
        if loops is not None:
            return bool(loops.minmax_codes(xf.reshape(n, block), half, bf16, np.float32(qmax),
                                           codes[start:stop].reshape(n, block), scales[first : first + n],
                                           scratch.work[:n]))
        t = scratch.work[: stop - start]
        absmax = np.maximum.reduceat(np.abs(xf, out=t).view(np.uint32), starts[:n]).view(np.float32)
        if not np.isfinite(absmax).all():
            return False
        scale = finish_scales(absmax / half, absmax == 0, bf16)
        scales[first : first + n] = scale
        np.multiply(xf.reshape(n, block), reciprocal(scale)[:, None], out=t.reshape(n, block))
        np.rint(t, out=t)
        # |t| <= max|x| / scale <= half_range * (1 + 2**-9) (bf16 rounding of the scale is
        # within 2**-9), so rint(t) lies in [qmin, qmax + 1]: only qmax needs clamping.
        out = codes[start:stop]
        if qmax < np.iinfo(out.dtype).max:  # qmax + 1 fits the codes: clamp after the cast
            np.copyto(out, t, casting="unsafe")
            np.minimum(out, scratch.ceiling(out.dtype.str, qmax, len(t)), out=out)
        else:
            np.minimum(t, scratch.ceiling("<f4", qmax, len(t)), out=t)
            np.copyto(out, t, casting="unsafe")
        return True

    if not _run(cut, x.dtype, piece):
        _raise_non_finite(origin)
    return codes.reshape(x.shape), scales


def value_range(x: np.ndarray, origin: Origin) -> tuple[np.float32, np.float32]:
    """``(min(x), max(x))`` as float32 of a C-contiguous float array; non-finite raises."""
    flat = _flat(x)
    cut = _Cut.of(x.size, x.size)
    lows = np.empty(cut.pieces, np.float32)
    highs = np.empty(cut.pieces, np.float32)
    loops = jit.loops()

    def piece(start: int, stop: int, scratch: _Scratch) -> bool:
        xf = scratch.float32(flat[start:stop])
        i = start // cut.piece
        if loops is not None:
            lows[i], highs[i], finite = loops.value_range(xf)
            return bool(finite)
        lows[i], highs[i] = xf.min(), xf.max()
        return True

    finite = _run(cut, x.dtype, piece)
    lo, hi = lows.min(), highs.max()
    if not (finite and np.isfinite(lo) and np.isfinite(hi)):
        _raise_non_finite(origin)
    return lo, hi
