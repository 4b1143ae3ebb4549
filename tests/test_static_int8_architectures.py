"""Static int8 on architectures beyond the two ImageNet CNNs, small and with random weights:
each exports with its self-check (every int8 node within its bound, on the real runtime), its
sensitivity ranges (no node kind torch cannot compute here: no ``OptionWarning``), and runs
on held-out inputs close to torch's float model, with ``budget=0.3`` as well.

The blocks carry what a sweep of 13 such architectures found broken or silently degraded:
silu and GELU (now int8), batch norms after concatenations and squeeze-and-excitation gates
(fp32 islands between int8 nodes), a channel shuffle, a layer norm in channels-last, a
transposed convolution and bilinear upsampling, a class token concatenated before attention.

Bounds: the SQNR each program measured here, less 6 dB.  Its int8 nodes compute the same
codes on any x86 CPU (``test_static_int8``); its fp32 nodes and calibration's float graph
move by float rounding between CPUs, which can move a grid by a step and the outputs by a
fraction of a dB, far less than 6.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xnnquant as xq
from xnnquant.metrics import sqnr_db

pytestmark = pytest.mark.xnnpack


def _normed(module: nn.Module) -> nn.Module:
    """Batch and layer norms given statistics and affine parameters other than their defaults."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.2)
    return module.eval()


class MBConv(nn.Module):
    """EfficientNet-B0's block: expansion, depthwise, squeeze-and-excitation, all with silu."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.SiLU())
        self.expand = nn.Sequential(nn.Conv2d(16, 64, 1), nn.BatchNorm2d(64), nn.SiLU())
        self.depthwise = nn.Sequential(nn.Conv2d(64, 64, 3, 1, 1, groups=64), nn.BatchNorm2d(64), nn.SiLU())
        self.squeeze, self.excite = nn.Conv2d(64, 8, 1), nn.Conv2d(8, 64, 1)
        self.project = nn.Sequential(nn.Conv2d(64, 16, 1), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.depthwise(self.expand(x))
        y = y * torch.sigmoid(self.excite(F.silu(self.squeeze(y.mean((2, 3), keepdim=True)))))
        return self.head((x + self.project(y)).mean((2, 3)))


class Shuffle(nn.Module):
    """ShuffleNetV2's unit: half the channels through a branch, concatenated, shuffled."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.BatchNorm2d(16),
                                    nn.Conv2d(16, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        a, b = x.chunk(2, dim=1)
        y = torch.cat([a, self.branch(b)], 1)
        y = y.view(1, 2, 16, 16, 16).transpose(1, 2).reshape(1, 32, 16, 16)
        return self.head(y.mean((2, 3)))


class Dense(nn.Module):
    """DenseNet's layers: batch norm and ReLU before each convolution, on the concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1)
        self.layers = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(16 + 8 * i), nn.ReLU(), nn.Conv2d(16 + 8 * i, 8, 3, 1, 1))
                                    for i in range(3))
        self.head = nn.Linear(40, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(F.avg_pool2d(x, 2).mean((2, 3)))


class ConvNeXt(nn.Module):
    """ConvNeXt's block: depthwise 7x7, layer norm in channels-last, linear, GELU, linear,
    layer scale, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 4, 4)
        self.depthwise = nn.Conv2d(32, 32, 7, 1, 3, groups=32)
        self.norm = nn.LayerNorm(32)
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)
        self.scale = nn.Parameter(torch.full((32,), 0.5))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.norm(self.depthwise(x).permute(0, 2, 3, 1))
        y = (self.down(F.gelu(self.up(y))) * self.scale).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


class ViT(nn.Module):
    """A patch embedding, a class token, one pre-norm attention block and its MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 32, 8, 8)
        self.token = nn.Parameter(torch.randn(1, 1, 32) * 0.1)
        self.position = nn.Parameter(torch.randn(1, 17, 32) * 0.1)
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attention = nn.MultiheadAttention(32, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.token, self.patches(x).flatten(2).transpose(1, 2)], 1) + self.position
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x[:, 0])


class UNet(nn.Module):
    """Down by a strided convolution, up by a transposed one and by bilinear upsampling, skips
    concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
        self.bottom = nn.Sequential(nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU())
        self.up = nn.ConvTranspose2d(32, 32, 2, 2)
        self.dec1 = nn.Sequential(nn.Conv2d(64, 16, 3, 1, 1), nn.ReLU())
        self.dec2 = nn.Conv2d(32, 4, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        d = self.down(e)
        y = self.dec1(torch.cat([self.up(self.bottom(d)), d], 1))
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        return self.dec2(torch.cat([y, e], 1))


#: architecture -> (module, the least SQNR of the default program, of budget=0.3's); measured
#: (default, budget=0.3) in the comment
ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], float, float]] = {
    "efficientnet block (silu, squeeze-and-excitation)": (MBConv, 33.0, 50.0),  # 39.1, 56.4 dB
    "shufflenet unit (chunk, concatenation, shuffle)": (Shuffle, 40.0, 53.0),  # 46.6, 59.2 dB
    "densenet layers (batch norms after concatenations)": (Dense, 47.0, 47.0),  # 53.2, 53.4 dB
    "convnext block (layer norm, gelu, layer scale)": (ConvNeXt, 34.0, 52.0),  # 40.4, 58.1 dB
    "vit block (class token, attention, gelu)": (ViT, 17.0, 28.0),  # 23.9, 34.0 dB
    "unet (transposed convolution, bilinear upsampling)": (UNet, 29.0, 31.0),  # 35.4, 37.0 dB
}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_static_int8_keeps_unseen_architectures_close_to_float(name: str) -> None:
    make, least, least_budget = ARCHITECTURES[name]
    torch.manual_seed(0)
    module = _normed(make())
    g = torch.Generator().manual_seed(2)
    calibration = [(torch.randn(1, 3, 32, 32, generator=g),) for _ in range(16)]
    held_out = [torch.randn(1, 3, 32, 32, generator=g) for _ in range(4)]
    with torch.no_grad():
        reference = np.concatenate([module(x).numpy() for x in held_out])
    got = {}
    for budget in (0.0, 0.3):
        with warnings.catch_warnings():
            warnings.simplefilter("error", xq.OptionWarning)  # sensitivity ranges and the budget followed
            exported = xq.export(module, calibration[0], weights="qc8w", calibration=calibration, progress=False,
                                 activations=xq.StaticInt8(budget=budget))
        got[budget] = sqnr_db(reference, np.concatenate([exported.run(x)[0] for x in held_out]))
    assert got[0.0] >= least, got
    assert got[0.3] >= least_budget, got
