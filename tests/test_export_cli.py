"""xnnquant export and xnnquant minilm: MODEL specs, .pt2 programs, errors, --json, --help."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest

from xnnquant import cli

torch = pytest.importorskip("torch")

FACTORY = textwrap.dedent("""
    import torch

    def small():
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
        return module, (torch.randn(2, 64),)

    def wrong():
        return 3

    def broken():
        raise FileNotFoundError("weights.bin")

    not_a_factory = 3
""")


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_models.py").write_text(FACTORY)
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_models:small"


@pytest.mark.xnnpack
def test_export_from_a_factory_writes_the_program(factory: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "small.pte"
    assert cli.main(["export", factory, "-o", str(out), "--weights", "qb4w:32", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("xnnquant export: weights qb4w:32, method mse, target 1.4.1;")
    assert f"wrote {out} ({out.stat().st_size:,} bytes)" in text and out.read_bytes()[4:8] == b"ET12"
    assert cli.main(["export", factory, "-o", str(tmp_path / "s.xnn"), "--weights", "qc8w", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["weights"] == "qc8w" and report["summary"]["rows"] == 2 and [r["path"] for r in report["rows"]] == ["0", "2"]
    assert report["rows"][0]["shape"] == [32, 64] and report["rows"][0]["scheme"] == "qc8w"


@pytest.mark.xnnpack
def test_export_from_a_pt2_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Hardswish()).eval()
    program = torch.export.export(module, (torch.randn(1, 32),))
    torch.export.save(program, tmp_path / "m.pt2")
    assert cli.main(["export", str(tmp_path / "m.pt2"), "-o", str(tmp_path / "m.pte"), "--weights", "fp32",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["path"], r["shape"], r["scheme"]) for r in rows] == [("0", [16, 32], "fp32")]
    assert (tmp_path / "m.pte").stat().st_size > 16 * 32 * 4


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "MODEL 'nocolon' does not resolve: expected package.module:factory, a callable returning "
                "(module, example_inputs), or a .pt2 file"),
    ("no_such_module_here:f", "MODEL 'no_such_module_here:f' does not resolve: No module named 'no_such_module_here'"),
    ("my_models:absent", "MODEL 'my_models:absent' does not resolve: module 'my_models' has no attribute 'absent'"),
    ("my_models:wrong", "MODEL 'my_models:wrong': the factory returned int, expected package.module:factory"),
    ("my_models:broken", "MODEL 'my_models:broken': the factory raised FileNotFoundError: weights.bin"),
    ("my_models:not_a_factory", "MODEL 'my_models:not_a_factory': 'not_a_factory' is int, not callable (expected "
                                "package.module:factory"),
    ("bad_syntax:f", "MODEL 'bad_syntax:f': importing 'bad_syntax' failed: SyntaxError: "),
])
def test_bad_models_are_clear_errors(spec: str, message: str, factory: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "x.pte"
    assert cli.main(["export", spec, "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"xnnquant: error: {message}")
    assert not out.exists()


def test_a_pt2_that_does_not_load(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "bad.pt2").write_bytes(b"not a zip file")
    assert cli.main(["export", str(tmp_path / "bad.pt2"), "-o", str(tmp_path / "x.pte")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xnnquant: error: cannot load '{tmp_path / 'bad.pt2'}' as a torch.export program")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt2"]


def test_an_export_that_fails_leaves_no_file(factory: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "x.pte"
    assert cli.main(["export", factory, "-o", str(out), "--weights", "qb4w:64", "--fallback", "none"]) == 2
    assert "layer '2' cannot take its weights: qb4w:64: group size 64 does not divide in_features 32" in \
        capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_syntax.py", "my_models.py"]


@pytest.mark.parametrize("command", ["export", "minilm"])
def test_help(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: xnnquant {command}")


@pytest.mark.xnnpack
def test_verify_accepts_an_exported_pte(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A deep dynamically quantized graph: end to end the interpreter and the runtime part by
    float ties that per-token quantization amplifies layer by layer, so each delegate is then
    judged node by node on the runtime's own values (xq.verify's check)."""
    from export_models import MODELS

    import xnnquant as xq

    module, inputs = MODELS["transformer"]()
    layers = torch.nn.Sequential(*[copy.deepcopy(module) for _ in range(4)]).eval()
    xq.export(layers, inputs, weights="qb4w:32", progress=False).save(tmp_path / "t.pte")
    assert cli.main(["verify", str(tmp_path / "t.pte"), "--no-isolate"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("OK: worst relative error")

