"""ExecuTorch's own XNNPACK operator tests, through ``xq.export`` on the real runtime.

``benchmarks/executorch_op_tests.py`` collects the modules and inputs that the op tests in
the executorch 1.4.1 wheel give to their ``Tester`` (without running ExecuTorch's flow),
exports each float32 case with ``weights="fp32"``, runs it on the real XNNPACK and compares
with the module in eager torch.  One child process collects (at collection time here) and
then runs every case; a case that kills it is a crash, and a new child runs the rest.

Each case must pass or be refused by name (``XnnquantError``): never a wrong result, never
a crash, never another exception.  ``KNOWN`` lists the cases that fail today, each with its
cause; they are strict xfails, so a fix turns them into failures until the mark is removed.
"""

from __future__ import annotations

import atexit
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xnnquant.errors import XnnquantError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "executorch_op_tests.py"


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("executorch_op_tests", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ops = _load_script()

HAVE_EXECUTORCH = importlib.util.find_spec("executorch") is not None

#: Cases that fail today, and why (strict xfails).
KNOWN: dict[str, str] = {}

#: What the recorders collect from executorch 1.4.1's op tests: every ``Tester`` (and
#: direct ``export``) call, and the float32 ones among them.  A change means the recorders
#: lost or gained cases (or the wheel changed).
COLLECTED, COLLECTED_FLOAT32 = 796, 637


def _start_runner() -> Any:
    """The child process, started now to list the cases (it collects them: ~10 s), kept to
    run them; it ends after the run, or at exit when the run is deselected."""
    if not HAVE_EXECUTORCH:
        return None
    runner = ops.Runner()
    atexit.register(runner.close)
    return runner


_runner = _start_runner()
_float32 = [c["id"] for c in _runner.cases if c["float32"]] if _runner is not None else []


@pytest.fixture(scope="module")
def records() -> Any:
    """Every float32 case run once, ``{case id: record}`` (the child process then ends)."""
    assert _runner is not None
    try:
        done = _runner.run([(case_id, "fp32", ()) for case_id in _float32])
    finally:
        _runner.close()
    return {r["id"]: r for r in done}


def _param(case_id: str) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[case_id])] if case_id in KNOWN else []
    return pytest.param(case_id, id=case_id, marks=marks)


@pytest.mark.xnnpack
@pytest.mark.slow
@pytest.mark.parametrize("case_id", [_param(c) for c in _float32])
def test_case_passes_or_is_refused(records: dict[str, Any], case_id: str) -> None:
    record = records[case_id]
    assert record["status"] in ("pass", "refused"), (
        f"{record['status']} ({record.get('stage')}): {record['reason']}\n{record.get('log', '')}"
        f"{record.get('traceback', '')}")


@pytest.mark.xnnpack
def test_recorders_collect_every_case() -> None:
    assert _runner is not None
    assert (len(_runner.cases), len(_float32)) == (COLLECTED, COLLECTED_FLOAT32)
    assert not set(KNOWN) - set(_float32), "a known failure is no longer collected"
    # the recorders stand in for ExecuTorch's flow: a test may end early on a placeholder
    # (a check of ExecuTorch's artifacts), never before it made its cases
    assert len({c["id"] for c in _runner.cases}) == len(_runner.cases)


# ------------------------------------------------------------------ the comparison itself


def test_within_the_float32_bound_passes() -> None:
    expected = np.array([2.0, -1.0, 0.0, 1e-3])
    got = expected + np.array([1.9e-4, -1e-4, 1e-7, 0.0])  # max error 1.9e-4 < 1e-4 * 2 + 1e-6
    assert ops.check_outputs([expected], [got.astype(np.float32)], "fp32", False)["ok"]


@pytest.mark.parametrize(("got", "cause"), [
    ([np.array([2.0, -1.0, 0.0, 2.2e-4])], "values outside the bound"),     # 2.2e-4 > 2.01e-4
    ([np.array([2.0, -1.0, 0.0])], "output shape"),
    ([np.array([2.0, -1.0, 0.0, 0.0])] * 2, "output count"),
    ([np.array([2.0, -1.0, np.nan, 0.0])], "NaN elsewhere"),
    ([np.array([2.0, -np.inf, 0.0, 0.0])], "infinities differ"),
])
def test_outside_the_float32_bound_is_wrong(got: list[np.ndarray], cause: str) -> None:
    verdict = ops.check_outputs([np.array([2.0, -1.0, 0.0, 0.0])], got, "fp32", False)
    assert (verdict["ok"], verdict["cause"]) == (False, cause)


def test_same_nans_and_infinities_pass() -> None:
    expected = np.array([np.nan, np.inf, -np.inf, 1.0])
    assert ops.check_outputs([expected], [expected.copy()], "fp32", False)["ok"]


def test_quantized_bound_is_on_the_normalized_rms_error() -> None:
    rng = np.random.default_rng(0)
    expected = rng.standard_normal(1000)
    noise = rng.standard_normal(1000)
    noise *= 0.04 * np.linalg.norm(expected) / np.linalg.norm(noise)  # exactly 4 % RMS
    assert ops.check_outputs([expected], [expected + noise], "qc8w", True)["ok"]
    verdict = ops.check_outputs([expected], [expected + 1.5 * noise], "qc8w", True)  # 6 % > 5 %
    assert not verdict["ok"] and verdict["rel_rms"] == pytest.approx(0.06)
    assert ops.check_outputs([expected], [expected + 1.5 * noise], "qb4w:32", True)["ok"]


def test_refusal_lists_the_refused_nodes_and_groups_by_cause() -> None:
    message = str(XnnquantError(
        "export refused 2 node(s) or layer(s):\n"
        "  - aten.convolution.default (node convolution, module conv1): only 2-D convolutions are supported: "
        "got an input of shape (2, 2, 4)\n"
        "  - aten.convolution.default (node convolution_1, module conv2): only 2-D convolutions are supported: "
        "got an input of shape (1, 2, 17)"))
    assert ops.refusal(message) == (
        "export refused 2 node(s) or layer(s): aten.convolution.default (node convolution, module conv1): only 2-D "
        "convolutions are supported: got an input of shape (2, 2, 4); aten.convolution.default (node "
        "convolution_1, module conv2): only 2-D convolutions are supported: got an input of shape (1, 2, 17)",
        "aten.convolution.default: only 2-D convolutions are supported")
    assert ops.refusal("example_inputs[0] is torch.int8: pass float32 inputs") == (
        "example_inputs[0] is torch.int8: pass float32 inputs", "example_inputs[0] is torch.int8")
