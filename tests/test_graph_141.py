"""Writing the node kinds ExecuTorch 1.4.1 appended to the schema (``Graph(target="1.4.1")``).

Oracles: ExecuTorch 1.4.1's own ``schema.fbs`` from the installed wheel (same reflection
data as ours), the real XNNPACK through the 1.4.1 runtime, float64 numpy / torch for what
each node means, and the reference interpreter.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_graph_schema import _fbs_tables, _layout_type

from xnnquant.compute.special import erf
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import Graph, Target, codegen, interpret, load
from xnnquant.graph.layout import TABLES, fields


def _executorch_schema() -> Path:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the xnnpack extra (executorch==1.4.1)")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "backends" / "xnnpack" / "serialization" / "schema.fbs"


def _reflection(schema: Path, work: Path) -> bytes:
    work.mkdir()
    shutil.copyfile(schema, work / "schema.fbs")  # the file name is part of the reflection data
    subprocess.run([str(codegen.find_flatc()), "--schema", "-b", "-o", str(work), str(work / "schema.fbs")],
                   check=True)
    return (work / "schema.bfbs").read_bytes()


@pytest.mark.xnnpack
def test_schema_141_has_executorch_141_wire_format(tmp_path: Path) -> None:
    """Same tables, fields, slots, types, enums, unions and deprecations as ExecuTorch 1.4.1's schema."""
    assert _reflection(codegen.SCHEMA_141, tmp_path / "ours") == _reflection(_executorch_schema(), tmp_path / "et")


@pytest.mark.xnnpack
def test_committed_141_code_is_what_flatc_generates() -> None:
    assert codegen.regenerated_text(codegen.SCHEMA_141) == codegen.GENERATED_141.read_text(), (
        "schema_141_generated.py is stale: run `make flatbuffers`")


def test_schema_141_extends_xn01_without_moving_a_slot() -> None:
    xn01 = _fbs_tables(codegen.SCHEMA.read_text())
    later = _fbs_tables(codegen.SCHEMA_141.read_text())
    assert set(later) == set(xn01)
    for name, seed_fields in xn01.items():
        assert later[name][:len(seed_fields)] == seed_fields, name
        # layout.py's EXTENSIONS restate what 1.4.1 appends (dq_datatype is the runtime schema's only)
        appended = [t for _, ftype in later[name][len(seed_fields):] for t in _layout_type(ftype)]
        assert [t for f, t in fields(name)[len(TABLES[name]):] if f != "dq_datatype"] == appended, name


def _xn01_graph(target: str) -> Graph:
    rng = np.random.default_rng(1)
    g = Graph(target=target)
    x = g.input((2, 64))
    h = g.fully_connected(x, g.constant(rng.standard_normal((32, 64)).astype(np.float32)))
    g.output(g.concatenate([g.sigmoid(h), g.abs(h)], axis=1))
    return g


def test_xn01_kinds_give_the_same_bytes_under_either_target() -> None:
    assert _xn01_graph("1.4.1").to_bytes() == _xn01_graph("xn01").to_bytes()


def test_xn01_graph_refuses_141_kinds() -> None:
    g = Graph()
    x = g.input((4,))
    with pytest.raises(UnsupportedConfigError, match=r"XNNGelu is a node kind of ExecuTorch 1.4.1's schema, "
                                                     r"not of XN01: build the graph with Graph\(target='1.4.1'\)"):
        g.gelu(x)
    with pytest.raises(UnsupportedConfigError, match="target xn01 concatenates 2 to 4 values in one node: got 5"):
        g.concatenate([x] * 5, 0)


def test_target_parsing() -> None:
    assert Target.parse("seed") is Target.XN01 and Target.parse(" XN01 ") is Target.XN01
    assert Target.parse("1.4.1") is Target.ET_1_4_1 and str(Target.ET_1_4_1) == "1.4.1"
    with pytest.raises(XnnquantError, match=r"unknown target: got '1.5', expected one of 'xn01', '1.4.1'"):
        Target.parse("1.5")


X = np.linspace(-10, 10, 4000, dtype=np.float32).reshape(4, -1)
POSITIVE = np.linspace(1e-3, 50, 4000, dtype=np.float32).reshape(4, -1)

# kind: (builder method, input, float64 reference, bound on |runtime - reference|).  The bounds
# are a few float32 ulps of the outputs' range above what XNNPACK's polynomial kernels
# measured on AMD Zen 2 (gelu 9.3e-7, tanh 2.5e-7, exp relative 5.8e-7, log 4.8e-7,
# rsqrt relative 1.6e-7, sin / cos 2.7e-7): the kernels differ between AVX2 and AVX-512.
UNARY = {
    "XNNGelu": ("gelu", X, lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))), 4e-6),
    "XNNTanh": ("tanh", X, np.tanh, 2e-6),
    "XNNExp": ("exp", X, np.exp, None),  # relative, below
    "XNNLog": ("log", POSITIVE, np.log, 4e-6),
    "XNNReciprocalSquareRoot": ("reciprocal_square_root", POSITIVE, lambda x: 1 / np.sqrt(x), None),
    "XNNSin": ("sin", X, np.sin, 2e-6),
    "XNNCos": ("cos", X, np.cos, 2e-6),
    "XNNCopy": ("copy", X, lambda x: x, 0.0),
}


@pytest.mark.xnnpack
@pytest.mark.parametrize("kind", sorted(UNARY))
def test_141_unary_kinds_on_the_runtime(kind: str) -> None:
    from xnnquant.graph import run

    method, data, reference, bound = UNARY[kind]
    g = Graph(target="1.4.1")
    g.output(getattr(g, method)(g.input(data.shape)))
    assert g.nodes[0].kind == kind
    payload = g.to_bytes()
    (got,) = run(payload, [data])
    (interpreted,) = interpret(payload, [data])
    expected = reference(data.astype(np.float64))
    if bound is None:  # exp and rsqrt: relative error, 8 float32 ulps (2**-23 each)
        assert np.max(np.abs(got - expected) / np.abs(expected)) < 8 * 2.0**-23
    else:
        assert np.max(np.abs(got - expected)) <= bound
    # the interpreter computes in float64 and rounds once (gelu through a 1.5e-7 erf)
    assert np.max(np.abs(interpreted - expected)) <= 3e-7 * max(1.0, float(np.abs(expected).max()))


@pytest.mark.xnnpack
def test_concatenate5_on_the_runtime() -> None:
    from xnnquant.graph import run

    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((3, k)).astype(np.float32) for k in (1, 2, 3, 4, 5)]
    g = Graph(target="1.4.1")
    g.output(g.concatenate([g.input(p.shape) for p in parts], axis=1))
    assert g.nodes[0].kind == "XNNConcatenate5"
    payload = g.to_bytes()
    assert load(payload).nodes[0].inputs == (0, 1, 2, 3, 4)
    (got,) = run(payload, parts)
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1))  # data movement: exact


@pytest.mark.xnnpack
@pytest.mark.parametrize("stride, padding, adjustment, groups, dilation", [
    (2, 1, 1, 1, 1), (1, 0, 0, 2, 1), (3, (0, 1, 2, 0), (2, 0), 4, 1), (2, 0, 0, 1, 2)])
def test_conv_transpose2d_against_torch_and_runtime(stride: int, padding: object, adjustment: object,
                                                     groups: int, dilation: int) -> None:
    """XNNConvTranspose2d against torch's conv_transpose2d (padding there is symmetric only,
    so an asymmetric crop is checked by slicing torch's uncropped result)."""
    import torch

    from xnnquant.graph import run

    rng = np.random.default_rng(groups)
    x = rng.standard_normal((2, 5, 6, 8)).astype(np.float32)  # NHWC
    w = rng.standard_normal((12, 3, 3, 8 // groups)).astype(np.float32)  # [OC, KH, KW, IC/g]
    b = rng.standard_normal(12).astype(np.float32)
    g = Graph(target="1.4.1")
    g.output(g.conv_transpose2d(g.input(x.shape), g.constant(w), g.constant(b), stride=stride, padding=padding,
                                adjustment=adjustment, groups=groups, dilation=dilation))
    payload = g.to_bytes()
    (got,) = run(payload, [x])
    (interpreted,) = interpret(payload, [x])
    # torch: weight [IC, OC/g, KH, KW], NCHW; computed uncropped (the adjustment is torch's
    # output_padding: extra bottom rows / right columns), then cropped (top, right, bottom, left)
    adj = (adjustment, adjustment) if isinstance(adjustment, int) else adjustment
    tw = torch.from_numpy(w).reshape(groups, 12 // groups, 3, 3, 8 // groups).permute(0, 4, 1, 2, 3)
    full = torch.nn.functional.conv_transpose2d(
        torch.from_numpy(x).permute(0, 3, 1, 2).double(), tw.reshape(8, 12 // groups, 3, 3).double(),
        torch.from_numpy(b).double(), stride=stride, output_padding=adj, groups=groups, dilation=dilation)
    pads = (padding,) * 4 if isinstance(padding, int) else padding
    top, right, bottom, left = pads
    h, wd = full.shape[2], full.shape[3]
    expected = full[:, :, top:h - bottom, left:wd - right].permute(0, 2, 3, 1).numpy()
    scale = np.abs(expected).max()
    # float32 sums of 27 products against float64: relative 1e-6 of the output range
    assert got.shape == expected.shape
    assert np.abs(interpreted - expected).max() <= 1e-6 * scale
    assert np.abs(got - expected).max() <= 1e-5 * scale
