"""Granularities: which elements share one scale, as small frozen dataclasses.

Each granularity reshapes a tensor into blocks ``(n_blocks, block)`` whose last axis
holds the elements that share a scale, and back.  The scale search and the quantizers
work on those blocks, whatever the scheme.

=================  ===========================  ==============================
granularity        ``blocks(x)``                scale shape
=================  ===========================  ==============================
``PerTensor()``    ``(1, x.size)``              ``()``
``PerChannel(a)``  ``(C, x.size // C)``         ``(C,)``, ``C = x.shape[a]``
``PerGroup(g)``    ``(C * K // g, g)``          ``(C, K // g)`` for 2-D ``[C, K]``
``PerToken(n)``    ``(M, row)``: ``rows(x)``    ``(M,)``, M = product of the batch dims
=================  ===========================  ==============================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``x`` (any shape) -> ``(1, x.size)``, a view."""
        return x.reshape(1, -1)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of ``axis`` (non-negative, already checked against the rank)."""

    axis: int = 0

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``x`` -> ``(C, x.size // C)`` with ``C = x.shape[axis]``; a copy when axis != 0."""
        return np.moveaxis(x, self.axis, 0).reshape(x.shape[self.axis], -1)

    def unblocks(self, blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """Inverse of ``blocks``: ``(C, rest)`` -> ``shape``, C-contiguous."""
        moved = (shape[self.axis],) + shape[: self.axis] + shape[self.axis + 1 :]
        return np.ascontiguousarray(np.moveaxis(blocks.reshape(moved), 0, self.axis))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[self.axis],)


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``(row, group of group_size consecutive columns)`` of a 2-D ``[C, K]``."""

    group_size: int = 32

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """``[C, K]`` -> ``(C * K // group_size, group_size)``, a view; block ``c * K // g + j``
        is row ``c``, columns ``j * g`` to ``(j + 1) * g - 1``."""
        return x.reshape(-1, self.group_size)

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
