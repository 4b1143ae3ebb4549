"""The module traced at the calibration batches' shapes.

An export whose calibration batches have other shapes than the example inputs runs them on
the module traced at their shapes (``batches.CalibrationData.programs_for``).  At one or two
shapes, ``batches.fx_traced`` traces it with ``make_fx`` at about half torch.export's cost
(issue 24's GPTQ export of MiniLM spent 0.8 s of its 6.6 s in torch.export's two traces).
The oracle is torch.export itself: the quick program must be torch.export's program at that
shape, node for node, every argument equal, sizes included, and every constant equal.  Where
the two tracers could differ (a trace unlike the example's), the quick one is refused and
torch.export traces the batch; the exported bytes are the same either way.  A module whose
calibrated layers are all ``nn.Linear`` calls runs the batches itself instead
(``frontend/eager.py``, ``test_calibration_eager.py``): here that is switched off.
"""

from __future__ import annotations

from typing import Any

import pytest

import xnnquant as xq
from xnnquant.frontend import batches, eager
from xnnquant.frontend.batches import CalibrationData, fx_traced
from xnnquant.frontend.passes import BEFORE_CALIBRATION, run_passes
from xnnquant.frontend.program import AtenProgram

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _traced_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of other shapes run on traced programs, never through the module itself."""
    monkeypatch.setattr(eager, "statistics", lambda *args: None)


def _reference(module: Any, example: tuple[Any, ...]) -> tuple[Any, AtenProgram]:
    """torch.export's program of ``module`` at the example's shapes, and the program the
    calibration compares a quick trace with (after the passes before calibration)."""
    exported = torch.export.export(module, example, strict=False)
    program = AtenProgram.of(exported)
    run_passes(program, None, BEFORE_CALIBRATION)
    return exported, program


def _listing(program: AtenProgram) -> list[Any]:
    """Every node as (op, target, every argument with defaults written out, nodes as their
    positions): two programs with equal listings compute the same thing."""
    index = {n: i for i, n in enumerate(program.graph.nodes)}
    return [(n.op, str(n.target), repr(torch.fx.node.map_arg(batches._arguments(n), lambda m: f"%{index[m]}")))
            for n in program.graph.nodes]


def _check_quick_trace(module: Any, first: tuple[Any, ...], batch: tuple[Any, ...], sized: bool = True) -> bool:
    """Trace ``module`` quickly at ``batch``'s shapes, checked against torch.export's program at
    ``first``'s (the example's, or the batches' first shape), as an export does; when that is
    accepted, assert it is torch.export's program at ``batch``'s shapes.  True when accepted."""
    exported, reference = _reference(module, first)
    quick = fx_traced(module, batch, exported, reference)
    if quick is None:
        return False
    slow = CalibrationData.parse([batch])._traced(module, 0, (), dynamic=False)  # torch.export at the batch's shape
    assert _listing(quick) == _listing(slow)
    if sized:  # the oracle can tell: the sizes differ from the reference's
        assert _listing(quick) != _listing(reference)
    assert [AtenProgram.module_path(n) for n in quick.graph.nodes] == \
        [AtenProgram.module_path(n) for n in slow.graph.nodes]  # layers named alike (layer_path)
    assert quick.inputs == slow.inputs and sorted(quick.constants) == sorted(slow.constants)
    for name, tensor in slow.constants.items():
        assert torch.equal(quick.constants[name], tensor), name
    return True


class Encoder(torch.nn.Module):
    """Sizes flow into views; a float cast, a mask, an arange of positions and a lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(32, 64)
        self.qkv = torch.nn.Linear(64, 192)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, 64)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        h = self.norm(h + self.positions(torch.arange(t)))
        q, k, v = self.qkv(h).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 4 + ((1 - mask.to(torch.float32)) * -1e4)[:, None, None, :]
        return self.out((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, 64))


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(y.mean(dim=(2, 3)))


def _encoder_inputs(batch: int, tokens: int, seed: int = 0) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, tokens, dtype=torch.int64)
    mask[0, tokens - 2:] = 0
    return torch.randn(batch, tokens, 64, generator=gen), mask


@pytest.mark.parametrize("name", ["encoder", "convnet"])
def test_the_quick_trace_is_torch_exports_program_at_the_batch_shape(name: str) -> None:
    """Against the example's program.  The convolutional net has no size in any argument (its
    programs at two shapes list alike)."""
    torch.manual_seed(0)
    if name == "encoder":
        module: Any = Encoder().eval()
        example, batch = _encoder_inputs(1, 8), _encoder_inputs(3, 13, seed=1)
    else:
        module = ConvNet().eval()
        example, batch = (torch.randn(1, 3, 16, 16),), (torch.randn(4, 3, 24, 20),)
    assert _check_quick_trace(module, example, batch, sized=name == "encoder")


#: transformers models: whether the quick trace is taken.  Llama: torch.export wraps the
#: rotary embedding's no_grad region in a higher-order op where make_fx records two
#: ``_set_grad_enabled`` calls; ViT: its constant subgraphs fold into other placeholders.
#: Both are refused and traced by torch.export.
TAKEN = {"bert": True, "gpt2": True, "t5_encoder": True, "resnet": True, "llama": False, "vit": False}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TAKEN))
def test_the_quick_trace_of_transformers_models(name: str) -> None:
    """Real architectures, ``fx_traced`` called directly (an export tries it only when it
    decomposes nothing, which these mostly need), checked against torch.export's program at
    the first batch's shape (the example's, at batch 1, can differ from a batch's:
    transformers' mask code depends on sizes).  Text models at another length (GPT-2 reads its rows through ``view(-1, K)``),
    vision models at another batch size."""
    pytest.importorskip("transformers")
    import hf_models

    module, example = hf_models.ARCHITECTURES[name]("eager")

    def batch(size: int, tokens: int) -> tuple[Any, ...]:
        if name not in hf_models.TEXT:
            return (example[0].expand(size, *example[0].shape[1:]).contiguous(),)
        ids = torch.randint(2, 128, (size, tokens), generator=torch.Generator().manual_seed(tokens))
        return (ids, torch.ones_like(ids))[:len(example)]

    text = name in hf_models.TEXT
    assert _check_quick_trace(module, batch(2, 7), batch(2 if text else 3, 9), sized=text) == TAKEN[name]


def _export(module: Any, example: tuple[Any, ...], data: list[Any], **kwargs: Any) -> bytes:
    exported = xq.export(module, example, weights="qb4w:32", method="gptq", calibration=data, progress=False,
                         check=False, **kwargs)
    return exported.to_pte()


def test_an_export_is_the_same_with_either_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batch shapes, both traced quickly; the same .pte bytes when torch.export traces them."""
    torch.manual_seed(0)
    module = Encoder().eval()
    data = [_encoder_inputs(3, 13, seed=1), _encoder_inputs(2, 11, seed=2)]
    calls: list[bool] = []

    def spy(*args: Any) -> Any:
        program = fx_traced(*args)
        calls.append(program is not None)
        return program

    monkeypatch.setattr(batches, "fx_traced", spy)
    quick = _export(module, _encoder_inputs(1, 8), data, calibration_mask=1)
    assert calls == [True, True]
    monkeypatch.setattr(batches, "fx_traced", lambda *args: None)
    assert _export(module, _encoder_inputs(1, 8), data, calibration_mask=1) == quick


class Summed(torch.nn.Module):
    """A linear whose filter is folded from two parameters (``a + b``: no name of its own, so the
    module it ran in names it), then an ``nn.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.a = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.inner.b = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.out = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(torch.nn.functional.linear(x, self.inner.a + self.inner.b)))


def test_a_filter_without_a_name_is_calibrated_on_quick_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The folded ``a + b`` is named by its node's module stack, which make_fx does not record:
    the quick programs take the reference's, else the layer's statistics were filed under
    another name and the export refused it ("no calibration statistics")."""
    torch.manual_seed(0)
    module = Summed().eval()
    example = (torch.randn(1, 6, 64),)
    data = [(torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(b)),) for b in range(2)]
    quick = _export(module, example, data)
    monkeypatch.setattr(batches, "fx_traced", lambda *args: None)
    assert _export(module, example, data) == quick


class ShapeScaled(torch.nn.Module):
    """A float computed from a size (``1 / t``): each shape's trace holds its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * (1.0 / x.shape[1]))


class ShapeBranch(torch.nn.Module):
    """Python control flow on a size: the batch's trace has other nodes than the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(x) if x.shape[1] > 8 else x)


class TensorAttribute(torch.nn.Module):
    """A plain tensor attribute (neither parameter nor buffer): torch.export lifts it as a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.scale = torch.linspace(0.5, 2.0, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * self.scale)


@pytest.mark.parametrize("make", [ShapeScaled, ShapeBranch, TensorAttribute])
def test_where_the_tracers_could_differ_torch_export_traces(make: Any) -> None:
    """The quick trace is refused (a float argument unlike the example's, other nodes, a lifted
    constant it cannot name), and the export, traced by torch.export, still calibrates each
    batch at its shape: the same codes as the module's linear calibrated by hand."""
    torch.manual_seed(0)
    module = make().eval()
    example = (torch.randn(1, 6, 64),)
    data = [(torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(b)),) for b in range(2)]
    assert not _check_quick_trace(module, example, data[0])
    payload = xq.export(module, example, weights="qb4w:32", method="gptq", calibration=data, progress=False,
                        check=False).to_bytes()
    inputs: list[Any] = []
    module.fc.register_forward_hook(lambda _, args, __: inputs.append(args[0].reshape(-1, 64).numpy()))
    with torch.no_grad():
        for batch in data:
            module(*batch)
    calibration = xq.Calibration(64)
    for x in inputs:
        calibration.add(x)
    by_hand = xq.quantize_blockwise(module.fc.weight.detach().numpy(), 32, "gptq", calibration=calibration)
    assert by_hand.to_bytes() in payload
