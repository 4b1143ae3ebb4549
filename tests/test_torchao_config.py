"""``XnnquantConfig``: torchao's ``quantize_`` with our codes and scales, through ExecuTorch.

The ``.pte`` comes from ExecuTorch 1.4.1's unchanged flow (``tests/oracles/et_programs.py``:
``quantize_(model, XnnquantConfig(...))``, ``to_edge_transform_and_lower`` with
``XnnpackPartitioner``, ``to_executorch``).  Read back with ``read_pte``, every weight
must hold exactly the codes and scales our schemes compute from the float weights, and
the ExecuTorch runtime's outputs must be what the reference interpreter computes from
those payloads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xnnquant import Datatype as D
from xnnquant.errors import XnnquantError
from xnnquant.rounding import to_bf16

try:
    import torch
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor
except ImportError:
    if os.environ.get("CI", "").lower() == "true":  # CI installs the dev extra: never skip silently there
        raise
    pytest.skip("needs torch and torchao (the torchao extra)", allow_module_level=True)

from xnnquant.torchao import XnnquantConfig, calibrate, executorch_quantize, parse_scheme

#: (method, layer) -> (config, datatype and group size ExecuTorch 1.4.1 writes), as in the oracle.
EXPECTED = {
    ("forward", "fc1"): (XnnquantConfig("qb4w:32", method="mse"), D.qbint4, 32),
    ("forward", "fc2"): (XnnquantConfig("qc4w", method="minmax"), D.qbint4, 64),  # qc4w -> one group per row
    ("forward", "fc3"): (XnnquantConfig("qc8w", method="mse"), D.qcint8, None),
    ("head", "proj"): (XnnquantConfig("qb4w:64", method="minmax"), D.qbint4, 64),
}


def fc_weights(program, method):
    """Filter values of the fully-connected nodes of ``method``, delegate by delegate."""
    return [d.graph.value(n.inputs[1]) for d in program.method_delegates(method)
            for n in d.graph.nodes if n.kind == "XNNFullyConnected"]


@pytest.mark.xnnpack
def test_the_pte_holds_exactly_our_codes_and_scales(et_programs: Path) -> None:
    from xnnquant.pte import read_pte

    program = read_pte(et_programs / "xnnquant.pte")
    weights = {("forward", n): w for n, w in zip(("fc1", "fc2", "fc3"), fc_weights(program, "forward"))}
    weights[("head", "proj")] = fc_weights(program, "head")[0]
    for (method, layer), (config, datatype, group) in EXPECTED.items():
        value = weights[(method, layer)]
        ours = executorch_quantize(config.scheme, np.load(et_programs / f"float_{method}_{layer}.npy"), config.method)
        assert value.datatype is datatype and getattr(value.quant, "group_size", None) == group, layer
        assert value.constant == ours.to_bytes(), layer  # the codes, byte for byte
        # the scales, byte for byte, as read from the named data the payload points at
        if datatype is D.qbint4:  # bf16 bits; ours are bf16-exact, so ExecuTorch's rounding kept them
            np.testing.assert_array_equal(value.quant.scale_bf16, to_bf16(ours.scale).bits.reshape(-1))
        else:
            assert value.quant.scale.tobytes() == ours.scale.tobytes()
        got = value.quantized_tensor()
        np.testing.assert_array_equal(got.codes, ours.codes)
        np.testing.assert_array_equal(got.scale, ours.scale.reshape(got.scale.shape))


@pytest.mark.xnnpack
def test_executorch_lowers_weight_only_linears_wrongly(et_programs: Path) -> None:
    """activations=None, measured with ExecuTorch 1.4.1 (torchao's own IntxWeightOnlyConfig does
    the same): the delegate holds an fp32 weight equal to the integer *codes*, and the scale
    and zero point, passed to the delegate as arguments, are used by nothing, so the program
    computes ``x @ codes.T`` instead of ``x @ (codes * scale).T``.  If this test fails,
    ExecuTorch changed: revisit XnnquantConfig's warning."""
    from xnnquant.pte import read_pte

    (weight,) = fc_weights(read_pte(et_programs / "xnnquant.pte"), "weight_only")
    ours = XnnquantConfig("qc8w", method="mse").scheme.quantize(np.load(et_programs / "float_weight_only_proj.npy"),
                                                                 "mse")
    assert weight.datatype is D.fp32 and weight.dims == (24, 128) and len(weight.constant) == 24 * 128 * 4
    np.testing.assert_array_equal(weight.array(), ours.codes.astype(np.float32))
    eager, program = np.load(et_programs / "eager_weight_only.npy"), np.load(et_programs / "output_weight_only.npy")
    assert np.abs(program).max() > 100 * np.abs(eager).max()  # int8 codes are ~1 / scale ~ 1000x the weights


def test_weight_only_config_warns() -> None:
    with pytest.warns(UserWarning, match="ExecuTorch 1.4.1's XnnpackPartitioner drops the scales of weight-only"):
        XnnquantConfig("qc8w", activations=None)


def test_the_runtime_computes_what_the_payloads_say(et_programs: Path) -> None:
    """forward = delegate 0, cumsum (not delegated), delegate 1 (whose first node divides by the
    program constant 8, an input of the delegate); head = delegate 0."""
    from xnnquant.graph import interpret
    from xnnquant.pte import read_pte

    program = read_pte(et_programs / "xnnquant.pte")
    first, second = (d.graph for d in program.method_delegates("forward"))
    x = np.load(et_programs / "input_forward.npy")
    between = np.cumsum(interpret(first, [x])[0], axis=-1, dtype=np.float32)
    got = interpret(second, [between, np.array([8], np.float32)])[0]
    want = np.load(et_programs / "output_forward.npy")
    # float sums in another order; per-token int8 quantization can move a near-tie value one step
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    head = program.method_delegates("head")[0].graph
    want = np.load(et_programs / "output_head.npy")
    assert np.abs(interpret(head, [x])[0] - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.xnnpack
def test_a_decoders_linears_hold_our_numbers_and_run_as_torchao_computes_them(et_programs: Path) -> None:
    """transformers' Llama (one layer; ``Decoder`` of the oracle) with every linear quantized by
    ``quantize_(model, XnnquantConfig("qb4w:32", method="mse"))`` and lowered by ExecuTorch's own
    flow, which places its 8 linears (q, k, v, o, gate, up, down, the LM head) in delegates
    among the embedding, norms, rotary and attention: each is a fully connected node holding
    exactly the codes and bf16 scales our scheme computes from its float weight.  The runtime's
    logits are the quantized torch module's: both quantize each row of activations per token,
    asymmetric, from floats that differ by float32 rounding (sums in another order, XNNPACK's
    softmax and SiLU: ``float_bounds.APPROXIMATED``), which can move a code at a near tie by one
    step, a change of about 1e-3 of the largest logit (a hidden row's range / 255 times the
    weights after it); measured 3e-7, no code moved."""
    from xnnquant.pte import read_pte

    held = fc_weights(read_pte(et_programs / "decoder.pte"), "forward")
    floats = sorted(et_programs.glob("float_decoder_*.npy"))
    assert len(held) == len(floats) == 8
    for path in floats:
        ours = executorch_quantize(parse_scheme("qb4w:32"), np.load(path), "mse")
        same = [v for v in held if v.constant == ours.to_bytes()]
        assert len(same) == 1, path.name
        assert same[0].datatype is D.qbint4 and same[0].quant.group_size == 32, path.name
        np.testing.assert_array_equal(same[0].quant.scale_bf16, to_bf16(ours.scale).bits.reshape(-1))
    eager, program = np.load(et_programs / "eager_decoder.npy"), np.load(et_programs / "output_decoder.npy")
    assert np.abs(program - eager).max() <= 1e-3 * np.abs(eager).max()


# ------------------------------------------------------------------- in process, no ExecuTorch


class Mlp(torch.nn.Module):
    def __init__(self, k2: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(128, k2)
        self.fc2 = torch.nn.Linear(k2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


@pytest.mark.parametrize("weights, target, group", [("qb4w:32", torch.int4, 32), ("qc4w", torch.int4, 128),
                                                     ("qc8w", torch.int8, 128)])
def test_quantize_swaps_in_torchaos_tensor_with_our_numbers(weights: str, target, group: int) -> None:
    torch.manual_seed(0)
    model = Mlp()
    w = model.fc1.weight.detach().numpy().copy()
    quantize_(model, XnnquantConfig(weights, method="mse"))
    tensor = model.fc1.weight
    assert isinstance(tensor, IntxUnpackedToInt8Tensor)
    ours = executorch_quantize(parse_scheme(weights), w, "mse")
    np.testing.assert_array_equal(tensor.qdata.numpy(), ours.codes)
    np.testing.assert_array_equal(tensor.scale.numpy(), ours.scale.reshape(64, -1))
    assert not tensor.zero_point.any() and tensor.zero_point.dtype == torch.int8
    assert tensor.block_size == (1, group) and tensor.target_dtype == target
    assert tensor.activation_quantization == "int8_asym_per_token"


def test_weight_only_keeps_the_activations_float() -> None:
    model = Mlp()
    with pytest.warns(UserWarning):
        config = XnnquantConfig("qc8w", activations=None)
    quantize_(model, config)
    assert model.fc2.weight.activation_quantization is None


def test_a_layer_that_does_not_fit_is_refused_by_name_or_skipped_by_the_filter() -> None:
    config = XnnquantConfig("qb4w:32")
    with pytest.raises(XnnquantError, match=r"layer 'fc2' does not fit weights='qb4w:32': group size 32 does not "
                                            r"divide in_features 48 \(group sizes that do: none\); to skip such layers "
                                            r"pass filter_fn=config.fits"):
        quantize_(Mlp(k2=48), config)
    model = Mlp(k2=48)
    quantize_(model, config, filter_fn=config.fits)
    assert isinstance(model.fc1.weight, IntxUnpackedToInt8Tensor)
    assert not isinstance(model.fc2.weight, IntxUnpackedToInt8Tensor)
    with pytest.raises(XnnquantError, match=r"layer 'fc2' does not fit weights='qc4w': in_features=48 is not a "
                                            r"multiple of 32 \(ExecuTorch 1.4.1 writes qc4w as qbint4 with one group "
                                            r"per row; XNNPACK's int4 blocks are multiples of 32; fits: qc8w only\)"):
        quantize_(Mlp(k2=48), XnnquantConfig("qc4w"))
    with pytest.raises(XnnquantError, match=r"layer 'fc1' does not fit weights='qb4w:256': group size 256 does not "
                                            r"divide in_features 128 \(group sizes that do: 32, 64, 128\)"):
        quantize_(Mlp(), XnnquantConfig("qb4w:256"))


def test_bad_config_values() -> None:
    with pytest.raises(XnnquantError, match=r"qb4w group size must be a positive multiple of 32: got 48"):
        XnnquantConfig("qb4w:48")
    with pytest.raises(XnnquantError, match="unknown method: got 'hqq', expected one of minmax, mse"):
        XnnquantConfig(method="hqq")
    with pytest.raises(XnnquantError, match="unknown activations: got 'int4', expected 'int8_dynamic' or None"):
        XnnquantConfig(activations="int4")
    with pytest.raises(XnnquantError, match=r"weights='fp32' quantizes nothing: expected one of qb4w:<group size>, "
                                            r"qc4w, qc8w"):
        XnnquantConfig("fp32")
    assert str(parse_scheme("qb4w:64")) == "qb4w:64" and str(parse_scheme("qc4w")) == "qc4w"


def run_python(code: str) -> subprocess.CompletedProcess:
    root = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_xnnquant_stays_free_of_torch_and_a_missing_torchao_names_the_extra() -> None:
    proc = run_python("import sys, xnnquant, xnnquant.pte; "
                      "print(sorted(m for m in ('torch', 'torchao', 'executorch') if m in sys.modules))")
    assert proc.stdout.strip() == "[]", proc.stderr[-2000:]
    proc = run_python("import sys; sys.modules['torchao'] = None\n"
                      "try:\n    import xnnquant.torchao\nexcept ImportError as e:\n    print(type(e).__name__, e)")
    assert proc.stdout.startswith("MissingExtraError xnnquant.torchao (quantize_ configs for ExecuTorch) needs the "
                                  "'torchao' package, which is not installed: install the extra with  pip install "
                                  "'xnnquant[torchao]'"), proc.stderr[-2000:]


# ------------------------------------------------------------------- activation-aware methods


def test_gptq_through_quantize_with_calibrate() -> None:
    """calibrate() collects each linear's inputs as XNNPACK's dynamic path sees them; the
    config then gives each layer exactly what quantize_blockwise / quantize_per_channel give
    for the same weight and calibration."""
    import xnnquant as xq

    torch.manual_seed(0)
    model = Mlp()
    weights = {name: getattr(model, name).weight.detach().numpy().copy() for name in ("fc1", "fc2")}
    batches = [torch.randn(64, 128) for _ in range(3)]
    calibration = calibrate(model, batches)
    assert sorted(calibration) == ["fc1", "fc2"] and calibration["fc1"].tokens == 192
    assert calibration["fc1"].runtime_quantized
    expected = xq.Calibration(128, runtime_quantized=True)
    for x in batches:  # batch by batch as the hook adds them: the same float32 chunks, summed alike
        expected.add(x)
    np.testing.assert_array_equal(calibration["fc1"].gram, expected.gram)
    quantize_(model, XnnquantConfig("qb4w:32", method="gptq", calibration=calibration), filter_fn=lambda m, n: n == "fc1")
    quantize_(model, XnnquantConfig("qc8w", method="act_mse", calibration={model.fc2: calibration["fc2"]}),
              filter_fn=lambda m, n: n == "fc2")
    ours = xq.quantize_blockwise(weights["fc1"], 32, method="gptq", calibration=calibration["fc1"])
    np.testing.assert_array_equal(model.fc1.weight.qdata.numpy(), ours.codes)
    np.testing.assert_array_equal(model.fc1.weight.scale.numpy(), ours.scale)
    ours = xq.quantize_per_channel(weights["fc2"], bits=8, method="act_mse", calibration=calibration["fc2"])
    np.testing.assert_array_equal(model.fc2.weight.qdata.numpy(), ours.codes)
    np.testing.assert_array_equal(model.fc2.weight.scale.numpy().reshape(-1), ours.scale)


def test_activation_aware_refusals() -> None:
    with pytest.raises(XnnquantError, match=r"method 'gptq' needs calibration: got none"):
        XnnquantConfig(method="gptq")
    with pytest.raises(XnnquantError, match=r"method 'mse' does not use calibration: got a calibration mapping"):
        XnnquantConfig(method="mse", calibration={"fc1": np.ones((4, 128), np.float32)})
    config = XnnquantConfig(method="gptq", calibration={"fc1": np.ones((200, 128), np.float32)})
    with pytest.raises(XnnquantError, match=r"layer 'fc2': method 'gptq' needs its calibration, and the mapping has "
                                            r"none for it \(keys: 'fc1'\)"):
        quantize_(Mlp(), config)
