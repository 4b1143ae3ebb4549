"""numpy's BLAS on one thread while xnnquant's own threads do the parallel work.

numpy's OpenBLAS runs every large enough product and factorization on threads of its
own, which wait for each other at every step of a blocked algorithm.  On a machine whose
cores are busy with other processes (or with torch's threads) each such wait can cost a
scheduler slice, so a Cholesky factorization with many small steps becomes hundreds of
times slower than on one thread (figures in docs/benchmarks.md, "Calibrated export time").
The activation-aware methods run many small factorizations and products, so they run
with numpy's BLAS on one thread (``one_blas_thread``) and spread their rows over the
cores themselves (``parallel.for_ranges``).

The limit goes through ``threadpoolctl`` when it is installed (the ``fast`` extra);
without it BLAS keeps its own threads.  The limit changes how fast, not what: the
tests compare the results both ways.
The limit is process-wide, held while any thread is inside ``one_blas_thread`` and
lifted when the last one leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.Lock()
_holders = 0
_restore: Any = None  # what threadpoolctl gives back to lift the limit
_controller: Any = None
_missing = False


def _threadpools() -> Any:
    """threadpoolctl's controller of the BLAS libraries loaded, or None without threadpoolctl."""
    global _controller, _missing
    if _controller is None and not _missing:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _missing = True
            return None
        _controller = ThreadpoolController()
    return _controller


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's BLAS on one thread inside the block (module docstring); nests, and may be
    entered by several threads at once."""
    global _holders, _restore
    with _lock:
        if _holders == 0:
            controller = _threadpools()
            _restore = None if controller is None else controller.select(user_api="blas").limit(limits=1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _restore is not None:
                _restore.restore_original_limits()
                _restore = None
