"""Programs that once came out of ``xq.export`` wrong, run on ExecuTorch's runtime against the module.

Each case ran without error and gave a wrong answer before it was fixed:

* a transposed convolution followed by batch norm: the batch norm was planned for folding
  but never folded, and its own lowering passed its input through (relative error 0.78);
* batch norm on a channels-last input: the program declared a contiguous input, and
  ExecuTorch's runtime reads a tensor's memory in the declared order whatever its strides
  (relative error 1.9).

The program is fed to ``executorch.runtime`` as a user would, from ``to_pte()`` bytes.

Bound: float32 programs of a few dozen products per output; each output differs from
torch's by the rounding of its sums taken in another order (at most ``n * 2**-24`` of the
sum of the magnitudes, n <= 54 here) and of the folded float64 weights rounded to float32:
well under ``1e-5`` of the output's largest magnitude, while a fault is off by its size.
"""

from __future__ import annotations

import pytest
from float_bounds import relative_error

import xnnquant as xq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack

BOUND = 1e-5  # relative to the largest output magnitude (see the module docstring)


def _batch_norm(channels: int, seed: int) -> torch.nn.BatchNorm2d:
    gen = torch.Generator().manual_seed(seed)
    bn = torch.nn.BatchNorm2d(channels)
    bn.running_mean.copy_(torch.rand(channels, generator=gen) * 2 - 1)
    bn.running_var.copy_(torch.rand(channels, generator=gen) * 1.5 + 0.5)
    bn.weight.data.copy_(torch.rand(channels, generator=gen) * 1.5 + 0.5)
    bn.bias.data.copy_(torch.rand(channels, generator=gen) - 0.5)
    return bn


class TransposedThenNorm(torch.nn.Module):
    def __init__(self, groups: int, bias: bool) -> None:
        super().__init__()
        self.conv = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups,
                                             bias=bias)
        self.bn = _batch_norm(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class SharedNorm(torch.nn.Module):
    """One batch norm module after two transposed convolutions (two batch-norm nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.ConvTranspose2d(4, 6, 2, stride=2)
        self.b = torch.nn.ConvTranspose2d(4, 6, 3, padding=1, bias=False)
        self.bn = _batch_norm(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.a(x))[..., :5, :5] + self.bn(self.b(x))


class NormThenConv(torch.nn.Module):
    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.bn = _batch_norm(3, 3)
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1) if conv else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.bn(x))


def _on_executorch(pte: bytes, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)  # kept alive while its method runs
    method = program.load_method("forward")
    return [t.clone() for t in method.execute(inputs)]


def _check(module: torch.nn.Module, x: torch.Tensor) -> xq.Exported:
    module = module.eval()
    with torch.no_grad():
        ref = module(x)
    exported = xq.export(module, (x,), weights="fp32", progress=False)
    (got,) = _on_executorch(exported.to_pte(), [x])
    assert relative_error(got, ref) < BOUND
    (run,) = exported.run(x)
    assert relative_error(run, ref) < BOUND
    return exported


@pytest.mark.parametrize(("groups", "bias"), [(1, True), (1, False), (2, True)])
def test_batch_norm_after_a_transposed_convolution_is_folded_on_its_output_channels(groups: int, bias: bool) -> None:
    exported = _check(TransposedThenNorm(groups, bias), torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(0)))
    assert [n.kind for n in exported.graph.nodes].count("XNNConvTranspose2d") == 1


def test_a_batch_norm_shared_by_two_transposed_convolutions() -> None:
    _check(SharedNorm(), torch.randn(1, 4, 5, 5, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("conv", [False, True], ids=["alone", "before-conv"])
def test_channels_last_input_is_declared_and_read_in_its_dim_order(conv: bool) -> None:
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(0)).to(memory_format=torch.channels_last)
    module = NormThenConv(conv)
    exported = _check(module, x)
    assert exported.inputs[0].dim_order == (0, 2, 3, 1)
    # the graph reads the NHWC memory as it is: no transpose at the input
    assert "XNNStaticTranspose" not in [n.kind for n in exported.graph.nodes]
    # Exported.run lays out any strides as the program declares them
    with torch.no_grad():
        ref = module(x)
    (run,) = exported.run(x.contiguous())
    assert relative_error(run, ref) < BOUND


def test_contiguous_example_gives_a_contiguous_program() -> None:
    x = torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(0))
    exported = _check(NormThenConv(True), x)
    assert exported.inputs[0].dim_order == (0, 1, 2, 3) and exported.outputs[0].dim_order == (0, 1, 2, 3)


def test_saved_channels_last_program_declares_its_dim_order(tmp_path: object) -> None:
    from pathlib import Path

    x = torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(0)).to(memory_format=torch.channels_last)
    module = NormThenConv(True).eval()
    path = xq.export(module, (x,), weights="fp32", progress=False).save(Path(str(tmp_path)) / "m.pte")
    (got,) = _on_executorch(path.read_bytes(), [x])
    with torch.no_grad():
        assert relative_error(got, module(x)) < BOUND
