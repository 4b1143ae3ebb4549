"""The compiled loops of ``jit``: numba, imported only through ``jit.loops()``.

Each loop does, over one piece of an array, exactly the float32 operations of its
numpy counterpart, value by value and in the same order, so the results are the same
bits.  numba compiles without fast-math: no reassociation, no multiply-add fusion, no
flush of subnormals, and ``np.rint`` rounds half to even as numpy's does.

The hot steps of the quantizers (max|x| of a block, its codes, nibble packing) go through
``vectors``, whole LLVM vectors of 32 values, so they are vectorized the same way
whatever CPU numba compiles for; the element-wise loops here take the remainder of a
block that is not whole vectors, and the steps across blocks (scales and their
reciprocals).  Loops are compiled with ``error_model="numpy"``: a float division by zero
gives inf as numpy's does, with no test in the loop to raise Python's error, which kept
LLVM from vectorizing loops that divide.  Every loop releases the GIL, so the pool in
``parallel`` runs two pieces on two cores.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..constants import FLT_MIN
from . import vectors
from .vectors import LANES

_FLT_MAX = np.float32(np.finfo(np.float32).max)
_ABS = np.uint32(0x7FFFFFFF)  # all bits but the sign
_INF = np.uint32(0x7F800000)  # +inf's bit pattern
_jit = nb.njit(nogil=True, cache=True, error_model="numpy")
_inline = nb.njit(nogil=True, cache=True, error_model="numpy", inline="always")  # small helpers of the loops above


@_inline
def _maxima(flat: np.ndarray, top: np.ndarray, width: int, count: int) -> None:  # pragma: no cover (compiled)
    """``top[n]`` = the largest ``bits(|x|)`` of block ``n`` of ``width`` values of ``flat``,
    the first ``count * LANES`` of each block as vectors."""
    bits = flat.view(np.uint32)
    whole = count * LANES
    for n in range(top.size):
        start = n * width
        m = vectors.max_abs_bits(flat, start, count)
        for j in range(start + whole, start + width):
            m = max(m, bits[j] & _ABS)
        top[n] = m


@_jit
def block_absmax(x: np.ndarray, out: np.ndarray) -> bool:  # pragma: no cover (compiled)
    """``out[n] = max|x[n, :]|`` for blocks ``x`` ``(N, B)`` float32, ``out`` ``(N,)``
    float32; False if any value is NaN or infinite (``out`` is then meaningless).

    The maximum is taken over the bit patterns of ``|x|`` as uint32 (sign bit cleared),
    which order as the values do; NaN's patterns lie above +inf's, so one comparison of
    the largest maximum finds them all.
    """
    flat, top = x.reshape(-1), out.view(np.uint32)
    width = x.shape[1]
    if width == LANES:  # one vector a block (qb4w's groups of 32): 16 blocks at a time
        whole = top.size - top.size % vectors.BLOCKS
        for n in range(0, whole, vectors.BLOCKS):
            vectors.block_maxima(flat, n * LANES, top, n)
        for n in range(whole, top.size):
            top[n] = vectors.max_abs_bits(flat, n * LANES, 1)
    else:
        _maxima(flat, top, width, width // LANES)
    m = np.uint32(0)
    for n in range(top.size):
        m = max(m, top[n])
    return m < _INF


@_jit
def value_range(x: np.ndarray) -> tuple[np.float32, np.float32, bool]:  # pragma: no cover (compiled)
    """``(min, max, finite)`` of a flat float32 array (min and max meaningless if not finite)."""
    lo = x[0]
    hi = x[0]
    finite = True
    for j in range(x.size):
        v = x[j]
        lo = min(lo, v)
        hi = max(hi, v)
        finite &= abs(v) <= _FLT_MAX
    return lo, hi, finite


@_inline
def _codes(flat: np.ndarray, inv: np.ndarray, lo: np.float32, hi: np.float32, zero_point: np.float32,
           capped: bool, out: np.ndarray, width: int, count: int) -> None:  # pragma: no cover (compiled)
    """``out = clip(rint(flat * inv[block]) + zero_point, lo + zero_point, hi + zero_point)``
    over blocks of ``width`` values, the first ``count * LANES`` of each block as vectors;
    ``capped``: ``lo = -inf``, ``zero_point = 0`` (``vectors.capped_codes``)."""
    whole = count * LANES
    shift = np.int32(zero_point)
    for n in range(inv.size):
        start, s = n * width, inv[n]
        if capped:
            vectors.capped_codes(flat, start, count, s, hi, out)
        else:
            vectors.codes(flat, start, count, s, lo, hi, shift, out)
        for j in range(start + whole, start + width):
            out[j] = np.int32(min(max(np.rint(flat[j] * s) + zero_point, lo + zero_point), hi + zero_point))


@_inline
def _all_codes(x: np.ndarray, inv: np.ndarray, lo: np.float32, hi: np.float32, zero_point: np.float32,
               capped: bool, codes: np.ndarray) -> None:  # pragma: no cover (compiled)
    """``_codes`` of blocks ``x`` ``(N, B)`` into ``codes`` ``(N, B)``."""
    flat, out = x.reshape(-1), codes.reshape(-1)
    width = x.shape[1]
    if width == LANES:  # one vector a block (qb4w's groups of 32): no loop within a block
        _codes(flat, inv, lo, hi, zero_point, capped, out, LANES, 1)
    else:
        _codes(flat, inv, lo, hi, zero_point, capped, out, width, width // LANES)


@_jit
def block_codes(x: np.ndarray, inv: np.ndarray, zero_point: np.float32, qmin: np.float32, qmax: np.float32,
                codes: np.ndarray) -> None:  # pragma: no cover (compiled)
    """``codes[n, b] = clip(rint(x[n, b] * inv[n]) + zero_point, qmin, qmax)``.

    ``x`` ``(N, B)`` float32, ``inv`` ``(N,)`` float32, ``codes`` ``(N, B)`` of an 8-bit
    integer dtype; ``zero_point``, ``qmin``, ``qmax`` integers.  A product beyond float32
    is +-inf and clamps to ``qmin`` / ``qmax``; ``x`` holds no NaN (the caller checked).
    """
    _all_codes(x, inv, qmin - zero_point, qmax - zero_point, zero_point, False, codes)


@_jit
def minmax_codes(x: np.ndarray, half: np.float32, bf16: bool, qmax: np.float32, codes: np.ndarray,
                 scales: np.ndarray, inv: np.ndarray) -> bool:  # pragma: no cover (compiled)
    """Min-max scales and codes of blocks ``x`` ``(N, B)`` float32, as ``search.minmax_scales``
    then ``search.quantize_blocks``: ``scales`` ``(N,)`` float32 and ``codes`` ``(N, B)``
    (8-bit) written, ``inv`` float32 ``(N,)`` scratch.  False if a value is NaN or
    infinite (outputs then meaningless).

    Each scale is ``finish_scales(max|x| / half)``: all-zero blocks 1.0, the rest at
    least ``FLT_MIN``, then rounded to bf16 (to nearest, ties to even) if ``bf16``.  The
    codes are clamped to ``qmax`` only: ``|x * (1 / scale)| <= half * (1 + 2**-8)``, so
    ``rint`` never goes below ``qmin = -qmax - 1`` (``half = qmax + 0.5``).

    Three loops: maxima, then scales and their reciprocals (one loop across blocks,
    vectorized), then codes.
    """
    if not block_absmax(x, scales):
        return False
    for n in range(x.shape[0]):
        absmax = scales[n]
        scale = np.float32(1) if absmax == 0 else _finish(absmax / half, bf16)
        scales[n] = scale
        inv[n] = np.float32(1) / scale
    _all_codes(x, inv, np.float32(-np.inf), qmax, np.float32(0), True, codes)
    return True


@_jit
def pack_nibbles(codes: np.ndarray, packed: np.ndarray) -> bool:  # pragma: no cover (compiled)
    """Two int4 codes a byte, as ``packing.int4.pack_int4``: ``codes`` int8 ``(2 * M,)``,
    ``packed`` uint8 ``(M,)``; False if a code lies outside [-8, 7] (``packed`` is then
    meaningless).  Whole vectors through ``vectors.pack_pairs``, the rest pair by pair::

        pairs[j] (uint16, little-endian)   bits 15..8: q[2j+1]   bits 7..0: q[2j]
        v = pairs[j] + 0x0808 per byte     bits 15..8: q[2j+1]+8 bits 7..0: q[2j]+8
        packed[j]                          bits  7..4: q[2j+1]+8 bits 3..0: q[2j]+8
                                           = low byte of (v | v >> 4)

    The bytes get their 8 without a carry between them (bit 7 of each is added apart, by
    xor); codes in [-8, 7] become 0..15, anything else leaves a bit of ``0xF0F0`` set.
    """
    count = codes.size // (2 * LANES)
    in_range = vectors.pack_pairs(codes, 0, count, packed)
    pairs = codes.view(np.uint16)
    bad = np.uint16(0)
    for j in range(count * LANES, pairs.size):
        p = pairs[j]
        v = np.uint16(((p & np.uint16(0x7F7F)) + np.uint16(0x0808)) ^ (p & np.uint16(0x8080)))
        bad |= v & np.uint16(0xF0F0)
        packed[j] = np.uint8((v | (v >> np.uint16(4))) & np.uint16(0xFF))
    return in_range and bad == 0


@_jit
def residual(w: np.ndarray, codes: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out = w - codes * scale`` in float32, as ``w - QuantizedTensor.dequantize()`` with
    zero point 0: ``w`` and ``codes`` ``(R, K)``, ``scale`` ``(R, G)`` (one scale a group
    of ``K // G`` columns), ``out`` float32 ``(R, K)``."""
    group = w.shape[1] // scale.shape[1]
    for r in range(w.shape[0]):
        for g in range(scale.shape[1]):
            s = scale[r, g]
            for j in range(g * group, (g + 1) * group):
                out[r, j] = w[r, j] - np.float32(codes[r, j]) * s


@_jit
def block_errors(x: np.ndarray, scales: np.ndarray, qmin: np.float32, qmax: np.float32,
                 out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """``search.block_errors``: ``x`` ``(N, B)`` and ``scales`` ``(R, N)`` float32 ->
    ``out`` ``(R, N)`` float32 (see ``_candidate_errors``)."""
    column = np.empty(scales.shape[0], np.float32)
    inv = np.empty(scales.shape[0], np.float32)
    errors = np.empty(scales.shape[0], np.float32)
    for n in range(x.shape[0]):
        column[:] = scales[:, n]
        _candidate_errors(x[n], column, len(column), qmin, qmax, inv, errors)
        out[:, n] = errors


@_inline
def _ldexp(v: np.float32, k: int) -> np.float32:  # pragma: no cover (compiled)
    """``v * 2**k`` rounded once to float32, as ``np.ldexp`` on float32: the float64
    product is exact."""
    return np.float32(np.float64(v) * 2.0**k)


@_inline
def _finish(raw: np.float32, bf16: bool) -> np.float32:  # pragma: no cover (compiled)
    """``finish_scales`` of one scale of a block that is not all zero."""
    s = np.float32(max(raw, FLT_MIN))
    if not bf16:
        return s
    # bf16 to nearest, ties to even, of a finite positive float32: add half a bf16 step
    # less one ulp plus the kept part's lowest bit, then cut the low 16 bits
    #   bits  [sign | exponent (8) | mantissa (7) kept | mantissa (16) cut]
    b = s.view(np.uint32)
    b = np.uint32((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return b.view(np.float32)


@_inline
def _candidate_errors(x: np.ndarray, scales: np.ndarray, count: int, qmin: np.float32, qmax: np.float32,
                      inv: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """``search.block_errors`` of one block ``x`` ``(B,)`` for ``scales[:count]`` into
    ``out[:count]`` (``inv`` scratch), all float32: the squared residuals added in the
    order of ``b``.  The inner loop runs across the candidates, so it vectorizes whatever
    ``B`` is (measured on Zen 2: 36 candidates of a 32-value block in 170 ns, against
    360 ns with float64 sums and about 1 us one candidate at a time)."""
    for c in range(count):
        inv[c] = np.float32(1) / scales[c]
        out[c] = 0
    for j in range(x.size):
        v = x[j]
        for c in range(count):
            d = min(max(np.rint(v * inv[c]), qmin), qmax) * scales[c] - v
            out[c] += d * d


@_inline
def _whole(count: int) -> int:  # pragma: no cover (compiled)
    """``count`` candidates rounded up to whole vectors of 8: sweeping 40 rows (the spare
    ones never chosen) instead of 36 and a scalar tail took 0.75 us a block against 0.90
    (medians of 10 runs on Zen 2, noisy)."""
    return (count + 7) // 8 * 8


@_jit
def mse_search(blocks: np.ndarray, qmin: np.float32, qmax: np.float32, bf16: bool, coarse: np.ndarray,
               fine: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """``search.mse_scales`` of blocks ``(N, B)`` float32 into ``out`` ``(N,)``: the same
    candidates and choices, block by block (see ``search._search``).  Every candidate is
    scored (``_candidate_errors`` scores them all in one sweep of the block): the numpy
    search skips those whose clipping alone rules them out, which changes no choice, but
    here pruning was measured to save nothing."""
    n_blocks, width = blocks.shape
    rows = _whole(max(len(coarse) + 1, len(fine)))
    x = np.empty(width, np.float32)
    raw = np.empty(rows, np.float32)
    finished = np.empty(rows, np.float32)  # candidates at their true size
    scales = np.empty(rows, np.float32)  # the same, normalized
    inv = np.empty(rows, np.float32)
    errors = np.empty(rows, np.float32)
    scales[:] = 1  # spare rows (scored, never chosen): any positive scale
    half = (qmax - qmin) / np.float32(2)
    for n in range(n_blocks):
        row = blocks[n]
        absmax = np.float32(0)
        for j in range(width):
            absmax = max(absmax, abs(row[j]))
        if absmax == 0:
            out[n] = np.float32(1)
            continue
        e = math.frexp(np.float64(absmax))[1]
        # 2**e and 2**-e exact float32s (2**-127 a subnormal one): a product with them is
        # the exact value rounded once, as ldexp's
        powers = -126 <= e <= 127
        up, down = (np.float32(2.0**e), np.float32(2.0**-e)) if powers else (np.float32(0), np.float32(0))
        if powers:
            for j in range(width):
                x[j] = row[j] * down
        else:
            for j in range(width):
                x[j] = _ldexp(row[j], -e)
        maxpos = np.float32(0)
        maxneg = np.float32(0)
        for j in range(width):
            maxpos = max(maxpos, x[j])
            maxneg = max(maxneg, -x[j])
        base = max(maxpos, maxneg) / half
        count = len(coarse) + 1
        for k in range(len(coarse)):
            raw[k] = coarse[k] * base
        raw[len(coarse)] = max(maxpos / qmax, maxneg / -qmin)
        for k in range(count):
            finished[k] = _finish(raw[k] * up if powers else _ldexp(raw[k], e), bf16)
            scales[k] = finished[k] * down if powers else _ldexp(finished[k], -e)
        # stage 1: the first least error among the coarse candidates
        _candidate_errors(x, scales, _whole(count), qmin, qmax, inv, errors)
        best_k = 0
        for k in range(1, count):
            if errors[k] < errors[best_k]:
                best_k = k
        best, best_err, best_raw = finished[best_k], errors[best_k], raw[best_k]
        # stage 2: small steps around the best raw value; ties keep the stage-1 choice
        for k in range(len(fine)):
            finished[k] = _finish(fine[k] * best_raw * up if powers else _ldexp(fine[k] * best_raw, e), bf16)
            scales[k] = finished[k] * down if powers else _ldexp(finished[k], -e)
        _candidate_errors(x, scales, _whole(len(fine)), qmin, qmax, inv, errors)
        for k in range(len(fine)):
            if errors[k] < best_err:
                best, best_err = finished[k], errors[k]
        out[n] = best


@_jit
def gptq_columns(work: np.ndarray, u: np.ndarray, row_scales: np.ndarray, group_of: np.ndarray, codes: np.ndarray,
                 err: np.ndarray, first: int, last: int, start: int, stop: int, qmin: float,
                 qmax: float) -> None:  # pragma: no cover (compiled)
    """Columns ``first .. last - 1`` of GPTQ's block ``start .. stop - 1`` (``schemes.gptq``),
    float64, as its numpy loop: for each column ``j``, with ``s = row_scales[group_of[j]]``::

        codes[j] = clip(rint(work[j] / s), qmin, qmax)
        err[j - start] = (work[j] - codes[j] * s) / u[j, j]
        work[i] -= u[j, i] * err[j - start]            for i in j + 1 .. stop - 1

    ``work``, ``codes`` ``(K, R)`` (one row per column of the weight, one entry per weight
    row), ``u`` ``(K, K)``, ``row_scales`` ``(G, R)``, ``group_of`` ``(K,)`` int64, ``err``
    ``(BLOCK, R)``.  Each value is computed by the same operations as numpy's, one rounding
    each (no multiply-add fusion), so the results are the same bits.
    """
    rows = work.shape[1]
    for j in range(first, last):
        s = row_scales[group_of[j]]
        wj = work[j]
        cj = codes[j]
        e = err[j - start]
        d = u[j, j]
        for r in range(rows):
            q = min(max(np.rint(wj[r] / s[r]), qmin), qmax)
            cj[r] = q
            e[r] = (wj[r] - q * s[r]) / d
        for i in range(j + 1, stop):
            f = u[j, i]
            wi = work[i]
            for r in range(rows):
                wi[r] -= f * e[r]
