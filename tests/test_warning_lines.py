"""Every warning xnnquant raises points at the caller's line: the file and line of the call into
the library, however many of the library's own frames lie between (``errors.warn_caller``:
``xq.export`` reaches its warnings through ``prequantized.dequantized_for_export``, the stages
and ``report.py``; ``xq.export_llm`` through ``xq.export``), and for a deprecated name the line
that uses it.  Each case makes its call on one line and expects exactly that file and line.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import xnnquant as xq

torch = pytest.importorskip("torch")
nn = torch.nn


def _next_line() -> int:
    """The line after the caller's."""
    return sys._getframe(1).f_lineno + 1


@contextmanager
def _recorded() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _where(caught: list[warnings.WarningMessage], category: type[Warning]) -> list[tuple[str, int]]:
    return [(w.filename, w.lineno) for w in caught if issubclass(w.category, category)]


@pytest.mark.xnnpack
def test_export_warns_at_the_call() -> None:
    """A layer of 40 inputs cannot take qb4w:32 (FallbackWarning); embeddings= on a module without
    a table and method= with nothing quantized do nothing (OptionWarning)."""
    module, x = nn.Sequential(nn.Linear(40, 8)).eval(), torch.randn(2, 40)
    with _recorded() as caught:
        line = _next_line()
        xq.export(module, (x,), weights="qb4w:32", embeddings="int8", progress=False)
    assert _where(caught, xq.FallbackWarning) == [(__file__, line)]
    assert _where(caught, xq.OptionWarning) == [(__file__, line)]
    with _recorded() as caught:
        line = _next_line()
        xq.export(module, (x,), weights="fp32", method="minmax", progress=False)
    assert _where(caught, xq.OptionWarning) == [(__file__, line)]


@pytest.mark.xnnpack
def test_static_int8_warns_at_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity ranges and a budget on a graph torch is made to find a node it cannot compute
    of are not followed (OptionWarning); the thresholds set so that any program is warned of, the
    measured accuracy (AccuracyWarning) and run time (PerformanceWarning)."""
    from xnnquant.frontend import report
    from xnnquant.frontend.static_int8 import torch_graph

    monkeypatch.setattr(torch_graph, "unsupported", lambda graph: "XNNSomething")
    monkeypatch.setattr(report, "ACCURACY_WARNING_DB", 1e9)
    monkeypatch.setattr(report, "SLOWER_WARNING", 0.0)
    monkeypatch.setattr(report, "TIMED_WARNING_MS", 0.0)
    module = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    g = torch.Generator().manual_seed(0)
    cal = [(torch.randn(4, 16, generator=g),) for _ in range(4)]
    choice = xq.StaticInt8(budget=0.3)
    with _recorded() as caught:
        line = _next_line()
        xq.export(module, cal[0], weights="qc8w", activations=choice, calibration=cal, progress=False)
    for category in (xq.OptionWarning, xq.AccuracyWarning, xq.PerformanceWarning):
        assert _where(caught, category) == [(__file__, line)], category


@pytest.mark.xnnpack
def test_export_llm_warns_at_its_own_call() -> None:
    """A decoder of width 48 whose layers cannot take qb4w:32's groups: the FallbackWarning raised
    inside ``xq.export`` names the call of ``xq.export_llm``."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = tf.LlamaForCausalLM(config).eval()
    with _recorded() as caught:
        line = _next_line()
        xq.export_llm(model, max_context=16, weights="qb4w:32", embeddings=None, progress=False)
    assert _where(caught, xq.FallbackWarning) == [(__file__, line)]


def test_calibration_and_deprecations_warn_at_the_call() -> None:
    """Too few calibration tokens (CalibrationWarning), and the deprecated spellings: per-tensor
    quantize's positional scale, ``Graph.<reader attribute>``, ``graph.layout.SEED_NODE_KINDS``."""
    from xnnquant import graph
    from xnnquant.graph import layout

    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal((8, 64)).astype(np.float32)
    with _recorded() as caught:
        line = _next_line()
        xq.quantize_blockwise(w, 32, "gptq", calibration=x)
    assert _where(caught, xq.CalibrationWarning) == [(__file__, line)]
    with _recorded() as caught:
        line = _next_line()
        xq.quantize_per_tensor(w, xq.Datatype.qint8, 0.05, 0)
        built = graph.Graph()
        lines = [line, _next_line()]
        built.version  # noqa: B018 (the deprecated read is the point)
        lines.append(_next_line())
        layout.SEED_NODE_KINDS  # noqa: B018
    assert _where(caught, DeprecationWarning) == [(__file__, n) for n in lines]


def test_torchao_and_xnnpack_deprecations_warn_at_the_call() -> None:
    """``XnnquantConfig(activations=None)`` (a UserWarning) and ``xnnquant.xnnpack.quantize_per_token``."""
    pytest.importorskip("torchao")
    from xnnquant import xnnpack
    from xnnquant.torchao import XnnquantConfig

    with _recorded() as caught:
        line = _next_line()
        XnnquantConfig("qc8w", activations=None)
        lines = [line, _next_line()]
        xnnpack.quantize_per_token  # noqa: B018
    assert [(w.filename, w.lineno) for w in caught if w.category in (UserWarning, DeprecationWarning)] == \
        [(__file__, n) for n in lines]
