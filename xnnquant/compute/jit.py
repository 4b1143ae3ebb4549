"""Compiled inner loops, when numba is installed.

The quantizers' kernels (``schemes/kernels.py``, ``packing/int4.py``, ``schemes/search.py``)
cut their input into cache-sized pieces and run each piece through a few steps.  In
numpy every step is its own pass over the piece (``abs``, ``max``, ``multiply``,
``rint``, ``clip``, cast, ...); numba runs the steps over the piece in cache, each block
as whole vectors (``compute.loops``, ``compute.vectors``), which saves the passes' memory
traffic and most of their instructions (docs/benchmarks.md, "Performance", gives the
speed-up).

Both paths give the same bits: the loops do the same float32 operations in the same
order (see ``compute.loops``), and the tests run every kernel both ways and compare.
numba is optional (the ``fast`` extra); without it, or with ``XNNQUANT_JIT=0`` in the
environment, every kernel takes its numpy path.  Loops are compiled on first use and
cached on disk by numba.
"""

from __future__ import annotations

import os
from types import ModuleType

_loaded: ModuleType | None = None
_missing = False


def loops() -> ModuleType | None:
    """The module of compiled loops, or None when numba is absent or ``XNNQUANT_JIT=0``."""
    global _loaded, _missing
    if os.environ.get("XNNQUANT_JIT", "1") == "0" or _missing:
        return None
    if _loaded is None:
        try:
            from . import loops as compiled
        except ImportError:
            _missing = True
            return None
        _loaded = compiled
    return _loaded
