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

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .. import tensor as _tensor  # the module: tensor.py itself imports packing.int4
from ..arrays import ArrayInput, as_float32, is_int
from ..constants import XNN_ALLOCATION_ALIGNMENT, XNN_MIN_BLOCKSIZE
from ..datatypes import Datatype
from ..errors import UnsupportedConfigError, XnnquantError
from ..rounding import check_bf16_exact
from .gemm_configs import PAD_ROWS, KernelConfig, kernel_configs
from .gemm_layouts import pack_f32, pack_qb4w, pack_qc4w, pack_qc8w, packed_size, tile_bytes
from .gemm_tiles import round_up

if TYPE_CHECKING:
    from ..tensor import QuantizedTensor

ROW_BLOCK_BYTES = 1 << 20  # quantized weights are packed about 1 MiB of codes at a time (f32: no gain measured)

_LAYOUT_OF = {Datatype.qcint8: ("qc8w",), Datatype.qcint4: ("qc4w", "qc4uw"), Datatype.qbint4: ("qb4w",)}


def pack_gemm(weight: QuantizedTensor | ArrayInput, bias: ArrayInput | None = None, *, nr: int | None = None,
              kr: int | None = None, sr: int = 1, planes: int | None = None, layout: str | None = None,
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
    if not isinstance(weight, _tensor.QuantizedTensor):  # layout "f32"
        w = as_float32(weight, "weight")
        _check_shape(w.shape)
        return pack_f32(w, _bias(bias, w), nr=nr, kr=kr, sr=sr, pad_rows=pad_rows)
    qt = weight
    b = _bias(bias, qt.codes)
    k = qt.shape[1]
    pack: Callable[..., np.ndarray]
    if layout == "qc8w":
        pack = functools.partial(pack_qc8w, nr=nr, kr=kr, sr=sr, pad_rows=pad_rows)
        rows = [qt.codes, qt.scale, b]
    elif layout in ("qc4w", "qc4uw"):
        pack = functools.partial(pack_qc4w, nr=nr, kr=kr, sr=sr, unsigned=layout == "qc4uw")
        rows = [qt.codes, qt.scale, b]
    else:
        pack = functools.partial(pack_qb4w, group_size=int(qt.group_size), nr=nr, kr=kr, sr=sr,  # type: ignore[arg-type]
                                 planes=planes)
        rows = [qt.codes, check_bf16_exact(qt.scale, "qbint4 scales").bits, b]
    tile = tile_bytes(layout, k, nr=nr, kr=kr, sr=sr, planes=planes, group_size=qt.group_size or 0)
    return _in_row_blocks(pack, rows, nr, tile, row_bytes=k)


def _in_row_blocks(pack: Callable[..., np.ndarray], rows: list[np.ndarray | None], nr: int, tile: int,
                   row_bytes: int) -> np.ndarray:
    """``pack(*rows)``, run on blocks of about ``ROW_BLOCK_BYTES`` of codes (whole tiles)
    that write into one buffer, so the packers' intermediates stay in cache.

    ``rows``: arrays whose first axis is N (None passes through); ``tile``: bytes per tile.
    Tiles depend only on their own rows, so the blocks' bytes are the whole one's.
    """
    n = rows[0].shape[0]  # type: ignore[union-attr]
    per_block = max(1, ROW_BLOCK_BYTES // (nr * row_bytes)) * nr
    if per_block >= n:
        return pack(*rows)
    out = np.zeros(round_up(-(-n // nr) * tile, XNN_ALLOCATION_ALIGNMENT), np.uint8)
    for start in range(0, n, per_block):
        part = [None if a is None else a[start:start + per_block] for a in rows]
        first, count = start // nr * tile, -(-min(per_block, n - start) // nr) * tile
        pack(*part, out=out[first:first + count])
    return out


# --- input checks -----------------------------------------------------------------------


def _layout_for(weight: QuantizedTensor | ArrayInput, layout: str | None) -> str:
    if not isinstance(weight, _tensor.QuantizedTensor):
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
        if g < XNN_MIN_BLOCKSIZE or g % XNN_MIN_BLOCKSIZE:
            raise UnsupportedConfigError(
                f"XNNPACK's qb4w GEMM needs group_size a multiple of {XNN_MIN_BLOCKSIZE}: got group_size={g}"
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
        if not is_int(value) or value < 1:
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
    if pad_rows == "replicate_all" and not (layout == "qc8w" or (layout == "f32" and kr == sr == 1)):
        raise UnsupportedConfigError(
            f"pad_rows='replicate_all' is the qc8w VNNI and the f32 SSE2 (kr=sr=1) packing: got layout={layout}, "
            f"kr={kr}, sr={sr}"
        )
    if layout in ("qc4w", "qc4uw") and planes != 2:
        raise UnsupportedConfigError(f"{layout} packing pairs nibbles in two planes: got planes={planes}, expected 2")
    if layout == "qb4w" and planes not in (1, 2):
        raise XnnquantError(f"planes must be 1 or 2 for 4-bit weights: got {planes}")
    if layout in ("qc4w", "qc4uw", "qb4w") and (kr > 16 or sr > 16):
        raise UnsupportedConfigError(f"XNNPACK's 4-bit packers take kr, sr <= 16: got kr={kr}, sr={sr}")


def _bias(bias: ArrayInput | None, weight: np.ndarray) -> np.ndarray | None:
    if bias is None:
        return None
    n = weight.shape[0]
    b = as_float32(bias, "bias")
    if b.shape != (n,):
        raise XnnquantError(f"bias must have shape (N,) = ({n},): got {b.shape}")
    return b


__all__ = [
    "KernelConfig",
    "kernel_configs",
    "pack_f32",
    "pack_gemm",
    "pack_qb4w",
    "pack_qc4w",
    "pack_qc8w",
    "packed_size",
]
