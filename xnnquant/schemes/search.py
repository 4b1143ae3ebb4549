"""Symmetric scales for blocks of values: min-max, and a searched least-squares scale.

Every function works on blocks ``(N, B)`` float32 (``N`` blocks of ``B`` values that
share one scale, see ``granularity``) and is vectorized over all blocks at once.  Codes
are always ``clip(round_half_even(x * (1 / scale)), qmin, qmax)`` with zero point 0,
the formula of torchao's ``quantize_affine``, so the search scores exactly the codes
that ``quantize_blocks`` later emits.

``"minmax"``: ``scale = max|x| / ((qmax - qmin) / 2)`` (torchao's symmetric rule: 7.5
for int4, 127.5 for int8; the positive extreme saturates at ``qmax``).

``"range"``: the least scale that clips nothing, ``max(max(x) / qmax, min(x) / qmin)``:
a block's extreme values are codes exactly (a negative extreme at ``qmin``, llama.cpp
``Q4_0``'s rule where the extreme is negative; a positive one at ``qmax``, as XNNPACK's
positive scales allow).  On SmolLM2-135M's weights it keeps more of the model than the
least-squares scale, which gives up the largest weights for the rest (``docs/llm.md``).

``"mse"``: a two-stage search per block, with each candidate scale made a positive
normal float (and rounded to bf16 when the runtime will read bf16) *before* its error
is computed:

1. coarse: ratios 0.25, 0.29, ..., 1.57 of the min-max scale, the min-max scale itself,
   and the no-clipping scale ``max(max(x) / qmax, min(x) / qmin)``: for int4 a negative
   extreme may map to -8 (scale ``-min / 8``) while a positive one can only reach +7;
2. fine: the best coarse candidate times ``1 + 0.005 j``, ``j = -4..4``.

Candidates are positive only (XNNPACK rejects negative scales).  The min-max scale is a
candidate and ties keep the earlier candidate, so a searched block's squared error is
never above its min-max error.  On all-MiniLM-L6-v2 (blockwise int4, g = 32, bf16
scales) this reaches +0.84 dB over min-max against +0.845 dB for the exhaustive optimum
over every bf16 scale (``exhaustive_bf16_scales``); see ``benchmarks/mse_search.py``.
"""

from __future__ import annotations

import numpy as np

from ..compute import jit
from ..compute.parallel import for_ranges
from ..rounding import bf16_bits_to_float32, quantize_values, to_bf16
from .checks import positive_normal, reciprocal

#: Stage-1 ratios to the min-max scale; 1.0 first, so ties keep min-max.
COARSE_RATIOS = np.concatenate([[1.0], np.arange(0.25, 1.6, 0.04)]).astype(np.float32)
#: Stage-2 factors applied to the best stage-1 candidate.
FINE_FACTORS = np.array([1 + 0.005 * j for j in range(-4, 5) if j], np.float32)
#: Values per evaluation chunk (candidates x blocks x block length), sized for the cache.
_CHUNK_ELEMENTS = 1 << 20


def half_range(qmin: int, qmax: int) -> np.float32:
    """``(qmax - qmin) / 2``: 7.5 for int4, 127.5 for int8."""
    return np.float32((qmax - qmin) / 2)


def finish_scales(scale: np.ndarray, all_zero: np.ndarray, bf16: bool) -> np.ndarray:
    """Raw float32 scales -> the scales XNNPACK will use: positive normal, bf16 if asked.

    bf16 rounding is to nearest, ties to even; the smallest normal float32 is a bf16
    value, so rounding never leaves the normal range.
    """
    out = positive_normal(scale, all_zero)
    return to_bf16(out).values if bf16 else out


def minmax_scales(blocks: np.ndarray, qmin: int, qmax: int, bf16: bool = False) -> np.ndarray:
    """Min-max scales of ``blocks`` ``(N, B)`` float32 -> ``(N,)`` float32.

    The reference: ``kernels.minmax_quantize`` gives the same scales in one fused pass.
    """
    maxabs = np.abs(blocks).max(axis=-1)
    return finish_scales(maxabs / half_range(qmin, qmax), maxabs == 0, bf16)


def range_scales(blocks: np.ndarray, qmin: int, qmax: int, bf16: bool = False) -> np.ndarray:
    """No-clipping scales of ``blocks`` ``(N, B)`` float32 -> ``(N,)`` float32 (module docstring):
    ``max(max(x) / qmax, min(x) / qmin)``, made positive normal (1.0 for an all-zero block),
    rounded to bf16 if asked (to nearest: an extreme may then land a rounding step past
    ``qmax`` and saturate, by at most ``qmax * 2**-9`` of a step)."""
    maxpos = np.maximum(blocks.max(axis=-1), 0)
    maxneg = np.maximum(-blocks.min(axis=-1), 0)
    scale = np.maximum(maxpos / np.float32(qmax), maxneg / np.float32(-qmin)).astype(np.float32)
    return finish_scales(scale, scale == 0, bf16)


def choose_scales(blocks: np.ndarray, qmin: int, qmax: int, method: str, bf16: bool = False) -> np.ndarray:
    """Scales of ``blocks`` ``(N, B)`` float32 by ``method`` ("minmax", "mse" or "range") -> ``(N,)`` float32."""
    if method == "mse":
        return mse_scales(blocks, qmin, qmax, bf16)
    if method == "range":
        return range_scales(blocks, qmin, qmax, bf16)
    assert method == "minmax", method
    return minmax_scales(blocks, qmin, qmax, bf16)


def quantize_blocks(blocks: np.ndarray, scale: np.ndarray, qmin: int, qmax: int, dtype: str) -> np.ndarray:
    """Codes of ``blocks`` ``(N, B)`` float32 for ``scale`` ``(N,)``: ``(N, B)`` of ``dtype``.

    The reference: ``kernels.quantize`` gives the same codes in cache-sized pieces.
    """
    return quantize_values(blocks, reciprocal(scale)[:, None], 0, qmin, qmax, dtype)


def block_errors(blocks: np.ndarray, scales: np.ndarray, qmin: int, qmax: int) -> np.ndarray:
    """Squared error of every candidate: blocks ``(N, B)``, scales ``(R, N)`` -> ``(R, N)`` float32.

    ``err[r, n] = sum_b (clip(rint(x[n, b] / s[r, n]), qmin, qmax) * s[r, n] - x[n, b])**2``,
    all in float32, the squares added in the order of ``b``: the compiled loop of ``jit``
    and this numpy path give the same bits, on any CPU.
    """
    loops = jit.loops()
    if loops is not None:
        out = np.empty(scales.shape, np.float32)
        loops.block_errors(np.ascontiguousarray(blocks, np.float32), np.ascontiguousarray(scales, np.float32),
                           np.float32(qmin), np.float32(qmax), out)
        return out
    t = blocks[None] * reciprocal(scales)[..., None]
    np.rint(t, out=t)
    np.clip(t, qmin, qmax, out=t)
    t *= scales[..., None]
    t -= blocks[None]
    with np.errstate(over="ignore"):  # unnormalized blocks (exhaustive_bf16_scales) may reach inf
        np.square(t, out=t)
        return np.add.accumulate(t, axis=-1)[..., -1]  # accumulate adds in order, as the loop does


#: Slack of ``clipping_bound`` for float32 rounding: a computed residual ``q * s - x`` of
#: values below 2 is within two rounding steps (2 * 2**-24 each) of the exact one.
_RESIDUAL_SLACK = 3e-7
_RELATIVE_SLACK = 1e-6


def clipping_bound(maxpos: np.ndarray, maxneg: np.ndarray, scales: np.ndarray, qmin: int,
                   qmax: int) -> np.ndarray:
    """A lower bound of ``block_errors`` from clipping alone: ``(R, N)`` float64.

    ``maxpos`` / ``maxneg`` ``(N,)``: the largest value and the largest negated value of
    each (normalized) block, ``scales`` ``(R, N)``.  A value beyond ``qmax * s`` (or below
    ``qmin * s``) keeps at least that distance from its code times ``s``; the squared
    error of a block, a sum of squares each rounded up or down by a few ulps, is at least
    its largest term.  The slacks cover those roundings for normalized blocks (values
    below 2).
    """
    s = scales.astype(np.float64)
    over = np.maximum(maxpos.astype(np.float64) - qmax * s, maxneg.astype(np.float64) + qmin * s)
    return np.maximum(over - _RESIDUAL_SLACK, 0.0) ** 2 * (1 - _RELATIVE_SLACK)


def _best(blocks: np.ndarray, raw: np.ndarray, exponent: np.ndarray, all_zero: np.ndarray,
          extremes: tuple[np.ndarray, np.ndarray], qmin: int, qmax: int, bf16: bool,
          first_errors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The least-error candidate of each block.

    ``blocks`` ``(N, B)`` and ``raw`` ``(R, N)`` are normalized (divided by ``2**exponent``);
    candidates are finished (made positive normal, rounded to bf16) at their true size,
    then scored in the normalized domain.  Row 0 is scored first (or its errors given as
    ``first_errors``); a row whose ``clipping_bound`` exceeds row 0's error in every block
    cannot win anywhere and is not scored.  Returns the index ``(N,)`` of the best
    candidate (the first of equal ones), the finished true-size candidates ``(R, N)`` and
    the best errors ``(N,)``.
    """
    cand = finish_scales(np.ldexp(raw, exponent), all_zero[None], bf16)
    scales = np.ldexp(cand, -exponent)
    errors = np.full(raw.shape, np.inf, np.float32)
    errors[0] = block_errors(blocks, scales[:1], qmin, qmax)[0] if first_errors is None else first_errors
    bound = clipping_bound(*extremes, scales[1:], qmin, qmax)
    rows = 1 + np.flatnonzero((bound <= errors[0]).any(axis=1))
    if len(rows):
        errors[rows] = block_errors(blocks, scales[rows], qmin, qmax)
    best = errors.argmin(axis=0)
    return best, cand, errors[best, np.arange(len(best))]


def mse_scales(blocks: np.ndarray, qmin: int, qmax: int, bf16: bool = False) -> np.ndarray:
    """Searched scales of ``blocks`` ``(N, B)`` float32 -> ``(N,)`` float32 (see module doc).

    Each block is first divided by a power of two that brings ``max|x|`` into [0.5, 1).
    That is exact and changes no rounding of ``x * (1 / scale)``, so the codes scored are
    the codes ``quantize_blocks`` gives, while squared errors neither underflow for tiny
    blocks nor overflow for huge ones.
    """
    n_blocks, block_len = blocks.shape
    out = np.empty(n_blocks, np.float32)
    loops = jit.loops()
    # numpy scores a chunk's candidates at once, (R, n, B) floats; the compiled loop one
    # block's, and takes chunks small enough to share out over the cores
    per_block = block_len * (128 if loops else len(COARSE_RATIOS) + 1)
    step = max(1, _CHUNK_ELEMENTS // per_block)

    def kernel(lo: int, hi: int) -> None:
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            if loops is not None:
                loops.mse_search(np.ascontiguousarray(blocks[start:stop], np.float32), np.float32(qmin),
                                 np.float32(qmax), bf16, COARSE_RATIOS, FINE_FACTORS, out[start:stop])
            else:
                out[start:stop] = _search(blocks[start:stop], qmin, qmax, bf16)

    for_ranges(kernel, n_blocks, step)  # blocks are searched independently: any cut gives the same scales
    return out


def _search(chunk: np.ndarray, qmin: int, qmax: int, bf16: bool) -> np.ndarray:
    """``mse_scales`` of a few blocks ``(n, B)`` -> ``(n,)``."""
    cols = np.arange(len(chunk))
    _, exponent = np.frexp(np.abs(chunk).max(axis=-1))
    x = np.ldexp(chunk, -exponent[:, None])
    raw, all_zero, maxpos, maxneg = coarse_candidates(x, qmin, qmax, COARSE_RATIOS)
    best, cand, kept_errors = _best(x, raw, exponent, all_zero, (maxpos, maxneg), qmin, qmax, bf16)
    kept = np.ldexp(cand[best, cols], -exponent)
    fine_raw = np.concatenate([kept[None], FINE_FACTORS[:, None] * raw[best, cols][None]])
    # the kept candidate is already finished: finishing it again changes nothing, so its
    # errors are the ones just computed
    best, cand, _ = _best(x, fine_raw, exponent, all_zero, (maxpos, maxneg), qmin, qmax, bf16, kept_errors)
    return cand[best, cols]


def coarse_candidates(x: np.ndarray, qmin: int, qmax: int,
                      ratios: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage-1 raw scales of blocks ``x`` ``(N, B)``: ``ratios`` ``(R,)`` times the min-max
    scale, then the no-clipping scale -> ``(R + 1, N)`` float32, with the all-zero blocks,
    the largest value and the largest negated value of each block (``(N,)`` each, >= 0)."""
    maxpos = np.maximum(x.max(axis=-1), 0)
    maxneg = np.maximum(-x.min(axis=-1), 0)
    base = np.maximum(maxpos, maxneg) / half_range(qmin, qmax)
    no_clip = np.maximum(maxpos / np.float32(qmax), maxneg / np.float32(-qmin))
    raw = np.concatenate([ratios[:, None] * base[None], no_clip[None]])
    return raw, base == 0, maxpos, maxneg


def exhaustive_bf16_scales(blocks: np.ndarray, qmin: int, qmax: int, low: float = 1 / 32,
                           high: float = 2.0) -> np.ndarray:
    """Reference optimum: every bf16 scale in ``[low, high] * max|x|`` per block.

    blocks ``(N, B)`` float32 -> ``(N,)`` float32 bf16 values.  Slow (about 128 candidates
    per octave, ~770 with the defaults); for benchmarks and tests.  Positive bf16 values
    are consecutive as uint16 bit patterns, so the candidates are ``lo_bits + k``.
    """
    maxabs = np.abs(blocks).max(axis=-1)
    all_zero = maxabs == 0
    lo_bits = to_bf16(positive_normal(maxabs * np.float32(low), all_zero)).bits.astype(np.int32)
    hi_bits = to_bf16(positive_normal(maxabs * np.float32(high), all_zero)).bits.astype(np.int32)
    best_scale = minmax_scales(blocks, qmin, qmax, bf16=True)
    best_err = block_errors(blocks, best_scale[None], qmin, qmax)[0]
    for k in range(int((hi_bits - lo_bits).max()) + 1):
        bits = np.minimum(lo_bits + k, hi_bits).astype(np.uint16)
        scale = bf16_bits_to_float32(bits)
        err = block_errors(blocks, scale[None], qmin, qmax)[0]
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    return best_scale
