"""xq.export with an activation-aware method calibrates sequentially: each linear on the
inputs that the already-quantized linears before it produce (frontend/calibration.py).

Oracle: the same calibration done by hand with the public verbs (``xq.Calibration``,
``xq.quantize_blockwise``), whose packed codes must appear, byte for byte, in the
exported payload; then the program runs on the real XNNPACK and matches the reference
interpreter node by node (``xq.verify``).
"""

from __future__ import annotations

import pytest

import xnnquant as xq
from xnnquant.metrics import sqnr_db

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack


class TwoBranches(torch.nn.Module):
    """``a`` and ``b`` read the same input (one stage), ``c`` reads what they produce."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.c = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.a(x)) * torch.tanh(self.b(x)))


def _model() -> tuple[TwoBranches, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    module = TwoBranches().eval()
    with torch.no_grad():  # a few loud input channels, as real activations have
        module.a.weight[:, :4] *= 8
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 40, 64, generator=gen) * torch.linspace(0.2, 3.0, 64),) for _ in range(3)]
    return module, batches


def _by_hand(module: TwoBranches, batches: list[tuple[torch.Tensor]], sequential: bool) -> dict[str, xq.QuantizedTensor]:
    """Every linear quantized with gptq qb4w:32, calibrated on float inputs or sequentially
    (c's inputs computed by a copy of the module whose a and b hold their dequantized
    weights, so with the very same torch arithmetic as the export's)."""
    import copy

    first = xq.Calibration(64)
    for (x,) in batches:
        first.add(x)
    out = {name: xq.quantize_blockwise(getattr(module, name).weight.detach().numpy(), 32, "gptq", calibration=first)
           for name in "ab"}
    twin = copy.deepcopy(module)
    if sequential:
        for name in "ab":
            getattr(twin, name).weight = torch.nn.Parameter(torch.from_numpy(out[name].dequantize()))
    second = xq.Calibration(64)
    twin.c.register_forward_pre_hook(lambda _, args: second.add(args[0].detach()) and None)
    with torch.no_grad():
        for batch in batches:
            twin(*batch)
    out["c"] = xq.quantize_blockwise(module.c.weight.detach().numpy(), 32, "gptq", calibration=second)
    return out


def test_each_linear_is_calibrated_on_what_the_quantized_ones_before_it_produce() -> None:
    module, batches = _model()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    exported = xq.export(module, batches[0], weights="qb4w:32", method="gptq", calibration=iter(batches),
                         progress=False)
    payload = exported.to_bytes()
    sequential, floating = _by_hand(module, batches, True), _by_hand(module, batches, False)
    for name in "abc":
        assert sequential[name].to_bytes() in payload, name
    # the oracle can tell: calibrated on the float model's activations, c differs
    assert floating["c"].to_bytes() != sequential["c"].to_bytes()
    assert floating["c"].to_bytes() not in payload
    # the module's own weights are back as they were
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the real XNNPACK computes what the reference interpreter does (xq.verify's 1e-4 of
    # each output's range), and stays near the float module (int4 weights: >= 14 dB, as
    # test_export_models' bound for qb4w:32)
    report = xq.verify(exported, batches[0], module)
    assert report.ok, str(report)
    x = batches[0][0]
    (got,) = exported.run(x)
    with torch.no_grad():
        want = module(x).numpy()
    assert sqnr_db(want, got) >= 14.0


def test_act_mse_too_and_refused_layers_stay_refused() -> None:
    module, batches = _model()
    exported = xq.export(module, batches[0], weights="qb4w:32", method="act_mse", calibration=batches,
                         progress=False)
    first = xq.Calibration(64)
    for (x,) in batches:
        first.add(x)
    expected = xq.quantize_blockwise(module.a.weight.detach().numpy(), 32, "act_mse", calibration=first)
    assert expected.to_bytes() in exported.to_bytes()
    # group 128 fits none of these layers (in_features 64): refused as without calibration
    with pytest.raises(xq.UnsupportedConfigError, match="group size 128 does not divide in_features 64"):
        xq.export(module, batches[0], weights="qb4w:128", method="gptq", calibration=batches, fallback=None,
                  progress=False)
    # with a fallback, the refused layers take it (qc8w, calibrated sequentially as well)
    fell = xq.export(module, batches[0], weights="qb4w:128", method="gptq", fallback="qc8w", calibration=batches,
                     progress=False)
    expected = xq.quantize_per_channel(module.a.weight.detach().numpy(), 8, method="gptq", calibration=first)
    assert expected.to_bytes() in fell.to_bytes()


def test_a_layer_without_statistics_is_refused_by_name() -> None:
    """A grouped convolution gets no calibration: refused saying why, not 'calibration=None'."""
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, groups=2), torch.nn.Flatten(),
                                 torch.nn.Linear(8 * 6 * 6, 32)).eval()
    x = torch.randn(1, 4, 8, 8)
    with pytest.raises(xq.UnsupportedConfigError,
                       match=r"module 0\): method 'gptq' has no calibration statistics for this layer: got none, "
                             r"expected the inputs of a linear or a one-group convolution reached by the calibration "
                             r"batches"):
        xq.export(module, (x,), weights="qc8w", method="gptq", calibration=[(x,)], progress=False)
