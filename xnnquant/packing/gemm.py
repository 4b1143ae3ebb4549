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
        nr, kr, sr, planes = config.nr, config.kr, config.sr, config.planes
        layout, pad_rows = config.weights, config.pad_rows
    if nr is None or kr is None:
        raise XnnquantError("pack_gemm needs the tile parameters: got nr=None or kr=None, expected nr=, kr= or config=")
    layout = _layout_for(weight, layout)
    planes = planes if planes is not None else (2 if layout in ("qc4w", "qc4uw", "qb4w") else 1)
    _check_tile(nr, kr, sr, planes, layout, pad_rows)
    if layout == "f32":
        w = as_float32(weight, "weight")
        _check_shape(w.shape)
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

    With ``kr = sr = 1`` (every x86 f32 config but SSE2's nr2) chunk ``k`` is column ``k``
    of the tile: ``w[t*nr + 0, k], w[t*nr + 1, k], ..., w[t*nr + nr-1, k]``.

    Rows ``n..nr-1`` of a last tile holding ``n < nr`` real rows (``pad_rows``):
    ``"zero"``: 0.0.  ``"replicate"`` (XNNPACK's AVX/AVX-512 packing micro-kernels,
    ``kr = sr = 1`` only): copies of row ``n-1``, except row ``nr-1``, which is 0.0 in the
    columns ``k < 4 * floor(K / 4)``.  Bias lanes past N are 0.0 in both cases.  After the
    last tile, zero bytes up to a multiple of 64.
    """
    n_rows, k = weight.shape
    kp = round_up(k, kr * sr)
    tiles = _tiles(weight, nr, kp)  # (T, nr, Kp) float32
    if pad_rows == "replicate" and n_rows % nr:  # _tiles made a fresh padded copy
        last, n = tiles[-1], n_rows % nr
        last[n:] = last[n - 1]
        last[nr - 1, : 4 * (k // 4)] = 0.0
    buffer, (head, body) = _tile_buffer(tiles.shape[0], nr, [4, kp * 4])
    head[...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    _store_chunks(body, _chunk_view(tiles, kr, sr, step=kr))
    return buffer


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
    padding channels hold zero bytes, and so does the buffer end (up to a multiple of 64).
    """
    n_rows, k = codes.shape
    kp = round_up(k, kr * sr)
    tiles = _tiles(codes.astype(np.int8, copy=False), nr, kp)
    corr = -np.sum(codes, axis=1, dtype=np.int64)
    buffer, sections = _tile_buffer(tiles.shape[0], nr, [4, kp, 4, 4])
    sections[0][...] = _per_tile(corr.astype(np.int32), n_rows, nr, np.int32).view(np.uint8)
    _store_chunks(sections[1], _chunk_view(tiles, kr, sr, step=kr))
    sections[2][...] = _per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    sections[3][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


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
    unsigned); padding rows (all their sections) and the buffer end (up to a multiple of
    64) hold zero bytes.
    """
    n_rows, k = codes.shape
    kp = round_up(round_up(k, 2), 2 * kr * sr)
    lo, hi = _nibble_views(codes, nr, kr, sr, kp)  # (T, nr, C, kr) int8 each
    packed = _nibble_bytes(lo, hi, unsigned, n_rows % nr)
    row_sums = np.sum(codes, axis=1, dtype=np.int64)
    corr = -row_sums if unsigned else -16 * row_sums
    buffer, sections = _tile_buffer(packed.shape[0], nr, [4, kp // 2, 4, 4])
    sections[0][...] = _per_tile(corr.astype(np.int32), n_rows, nr, np.int32).view(np.uint8)
    _store_chunks(sections[1], packed)
    sections[2][...] = _per_tile(scale, n_rows, nr, np.float32).view(np.uint8)
    sections[3][...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


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
    lo, hi = _nibble_views(codes, nr, kr, sr, k)  # (T, nr, C, kr) int8
    t, n_chunks, blocks = lo.shape[0], lo.shape[2], k // group_size
    if sr == 1:  # chunk c covers channels [2 kr c, 2 kr (c + 1)) of every row
        ksum = _int4_group_sums(codes, 2 * kr)
    else:
        ksum = (np.sum(lo, axis=3, dtype=np.int32) + np.sum(hi, axis=3, dtype=np.int32)).reshape(-1, n_chunks)[:n_rows]
    scale_f32 = (scale_bits.astype(np.uint32) << 16).view(np.float32)  # (N, B)
    terms = ksum.astype(np.float32) * np.repeat(scale_f32, group_size // (2 * kr), axis=1)  # (N, C), each rounded
    steps = np.concatenate([np.zeros((n_rows, 1), np.float32), -terms], axis=1)
    corr = np.add.accumulate(steps, axis=1, dtype=np.float32)[:, -1]  # sequential float32 sums
    s16 = ((scale_f32 / np.float32(16)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    packed = _nibble_bytes(lo, hi, False, n_rows % nr)  # (T, nr, C, kr) uint8
    buffer, (head, body, tail) = _tile_buffer(t, nr, [4, blocks * (group_size // 2 + 2), 4])
    head[...] = _per_tile(corr, n_rows, nr, np.float32).view(np.uint8)
    per_block = group_size // (2 * kr)
    block_bytes = per_block * nr * kr
    body3 = body.reshape(t, blocks, block_bytes + 2 * nr)
    _store_chunks(body3[:, :, :block_bytes], packed.reshape(t, nr, blocks, per_block, kr))
    scales = _per_tile(s16, n_rows, nr, np.uint16).reshape(t, nr, blocks)  # (T, nr, B)
    body3[:, :, block_bytes:] = scales.transpose(0, 2, 1).copy().view(np.uint8)
    tail[...] = _per_tile(bias, n_rows, nr, np.float32).view(np.uint8)
    return buffer


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
    _check_shape(weight.shape)
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


def _check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) != 2 or min(shape) < 1:
        raise XnnquantError(f"GEMM weights must be 2-D (N, K) with N, K >= 1: got shape {tuple(shape)}")


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


def _tiles(rows: np.ndarray, nr: int, width: int) -> np.ndarray:
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


def _chunk_view(tiles: np.ndarray, kr: int, sr: int, step: int, offset: int = 0) -> np.ndarray:
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


def _store_chunks(section: np.ndarray, chunks: np.ndarray) -> None:
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


def _nibble_views(codes: np.ndarray, nr: int, kr: int, sr: int, kp: int) -> tuple[np.ndarray, np.ndarray]:
    """Low- and high-nibble codes of every chunk: int8 ``(T, nr, C, kr)`` each, ``C = kp / 2kr``."""
    width = kp if sr == 1 else kp + 2 * kr * sr  # rotated chunks reach past kp: zeros
    tiles = _tiles(codes.astype(np.int8, copy=False), nr, width)
    n_chunks = kp // (2 * kr)
    lo = _chunk_view(tiles, kr, sr, step=2 * kr)[:, :, :n_chunks]
    hi = _chunk_view(tiles, kr, sr, step=2 * kr, offset=kr)[:, :, :n_chunks]
    return lo, hi


def _nibble_bytes(lo: np.ndarray, hi: np.ndarray, unsigned: bool, last_rows: int) -> np.ndarray:
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


def _int4_group_sums(codes: np.ndarray, width: int) -> np.ndarray:
    """Sums of consecutive groups of ``width`` int4 codes of every row: int32 ``(N, K / width)``.

    ``K`` must be a multiple of ``width``.  When ``width`` is 8 or 16, eight codes travel as
    one uint64: ``q + 8`` (each byte in [0, 15], 30 for two words added) summed across bytes by one multiplication
    by 0x0101010101010101 (the top byte collects the sum, at most 240, without carries).
    """
    n, k = codes.shape
    if width not in (8, 16) or not codes.flags.c_contiguous:
        return np.sum(codes.reshape(n, k // width, width), axis=2, dtype=np.int32)
    ones = np.uint64(0x0101010101010101)
    nibbles = codes.view(np.uint64).reshape(n, k // width, width // 8) & (ones * np.uint64(0x0F))
    words = nibbles ^ (ones * np.uint64(8))  # each byte (q & 0xF) ^ 8 = q + 8
    bytes_sum = words[..., 0] + words[..., 1] if width == 16 else words[..., 0]
    return ((bytes_sum * ones) >> np.uint64(56)).astype(np.int32) - 8 * width


def _per_tile(values: np.ndarray | None, n_rows: int, nr: int, dtype: Any) -> np.ndarray:
    """``(N, ...)`` -> ``(T, nr * ...)`` of ``dtype``, zero past N (None: ``(T, nr)`` zeros)."""
    t = -(-n_rows // nr)
    if values is None:
        return np.zeros((t, nr), dtype)
    values = np.asarray(values)
    out = np.zeros((t * nr,) + values.shape[1:], dtype)
    out[:n_rows] = values
    return out.reshape(t, -1)


def _tile_buffer(n_tiles: int, nr: int, section_bytes: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The zeroed packed buffer (uint8, size rounded up to ``ALIGNMENT``) and one
    ``(T, nr * b)`` uint8 view per section of ``b`` bytes per row, in tile order."""
    tile = nr * sum(section_bytes)
    buffer = np.zeros(round_up(n_tiles * tile, ALIGNMENT), np.uint8)
    tiles = buffer[: n_tiles * tile].reshape(n_tiles, tile)
    edges = np.cumsum([0] + [nr * b for b in section_bytes])
    return buffer, [tiles[:, a:b] for a, b in zip(edges[:-1], edges[1:])]


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
