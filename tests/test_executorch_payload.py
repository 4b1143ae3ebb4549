"""A payload ExecuTorch 1.4.1 writes for a torchao-quantized MLP, read back and run.

Oracles: torchao 0.18 (the codes and scales it computed) and ExecuTorch 1.4.1 itself
(its serializer wrote the payload and named data; its runtime computed the outputs of
the ``.pte`` it wrote).  ``tests/oracles/et_payloads.py`` produces all of them in a
subprocess: importing ``executorch.backends.xnnpack`` into the pytest process would
register ExecuTorch's ``XnnpackBackend`` here.  The model (8-bit dynamic activations):

====  ==========  =====================================  ==========================
name  features    torchao weight config                  what ExecuTorch writes
====  ==========  =====================================  ==========================
fc1   128 -> 64   int4, PerGroup(32), fp32 scales        qbint4, group 32, bf16 scales
fc2   64 -> 48    int4, PerAxis(0), no bias              qbint4, group 64 (= K)
fc3   48 -> 16    int8, PerAxis(0)                       qcint8, fp32 scales
====  ==========  =====================================  ==========================
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from float_bounds import EPS, assert_within, dynamic_chain_bound, gamma, half_ulp

from xnnquant import Datatype as D
from xnnquant.errors import PayloadError
from xnnquant.graph import PerTokenDynamicQuant, interpret, load, run
from xnnquant.graph.interpreter import HANDLERS
from xnnquant.graph.layout import XN01_NODE_KINDS
from xnnquant.rounding import to_bf16

pytestmark = pytest.mark.xnnpack

ORACLE = Path(__file__).parent / "oracles" / "et_payloads.py"
LAYERS = ("fc1", "fc2", "fc3")
#: Node kinds ExecuTorch 1.4.1 appended to the schema that its own ``Later`` payload uses.
LATER_KINDS = {"XNNConvTranspose2d", "XNNTanh", "XNNExp", "XNNGelu", "XNNLog", "XNNSin", "XNNCos",
               "XNNReciprocalSquareRoot", "XNNConcatenate5"}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("et_payloads")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ORACLE), str(out)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def named_data(oracle: Path) -> dict[str, bytes]:
    return {f.stem: f.read_bytes() for f in sorted((oracle / "named").iterdir())}


@pytest.fixture(scope="module")
def payload(oracle: Path) -> bytes:
    return (oracle / "payload.bin").read_bytes()


def torchao(oracle: Path, name: str, field: str) -> np.ndarray:
    return np.load(oracle / f"torchao_{name}_{field}.npy")


def fully_connected_layers(graph):
    """(filter value, bias value or None) of each fully-connected node, in node order."""
    nodes = [n for n in graph.nodes if n.kind == "XNNFullyConnected"]
    return [(graph.value(n.inputs[1]), graph.value(n.inputs[2]) if len(n.inputs) > 2 else None) for n in nodes]


def test_structure_is_dynamic_quantization_into_three_linears(payload: bytes, named_data) -> None:
    graph = load(payload, named_data=named_data)
    assert [n.kind for n in graph.nodes] == ["XNNConvert", "XNNFullyConnected"] * 3
    for convert in graph.nodes[0::2]:
        out = graph.value(convert.outputs[0])
        assert out.datatype is D.qdint8 and out.quant == PerTokenDynamicQuant(1)
    filters = [w for w, _ in fully_connected_layers(graph)]
    assert [w.datatype for w in filters] == [D.qbint4, D.qbint4, D.qcint8]
    assert [w.quant.group_size for w in filters[:2]] == [32, 64]


def test_constants_live_in_named_data(payload: bytes, named_data) -> None:
    graph = load(payload)
    assert sorted(graph.load_info.named_keys) == sorted(named_data)
    assert sorted(graph.load_info.missing_named_keys) == sorted(named_data)
    assert any(k.startswith("scale_") for k in graph.load_info.named_keys)
    assert load(payload, named_data=named_data).load_info.missing_named_keys == ()


@pytest.mark.parametrize("index, name", list(enumerate(LAYERS)))
def test_decodes_to_torchao_codes_and_scales(oracle: Path, payload: bytes, named_data, index: int,
                                             name: str) -> None:
    weight, bias = fully_connected_layers(load(payload, named_data=named_data))[index]
    qt = weight.quantized_tensor()
    np.testing.assert_array_equal(qt.codes, torchao(oracle, name, "qdata"))
    assert np.all(torchao(oracle, name, "zero_point") == 0)  # symmetric: stored nibble 8, code 0
    scale = torchao(oracle, name, "scale").astype(np.float32)
    if weight.datatype is D.qbint4:
        # ExecuTorch 1.4.1 stores blockwise scales as bf16, rounded to nearest even
        np.testing.assert_array_equal(qt.scale, to_bf16(scale).values.reshape(qt.scale.shape))
    else:
        np.testing.assert_array_equal(qt.scale, scale.reshape(qt.scale.shape))
    if (oracle / f"torchao_{name}_bias.npy").exists():
        np.testing.assert_array_equal(bias.array(), torchao(oracle, name, "bias"))
    else:
        assert bias is None


def test_run_equals_executorch_own_program(oracle: Path, payload: bytes, named_data) -> None:
    """Our .pte around ExecuTorch's payload computes exactly what ExecuTorch's .pte does."""
    x = np.load(oracle / "input.npy")
    np.testing.assert_array_equal(run(payload, [x], named_data=named_data)[0], np.load(oracle / "et_output.npy"))


def test_interpreter_matches_executorch(oracle: Path, payload: bytes, named_data) -> None:
    """Three dynamically quantized linears, ReLU between them: bounded layer by layer
    (``dynamic_chain_bound``, which allows a one-step difference for the few hidden codes
    that the CPU's float rounding could move: 3 of 256 after fc1 with this input)."""
    x = np.load(oracle / "input.npy")
    want = np.load(oracle / "et_output.npy")
    graph = load(payload, named_data=named_data)
    got = interpret(graph, [x])[0]
    layers = [(w.quantized_tensor(), None if b is None else b.array(), relu)
              for (w, b), relu in zip(fully_connected_layers(graph), (True, True, False))]
    ref, bound = dynamic_chain_bound(x, layers)
    np.testing.assert_array_equal(got, ref)
    assert_within(want, ref, bound, "ExecuTorch's output")


def test_missing_named_data_is_an_error_not_a_crash(oracle: Path, payload: bytes, named_data) -> None:
    """The 1.4.1 runtime dereferences a null named-data map (segfault): refused up front."""
    x = np.load(oracle / "input.npy")
    with pytest.raises(PayloadError, match="named data"):
        run(payload, [x])
    partial = dict(list(named_data.items())[1:])
    with pytest.raises(PayloadError, match="got no bytes for 1 of its"):
        run(payload, [x], named_data=partial)


def test_to_pte_works_beside_executorch_own_xnnpack_backend(oracle: Path) -> None:
    """The oracle process imported ``executorch.backends.xnnpack``; ``run`` still worked."""
    x = np.load(oracle / "clash_input.npy")
    # an add then a multiply, each one correctly rounded x86 instruction in XNNPACK (see
    # float_bounds.XNNPACK_F32), as numpy's float32 arithmetic is: the same bits
    np.testing.assert_array_equal(np.load(oracle / "clash_output.npy"), (x + np.arange(5, dtype=np.float32)) * x)


def test_later_node_kinds_run_and_match_the_interpreter(oracle: Path) -> None:
    """ExecuTorch's payload with the kinds only 1.4.1's schema has: runtime vs interpreter.

    Inputs are positive (log and rsqrt of ``|a| + c`` need ``c > 0``; the payload takes
    the lifted scalar constants as external inputs).
    """
    later = oracle / "later"
    payload = (later / "payload.bin").read_bytes()
    named = {f.stem: f.read_bytes() for f in sorted((later / "named").iterdir())}
    graph = load(payload, named_data=named)
    kinds = {n.kind for n in graph.nodes}
    assert kinds >= LATER_KINDS and not LATER_KINDS & set(XN01_NODE_KINDS)
    assert kinds <= set(HANDLERS)
    rng = np.random.default_rng(0)
    inputs = [(rng.random(graph.value(i).dims) + 0.5).astype(np.float32) for i in graph.inputs]
    got = run(payload, inputs, named_data=named)
    want = interpret(graph, inputs)
    assert [a.shape for a in got] == [b.shape for b in want]
    # output 1: y, 2y, y + c, y - c, y * y concatenated: one correctly rounded x86 op each
    np.testing.assert_array_equal(got[1], want[1])
    # output 0: b = tanh(a) + exp(-|a|) + gelu(a) + log(|a| + c1) + sin(a) cos(a) + rsqrt(|a| + c2)
    # with a = deconv(x) and c1, c2 >= 0.5 (the lifted scalars, inputs here).  |a| <= A, the
    # largest sum|terms| of the deconvolution; a is off by gamma(17) A (at most 16 taps and
    # the bias per output).  The derivatives of the six terms add up to at most 8 (1, 1,
    # 1.13, 1 / c1 <= 2, 1, 0.5 c2^-1.5 <= 1.42), so a's error moves b by 8 times as much.
    # Each of the 7 transcendental kernels adds XNNPACK's bound, at most 10 eps max(1, A + 2)
    # (float_bounds.XNNPACK_F32 on values below A + 2), and each of the 8 adds and
    # multiplies half an ulp of a partial sum below 6 + 2 A.
    deconv = next(n for n in graph.nodes if n.kind == "XNNConvTranspose2d")
    x = inputs[0].astype(np.float64)  # the image; the deconvolution reads it transposed to NHWC
    assert inputs[0].ndim == 4
    w = np.abs(graph.value(deconv.inputs[1]).array().astype(np.float64))  # [OC, KH, KW, IC]
    bias = np.abs(graph.value(deconv.inputs[2]).array().astype(np.float64))
    big_a = np.abs(x).max() * w.sum(axis=(1, 2, 3)).max() + bias.max()
    d_a = gamma(17) * big_a + EPS * big_a
    bound = 8 * d_a + 7 * 10 * EPS * max(1.0, big_a + 2) + 8 * EPS * (6 + 2 * big_a) / 2 + half_ulp(want[0])
    assert_within(got[0], want[0], bound, "six transcendental terms of a deconvolution")
