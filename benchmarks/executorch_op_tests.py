"""ExecuTorch's own XNNPACK operator tests, run through ``xq.export``.

ExecuTorch ships its XNNPACK operator tests in the wheel
(``executorch/backends/xnnpack/test/ops/test_*.py``): unittest classes that build small
modules and give them to ``executorch.backends.xnnpack.test.tester.Tester``, which then
exports, lowers, serializes and runs them.  This script reuses those modules and inputs as
a test corpus for xnnquant, in two steps:

1. **collect**: import every test module and run its test methods with ``Tester`` (and
   everything else they call to drive ExecuTorch's flow: the ``Export`` / ``Quantize``
   stages, ``torch.export.export``, ``to_edge_transform_and_lower``, torchao's
   ``quantize_``, ``prepare_pt2e``, the runtime) replaced by recorders.  Each ``Tester(...)``
   (or direct ``export(...)``) becomes one case: test id, module (put in eval mode as
   ``Tester`` does), example inputs, ``dynamic_shapes``, and whether the test quantizes.
   ExecuTorch's own pipeline never runs; the test's later checks fail on the recorders'
   placeholders, which ends that test method (its cases are already recorded).
2. **run**: for each case, ``xq.export(module, inputs, weights=...)``, then
   ``exported.run(*inputs)`` on the real runtime, compared with ``module(*inputs)`` in
   eager torch.  Cases run in a child process (one for the whole run, collected again
   there); when the runtime kills it, the case it was running is recorded as ``crash`` and
   a new child takes the remaining cases.

Only xnnquant's public API is used: ``xq.export``, ``Exported.run``, ``Exported.report``
(which scheme each weight took) and the error classes.

Classes of a case:

``pass``      every output within the bound (``check_outputs``)
``wrong``     an output outside it, or a different number / shape of outputs
``refused``   ``xq.export`` or ``run`` raised ``XnnquantError``: its first line (and the
              items it lists), grouped by ``cause`` (``refusal``)
``crash``     the child process died (a signal) or did not answer within ``--timeout``
``error``     any other exception (its type and message)

float32 cases are those whose floating-point tensors (inputs, parameters, buffers) are all
float32, whether or not the test then quantizes the module (xq.export gets the float
module, except for torchao's ``quantize_``, which runs: xq.export gets the module torchao
quantized, as ``Tester`` did); integer inputs stay in (xq.export refuses them).  Cases that put the module in
training mode are left out.  ``dynamic_shapes`` go to ``xq.export`` when it takes them;
otherwise the case is exported with the example inputs' static shapes (and says so).

The quantized modes (``--quantized``: ``qc8w`` with fallback ``fp32``, ``qb4w:32`` with
``qc8w`` then ``fp32``) run the same float32 cases; an export that quantized some weight is
judged on a looser bound over several inputs (``check_outputs``), one that quantized
nothing as in fp32.

Usage::

    python benchmarks/executorch_op_tests.py                 # float32 cases, weights fp32
    python benchmarks/executorch_op_tests.py --quantized     # also qc8w and qb4w:32 (fallbacks)
    python benchmarks/executorch_op_tests.py --json out.json --only test_conv2d
    python benchmarks/executorch_op_tests.py --list          # the collected cases, all dtypes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import json
import os
import pkgutil
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPS_PACKAGE = "executorch.backends.xnnpack.test.ops"
#: The repository this script belongs to: its ``xnnquant`` is the one measured (put first
#: on the child's path, and on this process's when run as a script).
REPO = Path(__file__).resolve().parents[1]

#: Relative bound of the float32 comparison (``check_outputs``), and the absolute floor.
FP32_RELATIVE = 1e-4
FP32_ABSOLUTE = 1e-6

#: Bounds of the quantized modes on the normalized RMS error (``check_outputs``), and
#: how many inputs a quantized export is judged on (the example inputs, then their values
#: shuffled: ``_shuffled_draws``).
QUANTIZED_RELATIVE_RMS = {"qc8w": 0.05, "qb4w:32": 0.25}
QUANTIZED_DRAWS = 8

#: The quantized modes: weights and the fallback schemes tried, in order, for layers
#: that cannot take them.
QUANTIZED_MODES = {"qc8w": ("fp32",), "qb4w:32": ("qc8w", "fp32")}

#: Seconds one case may take in the child (export + run) before it is stopped as a crash.
DEFAULT_TIMEOUT = 120.0


# ------------------------------------------------------------------------------------------
# collecting


@dataclass
class Case:
    """One module and its inputs, as a test gave them to ExecuTorch's ``Tester``."""

    id: str                   # "test_add::TestAdd::test_fp32_add", "#k" when a test made several
    file: str                 # "test_add"
    module: Any               # torch.nn.Module
    inputs: tuple[Any, ...]   # the example inputs, as given
    dynamic_shapes: Any = None
    quantizes: bool = False   # .quantize(), torchao quantize_ or prepare_pt2e on this case
    training: bool = False

    @property
    def dtypes(self) -> list[str]:
        return [str(x.dtype).removeprefix("torch.") if hasattr(x, "dtype") else type(x).__name__
                for x in self.inputs]

    @property
    def float32(self) -> bool:
        """Every floating-point tensor (inputs, parameters, buffers) is float32 (the test may
        go on to quantize the module: its float module is still a float32 case)."""
        import torch

        if self.training:
            return False
        tensors = [x for x in self.inputs if isinstance(x, torch.Tensor)]
        if isinstance(self.module, torch.nn.Module):
            tensors += list(self.module.parameters()) + list(self.module.buffers())
        return all(t.dtype == torch.float32 for t in tensors if t.dtype.is_floating_point)


class _Placeholder:
    """Stands for whatever ExecuTorch's flow would have returned: every attribute, call,
    index and context gives the placeholder back; it iterates as empty."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getitem__(self, key: Any) -> Any:
        return self

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _Recording:
    """The cases recorded so far and the test being run."""

    def __init__(self) -> None:
        self.cases: list[Case] = []
        self.test_id = ""
        self.quantized_modules: list[Any] = []  # modules given to torchao's quantize_ (kept: ids stay unique)

    def add(self, module: Any, inputs: Any, dynamic_shapes: Any = None, training: bool = False) -> Case:
        import torch

        if isinstance(module, torch.nn.Module):
            module.train(training)
        file = self.test_id.split("::", 1)[0]
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        quantizes = any(m is module for m in self.quantized_modules)
        with contextlib.suppress(Exception):  # a copy, in case the test changes them later (dtype, weights)
            module, inputs = copy.deepcopy((module, inputs))
        case = Case(self.test_id, file, module, inputs, dynamic_shapes, quantizes, training)
        self.cases.append(case)
        return case


_recording = _Recording()


class _RecordingTester(_Placeholder):
    """In place of ``Tester``: records the case, then accepts any stage as a no-op."""

    def __init__(self, module: Any, example_inputs: Any, dynamic_shapes: Any = None, training: bool = False,
                 **kwargs: Any) -> None:
        self.case = _recording.add(module, example_inputs, dynamic_shapes, training)
        self.stages = _Placeholder()

    def quantize(self, *args: Any, **kwargs: Any) -> _RecordingTester:
        self.case.quantizes = True
        return self

    def export(self, export_stage: Any = None) -> _RecordingTester:
        if isinstance(export_stage, _RecordingExport) and export_stage.dynamic_shapes is not None:
            self.case.dynamic_shapes = export_stage.dynamic_shapes
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Step(self)


class _Step(_Placeholder):
    """A stage or check of a recording tester: calling it gives the tester back (chains go
    on); anything else is a placeholder."""

    def __init__(self, tester: _RecordingTester) -> None:
        self._tester = tester

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tester


class _RecordingExport(_Placeholder):
    """In place of the ``Export`` stage: keeps its ``dynamic_shapes``."""

    def __init__(self, dynamic_shapes: Any = None, **kwargs: Any) -> None:
        self.dynamic_shapes = dynamic_shapes


class _RecordingStage(_Placeholder):
    """In place of the other stages (``Quantize``, ``ToEdgeTransformAndLower``, ...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _RecordedProgram(_Placeholder):
    """What a test's own ``torch.export.export`` call returns: the case it recorded."""

    def __init__(self, case: Case) -> None:
        self.case = case


def _record_export(module: Any, args: Any = (), kwargs: Any = None, *, dynamic_shapes: Any = None,
                   **options: Any) -> _RecordedProgram:
    if isinstance(module, _Placeholder):  # an export of something already recorded (converted_pt2e)
        return _RecordedProgram(module.case) if isinstance(module, _RecordedProgram) else module
    return _RecordedProgram(_recording.add(module, args, dynamic_shapes))


def _record_quantize_(module: Any, *args: Any, **kwargs: Any) -> None:
    """torchao's ``quantize_``, for real: the test then gives ``Tester`` the module torchao
    quantized, which ``xq.export`` takes with torchao's codes (or refuses by layer)."""
    from torchao.quantization import quantize_

    _recording.quantized_modules.append(module)
    quantize_(module, *args, **kwargs)


def _record_prepare_pt2e(program: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(program, _RecordedProgram):
        program.case.quantizes = True
    return program


#: Names a test module may import, and what stands for them while collecting.
_STAND_INS: dict[str, Any] = {
    "Tester": _RecordingTester,
    "Export": _RecordingExport,
    "Quantize": _RecordingStage,
    "RunPasses": _RecordingStage,
    "ToEdge": _RecordingStage,
    "ToEdgeTransformAndLower": _RecordingStage,
    "Partition": _RecordingStage,
    "Serialize": _RecordingStage,
    "ToExecutorch": _RecordingStage,
    "export": _record_export,
    "to_edge_transform_and_lower": lambda *args, **kwargs: _Placeholder(),
    "to_edge": lambda *args, **kwargs: _Placeholder(),
    "quantize_": _record_quantize_,
    "prepare_pt2e": _record_prepare_pt2e,
    "prepare_qat_pt2e": _record_prepare_pt2e,
    "convert_pt2e": lambda program, *args, **kwargs: program,
    "Runtime": _Placeholder(),
}


@contextlib.contextmanager
def _stand_ins(module: Any) -> Iterator[None]:
    """The module's imported drivers and ``torch.export.export`` replaced by recorders."""
    import torch

    saved = {name: getattr(module, name) for name in _STAND_INS if hasattr(module, name)}
    real_export = torch.export.export
    try:
        for name in saved:
            setattr(module, name, _STAND_INS[name])
        torch.export.export = _record_export
        yield
    finally:
        torch.export.export = real_export
        for name, value in saved.items():
            setattr(module, name, value)


class _Suppressing(_Placeholder):
    """What ``assertRaises`` and its kin return while collecting: a context that swallows
    any exception (ExecuTorch's flow, which would raise, does not run)."""

    def __exit__(self, *exc: Any) -> bool:  # type: ignore[override]
        return True


def _lenient(name: str) -> Any:
    if any(word in name for word in ("Raises", "Warns", "Logs")):
        def expect(self: Any, *args: Any, **kwargs: Any) -> Any:
            if len(args) > 1 and callable(args[1]):  # assertRaises(error, function, *args)
                with contextlib.suppress(Exception):
                    args[1](*args[2:], **kwargs)
                return None
            return _Suppressing()
        return expect
    return lambda self, *args, **kwargs: None


@contextlib.contextmanager
def _lenient_checks() -> Iterator[None]:
    """``TestCase.assert*`` and ``fail`` as no-ops: a test's checks of ExecuTorch's artifacts
    (placeholders here) must not end it before it has made all its cases."""
    names = [n for n in vars(unittest.TestCase) if n.startswith(("assert", "fail")) and n != "failureException"
             and callable(getattr(unittest.TestCase, n))]
    saved = {n: vars(unittest.TestCase)[n] for n in names}
    try:
        for n in names:
            setattr(unittest.TestCase, n, _lenient(n))
        yield
    finally:
        for n, value in saved.items():
            setattr(unittest.TestCase, n, value)


def _import_without_asserts(name: str) -> Any:
    """Test module ``name``, its ``assert`` statements compiled out (``optimize=1``): like
    the ``assert*`` methods, they check what ExecuTorch's flow made, which does not run."""
    import types

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None and spec.origin is not None
    source = spec.loader.get_source(name)  # type: ignore[attr-defined]
    module = types.ModuleType(name)
    module.__file__, module.__package__, module.__spec__ = spec.origin, name.rpartition(".")[0], spec
    sys.modules[name] = module  # classes and dataclasses look their module up by name
    exec(compile(source, spec.origin, "exec", optimize=1), module.__dict__)
    return module


def _test_methods(module: Any) -> list[unittest.TestCase]:
    def flatten(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
        for item in suite:
            if isinstance(item, unittest.TestSuite):
                yield from flatten(item)
            else:
                yield item

    return list(flatten(unittest.defaultTestLoader.loadTestsFromModule(module)))


@dataclass
class Collection:
    """Every recorded case, and what the test methods did under the recorders."""

    cases: list[Case]
    skipped: dict[str, str] = field(default_factory=dict)   # test id -> unittest's skip reason
    stopped: dict[str, str] = field(default_factory=dict)   # test id -> what ended it (a check on a placeholder)
    files: list[str] = field(default_factory=list)


def collect(only: Sequence[str] = ()) -> Collection:
    """Run every test method of ExecuTorch's XNNPACK op tests under the recorders.

    ``only``: test-file names (``"test_add"``) to restrict to.  Each test method starts
    from the same seeds (torch, numpy, random), so a collection in another process gives
    the same cases, inputs included.
    """
    import numpy as np
    import torch

    package = importlib.import_module(OPS_PACKAGE)
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("test_"))
    result = Collection([], files=[n for n in names if not only or n in only])
    for name in result.files:
        module = _import_without_asserts(f"{OPS_PACKAGE}.{name}")
        with _stand_ins(module), _lenient_checks():
            for test in _test_methods(module):
                cls, method = type(test).__name__, test._testMethodName
                test_id = f"{name}::{cls}::{method}"
                _recording.test_id = test_id
                first = len(_recording.cases)
                torch.manual_seed(0)
                np.random.seed(0)  # noqa: NPY002  (the tests may draw from the legacy global generator)
                random.seed(0)
                outcome = unittest.TestResult()
                with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                    test.run(outcome)
                for _, reason in outcome.skipped:
                    result.skipped[test_id] = reason
                for _, text in outcome.errors + outcome.failures:
                    result.stopped[test_id] = text.strip().splitlines()[-1]
                made = _recording.cases[first:]
                if len(made) > 1:
                    for k, case in enumerate(made):
                        case.id = f"{test_id}#{k}"
    result.cases, _recording.cases, _recording.quantized_modules = _recording.cases, [], []
    torch._dynamo.reset()
    return result


# ------------------------------------------------------------------------------------------
# running one case (in the child process)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


_SHAPE = re.compile(r"\([\d, ]*\)")  # a shape in a message: (1, 2, 8)


def refusal(message: str) -> tuple[str, str]:
    """``(reason, cause)`` of an ``XnnquantError`` message.

    ``reason``: the first line, followed by the items it announces when it is a list
    (``export refused 2 node(s) or layer(s):`` then ``  - op (node n, module m): why``).
    ``cause``: the same without what varies between cases (node names, shapes, the text
    after the first colon of each item), to group cases by.
    """
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "", ""
    items = [line[2:] for line in lines[1:] if line.startswith("- ")]
    if not (lines[0].endswith(":") and items):
        return lines[0], _SHAPE.sub("(...)", lines[0].split(": ", 1)[0])
    causes = []
    for item in items:
        op, _, rest = item.partition(" (node ")
        why = rest.split("): ", 1)[-1] if rest else op
        causes.append(f"{op}: {_SHAPE.sub('(...)', why.split(': ', 1)[0])}")
    return lines[0] + " " + "; ".join(items), " + ".join(dict.fromkeys(causes))


def _clone(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    import torch

    return tuple(x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in inputs)


def check_outputs(expected: Sequence[Any], got: Sequence[Any], weights: str, quantized: bool) -> dict[str, Any]:
    """Compare the runtime's outputs ``got`` with the eager module's ``expected`` (float64).

    Both must have the same number of outputs, the same shapes, NaN at the same places and
    the same infinities.  Then, on the finite values:

    * float32 weights (and a quantized mode whose export quantized nothing): the largest
      error must be within ``FP32_RELATIVE * max|expected| + FP32_ABSOLUTE``.  These ops are
      small (sums of at most a few hundred terms, unary functions of one value): a float32
      result computed in another order or with another polynomial is off by a few units of
      float32 (2^-24 = 6e-8) times the magnitudes involved, far below 1e-4 of the output's
      magnitude.  The bound is relative to the largest output, not to each element: exp,
      softmax or log give elements near zero whose own relative error is large while their
      absolute error stays at the output's scale.  The floor of 1e-6 (8 ulp of 1.0) admits
      outputs that are all (near) zero, computed from O(1) inputs (the tests use randn).
    * quantized weights: the normalized RMS error ``|got - expected| / |expected|`` (2-norms)
      must be within ``QUANTIZED_RELATIVE_RMS[weights]``.  ``run_case`` gives each output
      here over ``QUANTIZED_DRAWS`` inputs (the example inputs and shuffles of their values),
      so that ``|expected|`` measures the layer (a weight row's norm times the inputs') and
      not one draw's cancellation: a layer with two outputs near zero would otherwise show
      a large relative error for a correct absolute one.  Weights rounded to a grid of step
      ``s = max|w| / 127`` (int8) are off by ``s / sqrt(12)`` RMS, 0.45 % of the RMS of a
      uniform weight (``max|w| / sqrt(3)``), and per-token int8 inputs add about as much:
      about 1 % in all; int4 in groups of 32 (step ``max|w| / 7``) about 8 %.  A wrong
      layout, scale or sign gives 100 % or more.  The bounds (5 % and 25 %) are loose: they
      catch garbage, they do not measure accuracy.

    Returns ``ok`` (bool), ``why`` (what failed) and the figures measured.
    """
    import numpy as np

    if len(got) != len(expected):
        return {"ok": False, "why": f"{len(got)} output(s), expected {len(expected)}", "cause": "output count"}
    worst: dict[str, Any] = {"ok": True, "why": "", "ratio": 0.0}
    for i, (e, g) in enumerate(zip(expected, got)):
        e = np.asarray(e, np.float64)
        g = np.asarray(g).astype(np.float64)
        if e.shape != g.shape:
            return {"ok": False, "why": f"output {i} has shape {g.shape}, expected {e.shape}", "cause": "output shape"}
        if not np.array_equal(np.isnan(e), np.isnan(g)):
            return {"ok": False, "why": f"output {i}: NaN at {int((np.isnan(e) != np.isnan(g)).sum())} other place(s)",
                    "cause": "NaN elsewhere"}
        inf = np.isinf(e) | np.isinf(g)
        if not np.array_equal(e[inf], g[inf]):
            return {"ok": False, "why": f"output {i}: infinities differ at {int((e[inf] != g[inf]).sum())} place(s)",
                    "cause": "infinities differ"}
        finite = np.isfinite(e) & np.isfinite(g)
        e, g = e[finite], g[finite]
        if e.size == 0:
            continue
        err = np.abs(g - e)
        scale = float(np.abs(e).max())
        if quantized:
            norm = float(np.linalg.norm(e))
            rel_rms = float(np.linalg.norm(g - e)) / norm if norm else float(np.linalg.norm(g - e))
            # weights="fp32" quantized only layers torchao quantized, compared with torchao's module: their
            # codes are the same, the inputs' per-token int8 rounding differs at most (within qc8w's bound)
            bound = QUANTIZED_RELATIVE_RMS.get(weights, QUANTIZED_RELATIVE_RMS["qc8w"])
            figures = {"rel_rms": rel_rms, "bound": bound, "ratio": rel_rms / bound, "output": i}
        else:
            bound = FP32_RELATIVE * scale + FP32_ABSOLUTE
            figures = {"max_abs_err": float(err.max()), "max_abs_expected": scale,
                       "rel_err": float(err.max()) / scale if scale else float(err.max()),
                       "bound": bound, "ratio": float(err.max()) / bound, "output": i}
        if figures["ratio"] > worst["ratio"]:
            worst.update(figures)
    if worst["ratio"] > 1:
        what = (f"relative RMS error {worst['rel_rms']:.3g} > {worst['bound']:.3g}" if quantized else
                f"max |error| {worst['max_abs_err']:.3g} > {worst['bound']:.3g} (max |expected| "
                f"{worst['max_abs_expected']:.3g})")
        worst.update(ok=False, why=f"output {worst['output']}: {what}", cause="values outside the bound")
    return worst


def _exports_dynamic_shapes() -> bool:
    import inspect

    import xnnquant as xq

    return "dynamic_shapes" in inspect.signature(xq.export).parameters


def run_case(case: Case, weights: str = "fp32", fallback: Sequence[str] = ()) -> dict[str, Any]:
    """Export ``case`` with ``weights`` (and ``fallback``), run it on the real runtime in this
    process, compare with the eager module; one JSON-able record."""
    import numpy as np

    import xnnquant as xq

    record: dict[str, Any] = {
        "id": case.id, "file": case.file, "weights": weights, "fallback": list(fallback),
        "dtypes": case.dtypes, "quantizes": case.quantizes,
        "dynamic_shapes": None if case.dynamic_shapes is None else repr(case.dynamic_shapes),
        "status": "", "stage": "", "reason": "", "export_s": None,
    }

    def fail(status: str, stage: str, exc: BaseException) -> dict[str, Any]:
        if status == "refused":
            reason, cause = refusal(str(exc))
            record.update(message=str(exc))
        else:
            reason = cause = f"{type(exc).__name__}: {_first_line(exc)}"
            record.update(traceback=traceback.format_exc(limit=-4))
        record.update(status=status, stage=stage, reason=reason, cause=cause)
        return record

    try:
        expected = _eager(case.module, case.inputs)
    except Exception as exc:
        return fail("error", "eager", exc)
    options: dict[str, Any] = {"weights": weights, "progress": False}
    if fallback:
        options["fallback"] = tuple(fallback)
    if case.dynamic_shapes is not None:
        if _exports_dynamic_shapes():
            options["dynamic_shapes"] = case.dynamic_shapes
        else:
            record["dynamic_shapes_ignored"] = True  # exported with the example inputs' static shapes
    start = time.perf_counter()
    try:
        exported = xq.export(case.module, _clone(case.inputs), **options)
    except xq.XnnquantError as exc:
        return fail("refused", "export", exc)
    except Exception as exc:
        return fail("error", "export", exc)
    finally:
        record["export_s"] = round(time.perf_counter() - start, 4)
    rows = [getattr(row, "scheme", "?") for row in getattr(exported, "report", [])]
    record["schemes"] = dict(Counter(rows))
    quantized = any(scheme != "fp32" for scheme in rows)
    draws = [case.inputs] + (_shuffled_draws(case.inputs, QUANTIZED_DRAWS - 1) if quantized else [])
    start = time.perf_counter()
    try:
        got = [exported.run(*_clone(inputs)) for inputs in draws]
    except xq.XnnquantError as exc:
        return fail("refused", "run", exc)
    except Exception as exc:
        return fail("error", "run", exc)
    finally:
        record["run_s"] = round(time.perf_counter() - start, 4)
    if quantized:  # each output over every draw, one after the other
        try:
            more = [expected] + [_eager(case.module, inputs) for inputs in draws[1:]]
        except Exception as exc:
            return fail("error", "eager", exc)
        expected = [np.concatenate([np.ravel(e[i]) for e in more]) for i in range(len(expected))]
        got = [np.concatenate([np.ravel(g[i]) for g in got]) for i in range(len(got[0]))] \
            if all(len(g) == len(expected) for g in got) else got[0]
    else:
        got = got[0]
    verdict = check_outputs(expected, got, weights, quantized)
    record.update({k: v for k, v in verdict.items() if k not in ("ok", "why", "cause")})
    record.update(status="pass" if verdict["ok"] else "wrong", stage="compare", reason=verdict["why"],
                  cause=verdict.get("cause", ""))
    return record


def _eager(module: Any, inputs: tuple[Any, ...]) -> list[Any]:
    """The module's outputs, flattened, float64 numpy arrays (other leaves as they are)."""
    import torch
    from torch.utils._pytree import tree_leaves

    with torch.no_grad():
        return [t.detach().double().numpy() if isinstance(t, torch.Tensor) else t
                for t in tree_leaves(module(*_clone(inputs)))]


def _shuffled_draws(inputs: tuple[Any, ...], count: int) -> list[tuple[Any, ...]]:
    """``count`` more inputs like ``inputs``: each float tensor's own values in a random order
    (same shape, memory format and values, so the same domain: a test that feeds positive
    values to sqrt keeps doing so), others as they are."""
    import torch

    generator = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(count):
        draw = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.numel() > 1:
                order = torch.randperm(x.numel(), generator=generator)
                y = x.detach().reshape(-1)[order].reshape(x.shape)
                if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
                    y = y.contiguous(memory_format=torch.channels_last)
                draw.append(y)
            else:
                draw.append(x)
        draws.append(tuple(draw))
    return draws


# ------------------------------------------------------------------------------------------
# the child process, and the parent that drives it


def describe(case: Case) -> dict[str, Any]:
    """What the parent knows of a case (the module and inputs stay in the child)."""
    return {"id": case.id, "file": case.file, "dtypes": case.dtypes, "float32": case.float32,
            "quantizes": case.quantizes, "dynamic": case.dynamic_shapes is not None,
            "module": type(case.module).__name__,
            "shapes": [list(x.shape) if hasattr(x, "shape") else None for x in case.inputs]}


def _child(only: Sequence[str]) -> None:
    """Collect, send the cases, then run the tasks each request line lists.

    Messages are JSON lines on the original stdout; anything native code prints goes to
    stderr (the parent's log file) instead, as does the Python stack of a crash.
    """
    import faulthandler

    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    faulthandler.enable()

    def send(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")

    collection = collect(only)
    cases = {case.id: case for case in collection.cases}
    send({"event": "cases", "cases": [describe(c) for c in collection.cases], "skipped": collection.skipped,
          "stopped": collection.stopped})
    for line in sys.stdin:
        for i, (case_id, weights, fallback) in enumerate(json.loads(line)["tasks"]):
            send({"event": "start", "task": i})
            print(f"--- {case_id} {weights}", file=sys.stderr, flush=True)
            try:
                record = run_case(cases[case_id], weights, fallback)
            except Exception as exc:  # the harness's own failure: kept as the case's error
                reason = f"{type(exc).__name__}: {_first_line(exc)}"
                record = {"id": case_id, "weights": weights, "status": "error", "stage": "harness",
                          "reason": reason, "cause": reason,
                          "traceback": traceback.format_exc(limit=5)}
            send({"event": "done", "task": i, "record": record})
        send({"event": "finished"})


Task = tuple[str, str, Sequence[str]]  # (case id, weights, fallback schemes)


class _Silent(Exception):
    """The child said nothing within the time allowed."""


class Runner:
    """Drives one child process: it collects the cases when started, then runs the tasks
    it is sent; after a crash a new child (collecting again) takes the tasks left.

    ``only``: test files to collect from (all when empty).  ``timeout``: seconds one task
    may take; ``start_timeout``: seconds a child may take to import and collect.
    ``close()`` ends the child (a context manager does it on exit).
    """

    def __init__(self, only: Sequence[str] = (), timeout: float = DEFAULT_TIMEOUT,
                 start_timeout: float = 600.0, progress: bool = False) -> None:
        self.only, self.timeout, self.start_timeout, self.progress = list(only), timeout, start_timeout, progress
        self.log = tempfile.NamedTemporaryFile("w+", prefix="executorch-op-tests-", suffix=".log")  # noqa: SIM115
        self.restarts = 0
        self._proc: subprocess.Popen[str] | None = None
        self._buffer = ""
        self.cases: list[dict[str, Any]] = []
        self.skipped: dict[str, str] = {}
        self.stopped: dict[str, str] = {}
        self._start()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the child process --------------------------------------------------------------

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        command = [sys.executable, str(Path(__file__).resolve()), "--child"]
        self._proc = subprocess.Popen(command + (["--only", *self.only] if self.only else []),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                      text=True)
        self._buffer = ""
        try:
            first = self._receive(self.start_timeout)
        except _Silent:
            first = None
        if first is None or first.get("event") != "cases":
            self._stop()
            raise RuntimeError(f"the child process did not collect the cases:\n{self._log_tail(40)}")
        if self.cases and [c["id"] for c in first["cases"]] != [c["id"] for c in self.cases]:
            raise RuntimeError("a restarted child collected other cases than the first one")
        self.cases, self.skipped, self.stopped = first["cases"], first["skipped"], first["stopped"]

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """The child's next message; None when it has gone (end of its output)."""
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while "\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Silent
            chunk = os.read(fd, 1 << 16).decode()
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        return json.loads(line)

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def _how_it_ended(self) -> str:
        assert self._proc is not None
        try:
            code = self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return "closed its output but did not exit"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def _log_tail(self, lines: int = 12, since_marker: bool = False) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if since_marker and "\n--- " in "\n" + text:  # what was logged during the last task only
            text = ("\n" + text).rsplit("\n--- ", 1)[1].split("\n", 1)[-1]
        return "\n".join(text.splitlines()[-lines:])

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """End the child process and drop its log."""
        self._stop()
        self.log.close()

    # -- tasks ---------------------------------------------------------------------------

    def run(self, tasks: Sequence[Task]) -> list[dict[str, Any]]:
        """One record per task, in order (``run_case``'s, or a crash record)."""
        records: list[dict[str, Any]] = []
        todo = list(tasks)
        while todo:
            if self._proc is None:
                self.restarts += 1
                self._start()
            self._send({"tasks": [[case_id, weights, list(fallback)] for case_id, weights, fallback in todo]})
            for done, (case_id, weights, fallback) in enumerate(todo):
                started = time.monotonic()
                try:
                    message = self._receive(self.timeout)
                    if message is not None and message["event"] == "start":
                        message = self._receive(self.timeout)
                    how = "" if message is not None else self._how_it_ended()
                except _Silent:
                    message, how = None, f"did not finish the case within {self.timeout:g} s (stopped)"
                    assert self._proc is not None
                    self._proc.kill()
                if message is None:
                    records.append({"id": case_id, "weights": weights, "fallback": list(fallback),
                                    "status": "crash", "stage": "", "reason": f"the child process {how}",
                                    "cause": f"the child process {how}",
                                    "log": self._log_tail(since_marker=True),
                                    "seconds": round(time.monotonic() - started, 3)})
                    self._stop()
                    todo = todo[done + 1:]
                    break
                records.append(message["record"])
                if self.progress:
                    r = message["record"]
                    print(f"[{len(records)}/{len(tasks)}] {r['status']:8} {r['id']} ({r['weights']}) {r['reason']}",
                          file=sys.stderr, flush=True)
            else:
                finished = self._receive(self.timeout)
                assert finished == {"event": "finished"}, finished
                todo = []
        return records


# ------------------------------------------------------------------------------------------
# the command line


def modes(names: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``(weights, fallback)`` for each mode name (``fp32`` or a key of ``QUANTIZED_MODES``)."""
    return [(name, QUANTIZED_MODES.get(name, ())) for name in names]


def float32_tasks(cases: Sequence[dict[str, Any]], mode_list: Sequence[tuple[str, tuple[str, ...]]],
                  pattern: str = "") -> list[tuple[str, str, tuple[str, ...]]]:
    """One task per float32 case (whose id contains ``pattern``) and mode."""
    return [(c["id"], weights, fallback) for weights, fallback in mode_list
            for c in cases if c["float32"] and pattern in c["id"]]


STATUSES = ("pass", "wrong", "refused", "crash", "error")


def summary_table(records: Sequence[dict[str, Any]]) -> str:
    """Counts per test file and status, the median export time, and the totals."""
    by_file: dict[str, Counter[str]] = defaultdict(Counter)
    times: dict[str, list[float]] = defaultdict(list)
    for r in records:
        file = r["id"].split("::", 1)[0]
        by_file[file][r["status"]] += 1
        if r.get("export_s") is not None:
            times[file].append(r["export_s"])
            times["total"].append(r["export_s"])
    header = f"{'test file':28} {'cases':>5} " + " ".join(f"{s:>7}" for s in STATUSES) + f" {'export s':>9}"
    lines = [header, "-" * len(header)]

    def row(name: str, counts: Counter[str], spent: list[float]) -> str:
        median = sorted(spent)[len(spent) // 2] if spent else float("nan")
        return (f"{name:28} {sum(counts.values()):5d} " + " ".join(f"{counts[s]:7d}" for s in STATUSES)
                + f" {median:9.3f}")

    for file in sorted(by_file):
        lines.append(row(file, by_file[file], times[file]))
    lines.append("-" * len(header))
    lines.append(row("total", sum(by_file.values(), Counter()), times["total"]))
    lines.append("(export s: the median time of one xq.export call)")
    return "\n".join(lines)


def non_pass(records: Sequence[dict[str, Any]]) -> str:
    """Every case that did not pass, grouped by status and cause, each with its reason."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["status"] != "pass":
            groups[(r["status"], r.get("cause") or r.get("reason", ""))].append(r)
    lines = []
    for (status, cause), group in sorted(groups.items(), key=lambda g: (STATUSES.index(g[0][0]), -len(g[1]), g[0])):
        lines.append(f"{status} ({len(group)}): {cause}")
        for r in group:
            lines.append(f"    {r['id']}" + (f"  [{r['reason']}]" if r.get("reason", cause) != cause else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=[], metavar="FILE", help="test files (test_add ...)")
    parser.add_argument("-k", dest="pattern", default="", help="only case ids containing this text")
    parser.add_argument("--weights", nargs="+", default=["fp32"], choices=["fp32", *QUANTIZED_MODES],
                        help="modes to run (default fp32)")
    parser.add_argument("--quantized", action="store_true", help="also run qc8w and qb4w:32 (with fallbacks)")
    parser.add_argument("--json", type=Path, help="write every case's record here")
    parser.add_argument("--list", action="store_true", help="list the collected cases and stop")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per case")
    parser.add_argument("--progress", action="store_true", help="one line per case on stderr")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.only)
        return 0
    names = list(dict.fromkeys(args.weights + (list(QUANTIZED_MODES) if args.quantized else [])))
    mode_list = modes(names)
    start = time.perf_counter()
    with Runner(args.only, timeout=args.timeout, progress=args.progress) as runner:
        tasks = [] if args.list else float32_tasks(runner.cases, mode_list, args.pattern)
        records = runner.run(tasks)
    wall = time.perf_counter() - start
    cases = runner.cases
    kinds = Counter("float32" if c["float32"] else "other dtypes" for c in cases)
    print(f"collected {len(cases)} cases from {len({c['file'] for c in cases})} test files: "
          f"{kinds['float32']} float32 ({sum(c['float32'] and c['quantizes'] for c in cases)} of them from "
          f"tests that quantize), {kinds['other dtypes']} with other floating dtypes; "
          f"{sum(c['dynamic'] for c in cases if c['float32'])} float32 cases with dynamic_shapes; "
          f"{len(runner.stopped)} test methods ended on a placeholder, {len(runner.skipped)} skipped")
    if args.list:
        for c in cases:
            print(f"{'f32' if c['float32'] else '   '} {'q' if c['quantizes'] else ' '} "
                  f"{'dyn' if c['dynamic'] else '   '} {c['id']}  {c['module']} {c['dtypes']} {c['shapes']}")
        for test_id, why in runner.stopped.items():
            print(f"ended early: {test_id}: {why}")
        return 0
    for weights, fallback in mode_list:
        mode_records = [r for r in records if r["weights"] == weights]
        title = f"weights={weights}" + (f", fallback={','.join(fallback)}" if fallback else "")
        print(f"\n== {title}: {len(mode_records)} cases\n")
        print(summary_table(mode_records))
        if any(r["status"] != "pass" for r in mode_records):
            print("\n" + non_pass(mode_records))
        ignored = sum(1 for r in mode_records if r.get("dynamic_shapes_ignored"))
        if ignored:
            print(f"\n{ignored} case(s) with dynamic_shapes were exported with static shapes "
                  "(xq.export takes no dynamic_shapes)")
    print(f"\n{len(records)} runs in {wall:.1f} s wall ({runner.restarts} child restart(s) after a crash)")
    if args.json:
        args.json.write_text(json.dumps({"cases": cases, "records": records, "skipped": runner.skipped,
                                         "stopped": runner.stopped, "wall_s": wall}, indent=1))
    return 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.exit(main())
