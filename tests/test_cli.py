"""xnnquant inspect / verify on payloads built here, and their errors."""

import numpy as np
import pytest

import xnnquant as xq
from xnnquant import cli
from xnnquant.graph import Graph
from xnnquant.verify import compare


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


def test_compare_flags_a_difference():
    ref = [np.array([1.0, -2.0]), np.zeros((2, 2))]
    assert compare(ref, [np.array([1.0, -2.0]), np.zeros((2, 2))]) == [0.0, 0.0]
    assert compare(ref, [np.array([1.0, -1.0]), np.zeros((1, 2))]) == [0.5, float("inf")]
