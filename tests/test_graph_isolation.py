"""``run(..., isolate=True)``: the real runtime in a worker process.

Oracle: the same payload run in this process (same CPU, same kernels: bit-identical
outputs), and a payload known to kill ExecuTorch 1.4.1 (argmax pooling whose indices
output is never used: SIGSEGV; see ``oracles/runtime_refusals.py``), written without
validation.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import PayloadError, RuntimeCrashError, RuntimeTimeoutError, UnsupportedConfigError
from xnnquant.graph import Graph, run
from xnnquant.graph.worker import _slots, worker

pytestmark = pytest.mark.xnnpack

sys.path.insert(0, str(Path(__file__).parent / "oracles"))
from runtime_refusals import argmax_unused_indices, unchecked_bytes  # noqa: E402


def _mlp(seed: int = 0) -> tuple[Graph, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    g = Graph()
    x = g.input((5, 64))
    w = xq.quantize_blockwise(rng.standard_normal((24, 64)).astype(np.float32), group_size=32)
    h = g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(w), g.constant(np.ones(24, np.float32)))
    g.output(g.sigmoid(h))
    g.output(g.convert(g.input((2, 3)), xq.Datatype.fp16))
    return g, [rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)]


def test_slots_are_aligned_and_disjoint() -> None:
    offsets, size = _slots([((3,), np.dtype(np.float32)), ((0,), np.dtype(np.int8)), ((2, 33), np.dtype(np.int64))])
    assert offsets == [0, 64, 128] and size == 128 + 576  # 12 -> 64, empty -> 64, 528 -> 576


def test_isolated_outputs_equal_in_process_outputs() -> None:
    g, inputs = _mlp()
    here = run(g, inputs)
    there = run(g, inputs, isolate=True)
    assert [(a.dtype, a.shape) for a in there] == [(np.dtype(np.float32), (5, 24)), (np.dtype(np.float16), (2, 3))]
    for a, b in zip(here, there):
        np.testing.assert_array_equal(a, b)  # same CPU, same kernels: the same bits
    again = run(g, [inputs[0] * 2, inputs[1]], isolate=True)
    assert not np.shares_memory(again[0], there[0])
    np.testing.assert_array_equal(again[0], run(g, [inputs[0] * 2, inputs[1]])[0])


def test_isolated_errors_are_the_in_process_errors() -> None:
    g, inputs = _mlp()
    with pytest.raises(xq.XnnquantError, match="one array per external input"):
        run(g, inputs[:1], isolate=True)
    with pytest.raises(PayloadError, match="identifier"):
        broken = bytearray(g.to_bytes())
        broken[36:40] = b"XNzz"
        run(bytes(broken), inputs, validate=False, isolate=True)
    sdpa = Graph()
    q = sdpa.input((1, 2, 4, 8))
    sdpa.output(sdpa.scaled_dot_product_attention(q, q, q, sdpa.constant(np.ones(8, np.float32)),
                                                  sdpa.constant(np.zeros((4, 4), np.float32))))
    with pytest.raises(UnsupportedConfigError, match=r"refused the payload.*XNNCompiler"):
        run(sdpa.to_bytes(), [np.ones((1, 2, 4, 8), np.float32)], validate=False, isolate=True)


def test_a_runtime_crash_is_an_error_and_the_next_run_works() -> None:
    crashing = unchecked_bytes(argmax_unused_indices())
    with pytest.raises(xq.XnnquantError, match="ArgMaxPooling2d"):  # validation guards it
        run(crashing, [np.ones((1, 4, 4, 2), np.float32)], isolate=True)
    g, inputs = _mlp(1)
    run(g, inputs, isolate=True)  # the worker is up (run alone, this test would count its first start)
    starts = worker().starts
    with pytest.raises(RuntimeCrashError, match=r"killed by signal SIGSEGV \(11\).*runtime log: .+") as info:
        run(crashing, [np.ones((1, 4, 4, 2), np.float32)], validate=False, isolate=True)
    assert info.value.signal_number == signal.SIGSEGV
    # the worker's fault handler writes the log; two of XNNPACK's threads can fault at once and
    # cut into each other's lines ("Fatal Python error: Fatal Python error: Segmentation fault...",
    # or the first words alone), measured on a 2-core Xeon
    assert info.value.log.startswith("Fatal Python error: ")
    np.testing.assert_array_equal(run(g, inputs, isolate=True)[0], run(g, inputs)[0])
    assert worker().starts == starts + 1


def test_a_call_past_its_timeout_stops_the_worker() -> None:
    g, inputs = _mlp(2)  # a payload the worker has not loaded: building its program takes > 1 ms
    run(_mlp(3)[0], _mlp(3)[1], isolate=True)  # the worker is up before the clock starts
    with pytest.raises(RuntimeTimeoutError, match=r"did not finish running the payload within 0.001 s"):
        run(g, inputs, isolate=True, timeout=1e-3)
    assert worker()._proc is None


def test_a_call_in_the_worker_writes_to_its_log_and_may_crash(capfd: pytest.CaptureFixture) -> None:
    """``worker().call``: what the function writes to file descriptors 1 and 2 goes to the
    worker's log, not to this process's; a crash is ``RuntimeCrashError`` with that log."""
    capfd.readouterr()
    assert worker().call(os.write, (1, b"on stdout\n"), 60.0, "writing") == 10
    assert worker().call(os.write, (2, b"on stderr\n"), 60.0, "writing") == 10
    assert capfd.readouterr() == ("", "")
    assert "on stdout\non stderr\n" in worker().log_text()
    with pytest.raises(RuntimeCrashError, match=r"killed by signal SIGABRT \(6\) while aborting") as info:
        worker().call(os.abort, (), 60.0, "aborting")
    assert info.value.signal_number == signal.SIGABRT
    assert "Fatal Python error: Aborted" in info.value.log  # the worker's fault handler
