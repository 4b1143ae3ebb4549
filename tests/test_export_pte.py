"""Exported.to_pte: a program executorch.runtime loads, the module's inputs in, its outputs out;
the same bytes whether or not ExecuTorch's own XNNPACK backend is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.metrics import sqnr_db

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.xnnpack


class TwoInTwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h) + y, h  # h is both an output and used inside


def test_pte_takes_the_inputs_in_order_and_returns_the_outputs() -> None:
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    module = TwoInTwoOut().eval()
    x, y = torch.randn(4, 32), torch.randn(4, 8)
    exported = xq.export(module, (x, y), weights="qc8w", progress=False)
    assert [(t.name, t.shape, t.dim_order) for t in exported.inputs] == [("x", (4, 32), (0, 1)), ("y", (4, 8), (0, 1))]
    assert [t.shape for t in exported.outputs] == [(4, 8), (4, 16)]
    program = Runtime.get().load_program(exported.to_pte())
    got = [r.numpy() for r in program.load_method("forward").execute([x, y])]
    with torch.no_grad():
        expected = [t.numpy() for t in module(x, y)]
    assert [g.shape for g in got] == [(4, 8), (4, 16)]
    for g, e in zip(got, expected):
        # int8 weights and activations: measured 40 dB; 30 dB leaves room for other CPUs
        assert sqnr_db(e, g) > 30


def test_returning_an_input_unchanged_copies_it() -> None:
    class PassThrough(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x * 2

    x = torch.randn(3, 5)
    for target in ("1.4.1", "xn01"):
        exported = xq.export(PassThrough().eval(), (x,), weights="fp32", target=target, progress=False)
        a, b = exported.run(x)
        np.testing.assert_array_equal(a, x.numpy())
        np.testing.assert_array_equal(b, x.numpy() * 2)


def test_pte_bytes_do_not_depend_on_executorch_backends_being_imported(tmp_path: object) -> None:
    """A fresh process: export, write the .pte, import ExecuTorch's XNNPACK backend (whose
    own XnnpackBackend class would win a lookup by name), write it again: same bytes."""
    code = textwrap.dedent("""
        import torch, xnnquant as xq
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.GELU()).eval()
        exported = xq.export(module, (torch.randn(2, 32),), weights="qb4w:32", progress=False)
        before = exported.to_pte()
        import executorch.backends.xnnpack  # noqa: F401
        from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend  # noqa: F401
        after = exported.to_pte()
        assert before == after, "the .pte changed"
        print(len(before))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 1000
