"""xnnquant inspect / verify / report on payloads built here, their errors, and their quiet."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import xnnquant as xq
from xnnquant import cli
from xnnquant.graph import Graph
from xnnquant.graph.divergence import relative_errors


@pytest.fixture
def payload_path(tmp_path):
    rng = np.random.default_rng(0)
    g = Graph()
    x = g.input((3, 64))
    w = xq.quantize_per_channel(rng.standard_normal((16, 64)).astype(np.float32), bits=4)
    h = g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(w), bias=g.constant(np.ones(16, np.float32)))
    g.output(g.sigmoid(h))
    return g.save(tmp_path / "model.xnn")


def test_inspect_lists_values_and_nodes(payload_path, capsys):
    assert cli.main(["inspect", str(payload_path)]) == 0
    out = capsys.readouterr().out
    assert "3 nodes, 2 externals" in out
    line = next(line for line in out.splitlines() if "qcint4" in line)
    assert line.split()[:3] == ["%2", "qcint4", "[16,"] and line.endswith("512 bytes; 16 scales on dim 0")
    assert "%4 = XNNFullyConnected(%1, %2, %3)" in out


def test_inspect_reports_bad_files(tmp_path, payload_path, capsys):
    (tmp_path / "cut.xnn").write_bytes(payload_path.read_bytes()[:100])
    assert cli.main(["inspect", str(tmp_path / "cut.xnn")]) == 2
    assert "extends past the end of the 100-byte payload" in capsys.readouterr().err
    assert cli.main(["inspect", str(tmp_path / "missing.xnn")]) == 2


@pytest.mark.xnnpack
def test_verify_runs_the_real_runtime(payload_path, capsys):
    assert cli.main(["verify", str(payload_path)]) == 0
    assert "OK: worst relative error" in capsys.readouterr().out
    assert cli.main(["verify", str(payload_path), "--no-isolate"]) == 0
    assert "OK: worst relative error" in capsys.readouterr().out


@pytest.mark.xnnpack
def test_verify_json_and_inspect_say_what_they_checked(payload_path, capsys):
    """Issue 34: verify had no --json; inspect printed a file with exit 0 and no word that
    nothing was run."""
    import json

    assert cli.main(["verify", str(payload_path), "--no-isolate", "--json", "--seed", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["ok"] is True and record["file"] == str(payload_path) and record["seed"] == 3
    assert record["isolated"] is False and record["tolerance"] > 0
    assert 0 <= record["worst_relative_error"] <= record["tolerance"] and record["errors"]
    assert record["report"] == [f"output 0 (3, 16): max relative error {record['errors'][0]:.3g}"]
    assert cli.main(["inspect", str(payload_path), "--no-validate"]) == 0
    *_, checked, not_checked = capsys.readouterr().out.rstrip().splitlines()
    assert checked == "checked: the file's structure: headers, offsets, flatbuffers"
    assert not_checked == ("not checked: every payload against XNNPACK 1.4.1's rules for values and nodes "
                           "(graph.validate): --no-validate; the runtime: nothing was loaded or run (xnnquant verify "
                           f"{payload_path} runs it, isolated)")
    assert cli.main(["inspect", str(payload_path), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["run"] is False and len(record["checked"]) == 2 and len(record["not_checked"]) == 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m xnnquant ARGS`` in a fresh process, as a user's shell runs it."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "xnnquant", *args], capture_output=True, text=True, env=env,
                          timeout=900)


@pytest.mark.xnnpack
def test_verify_prints_only_its_own_lines(payload_path):
    """torch, torchao and executorch warn while they load; none of it reaches the user."""
    done = _cli("verify", str(payload_path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("output 0 (3, 16): max relative error "), lines
    assert lines[1].startswith("OK: worst relative error "), lines
    inspected = _cli("inspect", str(payload_path))
    assert inspected.returncode == 0 and inspected.stderr == "" and inspected.stdout.startswith("6 values, 3 nodes, 2 externals\n")


@pytest.mark.xnnpack
def test_verbose_shows_what_the_libraries_log(payload_path):
    done = _cli("verify", "--no-isolate", "--verbose", str(payload_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("OK: worst relative error ")
    assert done.stderr != ""  # the registration warnings, printed as the libraries wrote them


REPORT_ON_A_SMALL_WEIGHT = """
import numpy as np, sys
import xnnquant.models.weights as weights
weights.minilm_linears = lambda: {"w": np.linspace(-1, 1, 8 * 96, dtype=np.float32).reshape(8, 96)}
from xnnquant.cli import main
sys.exit(main(["report", "--group-sizes", "32", "96"]))
"""


def test_report_prints_only_its_table():
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", REPORT_ON_A_SMALL_WEIGHT], capture_output=True, text=True,
                          cwd=root, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("all-MiniLM-L6-v2: 1 encoder linear weights, 768 parameters\n")


def test_errors_are_one_line_of_ours(tmp_path):
    (tmp_path / "junk.xnn").write_bytes(b"not a payload at all")
    done = _cli("verify", str(tmp_path / "junk.xnn"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("xnnquant: error: ") and done.stderr.count("\n") == 1, done.stderr


def test_compare_flags_a_difference():
    ref = [np.array([1.0, -2.0]), np.zeros((2, 2))]
    assert relative_errors(ref, [np.array([1.0, -2.0]), np.zeros((2, 2))]) == [0.0, 0.0]
    assert relative_errors(ref, [np.array([1.0, -1.0]), np.zeros((1, 2))]) == [0.5, float("inf")]
