"""The four GEMM weight layouts of XNNPACK, one packer each (drawn in its docstring).

``pack_f32`` (fully_connected_nc_f32), ``pack_qc8w`` (qd8/qdu8 x qc8w), ``pack_qc4w``
(qd8/qdu8 x qc4w, signed or unsigned nibbles), ``pack_qb4w`` (qd8/qdu8 x qb4w).  Each takes
codes in their logical ``(N, K)`` shape and tile parameters, and returns the packed buffer:
uint8, a multiple of 64 bytes (or, with ``out``, write the tiles into the zeroed ``out``
and return it).  ``xnnquant.packing.pack_gemm`` picks the packer, checks its input and
feeds large weights in row blocks; these functions trust their input.
"""

from __future__ import annotations

import numpy as np

from ..constants import XNN_ALLOCATION_ALIGNMENT
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import bf16_bits_to_float32
from .gemm_configs import WEIGHT_LAYOUTS
from .gemm_tiles import (
    chunk_view,
    int4_group_sums,
    nibble_bytes,
    nibble_views,
    per_tile,
    round_up,
    row_tiles,
    store_chunks,
    tile_buffer,
)


def pack_f32(weight: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int = 1, sr: int = 1,
             pad_rows: str = "zero", out: np.ndarray | None = None) -> np.ndarray:
    """fp32 weights ``(N, K)`` and bias ``(N,)`` -> packed bytes (fully_connected_nc_f32).

    ``Kp = round_up(K, kr * sr)``; each tile is ``nr * (1 + Kp) * 4`` bytes::

        [ bias[0] .. bias[nr-1] ]             nr float32 (0 without bias or past N)
        [ chunk 0: row 0 kr floats | row 1 kr floats | ... | row nr-1 kr floats ]
        [ chunk 1 ... ]  ...  [ chunk Kp/kr - 1 ]

    With ``kr = sr = 1`` (every x86 f32 config but SSE2's nr2) chunk ``k`` is column ``k``
    of the tile: ``w[t*nr + 0, k], w[t*nr + 1, k], ..., w[t*nr + nr-1, k]``.

    Rows ``n..nr-1`` of a last tile holding ``n < nr`` real rows (``pad_rows``):
    ``"zero"``: 0.0.  ``"replicate"`` (XNNPACK's AVX/AVX-512 packing micro-kernels,
    ``kr = sr = 1`` only): copies of row ``n-1``, except row ``nr-1``, which is 0.0 in the
    columns ``k < 4 * floor(K / 4)``.  ``"replicate_all"`` (the SSE2 micro-kernel): copies
    of row ``n-1``, all of them.  Bias lanes past N are 0.0 in every case.  After the
    last tile, zero bytes up to a multiple of 64.
    """
    n_rows, k = weight.shape
    kp = round_up(k, kr * sr)
    tiles = row_tiles(weight, nr, kp)  # (T, nr, Kp) float32
    if pad_rows in ("replicate", "replicate_all") and n_rows % nr:  # row_tiles made a fresh copy
        last, n = tiles[-1], n_rows % nr
        last[n:] = last[n - 1]
        if pad_rows == "replicate":
            last[nr - 1, : 4 * (k // 4)] = 0.0
    buffer, (head, body) = tile_buffer(tiles.shape[0], nr, [4, kp * 4], out)
    head[...] = per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    store_chunks(body, chunk_view(tiles, kr, sr, step=kr))
    return buffer


def pack_qc8w(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int,
              sr: int = 1, pad_rows: str = "zero", out: np.ndarray | None = None) -> np.ndarray:
    """int8 per-channel weights -> packed bytes (qd8_f32_qc8w and qdu8_f32_qc8w).

    ``codes`` int8 ``(N, K)``, ``scale`` float32 ``(N,)``, ``bias`` float32 ``(N,)`` or None.
    ``Kp = round_up(K, kr * sr)``; each tile is ``nr * (Kp + 12)`` bytes::

        [ corr[0] .. corr[nr-1] ]     nr int32 LE   corr[r] = -sum_k codes[r, k]
        [ chunk 0: row 0 kr int8 | row 1 kr int8 | ... | row nr-1 kr int8 ]
        ...                           Kp / kr chunks
        [ scale[0] .. scale[nr-1] ]   nr float32
        [ bias[0] .. bias[nr-1] ]     nr float32 (0.0 without bias)

    ``corr`` is the row sum times the input zero point XNNPACK packs with, which is 1 for
    both the signed (qd8) and the unsigned (qdu8) input kernels: the run-time zero point
    (and the +128 of unsigned inputs) multiplies it inside the kernel.  Padding channels
    hold zero bytes, and so does the buffer end (up to a multiple of 64).  Rows ``n..nr-1``
    of a last tile with ``n < nr`` real rows (``pad_rows``): ``"zero"``: zero bytes
    throughout; ``"replicate_all"`` (the VNNI packing micro-kernels): weights and ``corr``
    of row ``n-1`` again, scale and bias 0.0.
    """
    n_rows, k = codes.shape
    kp = round_up(k, kr * sr)
    tiles = row_tiles(codes.astype(np.int8, copy=False), nr, kp)
    corr = -np.sum(codes, axis=1, dtype=np.int64)
    if pad_rows == "replicate_all" and n_rows % nr:  # row_tiles made a fresh padded copy
        tiles[-1, n_rows % nr:] = tiles[-1, n_rows % nr - 1]
        corr = np.concatenate([corr, np.repeat(corr[-1:], nr - n_rows % nr)])
    buffer, sections = tile_buffer(tiles.shape[0], nr, [4, kp, 4, 4], out)
    sections[0][...] = per_tile(corr.astype(np.int32), len(corr), nr, np.int32).view(np.uint8)
    store_chunks(sections[1], chunk_view(tiles, kr, sr, step=kr))
    sections[2][...] = per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    sections[3][...] = per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


def pack_qc4w(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int,
              sr: int = 1, unsigned: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """int4 per-channel weights -> packed bytes (qd8_f32_qc4w, qdu8_f32_qc4w), two planes.

    ``codes`` int8 in [-8, 7] ``(N, K)``, ``scale`` float32 ``(N,)``, ``bias`` float32
    ``(N,)`` or None.  K is first rounded up to even (a zero code pads odd rows), then
    ``Kp = round_up(K, 2 * kr * sr)``; each tile is ``nr * (Kp / 2 + 12)`` bytes::

        [ corr[0] .. corr[nr-1] ]     nr int32 LE
        [ chunk 0: row 0 kr bytes | row 1 kr bytes | ... | row nr-1 kr bytes ]
        ...                           Kp / (2 kr) chunks of 2 kr channels
        [ scale[0] .. scale[nr-1] ]   nr float32
        [ bias[0] .. bias[nr-1] ]     nr float32 (0.0 without bias)

    Byte ``j`` of row ``r`` in the chunk starting at channel ``s`` (``sr = 1``) pairs
    channel ``s + j`` (low nibble) with channel ``s + kr + j`` (high nibble)::

        bit   7   6   5   4   3   2   1   0
            [ q[r, s+kr+j]  ][  q[r, s+j]    ]

    ``unsigned=False`` (layout qc4w, the VNNI/AMX/SSE2 kernels): two's-complement nibbles
    ``q & 0xF`` (the unsigned form XOR 0x88) and ``corr[r] = -16 * sum_k q[r, k]`` (the
    kernels shift each nibble to the top of a byte, scaling products by 16).
    ``unsigned=True`` (layout qc4uw, the x86 "madd" kernels): unsigned nibbles ``q + 8``
    and ``corr[r] = -sum_k q[r, k]``.  Padding channels hold code 0 (nibble 0, or 8
    unsigned); padding rows (all their sections) and the buffer end (up to a multiple of
    64) hold zero bytes.
    """
    n_rows, k = codes.shape
    kp = round_up(round_up(k, 2), 2 * kr * sr)
    lo, hi = nibble_views(codes, nr, kr, sr, kp)  # (T, nr, C, kr) int8 each
    packed = nibble_bytes(lo, hi, unsigned, n_rows % nr)
    row_sums = np.sum(codes, axis=1, dtype=np.int64)
    corr = -row_sums if unsigned else -16 * row_sums
    buffer, sections = tile_buffer(packed.shape[0], nr, [4, kp // 2, 4, 4], out)
    sections[0][...] = per_tile(corr.astype(np.int32), n_rows, nr, np.int32).view(np.uint8)
    store_chunks(sections[1], packed)
    sections[2][...] = per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    sections[3][...] = per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


def pack_qb4w(codes: np.ndarray, scale_bits: np.ndarray, bias: np.ndarray | None, *, group_size: int,
              nr: int, kr: int, sr: int = 1, planes: int = 2, out: np.ndarray | None = None) -> np.ndarray:
    """int4 blockwise weights with bf16 scales -> packed bytes (qd8/qdu8_f32_qb4w).

    ``codes`` int8 in [-8, 7] ``(N, K)``; ``scale_bits`` uint16 bf16 patterns
    ``(N, K // group_size)``; ``bias`` float32 ``(N,)`` or None.  With ``g = group_size``
    and ``B = K / g`` blocks, each tile is ``nr * (K/2 + 2B + 8)`` bytes::

        [ corr[0] .. corr[nr-1] ]                    nr float32
        block 0: [ chunk: row 0 kr bytes | ... | row nr-1 kr bytes ] x g/(2 kr)
                 [ s16[0, 0] .. s16[nr-1, 0] ]       nr bf16 LE
        block 1: ...                                 ... B blocks
        [ bias[0] .. bias[nr-1] ]                    nr float32 (0.0 without bias)

    Nibbles pair like ``pack_qc4w`` (signed, ``q & 0xF``).  ``s16[r, b]`` is the top 16
    bits of the float32 ``scale[r, b] / 16`` (truncated, as XNNPACK converts).  ``corr[r]``
    is a float32 accumulation, chunk after chunk in channel order, starting from 0.0::

        corr[r] = corr[r] - float32(float32(sum of the 2 kr codes of the chunk) * scale[r, b])

    (``scale`` as the float32 value of the bf16).  Padding rows (weights, corr, scales,
    bias) and the buffer end (up to a multiple of 64) hold zero bytes.
    """
    n_rows, k = codes.shape
    skr = kr * sr
    if group_size % skr or 2 * skr > group_size:
        raise UnsupportedConfigError(
            f"qb4w packing needs group_size to be a multiple of kr*sr and at least 2*kr*sr: got "
            f"group_size={group_size}, kr={kr}, sr={sr}"
        )
    assert k % (2 * skr) == 0 and k == round_up(round_up(k, planes), skr * planes), "K is a multiple of g"
    lo, hi = nibble_views(codes, nr, kr, sr, k)  # (T, nr, C, kr) int8
    t, n_chunks, blocks = lo.shape[0], lo.shape[2], k // group_size
    if sr == 1:  # chunk c covers channels [2 kr c, 2 kr (c + 1)) of every row
        ksum = int4_group_sums(codes, 2 * kr)
    else:
        ksum = (np.sum(lo, axis=3, dtype=np.int32) + np.sum(hi, axis=3, dtype=np.int32)).reshape(-1, n_chunks)[:n_rows]
    scale_f32 = bf16_bits_to_float32(scale_bits)  # (N, B)
    terms = ksum.astype(np.float32) * np.repeat(scale_f32, group_size // (2 * kr), axis=1)  # (N, C), each rounded
    steps = np.concatenate([np.zeros((n_rows, 1), np.float32), -terms], axis=1)
    corr = np.add.accumulate(steps, axis=1, dtype=np.float32)[:, -1]  # sequential float32 sums
    s16 = ((scale_f32 / np.float32(16)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    packed = nibble_bytes(lo, hi, False, n_rows % nr)  # (T, nr, C, kr) uint8
    buffer, (head, body, tail) = tile_buffer(t, nr, [4, blocks * (group_size // 2 + 2), 4], out)
    head[...] = per_tile(corr, n_rows, nr, np.float32).view(np.uint8)
    per_block = group_size // (2 * kr)
    block_bytes = per_block * nr * kr
    body3 = body.reshape(t, blocks, block_bytes + 2 * nr)
    store_chunks(body3[:, :, :block_bytes], packed.reshape(t, nr, blocks, per_block, kr))
    scales = per_tile(s16, n_rows, nr, np.uint16).reshape(t, nr, blocks)  # (T, nr, B)
    body3[:, :, block_bytes:] = scales.transpose(0, 2, 1).copy().view(np.uint8)
    tail[...] = per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


def tile_bytes(layout: str, k: int, *, nr: int, kr: int, sr: int = 1, planes: int = 1,
               group_size: int = 0) -> int:
    """Bytes of one tile of ``nr`` rows for ``k`` input channels (XNNPACK's weights stride
    times ``nr``)."""
    if layout == "f32":
        row = round_up(k, kr * sr) * 4 + 4
    elif layout == "qc8w":
        row = round_up(k, kr * sr) + 12
    elif layout in ("qc4w", "qc4uw", "qb4w"):
        row = round_up(round_up(k, planes), kr * sr * planes) // 2 + (12 if layout != "qb4w" else 8)
        row += 2 * (k // group_size) if layout == "qb4w" else 0
    else:
        raise XnnquantError(f"unknown layout: got {layout!r}, expected one of {WEIGHT_LAYOUTS}")
    return nr * row


def packed_size(layout: str, n: int, k: int, *, nr: int, kr: int, sr: int = 1, planes: int = 1,
                group_size: int = 0) -> int:
    """Bytes of the packed buffer for an ``(n, k)`` weight, a multiple of 64."""
    tile = tile_bytes(layout, k, nr=nr, kr=kr, sr=sr, planes=planes, group_size=group_size)
    return round_up(-(-n // nr) * tile, XNN_ALLOCATION_ALIGNMENT)
