"""In-place ops on intermediates (``nn.ReLU6(inplace=True)``, ``y += x``): made functional
without torch's decompositions where nothing else can see the value, left to them where a
view, an input or an alias could (``frontend/functional.py``).

The oracle is the eager module, in float64.  Each case reads its intermediate both before
and after the in-place op where it can, so reading the wrong version is off by the values'
size, far above ``RTOL`` (float32 rounding of sums of a few dozen terms, in XNNPACK's order
or torch's).  Whether the export retraced the program (``run_decompositions``) is watched:
skipping it is the point (MobileNetV2: 1.6 s of a 5 s static int8 export), taking it where
a view could see the update is what keeps the program right.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from float_bounds import relative_error

import xnnquant as xq
from xnnquant.frontend.functional import buffer_updates, out_of_place

pytestmark = pytest.mark.xnnpack

#: relative to the output's largest magnitude: float32 rounding of sums of a few dozen terms (measured at
#: most 1.1e-7 here: a wrong read is off by the values' size)
RTOL = 1e-5


class Block(torch.nn.Module):
    """A convolution block whose activations and residual add work in place."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 1)
        self.relu6 = torch.nn.ReLU6(inplace=True)  # as torchvision's MobileNetV2 has it: hardtanh_
        self.lin = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "relu6 chain":  # MobileNetV2's blocks: batch norm, ReLU6 in place, a residual add in place
            y = self.relu6(self.bn(self.conv(x)))
            z = self.conv2(y)
            z += x
            return z.mul_(0.5)
        if k == "read before and after":
            y = self.conv(x)
            before = y * 2
            y.relu_()
            return before - y
        if k == "returned":
            y = self.lin(x.flatten(1)[:, :8])
            torch.nn.functional.relu(y, inplace=True)
            return y
        if k == "clamp then add":
            y = self.conv(x)
            y.clamp_(-0.2, 0.3).add_(x)
            return self.conv2(y) + y
        # cases only torch's functionalization gets right: a view sees the update
        if k == "on a view":
            y = self.conv(x)
            y[:, :2].relu_()
            return y
        if k == "view taken before":
            y = self.conv(x)
            flat = y.view(-1)
            y.relu_()
            return flat.reshape(y.shape) * 3
        if k == "on the input":
            x.relu_()
            return self.conv(x)
        raise AssertionError(k)


RETRACED = {"relu6 chain": False, "read before and after": False, "returned": False, "clamp then add": False,
            "on a view": True, "view taken before": True, "on the input": True}


@pytest.mark.parametrize("kind", list(RETRACED))
def test_in_place_ops_answer_as_the_module(kind: str, decompositions: list[list[str] | None]) -> None:
    """The program gives the eager module's output, the export retraces only where a view or an
    input could see the update, and the caller's example and module are left as they were."""
    torch.manual_seed(0)
    module = Block(kind).eval()
    x = torch.randn(1, 4, 6, 6)
    example = x.clone()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    exported = xq.export(module, (example,), weights="fp32", progress=False)
    assert bool(decompositions) == RETRACED[kind]
    assert torch.equal(example, x)  # "on the input" writes into its input: export works on copies
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    with torch.no_grad():
        want = module.double()(x.double().clone())
    got = exported.run(x.clone())[-1]  # "on the input": the input's new value comes first
    assert relative_error(got, want) <= RTOL
    assert float(np.abs(want.numpy()).max()) > 0.1  # an output of the values' size: a wrong read shows


def test_only_unaliased_fresh_values_are_updated_without_a_retrace() -> None:
    torch.manual_seed(0)
    found = {}
    for kind in RETRACED:
        program = torch.export.export(Block(kind).eval(), (torch.randn(1, 4, 6, 6),), strict=False)
        updates = buffer_updates(program)
        found[kind] = None if updates is None else sorted(str(n.target) for n in updates)
    assert found == {"relu6 chain": ["aten.add_.Tensor", "aten.hardtanh_.default", "aten.mul_.Tensor"],
                     "read before and after": ["aten.relu_.default"], "returned": ["aten.relu_.default"],
                     "clamp then add": ["aten.add_.Tensor", "aten.clamp_.default"],
                     "on a view": None, "view taken before": None, "on the input": None}


def test_an_update_that_would_promote_out_of_place_is_left_to_the_retrace() -> None:
    """``y16.add_(y)`` keeps float16; ``add(y16, y)`` would be float32."""

    class Mixed(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y16 = y.half() * 1
            y16.add_(y)
            return y16 + 0  # not .float(): an aliasing reader, refused for that alone

    program = torch.export.export(Mixed(), (torch.randn(2, 3),), strict=False)
    assert buffer_updates(program) is None


def test_out_of_place_ops_are_the_same_ops_writing_nothing() -> None:
    aten = torch.ops.aten
    assert out_of_place(aten.hardtanh_.default) is aten.hardtanh.default
    assert out_of_place(aten.add_.Tensor) is aten.add.Tensor
    assert out_of_place(aten.clamp_.default) is aten.clamp.default
    assert out_of_place(aten.index_put_.default) is aten.index_put.default
    assert out_of_place(aten.relu.default) is None  # not in place
    assert out_of_place(aten.view.default) is None
