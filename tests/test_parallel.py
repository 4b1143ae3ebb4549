"""compute.parallel.for_ranges: every range once, the caller among the threads, errors in range order."""

from __future__ import annotations

import threading

import pytest

from xnnquant.compute.parallel import for_ranges, ranges


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("XNNQUANT_NUM_THREADS", str(request.param))
    return int(request.param)


def test_every_range_runs_once(threads: int) -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def kernel(start: int, stop: int) -> None:
        with lock:
            seen.append((start, stop))

    for_ranges(kernel, 1000, 7)
    assert sorted(seen) == ranges(1000, 7, threads * 4 if threads > 1 else 1)
    covered = sorted(i for start, stop in seen for i in range(start, stop))
    assert covered == list(range(1000))


def test_the_caller_takes_ranges_too(threads: int) -> None:
    caller = threading.get_ident()
    runners: set[int] = set()

    def kernel(start: int, stop: int) -> None:
        runners.add(threading.get_ident())

    for_ranges(kernel, 10, 1)
    assert len(runners) <= threads
    if threads == 1:
        assert runners == {caller}


def test_the_first_range_s_error_is_raised_after_every_range_ran(threads: int) -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def kernel(start: int, stop: int) -> None:
        with lock:
            ran.append(start)
        for i in range(start, stop):
            if i in (3, 5, 8):
                raise ValueError(f"value {i}")

    with pytest.raises(ValueError, match="value 3"):
        for_ranges(kernel, 10, 1)
    if threads > 1:  # the threads share the ranges: all run, whichever thread meets the errors
        assert sorted(ran) == [start for start, _ in ranges(10, 1, threads * 4)]


def test_ranges_started_from_a_range_run_in_its_thread(threads: int) -> None:
    inner: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def outer(start: int, stop: int) -> None:
        me = threading.get_ident()
        for row in range(start, stop):

            def kernel(lo: int, hi: int, row: int = row) -> None:
                with lock:
                    inner.extend((4 * row + i, threading.get_ident() == me) for i in range(lo, hi))

            for_ranges(kernel, 4, 1)

    for_ranges(outer, 6, 1)
    assert sorted(i for i, _ in inner) == list(range(24))
    assert all(same for _, same in inner)
