"""What ExecuTorch's runtime and its Python packages write to stderr, as xnnquant lets it through.

The runtime logs through its platform layer (``runtime/platform``): ``ET_LOG`` formats a
line and calls the PAL's ``emit_log_message``.  The executorch 1.4.1 wheel holds several
copies of that layer, each with its own PAL table: the pybindings' (``_portable_lib``,
which resolves it in ``libqnn_executorch_backend.so`` and sets it to print to
``std::cerr``), and one in each kernel library xnnquant loads (``libcustom_ops_aot_lib``:
the ``llama::`` kernels; ``libquantized_ops_aot_lib``), left at the default, which prints to
file descriptor 2.  ``quiet()`` registers one emitter in each copy loaded
(``register_pal``, the runtime's own hook for it, through ctypes):

    dropped   lines below Error (Debug, Info: e.g. the thread pool's cpuinfo probing on
              x86, "Failed to open midr file"), and the Error lines of ``BENIGN``, which
              the runtime logs on a path that then goes on correctly
    shown     every other line (Error, Fatal), on ``sys.stderr`` at once, in the runtime's
              own format: ``E executorch:file.cpp:123] message``

With ``XNNQUANT_RUNTIME_LOG=all`` in the environment, or inside ``every_line()`` (what
``xnnquant --verbose`` runs its command in), nothing is dropped.  The emitter is Python,
called with the GIL from the thread that logs: the kernels log from the thread that calls
them (the ``llama::`` kernels check their scratch memory before their parallel loop), as the
pybindings' own ``std::cerr`` redirect does.

Importing executorch imports torchao, which logs a warning for each optional native
library it does not find (CUDA kernels on a CPU wheel) and, through torch, one for each
enum it registers the deprecated way: ``quiet()`` makes that import with those two loggers
at Error.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: (file, message) of runtime Error lines that do not mean an error -> why.
BENIGN = {
    ("kernel_runtime_context.h", "No temp allocator provided"):
        "KernelRuntimeContext::allocate_temp without an allocator (torch's eager llama:: ops, the pybindings); "
        "llama::custom_sdpa then allocates its scratch itself (extension/llm/custom_ops/op_sdpa_impl.h)",
    ("platform.cpp", "register_pal() called multiple times"):
        "quiet() replacing the pybindings' emitter",
}
#: ExecuTorch's ``et_pal_log_level_t``: the level's letter.
SHOWN_LEVELS = frozenset("EF?")
#: The environment variable that lets every line through.
VERBOSE_VARIABLE = "XNNQUANT_RUNTIME_LOG"
#: The libraries' mangled ``executorch::runtime::register_pal(PalImpl)`` and
#: ``executorch::runtime::get_pal_impl()``.
REGISTER_PAL = "_ZN10executorch7runtime12register_palENS0_7PalImplE"
GET_PAL_IMPL = "_ZN10executorch7runtime12get_pal_implEv"

_EMIT = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                         ctypes.c_char_p, ctypes.c_size_t)


class _PalImpl(ctypes.Structure):
    """``executorch::runtime::PalImpl`` (runtime/platform/platform.h): null entries are left as
    they are by ``register_pal``."""

    _fields_ = [("init", ctypes.c_void_p), ("abort", ctypes.c_void_p), ("current_ticks", ctypes.c_void_p),
                ("ticks_to_ns_multiplier", ctypes.c_void_p), ("emit_log_message", ctypes.c_void_p),
                ("allocate", ctypes.c_void_p), ("free", ctypes.c_void_p), ("source_filename", ctypes.c_char_p)]


_EVERY_LINE = [False]  # set by ``every_line()``


@contextlib.contextmanager
def every_line() -> Iterator[None]:
    """Every runtime line through while the block runs (``xnnquant --verbose``)."""
    before = _EVERY_LINE[0]
    _EVERY_LINE[0] = True
    try:
        yield
    finally:
        _EVERY_LINE[0] = before


def shown(level: str, filename: str, message: str) -> bool:
    """Whether a runtime line reaches stderr (module docstring)."""
    if _EVERY_LINE[0] or os.environ.get(VERBOSE_VARIABLE, "") == "all":
        return True
    if level not in SHOWN_LEVELS:
        return False
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    return not any(name == file and message.startswith(text) for file, text in BENIGN)


def _emit(timestamp: int, level: int, filename: bytes | None, function: bytes | None, line: int,
          message: bytes | None, length: int) -> None:
    letter = chr(level) if 0 < level < 128 else "?"
    name = (filename or b"").decode("utf-8", "replace")
    text = (message or b"").decode("utf-8", "replace")
    if shown(letter, name, text):
        try:
            sys.stderr.write(f"{letter} executorch:{name}:{line}] {text}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # no stderr (closed, or at shutdown): the line is lost
            pass


_CALLBACK = _EMIT(_emit)  # kept for the life of the process: the libraries call it
_DONE: set[str] = set()
#: (register_pal, the emitter it had) of each library done: put back at exit, so that no
#: line logged while the process ends calls into a finished interpreter.
_BEFORE: list[tuple[Any, int]] = []


def _libraries() -> list[Path]:
    """The loaded ExecuTorch libraries with a copy of the platform layer: the pybindings' (its
    symbols resolve in its dependencies) and the kernel libraries imported so far."""
    found = []
    for module, pattern in (("executorch.extension.pybindings._portable_lib", None),
                            ("executorch.extension.llm.custom_ops.custom_ops", "libcustom_ops_aot_lib.*"),
                            ("executorch.kernels.quantized", "libquantized_ops_aot_lib.*"),
                            ("executorch.extension.llm.runner._llm_runner", None)):
        loaded = sys.modules.get(module)
        where = getattr(loaded, "__file__", None)
        if where is None:
            continue
        if pattern is None:
            found.append(Path(where))
        else:
            found.extend(sorted(Path(where).parent.glob(pattern))[:1])
    return found


@contextlib.contextmanager
def _fd2_dropped() -> Iterator[None]:
    """File descriptor 2 sent nowhere for the block (the one line ``register_pal`` logs through
    the emitter it replaces)."""
    sys.stderr.flush()
    saved = os.dup(2)
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(sink, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(sink)


@contextlib.contextmanager
def _loggers_at_error(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def quiet_imports() -> None:
    """Import torchao (which executorch imports) with its optional-library warnings and
    torch's pytree deprecation warning held back (module docstring)."""
    if "torchao" in sys.modules:
        return
    with _loggers_at_error("torchao", "torch.utils._pytree"), contextlib.suppress(ImportError):
        import torchao.prototype.mx_formats.config  # noqa: F401  (torchao, and an enum it registers so)


def quiet() -> None:
    """Put the filtering emitter into every loaded ExecuTorch library not done yet (module
    docstring); quiet imports first.  Does nothing where a library lacks the hook."""
    quiet_imports()
    for path in _libraries():
        key = str(path)
        if key in _DONE:
            continue
        _DONE.add(key)
        try:
            library = ctypes.CDLL(key)
            register, current = getattr(library, REGISTER_PAL), getattr(library, GET_PAL_IMPL)
        except (OSError, AttributeError):  # another build of ExecuTorch: its log as it is
            continue
        register.argtypes, register.restype = [_PalImpl], ctypes.c_bool
        current.argtypes, current.restype = [], ctypes.POINTER(_PalImpl)
        before = current().contents.emit_log_message
        if not _BEFORE:
            atexit.register(_put_back)
        _BEFORE.append((register, before))
        with _fd2_dropped():
            register(_table(ctypes.cast(_CALLBACK, ctypes.c_void_p).value))


def _table(emit: int | None) -> _PalImpl:
    return _PalImpl(None, None, None, None, emit, None, None, b"xnnquant/pte/runtime_log.py")


def _put_back() -> None:
    for register, before in _BEFORE:
        register(_table(before))  # logs "register_pal() called multiple times" through ours: BENIGN
    _BEFORE.clear()
