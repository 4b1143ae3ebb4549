"""Tiling helpers shared by the GEMM packers: rows into tiles, chunks, nibbles, sections.

Every packer builds one zeroed buffer (``tile_buffer``) and fills per-tile *sections* of
it (correction terms, chunked weights, scales, bias) through ``(T, bytes)`` views, so the
weights cross memory once on their way in.  Shapes: ``T`` tiles of ``nr`` rows, ``C``
chunks of ``kr`` values per row.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..constants import XNN_ALLOCATION_ALIGNMENT


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def row_tiles(rows: np.ndarray, nr: int, width: int) -> np.ndarray:
    """``(N, K)`` -> ``(ceil(N / nr), nr, width)``, zero rows and columns appended.

    A view of ``rows`` when nothing needs appending, else a fresh array.
    """
    n, k = rows.shape
    n_pad = round_up(n, nr)
    if n_pad == n and width == k:
        return np.ascontiguousarray(rows).reshape(n // nr, nr, width)
    out = np.zeros((n_pad, width), rows.dtype)
    out[:n, :k] = rows
    return out.reshape(n_pad // nr, nr, width)


def chunk_view(tiles: np.ndarray, kr: int, sr: int, step: int, offset: int = 0) -> np.ndarray:
    """``(T, nr, Kx)`` -> ``(T, nr, C, kr)``: chunk ``c`` of row ``o`` holds channels
    ``(s // (kr sr)) kr sr + ((s + o kr) mod kr sr) + offset + j``, ``s = c step``.

    ``C = Kx // step``; channels past ``Kx`` read as zero.  A view when ``sr == 1``.
    """
    t, nr, kx = tiles.shape
    n_chunks = kx // step
    if sr == 1:  # chunk c of every row starts at c * step: a plain reshape
        return tiles[:, :, : n_chunks * step].reshape(t, nr, n_chunks, step)[..., offset:offset + kr]
    skr = kr * sr
    start = np.arange(n_chunks)[None, :, None] * step
    row = np.arange(nr)[:, None, None]
    index = (start // skr) * skr + ((start + row * kr) & (skr - 1)) + offset + np.arange(kr)
    wide = np.concatenate([tiles, np.zeros((t, nr, 1), tiles.dtype)], axis=2)
    index = np.minimum(index, kx).reshape(1, nr, -1)  # past Kx: the zero column appended above
    return np.take_along_axis(wide, index, axis=2).reshape(t, nr, n_chunks, kr)


def store_chunks(section: np.ndarray, chunks: np.ndarray) -> None:
    """Write ``chunks`` ``(T, nr, ..., kr)`` chunk-major into ``section`` (``(T, bytes)`` uint8
    view of the tile buffer): ``section[t] = chunks[t].swapaxes(0, -2)`` flattened, i.e.
    for every chunk the ``kr`` values of row 0, then row 1, ... row ``nr - 1``.

    The ``kr`` values of a row travel as one wide element when they fit 1, 2, 4 or 8 bytes.
    """
    width = chunks.shape[-1] * chunks.itemsize
    shape = (chunks.shape[0],) + chunks.shape[2:-1] + (chunks.shape[1],)  # (T, ..., nr)
    if width in (1, 2, 4, 8) and chunks.strides[-1] == chunks.itemsize:
        wide = np.dtype(f"u{width}")
        source = chunks.view(wide)[..., 0]  # (T, nr, ...)
        target = section.view(wide).reshape(shape)
    else:
        source = chunks
        target = section.view(chunks.dtype).reshape(shape + chunks.shape[-1:])
    assert np.may_share_memory(target, section), "reshape must not copy: the write would be lost"
    np.copyto(target, np.moveaxis(source, 1, -1 if source.ndim == len(shape) else -2))


def nibble_views(codes: np.ndarray, nr: int, kr: int, sr: int, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """Low- and high-nibble codes of every chunk: int8 ``(T, nr, C, kr)`` each, ``C = kp / 2kr``."""
    width = kp if sr == 1 else kp + 2 * kr * sr  # rotated chunks reach past kp: zeros
    tiles = row_tiles(codes.astype(np.int8, copy=False), nr, width)
    n_chunks = kp // (2 * kr)
    lo = chunk_view(tiles, kr, sr, step=2 * kr)[:, :, :n_chunks]
    hi = chunk_view(tiles, kr, sr, step=2 * kr, offset=kr)[:, :, :n_chunks]
    return lo, hi


def nibble_bytes(lo: np.ndarray, hi: np.ndarray, unsigned: bool, last_rows: int) -> np.ndarray:
    """``lo & 0xF | hi << 4`` as uint8 ``(T, nr, C, kr)``: two's-complement nibbles, or
    ``q + 8`` (the same XOR 0x88) when ``unsigned``.  Rows past ``last_rows`` of the last
    tile (when non-zero) are 0x00.

    The ``kr`` bytes of a row are combined as one wide integer when ``kr`` is 1, 2, 4 or 8:
    ``hi << 4`` only spills bits into the neighbouring byte's low nibble, which the 0xF0
    mask clears.
    """
    kr = lo.shape[-1]
    if kr in (1, 2, 4, 8) and lo.strides[-1] == 1 and hi.strides[-1] == 1:
        wide = np.dtype(f"u{kr}")
        low, high = lo.view(wide)[..., 0], hi.view(wide)[..., 0]
        ones = int.from_bytes(b"\x01" * kr, "little")
        packed = np.bitwise_and(low, wide.type(0x0F * ones))
        packed |= np.left_shift(high, wide.type(4)) & wide.type(0xF0 * ones)
        if unsigned:
            packed ^= wide.type(0x88 * ones)
        packed = packed[..., None].view(np.uint8)
    else:
        packed = np.bitwise_and(lo.view(np.uint8), 0x0F)
        packed |= np.left_shift(hi.view(np.uint8), 4)
        if unsigned:
            packed ^= 0x88
    if last_rows:
        packed[-1, last_rows:] = 0
    return packed


def int4_group_sums(codes: np.ndarray, width: int) -> np.ndarray:
    """Sums of consecutive groups of ``width`` int4 codes of every row: int32 ``(N, K / width)``.

    ``K`` must be a multiple of ``width``.  When ``width`` is 8 or 16, eight codes travel as
    one uint64: ``q + 8`` (each byte in [0, 15], 30 for two words added) summed across bytes by one multiplication
    by 0x0101010101010101 (the top byte collects the sum, at most 240, without carries).
    """
    n, k = codes.shape
    if width not in (8, 16) or not codes.flags.c_contiguous:
        return np.asarray(np.sum(codes.reshape(n, k // width, width), axis=2, dtype=np.int32))
    ones = np.uint64(0x0101010101010101)
    nibbles = codes.view(np.uint64).reshape(n, k // width, width // 8) & (ones * np.uint64(0x0F))
    words = nibbles ^ (ones * np.uint64(8))  # each byte (q & 0xF) ^ 8 = q + 8
    bytes_sum = words[..., 0] + words[..., 1] if width == 16 else words[..., 0]
    return ((bytes_sum * ones) >> np.uint64(56)).astype(np.int32) - 8 * width


def per_tile(values: np.ndarray | None, n_rows: int, nr: int, dtype: Any) -> np.ndarray:
    """``(N, ...)`` -> ``(T, nr * ...)`` of ``dtype``, zero past N (None: ``(T, nr)`` zeros)."""
    t = -(-n_rows // nr)
    if values is None:
        return np.zeros((t, nr), dtype)
    values = np.asarray(values)
    out = np.zeros((t * nr,) + values.shape[1:], dtype)
    out[:n_rows] = values
    return out.reshape(t, -1)


def tile_buffer(n_tiles: int, nr: int, section_bytes: list[int],
                out: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """The zeroed packed buffer (uint8, size rounded up to ``XNN_ALLOCATION_ALIGNMENT``) and one
    ``(T, nr * b)`` uint8 view per section of ``b`` bytes per row, in tile order.

    ``out``: a zeroed uint8 array of at least ``T`` tiles to use instead (its first ``T``
    tiles are the buffer; the caller owns the rest).
    """
    tile = nr * sum(section_bytes)
    buffer = np.zeros(round_up(n_tiles * tile, XNN_ALLOCATION_ALIGNMENT), np.uint8) if out is None else out
    tiles = buffer[: n_tiles * tile].reshape(n_tiles, tile)
    edges = np.cumsum([0] + [nr * b for b in section_bytes])
    return buffer, [tiles[:, a:b] for a, b in itertools.pairwise(edges)]
