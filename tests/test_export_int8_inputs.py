"""int8 tensors read by an XNNPACK delegate: ``x.to(torch.float32)`` of an int8 value runs in
XNNPACK as a Convert of a qint8 external input of scale 1 and zero point 0 (each code its
integer, exactly), instead of ExecuTorch's portable ``_to_copy``.  Oracle: torch's eager
module, on ExecuTorch's runtime; other int8 readers and other conversions stay portable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xnnquant as xq

pytestmark = pytest.mark.xnnpack


class Dequantize(torch.nn.Module):
    """codes (a buffer, updated in place by each call as a KV cache is) read back as float."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("codes", torch.arange(-128, 128, dtype=torch.int8).reshape(16, 16))
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 16).reshape(16, 1))

    def forward(self, x: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        self.codes[0].copy_(new)  # int8 state, written by a portable kernel
        return x * (self.codes.to(torch.float32) * self.scale)


def test_an_int8_value_converted_to_float_runs_in_xnnpack_and_is_exact() -> None:
    module = Dequantize().eval()
    x, new = torch.randn(16, 16), torch.arange(-8, 8, dtype=torch.int8) * 16
    exported = xq.export(module, (x, new), weights="fp32", progress=False)
    report = exported.delegation_report()
    assert "_to_copy" not in report, report  # the conversion runs in the delegate
    want = Dequantize().eval()(x, new).numpy()
    got = exported.run(x, new)[0]
    np.testing.assert_array_equal(got, want)  # a Convert and one multiply each: no rounding differs


def test_a_conversion_to_int8_stays_portable() -> None:
    class Quantize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.round(x * 4).to(torch.int8)

    exported = xq.export(Quantize().eval(), (torch.randn(4, 8),), weights="fp32", progress=False)
    assert "aten._to_copy.default x1 (its result is int8" in exported.delegation_report()
