"""Granularities: which elements share one scale, as small frozen dataclasses.

Each granularity reshapes a tensor into blocks ``(C, n_blocks, block)`` whose last
axis holds the elements that share a scale, and back.  The scale search and the
quantizers work on those blocks, whatever the scheme.

================  =======================  ==============================
granularity       blocks of ``x``          scale shape
================  =======================  ==============================
``PerTensor()``   ``(1, 1, x.size)``       ``()``
``PerChannel(a)``  ``(C, 1, x.size // C)``  ``(C,)``, ``C = x.shape[a]``
``PerGroup(g)``   ``(C, K // g, g)``       ``(C, K // g)`` for 2-D ``[C, K]``
================  =======================  ==============================

Per-token dynamic quantization has its own rows (``PerToken``); it is asymmetric and
follows XNNPACK's runtime algorithm, not the block search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``x`` (any shape) -> ``(1, 1, x.size)``, same dtype."""
        return x.reshape(1, 1, -1)

    def unblocks(self, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Inverse of ``blocks``."""
        return blocks.reshape(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of ``axis`` (non-negative, already checked against the rank)."""

    axis: int = 0

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``x`` -> ``(C, 1, x.size // C)`` with ``C = x.shape[axis]``; a copy when axis != 0."""
        return np.moveaxis(x, self.axis, 0).reshape(x.shape[self.axis], 1, -1)

    def unblocks(self, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Inverse of ``blocks``: ``(C, 1, rest)`` -> ``shape``, C-contiguous."""
        moved = (shape[self.axis],) + shape[: self.axis] + shape[self.axis + 1 :]
        return np.ascontiguousarray(np.moveaxis(blocks.reshape(moved), 0, self.axis))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[self.axis],)


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``(row, group of group_size consecutive columns)`` of a 2-D ``[C, K]``."""

    group_size: int = 32

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``[C, K]`` -> ``(C, K // group_size, group_size)``, a view."""
        return x.reshape(x.shape[0], x.shape[1] // self.group_size, self.group_size)

    def unblocks(self, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Inverse of ``blocks``."""
        return blocks.reshape(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], shape[1] // self.group_size)


@dataclass(frozen=True)
class PerToken:
    """One scale and zero point per row: the trailing ``num_nonbatch_dims`` dims form a row."""

    num_nonbatch_dims: int = 1

    def rows(self, x: np.ndarray) -> np.ndarray:
        """``x`` -> ``(M, row_len)``: ``M`` = product of the leading (batch) dims."""
        lead = x.shape[: x.ndim - self.num_nonbatch_dims]
        return x.reshape(int(np.prod(lead, dtype=np.int64)), -1)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (int(np.prod(shape[: len(shape) - self.num_nonbatch_dims], dtype=np.int64)),)
