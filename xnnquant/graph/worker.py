"""Running payloads on the real runtime in a child process: a crash becomes an error.

``run(payload, inputs, isolate=True)`` sends the work to one long-lived worker process
(``python -m xnnquant.graph.worker``), started on first use and reused by later calls:
it imports torch and executorch once and keeps its own cache of loaded programs.  When
the runtime kills the worker (a signal such as SIGSEGV from a payload that slipped past
validation), the caller gets ``RuntimeCrashError`` with the signal and the runtime's
last log lines, and the next call starts a new worker.  A call that does not answer
within ``timeout`` seconds stops the worker and raises ``RuntimeTimeoutError``.
``worker().call(function, args)`` isolates other work on the runtime the same way
(``pte_run.verify_pte(..., isolate=True)``).

How a call travels::

    parent                                          worker
    ------                                          ------
    load + validate + check inputs (numpy only)
    inputs -> data file (mmap, 64-byte aligned)
    request (pickle, worker's stdin) ------------>  maps the inputs (no copy), runs the
                                                    payload, writes each output into
                                                    its slot of the data file
    outputs <- data file (one copy) <------------   reply (pickle, the worker's stdout)

The data file lives in ``/dev/shm`` where there is one (memory, not disk).  Its layout
for a call: each input, then each output, each at an offset that is a multiple of 64,
in external-id order.  The worker's own stdout is moved to its stderr on start (native
code may print), and its stderr goes to a log file that the parent reads on a crash
(and ``xnnquant verify --verbose`` shows); the log never reaches the caller's terminal.
"""

from __future__ import annotations

import atexit
import faulthandler
import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..constants import XNN_ALLOCATION_ALIGNMENT
from ..errors import RuntimeCrashError, RuntimeTimeoutError, XnnquantError
from .program import _log_summary

#: Seconds a call may take (building the program, XNNPACK's weight packing, execution)
#: before the worker is stopped; also the limit for a worker to start.
DEFAULT_TIMEOUT = 300.0

_HEADER = struct.Struct("<Q")  # length of each pickled message


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _slots(specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> tuple[list[int], int]:
    """Offsets of consecutive arrays, each aligned to XNNPACK's allocation alignment (64),
    and the total size."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        end += -(-max(nbytes, 1) // XNN_ALLOCATION_ALIGNMENT) * XNN_ALLOCATION_ALIGNMENT
    return offsets, max(end, XNN_ALLOCATION_ALIGNMENT)


def _view(buffer: Any, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; ``None`` at end of file; ``TimeoutError`` past ``deadline``."""
    chunks, remaining = [], n
    while remaining:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None) -> tuple[bool, Any]:
    """``(True, message)``, or ``(False, None)`` when the other side has gone."""
    header = _read_exactly(fd, _HEADER.size, deadline)
    if header is None:
        return False, None
    body = _read_exactly(fd, _HEADER.unpack(header)[0], deadline)
    if body is None:
        return False, None
    return True, pickle.loads(body)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


class Worker:
    """One child process running payloads; restarted after a crash or a timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._data: IO[bytes] | None = None
        self._call_log = ""
        self.starts = 0  # how many processes this worker has started (for tests and benchmarks)

    # -- process life -------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        import xnnquant

        # both live as long as the worker process; stop() closes them
        self._log = tempfile.TemporaryFile(prefix="xnnquant-worker-", suffix=".log")  # noqa: SIM115
        data = tempfile.NamedTemporaryFile(prefix="xnnquant-worker-", suffix=".data", dir=_shm_dir())  # noqa: SIM115
        self._data, self._call_log = data, data.name + ".call.log"
        package_root = str(Path(xnnquant.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "xnnquant.graph.worker", data.name, self._call_log],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
        )
        self.starts += 1
        self._exchange(None, timeout, "starting")

    def stop(self) -> None:
        """End the worker process (it is started again on the next call)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            assert proc.stdin is not None and proc.stdout is not None
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # the worker exits at end of input
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
            else:
                proc.stdin.close()
            proc.stdout.close()
        for f in (self._log, self._data):
            if f is not None:
                f.close()
        self._log = self._data = None
        if self._call_log:
            Path(self._call_log).unlink(missing_ok=True)

    def log_text(self) -> str:
        """Everything the worker process has logged so far (torch, executorch, XNNPACK)."""
        parts = []
        if self._log is not None:
            self._log.seek(0)
            parts.append(self._log.read().decode("utf-8", "replace"))
        if self._call_log and os.path.exists(self._call_log):
            parts.append(Path(self._call_log).read_text("utf-8", "replace"))
        return "".join(parts)

    # -- one call -----------------------------------------------------------------------

    def _exchange(self, request: Any, timeout: float | None, doing: str) -> Any:
        """Send ``request`` (``None``: only wait for the start-up message), return the reply."""
        assert self._proc is not None and self._log is not None
        assert self._proc.stdin is not None and self._proc.stdout is not None
        log_start = self._log.seek(0, os.SEEK_END)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if request is not None:
                _send(self._proc.stdin, request)
            alive, reply = _receive(self._proc.stdout.fileno(), deadline)
        except TimeoutError:
            log = self._log_since(log_start)
            self._proc.kill()
            self.stop()
            raise RuntimeTimeoutError(
                f"the isolated runtime did not finish {doing} within {timeout:g} s: stopped it "
                f"(pass a larger timeout= if the work is that slow); runtime log: {_log_summary(log)}"
            ) from None
        except (BrokenPipeError, ConnectionResetError):
            alive, reply = False, None
        if not alive:
            try:
                code = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            log = self._log_since(log_start)
            self.stop()
            how = (f"was killed by signal {_signal_name(-code)} ({-code})" if code < 0
                   else f"exited with status {code}")
            raise RuntimeCrashError(
                f"the runtime process {how} while {doing}: the runtime crashes on it "
                f"(the calling process is unharmed); runtime log: {_log_summary(log)}",
                signal_number=-code if code < 0 else None, log=log,
            )
        status, value = reply
        if status == "error":
            kind, message = value
            raise _error_class(kind)(message)
        return value

    def _log_since(self, offset: int) -> str:
        assert self._log is not None
        self._log.seek(offset)
        text = self._log.read().decode("utf-8", "replace")
        if self._call_log and os.path.exists(self._call_log):
            text += Path(self._call_log).read_text("utf-8", "replace")
        return text

    def run(self, payload: bytes, named_data: Mapping[str, bytes] | None, validate: bool,
            inputs: list[np.ndarray], outputs: list[tuple[tuple[int, ...], np.dtype]],
            timeout: float | None) -> list[np.ndarray]:
        """Outputs of ``payload`` for checked ``inputs``; ``outputs``: expected (shape, dtype)."""
        with self._lock:
            self._ensure_started(timeout)
            assert self._data is not None
            specs = [(a.shape, a.dtype) for a in inputs] + [(s, np.dtype(d)) for s, d in outputs]
            offsets, size = _slots(specs)
            if os.fstat(self._data.fileno()).st_size < size:
                os.ftruncate(self._data.fileno(), size)
            with mmap.mmap(self._data.fileno(), size) as mm:
                for a, offset in zip(inputs, offsets):
                    _view(mm, offset, a.shape, a.dtype)[...] = a
                request = {
                    "payload": payload, "named_data": dict(named_data) if named_data else None,
                    "validate": validate, "size": size,
                    "inputs": [(o, a.shape, a.dtype.str) for o, a in zip(offsets, inputs)],
                    "outputs": [(o, tuple(s), np.dtype(d).str) for o, (s, d) in zip(offsets[len(inputs):], outputs)],
                }
                self._exchange(request, timeout, "running the payload")
                return [np.array(_view(mm, o, tuple(s), np.dtype(d)), copy=True)
                        for o, (s, d) in zip(offsets[len(inputs):], outputs)]

    def call(self, function: Callable[..., Any], args: tuple[Any, ...], timeout: float | None, doing: str) -> Any:
        """``function(*args)`` in the worker process: its log, crashes and timeout handled as
        ``run``'s.  ``function``: a module-level function (pickled by name); ``args`` and
        the result are pickled; ``doing``: what it does, for the error messages."""
        with self._lock:
            self._ensure_started(timeout)
            return self._exchange({"call": function, "args": args}, timeout, doing)

    def _ensure_started(self, timeout: float | None) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self.stop()
            self._start(DEFAULT_TIMEOUT if timeout is None else max(timeout, DEFAULT_TIMEOUT))


def _error_class(name: str) -> type[XnnquantError]:
    from .. import errors

    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, XnnquantError) else XnnquantError


_worker: Worker | None = None
_worker_lock = threading.Lock()


def worker() -> Worker:
    """The process-wide worker (created on first use, stopped at interpreter exit)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = Worker()
            atexit.register(_worker.stop)
        return _worker


# ------------------------------------------------------------------ the child side


def _serve(data_path: str, call_log: str) -> None:
    """The worker's loop: one request at a time from stdin, replies on the original stdout."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything native code prints goes to the log, not into the replies
    faulthandler.enable()  # a crash leaves the Python stack (where it happened) in the log
    from . import program

    program._CALL_LOG = call_log
    try:
        program._import_torch_executorch()
        _send(channel, ("ok", "ready"))
    except XnnquantError as exc:
        _send(channel, ("error", (type(exc).__name__, str(exc))))
        return
    data = open(data_path, "r+b")  # noqa: SIM115 - open for the worker's lifetime
    stdin = sys.stdin.buffer.fileno()
    mapped: tuple[int, mmap.mmap] | None = None
    while True:
        alive, request = _receive(stdin, None)
        if not alive:
            return
        try:
            if "call" in request:  # Worker.call
                reply: Any = ("ok", request["call"](*request["args"]))
            else:
                mapped = _run_request(request, data, mapped)
                reply = ("ok", None)
        except XnnquantError as exc:
            reply = ("error", (type(exc).__name__, str(exc)))
        except Exception as exc:
            reply = ("error", ("XnnquantError", f"the isolated runtime failed: {type(exc).__name__}: {exc}"))
        _send(channel, reply)


def _run_request(request: dict[str, Any], data: IO[bytes],
                 mapped: tuple[int, mmap.mmap] | None) -> tuple[int, mmap.mmap]:
    """One ``Worker.run`` request, its inputs read from and its outputs written into the
    data file; returns the mapping of the data file, kept for the next request."""
    from .program import _run_in_process

    if mapped is None or mapped[0] != request["size"]:
        # a mapping is not closed: the runtime may still hold views of the last one,
        # which is unmapped once they are gone
        mapped = (request["size"], mmap.mmap(data.fileno(), request["size"]))
    mm = mapped[1]
    arrays = [_view(mm, o, tuple(s), np.dtype(d)) for o, s, d in request["inputs"]]
    slots = [_view(mm, o, tuple(s), np.dtype(d)) for o, s, d in request["outputs"]]
    _run_in_process(request["payload"], arrays, request["named_data"], request["validate"], into=slots)
    return mapped


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])
