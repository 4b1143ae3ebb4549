"""Sequential calibration on the module itself (``frontend/eager.py``).

Batches of other shapes than the example's run through the module, one thread per batch,
when its calibrated layers are ``nn.Linear`` calls; else through the module traced at their
shapes (``test_calibration_traces.py``).  Oracles: the traced path (the program's own run,
``eager.statistics`` switched off), which must give the same statistics and the same .pte
bytes, and, in ``test_calibration_graph.py``, an eager twin calibrated by hand.  Where the
module cannot stand in for the program (layers met in another order, a layer used twice, a
hook of the user's, inputs that do not fit), the traced path runs: same result, same error,
and the module's parameters are its own again.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import XnnquantError
from xnnquant.frontend import batches, eager
from xnnquant.frontend.calibration import LayerStatistics

torch = pytest.importorskip("torch")


class Block(torch.nn.Module):
    """Query, key and value reading one input, a layer norm, an MLP: a transformer layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))
        self.out = torch.nn.Linear(64, 64)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        x = self.norm(h)
        q, k, v = (layer(x).view(b, t, 4, 16).transpose(1, 2) for layer in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / 4 + ((1 - mask) * -1e4)[:, None, None, :]
        h = h + self.out((torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, 64))
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def _batches(lengths: list[int], seed: int = 4) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in lengths:
        h = torch.randn(3, t, 64, generator=gen) * torch.linspace(0.2, 3, 64)
        mask = torch.ones(3, t)
        mask[1, t - 3:] = 0  # padding
        out.append((h, mask))
    return out


EXAMPLE = (torch.randn(1, 8, 64), torch.ones(1, 8))


class _Spy:
    """Counts what each export took: the module's run (statistics), refusals (None), traces."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, off: bool = False) -> None:
        self.results: list[LayerStatistics | None] = []
        self.traces = 0
        real_statistics, real_fx, real_traced = eager.statistics, batches.fx_traced, batches.CalibrationData._traced

        def statistics(*args: Any) -> Any:
            found = None if off else real_statistics(*args)
            self.results.append(found)
            return found

        def fx_traced(*args: Any) -> Any:
            self.traces += 1
            return real_fx(*args)

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.traces += 1
            return real_traced(*args, **kwargs)

        monkeypatch.setattr(eager, "statistics", statistics)
        monkeypatch.setattr(batches, "fx_traced", fx_traced)
        monkeypatch.setattr(batches.CalibrationData, "_traced", traced)


def _export(module: Any, data: list[Any], example: tuple[Any, ...] = EXAMPLE, **kwargs: Any) -> bytes:
    return xq.export(module, example, weights="qb4w:32", method="gptq", calibration=data, calibration_mask=1,
                     progress=False, **kwargs).to_pte()


def _calibration_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("xnnquant-calibration")]


def _parameters(module: Any) -> list[tuple[str, Any, Any]]:
    return [(name, p, p.detach().clone()) for name, p in module.named_parameters()]


def _assert_own(module: Any, before: list[tuple[str, Any, Any]]) -> None:
    """The module holds the very parameters it held, with their values."""
    now = dict(module.named_parameters())
    assert sorted(now) == sorted(name for name, _, _ in before)
    for name, p, values in before:
        assert now[name] is p, name
        assert torch.equal(p.detach(), values), name


def test_the_module_calibrates_as_the_program_without_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batch shapes, neither the example's: no trace, the module's run; the same .pte as
    the traced path, to the byte; the module's parameters its own again, no thread left."""
    torch.manual_seed(0)
    module = Block().eval()
    before = _parameters(module)
    spy = _Spy(monkeypatch)
    ours = _export(module, _batches([10, 7]))
    assert spy.traces == 0 and len(spy.results) == 1 and spy.results[0] is not None
    assert sorted(spy.results[0].quantized) == ["down", "k", "out", "q", "up", "v"]
    _assert_own(module, before)
    assert not _calibration_threads()
    monkeypatch.undo()
    traced = _Spy(monkeypatch, off=True)
    assert _export(module, _batches([10, 7])) == ours
    assert traced.traces == 2  # the oracle is the traced path


def test_batches_that_fit_the_program_run_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of the example's shapes need no trace: the program runs them, as before."""
    torch.manual_seed(0)
    spy = _Spy(monkeypatch)
    _export(Block().eval(), _batches([8, 8]), example=(torch.randn(3, 8, 64), torch.ones(3, 8)))
    assert spy.results == [] and spy.traces == 0


def test_minilm_statistics_equal_the_programs_run() -> None:
    """The torch MiniLM encoder on real sentences, 2 batches of other lengths than the example's:
    each of the 36 linears gets the traced path's Gram matrix, codes and scales, exactly (the
    module computes with the kernels the program's ATen ops call)."""
    from xnnquant.frontend.calibration import statistics
    from xnnquant.frontend.options import ExportOptions
    from xnnquant.frontend.passes import BEFORE_CALIBRATION, PassOptions, run_passes
    from xnnquant.frontend.program import AtenProgram
    from xnnquant.models import minilm_torch
    from xnnquant.models.sentences import calibration_sentences

    module, example = minilm_torch.example()
    sentences = calibration_sentences()[:24]
    data = [minilm_torch.encoder_inputs(sentences[:14]), minilm_torch.encoder_inputs(sentences[14:])]
    assert len({tuple(h.shape) for h, _ in data} | {tuple(example[0].shape)}) == 3
    options = ExportOptions.parse(weights="qb4w:32", method="gptq", calibration=data, calibration_mask=1)
    exported = torch.export.export(module, example, strict=False)
    program = AtenProgram.of(exported)
    run_passes(program, PassOptions(None, False), BEFORE_CALIBRATION)
    ours = eager.statistics(module, program, options.calibration, options.policy, "gptq", keep_grams=True)
    assert ours is not None
    theirs = statistics(options.calibration.programs_for(module, program, (), exported), options.calibration,
                        options.policy, "gptq", keep_grams=True)
    assert len(ours.quantized) == 36 and sorted(ours.quantized) == sorted(theirs.quantized)
    for path, qt in theirs.quantized.items():
        assert np.array_equal(ours.grams[path].gram, theirs.grams[path].gram), path
        assert np.array_equal(ours.quantized[path].codes, qt.codes), path
        assert np.array_equal(ours.quantized[path].scale, qt.scale), path


class Reordered(torch.nn.Module):
    """Python control flow on a size that calls the layers in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) if x.shape[1] > 8 else self.a(torch.relu(self.b(x)))


class Twice(torch.nn.Module):
    """One linear called twice: its weight read by two nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(torch.relu(self.a(x))))


class Hooked(torch.nn.Module):
    """A hook of the user's changes what a linear reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.a.register_forward_pre_hook(lambda _, args: (args[0] * 2,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _plain(seed: int) -> list[tuple[Any]]:
    return [(torch.randn(2, t, 64, generator=torch.Generator().manual_seed(seed + t)),) for t in (12, 10)]


@pytest.mark.parametrize(("make", "taken"), [(Reordered, False), (Twice, False), (Hooked, False)])
def test_where_the_module_cannot_stand_in_the_program_runs(monkeypatch: pytest.MonkeyPatch, make: Any,
                                                          taken: bool) -> None:
    """Layers met in another order than the program's, a layer used twice, a user's hook: the
    traced path runs, with its result or its error, and the module's parameters are its own."""
    torch.manual_seed(0)
    module = make().eval()
    before = _parameters(module)
    data = _plain(1)

    def outcome() -> Any:
        try:
            return xq.export(module, (torch.randn(1, 6, 64),), weights="qb4w:32", method="gptq", calibration=data,
                             progress=False, check=False).to_pte()
        except XnnquantError as exc:
            return str(exc)

    spy = _Spy(monkeypatch)
    ours = outcome()
    assert (spy.results[0] is not None) is taken
    _assert_own(module, before)
    monkeypatch.undo()
    _Spy(monkeypatch, off=True)
    assert outcome() == ours


def test_unusable_inputs_get_the_programs_error_and_leave_the_module_as_it_was(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """A batch whose layer norm overflows: the traced path's error (naming the batch and the
    layer), no thread left waiting, the module's parameters its own."""
    torch.manual_seed(0)
    module = Block().eval()
    data = _batches([10, 7])
    data[1][0][2, 3, 5] = 3e38  # finite input; the layer norm's output is not
    before = _parameters(module)
    spy = _Spy(monkeypatch)
    with pytest.raises(XnnquantError) as ours:
        _export(module, data)
    assert spy.results == [None] and spy.traces == 2
    assert "calibration batch 1" in str(ours.value)
    _assert_own(module, before)
    assert not _calibration_threads()
    monkeypatch.undo()
    _Spy(monkeypatch, off=True)
    with pytest.raises(XnnquantError) as theirs:
        _export(module, data)
    assert str(theirs.value) == str(ours.value)


def test_a_transformers_llama_calibrates_as_its_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' Llama (padding masks, rotary positions) runs the batches itself: the traced
    path's .pte bytes (BERT, RoBERTa, DistilBERT, Qwen2 and T5 too: docs/benchmarks.md)."""
    pytest.importorskip("transformers")
    import hf_models

    module, example = hf_models.ARCHITECTURES["llama"]("eager")
    data, masks = [], []
    for i, length in enumerate((9, 14)):
        ids = torch.randint(2, 128, (3, length), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        data.append((ids, mask) if len(example) == 2 else (ids,))
        masks.append(mask.bool())

    def export() -> bytes:
        return xq.export(module, example, weights="qb4w:32", method="gptq", calibration=data,
                         calibration_mask=masks, progress=False, check=False).to_pte()

    spy = _Spy(monkeypatch)
    ours = export()
    assert spy.results[0] is not None and spy.traces == 0
    monkeypatch.undo()
    _Spy(monkeypatch, off=True)
    assert export() == ours


def test_a_callers_thread_local_mode_keeps_the_programs_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch function mode is thread-local: batch threads would run without it, so the
    program's run calibrates, under it (here a mode that counts calls and changes nothing)."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    spy = _Spy(monkeypatch)
    with Counting():
        _export(Block().eval(), _batches([10, 7]), check=False)
    assert spy.results == [None] and spy.traces == 2 and Counting.calls > 0
