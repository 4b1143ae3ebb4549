"""Running a kernel over disjoint ranges of an array on every core.

The fast kernels (``schemes/kernels.py``, ``packing/int4.py``) cut their input into
ranges of whole chunks and hand each range to ``for_ranges``, which runs them on a
shared thread pool.  numpy's ufuncs and reductions release the GIL while they loop, so
two threads keep two cores busy.  Every range writes only its own slice of the output
arrays, so the result is the same bytes whatever the number of threads or the order in
which ranges finish.

The number of threads is ``XNNQUANT_NUM_THREADS`` when set, else the CPUs this process
may run on.  The calling thread is one of them: it takes ranges from the same list as
the pool's threads instead of waiting for them, so a pool thread that the system is slow
to wake (other processes on the cores, or two threads sharing one core) costs no more
than the ranges it does not take.  A range started from inside a range (a kernel calling
a kernel, or a caller that already quantizes layers in parallel) runs in its thread, so
the pool never waits on itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..errors import XnnquantError

#: Ranges handed out per thread: more than one, so a thread slowed by another process
#: does not hold up the rest for long.
RANGES_PER_THREAD = 4

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (process id, threads) the pool was made for
_worker = threading.local()


def num_threads() -> int:
    """Threads the kernels use: ``XNNQUANT_NUM_THREADS`` or the CPUs available (>= 1)."""
    given = os.environ.get("XNNQUANT_NUM_THREADS")
    if given is not None:
        try:
            n = int(given)
        except ValueError:
            n = 0
        if n < 1:
            raise XnnquantError(f"XNNQUANT_NUM_THREADS must be a positive integer: got {given!r}")
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _mark_worker() -> None:
    _worker.active = True


def _executor(threads: int) -> ThreadPoolExecutor:
    """The shared pool, made again after a fork (a child inherits no running threads)."""
    global _pool, _pool_key
    with _lock:
        if _pool is None or _pool_key != (os.getpid(), threads):
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="xnnquant", initializer=_mark_worker)
            _pool_key = (os.getpid(), threads)
        return _pool


def ranges(total: int, step: int, pieces: int) -> list[tuple[int, int]]:
    """``[0, total)`` cut into at most ``pieces`` ranges whose starts are multiples of ``step``."""
    if total <= 0:
        return []
    steps = -(-total // step)
    per = -(-steps // max(1, pieces)) * step
    return [(start, min(total, start + per)) for start in range(0, total, per)]


def for_ranges(kernel: Callable[[int, int], None], total: int, step: int) -> None:
    """Call ``kernel(start, stop)`` over ``[0, total)`` cut at multiples of ``step``.

    The ranges run on the calling thread and ``threads - 1`` pool threads, each taking
    the next range not yet taken, when there are several threads and several ranges;
    otherwise all in the calling thread.  The exception of the first range (in their
    order) that raises one is re-raised here: at once when the calling thread runs every
    range, after all have run when threads share them (so which one does not depend on
    the threads' timing).
    """
    threads = num_threads()
    parts = ranges(total, step, threads * RANGES_PER_THREAD if threads > 1 else 1)
    if threads == 1 or len(parts) <= 1 or getattr(_worker, "active", False):
        for start, stop in parts:
            kernel(start, stop)
        return
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()  # each range is taken once, by one thread
    for i in range(len(parts)):
        todo.put(i)
    raised: dict[int, Exception] = {}

    def take_ranges() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                kernel(*parts[i])
            except Exception as e:
                raised[i] = e

    helpers = [_executor(threads - 1).submit(take_ranges) for _ in range(min(threads, len(parts)) - 1)]
    _worker.active = True  # a range started from one of the caller's ranges runs in the caller
    try:
        take_ranges()
    finally:
        _worker.active = False
        for helper in helpers:
            helper.result()
    if raised:
        raise raised[min(raised)]
