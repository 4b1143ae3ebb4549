"""Kernel-level prepacking: the buffer XNNPACK's GEMM micro-kernels read, byte for byte.

When XNNPACK creates a fully-connected operator it repacks the constant weights for the
micro-kernel it selected (see ``gemm_configs.kernel_configs``).  ``pack_gemm`` writes
the same buffer ahead of time.  Every layout is a sequence of *tiles* of ``nr`` output
channels (the last one padded to ``nr``); the buffer is the tiles back to back, padded
with zero bytes to a multiple of 64 (``XNN_ALLOCATION_ALIGNMENT``).

Inside a tile the input channels are cut into *chunks* of ``kr`` (8-/32-bit weights) or
``2 * kr`` (4-bit weights, two nibble planes).  A chunk holds ``kr`` values of each of the
``nr`` rows, row after row.  With ``sr > 1`` the chunks of each group of ``sr`` are
rotated per row: row ``o`` of chunk ``c`` reads input channels starting at
``(c // sr) * kr * sr + ((c + o) % sr) * kr``.  Channels past K read as zero weights.

Functions here take codes in their logical shape ``(N, K)`` (``QuantizedTensor.codes``),
never the nibble-packed bytes, so the same code serves every ``planes`` setting.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..arrays import as_float32
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import to_bf16
from ..tensor import QuantizedTensor
from .gemm_configs import PAD_ROWS, WEIGHT_LAYOUTS, KernelConfig, kernel_configs

ALIGNMENT = 64  # XNN_ALLOCATION_ALIGNMENT on x86-64: the packed buffer is a multiple of it
MIN_BLOCK_SIZE = 32  # XNN_MIN_BLOCKSIZE: qb4w group sizes are multiples of it

_LAYOUT_OF = {Datatype.qcint8: ("qc8w",), Datatype.qcint4: ("qc4w", "qc4uw"), Datatype.qbint4: ("qb4w",)}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack_gemm(weight: Any, bias: Any = None, *, nr: int | None = None, kr: int | None = None,
              sr: int = 1, planes: int | None = None, layout: str | None = None,
              pad_rows: str = "zero", config: KernelConfig | None = None) -> np.ndarray:
    """XNNPACK's packed GEMM weights for ``weight`` (``(N, K)``, output channels first).

    ``weight``: float array (fp32 layout) or a ``QuantizedTensor``: qcint8 (``qc8w``),
    qcint4 (``qc4w``, or ``qc4uw`` with ``layout="qc4uw"``), qbint4 (``qb4w``), all with
    ``channel_dim`` 0.  ``bias``: float ``(N,)`` or None.  ``nr``, ``kr``, ``sr``,
    ``planes`` are the tile parameters; ``config`` (a ``KernelConfig``) supplies all of
    them plus ``layout`` and ``pad_rows`` at once.  Returns uint8 ``(size,)``, ``size`` a
    multiple of 64.  Per layout, see ``pack_f32``, ``pack_qc8w``, ``pack_qc4w``,
    ``pack_qb4w``.
    """
    if config is not None:
        args = config.pack_args()
        nr, kr, sr, planes = args["nr"], args["kr"], args["sr"], args["planes"]  # type: ignore[assignment]
        layout, pad_rows = str(args["layout"]), str(args["pad_rows"])
    if nr is None or kr is None:
        raise XnnquantError("pack_gemm needs the tile parameters: got nr=None or kr=None, expected nr=, kr= or config=")
    layout = _layout_for(weight, layout)
    planes = planes if planes is not None else (2 if layout in ("qc4w", "qc4uw", "qb4w") else 1)
    _check_tile(nr, kr, sr, planes, layout, pad_rows)
    if layout == "f32":
        w = as_float32(weight, "weight")
        if w.ndim != 2:
            raise XnnquantError(f"GEMM weights must be 2-D (N, K): got shape {w.shape}")
        return pack_f32(w, _bias(bias, w), nr=nr, kr=kr, sr=sr, pad_rows=pad_rows)
    qt: QuantizedTensor = weight
    b = _bias(bias, qt.codes)
    if layout == "qc8w":
        return pack_qc8w(qt.codes, qt.scale, b, nr=nr, kr=kr, sr=sr)
    if layout in ("qc4w", "qc4uw"):
        return pack_qc4w(qt.codes, qt.scale, b, nr=nr, kr=kr, sr=sr, unsigned=layout == "qc4uw")
    return pack_qb4w(qt.codes, _bf16_bits(qt.scale), b, group_size=int(qt.group_size), nr=nr, kr=kr, sr=sr,
                     planes=planes)


def pack_f32(weight: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int = 1, sr: int = 1,
             pad_rows: str = "zero") -> np.ndarray:
    """fp32 weights ``(N, K)`` and bias ``(N,)`` -> packed bytes (fully_connected_nc_f32).

    ``Kp = round_up(K, kr * sr)``; each tile is ``nr * (1 + Kp) * 4`` bytes::

        [ bias[0] .. bias[nr-1] ]             nr float32 (0 without bias or past N)
        [ chunk 0: row 0 kr floats | row 1 kr floats | ... | row nr-1 kr floats ]
        [ chunk 1 ... ]  ...  [ chunk Kp/kr - 1 ]

    With ``kr = sr = 1`` (every x86 f32 config) chunk ``k`` is simply column ``k`` of the
    tile: ``w[t*nr + 0, k], w[t*nr + 1, k], ..., w[t*nr + nr-1, k]``.

    Rows ``n..nr-1`` of a last tile holding ``n < nr`` real rows (``pad_rows``):
    ``"zero"``: 0.0.  ``"replicate"`` (XNNPACK's AVX/AVX-512 packing micro-kernels,
    ``kr = sr = 1`` only): copies of row ``n-1``, except row ``nr-1``, which is 0.0 in the
    columns ``k < 4 * floor(K / 4)``.  Bias lanes past N are 0.0 in both cases.
    """
    n_rows, k = weight.shape
    kp = round_up(k, kr * sr)
    tiles = _row_tiles(np.pad(weight, ((0, 0), (0, kp - k))), nr)  # (T, nr, Kp) f32
    if pad_rows == "replicate" and n_rows % nr:
        last, n = tiles[-1], n_rows % nr
        last[n:] = last[n - 1]
        last[nr - 1, : 4 * (k // 4)] = 0.0
    chunks = _chunks(tiles, kr, sr, step=kr)  # (T, C, nr, kr)
    out = _tile_buffer(tiles.shape[0], nr, [4, kp * 4])
    out[0][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    out[1][...] = chunks.reshape(tiles.shape[0], -1).view(np.uint8)
    return _finish(out)


def pack_qc8w(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int,
              sr: int = 1) -> np.ndarray:
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
    (and the +128 of unsigned inputs) multiplies it inside the kernel.  Padding rows and
    padding channels hold zero bytes.
    """
    n_rows, k = codes.shape
    kp = round_up(k, kr * sr)
    tiles = _row_tiles(np.pad(codes.astype(np.int8, copy=False), ((0, 0), (0, kp - k))), nr)
    corr = -codes.astype(np.int64).sum(axis=1)
    out = _tile_buffer(tiles.shape[0], nr, [4, kp, 4, 4])
    out[0][...] = _per_tile(corr.astype(np.int32), n_rows, nr, np.int32).view(np.uint8)
    out[1][...] = _chunks(tiles, kr, sr, step=kr).reshape(tiles.shape[0], -1).view(np.uint8)
    out[2][...] = _per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    out[3][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return _finish(out)


def pack_qc4w(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray | None, *, nr: int, kr: int,
              sr: int = 1, unsigned: bool = False) -> np.ndarray:
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
    unsigned); padding rows hold zero bytes.
    """
    n_rows, k = codes.shape
    kp = round_up(round_up(k, 2), 2 * kr * sr)
    lo, hi = _nibble_chunks(codes, nr, kr, sr, kp)  # (T, C, nr, kr) int8 each
    if unsigned:
        packed = (lo + 8).view(np.uint8) | ((hi + 8).view(np.uint8) << 4)
        corr = -codes.astype(np.int64).sum(axis=1)
    else:
        packed = (lo.view(np.uint8) & 0xF) | (hi.view(np.uint8) << 4)
        corr = -16 * codes.astype(np.int64).sum(axis=1)
    _zero_padding_rows(packed, n_rows, nr)
    t = packed.shape[0]
    out = _tile_buffer(t, nr, [4, kp // 2, 4, 4])
    out[0][...] = _per_tile(corr.astype(np.int32), n_rows, nr, np.int32).view(np.uint8)
    out[1][...] = packed.reshape(t, -1)
    out[2][...] = _per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    out[3][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return _finish(out)


def pack_qb4w(codes: np.ndarray, scale_bits: np.ndarray, bias: np.ndarray | None, *, group_size: int,
              nr: int, kr: int, sr: int = 1, planes: int = 2) -> np.ndarray:
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

    (``scale`` as the float32 value of the bf16).  Padding rows hold zero bytes.
    """
    n_rows, k = codes.shape
    skr = kr * sr
    if group_size % skr or 2 * skr > group_size:
        raise UnsupportedConfigError(
            f"qb4w packing needs group_size to be a multiple of kr*sr and at least 2*kr*sr: got "
            f"group_size={group_size}, kr={kr}, sr={sr}"
        )
    kp = round_up(k, 2 * skr)
    assert kp == k == round_up(round_up(k, planes), skr * planes), "K is a multiple of group_size"
    lo, hi = _nibble_chunks(codes, nr, kr, sr, kp)  # (T, C, nr, kr) int8
    t, n_chunks = lo.shape[:2]
    blocks = k // group_size
    scale_f32 = _per_tile(scale_bits.astype(np.uint32) << 16, n_rows, nr, np.uint32).view(np.float32)
    chunk_scale = np.repeat(scale_f32.reshape(t, nr, blocks), group_size // (2 * kr), axis=2)  # (T, nr, C)
    ksum = (lo.astype(np.int32) + hi).sum(axis=3).astype(np.float32)  # (T, C, nr)
    terms = ksum * chunk_scale.transpose(0, 2, 1)  # (T, C, nr) float32 products, rounded each
    steps = np.concatenate([np.zeros((t, 1, nr), np.float32), -terms], axis=1)
    corr = np.add.accumulate(steps, axis=1, dtype=np.float32)[:, -1]  # sequential float32 sums
    packed = (lo.view(np.uint8) & 0xF) | (hi.view(np.uint8) << 4)
    _zero_padding_rows(packed, n_rows, nr)
    s16 = ((scale_f32 / np.float32(16)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    block_bytes = group_size // 2 * nr
    out = _tile_buffer(t, nr, [4, blocks * (group_size // 2 + 2), 4])
    out[0][...] = np.ascontiguousarray(corr).view(np.uint8)
    body = out[1].reshape(t, blocks, block_bytes + 2 * nr)
    body[:, :, :block_bytes] = packed.reshape(t, blocks, block_bytes)
    body[:, :, block_bytes:] = s16.reshape(t, nr, blocks).transpose(0, 2, 1).copy().view(np.uint8)
    out[2][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return _finish(out)


def packed_size(layout: str, n: int, k: int, *, nr: int, kr: int, sr: int = 1, planes: int = 1,
                group_size: int = 0) -> int:
    """Bytes of the packed buffer for an ``(n, k)`` weight, a multiple of 64."""
    if layout == "f32":
        row = round_up(k, kr * sr) * 4 + 4
    elif layout == "qc8w":
        row = round_up(k, kr * sr) + 12
    elif layout in ("qc4w", "qc4uw", "qb4w"):
        row = round_up(round_up(k, planes), kr * sr * planes) // 2 + (12 if layout != "qb4w" else 8)
        row += 2 * (k // group_size) if layout == "qb4w" else 0
    else:
        raise XnnquantError(f"unknown layout: got {layout!r}, expected one of {WEIGHT_LAYOUTS}")
    return round_up(round_up(n, nr) * row, ALIGNMENT)


# --- input checks -----------------------------------------------------------------------


def _layout_for(weight: Any, layout: str | None) -> str:
    if not isinstance(weight, QuantizedTensor):
        if layout not in (None, "f32"):
            raise XnnquantError(f"layout {layout!r} needs a QuantizedTensor weight: got a float array")
        return "f32"
    allowed = _LAYOUT_OF.get(weight.datatype)
    if allowed is None:
        raise UnsupportedConfigError(
            f"GEMM packing supports qcint8, qcint4 and qbint4 weights: got {weight.datatype.name}"
        )
    if weight.codes.ndim != 2:
        raise XnnquantError(f"GEMM weights must be 2-D (N, K): got shape {weight.shape}")
    if weight.datatype is not Datatype.qbint4 and weight.channel_dim != 0:
        raise UnsupportedConfigError(
            f"GEMM packing needs per-output-channel scales: got channel_dim={weight.channel_dim}, expected 0"
        )
    if weight.datatype is Datatype.qcint8 and np.any(np.asarray(weight.zero_point) != 0):
        raise XnnquantError("qcint8 weights need zero point 0: got a non-zero zero point")
    if weight.datatype is Datatype.qbint4:
        g = weight.group_size or 0
        if g < MIN_BLOCK_SIZE or g % MIN_BLOCK_SIZE:
            raise UnsupportedConfigError(
                f"XNNPACK's qb4w GEMM needs group_size a multiple of {MIN_BLOCK_SIZE}: got group_size={g}"
            )
    if weight.bits == 4 and weight.codes.size and (weight.codes.min() < -8 or weight.codes.max() > 7):
        raise XnnquantError(
            f"int4 codes must lie in [-8, 7]: got range [{weight.codes.min()}, {weight.codes.max()}]"
        )
    if layout is None:
        return allowed[0]
    if layout not in allowed:
        raise XnnquantError(f"layout {layout!r} does not fit {weight.datatype.name} weights: expected one of {allowed}")
    return layout


def _check_tile(nr: int, kr: int, sr: int, planes: int, layout: str, pad_rows: str) -> None:
    for name, value in (("nr", nr), ("kr", kr), ("sr", sr), ("planes", planes)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise XnnquantError(f"{name} must be a positive integer: got {value!r}")
    for name, value in (("kr", kr), ("sr", sr)):
        if value & (value - 1):
            raise XnnquantError(f"{name} must be a power of two (XNNPACK stores log2): got {value}")
    if sr > nr:
        raise XnnquantError(f"sr must not exceed nr: got sr={sr}, nr={nr}")
    if pad_rows not in PAD_ROWS:
        raise XnnquantError(f"pad_rows must be one of {PAD_ROWS}: got {pad_rows!r}")
    if pad_rows == "replicate" and (layout != "f32" or kr != 1 or sr != 1):
        raise UnsupportedConfigError(
            f"pad_rows='replicate' is the f32 AVX packing of kr=sr=1 tiles: got layout={layout}, kr={kr}, sr={sr}"
        )
    if layout in ("qc4w", "qc4uw") and planes != 2:
        raise UnsupportedConfigError(f"{layout} packing pairs nibbles in two planes: got planes={planes}, expected 2")
    if layout == "qb4w" and planes not in (1, 2):
        raise XnnquantError(f"planes must be 1 or 2 for 4-bit weights: got {planes}")
    if layout in ("qc4w", "qc4uw", "qb4w") and (kr > 16 or sr > 16):
        raise UnsupportedConfigError(f"XNNPACK's 4-bit packers take kr, sr <= 16: got kr={kr}, sr={sr}")


def _bias(bias: Any, weight: Any) -> np.ndarray | None:
    if bias is None:
        return None
    n = weight.shape[0]
    b = as_float32(bias, "bias")
    if b.shape != (n,):
        raise XnnquantError(f"bias must have shape (N,) = ({n},): got {b.shape}")
    return b


def _bf16_bits(scale: np.ndarray) -> np.ndarray:
    bf = to_bf16(scale)
    changed = bf.values.view(np.uint32) != scale.astype(np.float32).view(np.uint32)
    if changed.any():
        where = tuple(int(i) for i in np.argwhere(changed)[0])
        raise XnnquantError(
            f"qbint4 scales must be exact bf16 values (XNNPACK stores bf16): got {scale[where]!r} at "
            f"index {where}, nearest bf16 {bf.values[where]!r}"
        )
    return bf.bits


# --- tiling helpers ---------------------------------------------------------------------


def _row_tiles(rows: np.ndarray, nr: int) -> np.ndarray:
    """``(N, K')`` -> ``(ceil(N / nr), nr, K')``, padding rows zero."""
    n = rows.shape[0]
    padded = np.zeros((round_up(n, nr),) + rows.shape[1:], rows.dtype)
    padded[:n] = rows
    return padded.reshape(-1, nr, *rows.shape[1:])


def _chunks(tiles: np.ndarray, kr: int, sr: int, step: int, offset: int = 0) -> np.ndarray:
    """``(T, nr, Kx)`` -> ``(T, C, nr, kr)``: chunk ``c`` of row ``o`` starts at channel
    ``(s // (kr sr)) kr sr + ((s + o kr) mod kr sr) + offset`` with ``s = c * step``.

    ``C = Kx // step``.  Values are moved ``kr`` at a time (one wide element when possible).
    """
    t, nr, kx = tiles.shape
    n_chunks = kx // step
    if sr == 1:  # chunk c of every row starts at c * step: a plain reshape
        chunked = tiles[:, :, : n_chunks * step].reshape(t, nr, n_chunks, step)[..., offset:offset + kr]
    else:
        skr = kr * sr
        start = np.arange(n_chunks)[None, :, None] * step
        row = np.arange(nr)[:, None, None]
        index = (start // skr) * skr + ((start + row * kr) & (skr - 1)) + offset + np.arange(kr)
        index = np.minimum(index, kx)  # channels past Kx read the zero column appended below
        wide = np.concatenate([tiles, np.zeros((t, nr, 1), tiles.dtype)], axis=2)
        chunked = np.take_along_axis(wide, index.reshape(1, nr, -1), axis=2).reshape(t, nr, n_chunks, kr)
    return _swap_rows_and_chunks(np.ascontiguousarray(chunked))


def _swap_rows_and_chunks(chunked: np.ndarray) -> np.ndarray:
    """``(T, nr, C, kr)`` -> contiguous ``(T, C, nr, kr)``, moving whole ``kr``-runs."""
    t, nr, n_chunks, kr = chunked.shape
    width = kr * chunked.itemsize
    if width in (1, 2, 4, 8):
        wide = chunked.view(f"u{width}").reshape(t, nr, n_chunks)
        return np.ascontiguousarray(wide.transpose(0, 2, 1)).view(chunked.dtype).reshape(t, n_chunks, nr, kr)
    return np.ascontiguousarray(chunked.transpose(0, 2, 1, 3))


def _nibble_chunks(codes: np.ndarray, nr: int, kr: int, sr: int, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """Low- and high-nibble codes of every chunk: two int8 ``(T, C, nr, kr)``, ``C = kp / 2kr``."""
    k = codes.shape[1]
    width = kp + 2 * kr * sr  # room for the high nibble of rotated chunks; zeros past K
    tiles = _row_tiles(np.pad(codes.astype(np.int8, copy=False), ((0, 0), (0, width - k))), nr)
    lo = _chunks(tiles, kr, sr, step=2 * kr)[:, : kp // (2 * kr)]
    hi = _chunks(tiles, kr, sr, step=2 * kr, offset=kr)[:, : kp // (2 * kr)]
    return lo, hi


def _zero_padding_rows(packed: np.ndarray, n_rows: int, nr: int) -> None:
    """Padding rows of the last tile (``packed`` ``(T, C, nr, kr)``) are never written: 0."""
    if n_rows % nr:
        packed[-1, :, n_rows % nr:] = 0


def _per_tile(values: np.ndarray | None, n_rows: int, nr: int, dtype: Any) -> np.ndarray:
    """``(N,)`` (or ``(N, B)``) -> ``(T, nr * ...)`` of ``dtype``, zero past N (or None: zeros)."""
    t = -(-n_rows // nr)
    if values is None:
        return np.zeros((t, nr), dtype)
    return _row_tiles(np.asarray(values).astype(dtype, copy=False), nr).reshape(t, -1)


def _tile_buffer(n_tiles: int, nr: int, section_bytes: list[int]) -> list[np.ndarray]:
    """Views ``(T, nr * b)`` uint8 of one zeroed ``(T, tile)`` buffer, one per section.

    The buffer itself is ``views[0].base``; ``_finish`` flattens and aligns it.
    """
    tile = nr * sum(section_bytes)
    buffer = np.zeros((n_tiles, tile), np.uint8)
    edges = np.cumsum([0] + [nr * b for b in section_bytes])
    return [buffer[:, a:b] for a, b in zip(edges[:-1], edges[1:])]


def _finish(sections: list[np.ndarray]) -> np.ndarray:
    """The tiles back to back, zero-padded to a multiple of ``ALIGNMENT`` bytes."""
    buffer = sections[0].base
    assert buffer is not None and buffer.ndim == 2
    size = buffer.size
    out = np.zeros(round_up(size, ALIGNMENT), np.uint8)
    out[:size] = buffer.reshape(-1)
    return out


__all__ = [
    "ALIGNMENT",
    "KernelConfig",
    "kernel_configs",
    "pack_f32",
    "pack_gemm",
    "pack_qb4w",
    "pack_qc4w",
    "pack_qc8w",
    "packed_size",
]
