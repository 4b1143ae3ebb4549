"""4-bit nibble packing, as ExecuTorch serializes qcint4 and qbint4 constants."""

from __future__ import annotations

import io

import numpy as np

from ..arrays import ArrayInput, as_int_codes, is_int, to_numpy
from ..compute import jit
from ..compute.parallel import for_ranges
from ..errors import XnnquantError

INT4_MIN, INT4_MAX = -8, 7
#: Codes per piece of the fast path: 64 KiB of int8 and its temporaries stay in L2.
PACK_CHUNK = 1 << 16


def pack_int4(codes: ArrayInput) -> np.ndarray:
    """Pack signed 4-bit codes two to a byte, each row on its own.

    ``codes``: integers in [-8, 7], shape ``(..., K)``.  Returns uint8 ``(..., ceil(K / 2))``::

        byte[r, j] = (q[r, 2j] + 8) | (q[r, 2j + 1] + 8) << 4

          bit  7   6   5   4   3   2   1   0
              [ q[r,2j+1] + 8 ][  q[r,2j] + 8 ]
                 high nibble      low nibble

    When K is odd, each row gets one padding code 0 (stored nibble 8, a zero weight) in
    the high nibble of its last byte, so rows start on byte boundaries; XNNPACK's 4-bit
    kernels with two nibble planes read ``ceil(K / 2)`` bytes per row.
    """
    q = _even_codes(codes)
    packed = np.empty(q.shape[:-1] + (q.shape[-1] // 2,), np.uint8)
    if not _pack_even(q.reshape(-1), [packed.reshape(-1)]):
        _int4_codes(q)  # raises, naming the first code out of range
    return packed


def pack_int4_bytes(codes: ArrayInput) -> bytes:
    """``pack_int4(codes).tobytes()``, packed straight into the bytes returned.

    The bytes object is the buffer of an ``io.BytesIO``, written through
    ``getbuffer()``; ``getvalue()`` hands that object over without a copy in CPython
    (elsewhere it copies once).  No packed array as large as the output is made, nor
    copied: on a 4096 x 4096 weight that is 8 MiB less fresh memory and one pass less.
    """
    q = _even_codes(codes)
    size = q.size // 2
    if size == 0:
        return b""
    stream = io.BytesIO()
    stream.seek(size - 1)
    stream.write(b"\0")  # the buffer: size bytes, zero-filled
    view = stream.getbuffer()
    # the kernels reach the array through this list, emptied as soon as they are done:
    # view.release() fails while any array over the view lives, and a pool thread may
    # still hold the kernel a moment after its result is in
    target = [np.frombuffer(view, np.uint8)]
    packed = _pack_even(q.reshape(-1), target)
    target.clear()
    view.release()
    if not packed:
        _int4_codes(q)  # raises, naming the first code out of range
    return stream.getvalue()


def _even_codes(codes: ArrayInput) -> np.ndarray:
    """``codes`` as C-contiguous int8 with an even last dim (odd K padded with a zero code
    a row), checked to be integers; the range [-8, 7] is checked as they are packed."""
    arr = to_numpy(codes, "codes")
    if not (arr.dtype == np.int8 and arr.ndim and arr.shape[-1] % 2 == 0):
        arr = _int4_codes(arr)
        if arr.shape[-1] % 2:
            arr = np.concatenate([arr, np.zeros(arr.shape[:-1] + (1,), np.int8)], axis=-1)
    return np.ascontiguousarray(arr)


def pack_int4_high_first(codes: ArrayInput) -> np.ndarray:
    """Pack signed 4-bit codes two to a byte, the first of each pair in the HIGH nibble: the
    order of ExecuTorch's quantized embedding kernel (``quantized_decomposed::embedding_4bit``,
    measured on the 1.4.1 runtime: its element ``2j`` is ``(byte[j] >> 4) - 8``).

    ``codes``: integers in [-8, 7], shape ``(..., K)`` with K even.  Returns uint8 ``(..., K / 2)``::

        byte[r, j] = (q[r, 2j] + 8) << 4 | (q[r, 2j + 1] + 8)

          bit  7   6   5   4   3   2   1   0
              [  q[r,2j] + 8 ][ q[r,2j+1] + 8 ]
                high nibble      low nibble

    ``pack_int4`` (XNNPACK's order) with the two nibbles of every byte swapped.  An odd K
    has no such layout (the kernel reads ``2 * bytes`` codes per row): refused.
    """
    arr = to_numpy(codes, "codes")
    if arr.ndim == 0 or arr.shape[-1] % 2:
        raise XnnquantError(f"codes packed high nibble first need an even last dim (two codes a byte): got shape "
                            f"{arr.shape}")
    packed = pack_int4(arr)
    return (packed << 4) | (packed >> 4)


def _pack_even(flat: np.ndarray, target: list[np.ndarray]) -> bool:
    """``pack_int4`` of int8 codes ``flat`` ``(2 * M,)`` into ``target[0]`` uint8 ``(M,)``,
    in cache-sized pieces on every core; False if a code lies outside [-8, 7] (checked on
    each piece as it is packed; the output is then meaningless)."""
    bad = []
    loops = jit.loops()

    def kernel(start: int, stop: int) -> None:
        packed = target[0]
        for lo in range(start, stop, PACK_CHUNK):
            piece = flat[lo:min(stop, lo + PACK_CHUNK)]
            out = packed[lo // 2:(lo + len(piece)) // 2]
            if loops is not None:
                if not loops.pack_nibbles(piece, out):
                    bad.append(lo)
                    return
                continue
            if piece.min() < INT4_MIN or piece.max() > INT4_MAX:
                bad.append(lo)
                return
            # In uint8 arithmetic code + 8 wraps -8..7 onto 0..15.  Read as little-endian
            # uint16, each pair is  (q[2j+1] + 8) << 8 | (q[2j] + 8); shifting a copy right
            # by 4 brings the odd code into bits 4..7: the low byte of the OR is the byte.
            pairs = (piece.view(np.uint8) + np.uint8(8)).view("<u2")
            np.bitwise_or(pairs, pairs >> 4, out=pairs)
            np.copyto(out, pairs, casting="unsafe")

    for_ranges(kernel, flat.size, PACK_CHUNK)
    return not bad


def _int4_codes(codes: ArrayInput) -> np.ndarray:
    """``codes`` as int8 after checking they are integers in [-8, 7]."""
    arr = to_numpy(codes, "codes")
    q = arr if arr.dtype == np.int8 else as_int_codes(arr)
    if q.ndim == 0:
        raise XnnquantError("codes must have at least one dimension (..., K): got a scalar")
    if q.size and (q.min() < INT4_MIN or q.max() > INT4_MAX):
        bad = tuple(int(i) for i in np.argwhere((q < INT4_MIN) | (q > INT4_MAX))[0])
        raise XnnquantError(f"int4 codes must lie in [-8, 7]: got {q[bad]} at index {bad}")
    return q.astype(np.int8, copy=False)


def unpack_int4(packed: ArrayInput, k: int) -> np.ndarray:
    """Inverse of ``pack_int4``: uint8 ``(..., ceil(k / 2))`` -> int8 codes ``(..., k)``.

    The padding nibble of odd ``k`` is dropped without being checked.
    """
    p = to_numpy(packed, "packed")
    if p.dtype != np.uint8:
        raise XnnquantError(f"packed int4 data must be uint8: got dtype {p.dtype}")
    if p.ndim == 0:
        raise XnnquantError("packed int4 data must have at least one dimension: got a scalar")
    if not is_int(k) or k < 0:
        raise XnnquantError(f"k must be a non-negative integer: got {k!r}")
    if p.shape[-1] != (k + 1) // 2:
        raise XnnquantError(
            f"packed width does not match k: got {p.shape[-1]} bytes per row for k={k}, "
            f"expected ceil(k / 2) = {(k + 1) // 2}"
        )
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.int8)
    out[..., 0::2] = (p & 0x0F).astype(np.int8) - 8
    out[..., 1::2] = (p >> 4).astype(np.int8) - 8
    return out[..., :k]
