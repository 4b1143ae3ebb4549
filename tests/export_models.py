"""Small torch models for the export tests (fixtures, not tests): each factory returns
``(module in eval mode, example inputs)`` with fixed seeds."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Schemes tried in order for layers that cannot take the requested one (depthwise
#: convolutions have no quantized XNNPACK kernel; 3x3 convolutions no 4-bit one).
FALLBACK = ("qc8w", "fp32")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 96)
        self.out = nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu6(self.fc1(x)))))


class SmallCNN(nn.Module):
    """Convolution, depthwise, pooling, hardswish, a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 32, 1)
        self.conv = nn.Conv2d(32, 64, 3, padding=1)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.hardswish(self.stem(x))
        x = x + self.pw(F.relu(self.dw(x)))
        x = F.max_pool2d(x, 2)
        x = F.avg_pool2d(F.relu(self.conv(x)), 2)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 4, 1)
        self.expand = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean((2, 3), keepdim=True)  # spatial mean
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(scale))))


class InvertedResidual(nn.Module):
    def __init__(self, channels: int, expansion: int, activation: type[nn.Module]) -> None:
        super().__init__()
        hidden = channels * expansion
        self.expand = nn.Sequential(nn.Conv2d(channels, hidden, 1, bias=False), nn.BatchNorm2d(hidden), activation())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), activation())
        self.se = SqueezeExcite(hidden)
        self.project = nn.Sequential(nn.Conv2d(hidden, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.depthwise(self.expand(x))))


class MobileNetStyle(nn.Module):
    """Inverted residual blocks with batch norm, squeeze-and-excitation, SiLU and hardswish."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(32, 4, nn.SiLU), InvertedResidual(32, 3, nn.Hardswish))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm attention (linear, bmm, softmax) and a GELU feed-forward, each with a residual."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(torch.bmm(q.reshape(-1, t, d // self.heads),
                                            k.reshape(-1, t, d // self.heads).transpose(1, 2)) / (d // self.heads) ** 0.5,
                                  dim=-1)
        context = torch.bmm(attention, v.reshape(-1, t, d // self.heads))
        x = x + self.proj(context.view(b, self.heads, t, -1).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _randomize_batch_norms(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)


def _make(cls: type[nn.Module], *shapes: tuple[int, ...]) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def factory() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        torch.manual_seed(0)
        module = cls()
        _randomize_batch_norms(module)
        return module.eval(), tuple(torch.randn(*s) for s in shapes)
    return factory


MODELS = {
    "mlp": _make(MLP, (8, 64)),
    "cnn": _make(SmallCNN, (2, 3, 32, 32)),
    "mobilenet": _make(MobileNetStyle, (2, 3, 32, 32)),
    "transformer": _make(TransformerBlock, (2, 16, 64)),
}
