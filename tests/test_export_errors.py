"""Bad input to xq.export and Exported: one clear error each (full texts pinned), no partial files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import xnnquant as xq
from xnnquant.errors import MissingExtraError, UnsupportedConfigError, XnnquantError
from xnnquant.frontend import WeightScheme

torch = pytest.importorskip("torch")
nn = torch.nn


def test_weight_scheme_parsing() -> None:
    assert [str(WeightScheme.parse(s)) for s in ("fp32", " QC8W ", "qc4w", "qb4w:64")] == [
        "fp32", "qc8w", "qc4w", "qb4w:64"]
    scheme = WeightScheme.parse("qb4w:32")
    assert scheme.is_4bit and scheme.is_quantized and scheme.group_size == 32 and scheme.datatype.name == "qbint4"
    assert WeightScheme.parse(scheme) is scheme and not WeightScheme.parse("fp32").is_quantized
    valid = "expected 'fp32', 'qc8w', 'qc4w' or 'qb4w:G' with G a multiple of 32 (e.g. 'qb4w:32')"
    for bad in ("int4", "qb4w", "qb4w:x", "qc8w:32", 8, None):
        with pytest.raises(XnnquantError, match=rf"^unknown weights scheme: got {bad!r}, {valid}".replace("(", r"\(")
                           .replace(")", r"\)")):
            WeightScheme.parse(bad)
    with pytest.raises(XnnquantError, match=r"^qb4w group size must be a positive multiple of 32: got 48"):
        WeightScheme.parse("qb4w:48")


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), Cumulative())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Cumulative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=-1) + torch.erfinv(x.clamp(-0.5, 0.5))


def test_unsupported_operators_are_listed_with_their_module_paths() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        xq.export(Blocks().eval(), (torch.randn(2, 8),), weights="fp32", progress=False)
    assert str(info.value) == (
        "export refused 2 node(s) or layer(s):\n"
        "  - aten.cumsum.default (node cumsum, module inner.1): unsupported operator\n"
        "  - aten.erfinv.default (node erfinv, module inner.1): unsupported operator")


def test_a_layer_that_cannot_take_the_scheme_is_refused_by_name() -> None:
    module = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 100), nn.Linear(100, 4)).eval()
    x = torch.randn(3, 96)
    with pytest.raises(UnsupportedConfigError) as info:
        xq.export(module, (x,), weights="qb4w:64", fallback=None, progress=False)
    assert str(info.value) == (
        "export refused 2 node(s) or layer(s):\n"
        "  - aten.linear.default (node linear, module 0): layer '0' cannot take its weights: qb4w:64: group size "
        "64 does not divide in_features 96 (group sizes that do: 32, 96) (pass fallback='auto')\n"
        "  - aten.linear.default (node linear_2, module 3): layer '3' cannot take its weights: qb4w:64: group size "
        "64 does not divide in_features 100 (group sizes that do: none) (pass fallback='auto')")
    exported = xq.export(module, (x,), weights="qb4w:64", fallback="qb4w:32,qc8w", progress=False)
    assert [(r.scheme, r.fallback) for r in exported.report] == [
        ("qb4w:32", "qb4w:64: group size 64 does not divide in_features 96 (group sizes that do: 32, 96); took "
                    "fallback qb4w:32"),
        ("qb4w:64", ""),
        ("qc8w", "qb4w:64: group size 64 does not divide in_features 100 (group sizes that do: none); fallback "
                 "qb4w:32: group size 32 does not divide in_features 100 (group sizes that do: none); took fallback "
                 "qc8w")]
    odd = nn.Linear(7, 4).eval()
    with pytest.raises(UnsupportedConfigError, match=r"qc4w: qc4w with an odd in_features \(7\) is computed wrongly "
                                                     r"by XNNPACK's dynamically quantized int4 kernels"):
        xq.export(odd, (torch.randn(2, 7),), weights="qc4w", fallback=None, progress=False)


def test_bad_modules_and_inputs() -> None:
    linear = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(XnnquantError, match=r"^Linear is in training mode: call module.eval\(\) before exporting"):
        xq.export(linear, (x,), progress=False)
    with pytest.raises(XnnquantError, match=r"^parameter 'weight' is torch.float16: xnnquant exports float32 modules "
                                            r"\(call module.float\(\)\)"):
        xq.export(nn.Linear(4, 4).half().eval(), (x.half(),), progress=False)
    with pytest.raises(XnnquantError, match=r"^example_inputs\[0\] is torch.int64: XNNPACK's external values are "
                                            r"float32 here"):
        xq.export(linear.eval(), (torch.ones(2, 4, dtype=torch.int64),), progress=False)
    with pytest.raises(XnnquantError, match=r"^example_inputs must be a tuple of tensors, the module's positional "
                                            r"inputs: got Tensor"):
        xq.export(linear, x, progress=False)
    with pytest.raises(XnnquantError, match=r"^module must be a torch.nn.Module or an ExportedProgram: got str"):
        xq.export("model.pt", (x,), progress=False)
    with pytest.raises(XnnquantError, match=r"^unknown target: got '1.3', expected one of 'xn01', '1.4.1'"):
        xq.export(linear, (x,), target="1.3", progress=False)
    with pytest.raises(XnnquantError, match=r"^unknown method: got 'best'"):
        xq.export(linear, (x,), method="best", progress=False)
    with pytest.raises(XnnquantError, match=r"^calibration= has no use with fp32 weights: it calibrates quantized "
                                            r"layers"):
        xq.export(linear, (x,), weights="fp32", calibration=[(x,)], progress=False)
    with pytest.raises(UnsupportedConfigError, match=r"layer '<top level>' cannot take its weights: qb4w:32: group "
                                                     r"size 32 does not divide in_features 4"):
        xq.export(linear, (x,), weights="qb4w:32", fallback=None, progress=False)
    with pytest.raises(XnnquantError, match=r"^torch.export.export failed on Linear: RuntimeError: "):
        xq.export(linear, (torch.randn(2, 5),), progress=False)


def test_a_dynamic_dimension_needs_an_upper_bound() -> None:
    module = nn.Linear(4, 3).eval()
    batch = torch.export.Dim("batch")
    program = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes=({0: batch},), strict=False)
    with pytest.raises(XnnquantError, match=r"^input 'input' has a dynamic dim s\d+ with no upper bound: ExecuTorch "
                                            r"plans memory at the bound; give its torch.export.Dim a max"):
        xq.export(program, progress=False)


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(MissingExtraError, match=r"exporting a torch module needs the 'torch' package, which is not "
                                                r"installed: install the extra with  pip install 'xnnquant\[torch\]'"):
        xq.export(object(), ())


@pytest.mark.xnnpack
def test_save_writes_by_suffix_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exported = xq.export(nn.Linear(32, 8).eval(), (torch.randn(2, 32),), weights="qb4w:32", progress=False)
    xnn = exported.save(tmp_path / "m.xnn")
    assert xnn.read_bytes() == exported.to_bytes()
    pte = exported.save(tmp_path / "m.pte")
    assert pte.read_bytes() == exported.to_pte() and pte.read_bytes()[4:8] == b"ET12"
    with pytest.raises(XnnquantError, match=r"cannot tell what to write from the suffix of '.*m.onnx': expected .pte "
                                            r"\(an ExecuTorch program"):
        exported.save(tmp_path / "m.onnx")

    def broken() -> bytes:
        raise RuntimeError("serializer failed")

    monkeypatch.setattr(exported, "to_pte", broken)
    with pytest.raises(RuntimeError, match="serializer failed"):
        exported.save(tmp_path / "m.pte")
    assert pte.read_bytes()[4:8] == b"ET12"  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pte", "m.xnn"]  # no temporary left


def test_missing_executorch_names_the_extra_and_writes_nothing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    exported = xq.export(nn.Linear(32, 8).eval(), (torch.randn(2, 32),), weights="qc8w", progress=False)
    for name in [m for m in sys.modules if m == "executorch" or m.startswith("executorch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "executorch", None)  # import executorch -> ImportError
    with pytest.raises(MissingExtraError, match=r"needs the 'executorch' package, which is not installed: install "
                                                r"the extra with  pip install 'xnnquant\[xnnpack\]'"):
        exported.save(tmp_path / "m.pte")
    assert list(tmp_path.iterdir()) == []
    assert exported.save(tmp_path / "m.xnn").read_bytes() == exported.to_bytes()  # the payload needs no executorch
