"""Shared test set-up.

Tests that need the real XNNPACK carry ``@pytest.mark.xnnpack``.  Locally, without the
``xnnpack`` extra, they are skipped; under CI (``CI=true``) a missing extra is a failure,
so a broken install can never turn the oracle tests into silent skips.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HAVE_EXECUTORCH = importlib.util.find_spec("executorch") is not None
IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_EXECUTORCH:
        return
    for item in items:
        if "xnnpack" in item.keywords:
            if IN_CI:
                raise pytest.UsageError(f"{item.nodeid} needs executorch==1.4.1, which CI must install")
            item.add_marker(pytest.mark.skip(reason="needs the xnnpack extra (executorch==1.4.1)"))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """torch's global generator seeded before every test: a module built with random weights
    (``nn.Linear(8, 8)``) is the same on every run and in any order or subset of tests, so a
    measured figure in a test's comment stays the figure it asserts against."""
    if "torch" in sys.modules:  # tests that never imported torch do not pay for its import
        sys.modules["torch"].manual_seed(0)


def _shared_candidates() -> list[Path]:
    """Where the project's ``shared`` folder may be: beside the repository, or beside
    the main checkout when this is a git worktree (its common git dir is the main
    checkout's ``.git``)."""
    candidates = [REPO.parent / "shared"]
    try:
        common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        common = ""
    if common:
        candidates.append((REPO / common).resolve().parent.parent / "shared")
    return candidates


@pytest.fixture
def decompositions(monkeypatch: pytest.MonkeyPatch) -> list[list[str] | None]:
    """Every ``ExportedProgram.run_decompositions`` call the test makes (torch's retrace of the
    whole program), each as the sorted names of its table (None: torch's default table)."""
    import torch

    calls: list[list[str] | None] = []
    original = torch.export.ExportedProgram.run_decompositions

    def spy(self: object, decomp_table: object = None, **kwargs: object) -> object:
        calls.append(None if decomp_table is None else sorted(map(str, decomp_table)))
        return original(self, decomp_table, **kwargs)

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", spy)
    return calls


@pytest.fixture(scope="session")
def shared_reference() -> Path | None:
    """``shared/reference`` of the project when it is there (optional: a clean clone in CI
    may have none, and every test must pass without it)."""
    return next((c / "reference" for c in _shared_candidates() if (c / "reference").is_dir()), None)


@pytest.fixture(scope="session")
def et_programs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Programs ExecuTorch 1.4.1 wrote through its own flow (``tests/oracles/et_programs.py``,
    run once per test run in a subprocess; see its docstring for the files).  Under
    pytest-xdist (``make test`` runs ``-n 2``) the workers share one copy: the first makes it
    in the run's temporary directory, under a lock, and the others read it."""
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _make_et_programs(tmp_path_factory.mktemp("et_programs"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's directory, the workers' parent
    out = shared / "et_programs"
    with FileLock(str(shared / "et_programs.lock")):
        if not (out / "done").exists():
            _make_et_programs(out)
            (out / "done").write_text("")
    return out


def _make_et_programs(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "oracles" / "et_programs.py"), str(out)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
