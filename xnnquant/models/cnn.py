"""Two small CNNs for static int8 experiments, with batch norms whose statistics are not trivial.

``residual()``: a ResNet-style network (input ``[1, 3, 96, 96]``)::

    conv 3x3 s2 3->32, BN, ReLU                                       48 x 48
    2 x [conv 3x3, BN, ReLU, conv 3x3, BN] + input, ReLU   (32)       48 x 48
    [conv 3x3 s2, BN, ReLU, conv 3x3, BN] + [conv 1x1 s2, BN], ReLU   24 x 24  (64), then 1 block
    the same to 128 channels                                          12 x 12, then 1 block
    adaptive average pooling to 1x1, flatten, linear 128->10

``inverted_residual()``: a MobileNetV2-style network (input ``[1, 3, 96, 96]``)::

    conv 3x3 s2 3->16, BN, ReLU6                                      48 x 48
    inverted residuals (expansion t, channels c, repeats n, stride s) = (4,24,2,2) (4,32,3,2) (4,64,2,2):
        conv 1x1 C->tC, BN, ReLU6, depthwise 3x3 stride s, BN, ReLU6, conv 1x1 tC->c, BN,
        plus the input when s == 1 and C == c
    conv 1x1 64->256, BN, ReLU6, adaptive average pooling, flatten, linear 256->10

Weights come from torch's default initialization with ``seed``; each batch norm gets
running statistics and affine parameters drawn around (0, 1), so that folding it moves
every filter.  ``example()`` / ``calibration()`` give inputs (standard normal) for
``xnnquant export ... --calibration``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

RESIDUAL_STAGES = ((32, 1, 2), (64, 2, 2), (128, 2, 2))  # (channels, first stride, blocks)
INVERTED_STAGES = ((4, 24, 2, 2), (4, 32, 3, 2), (4, 64, 2, 2))  # (t, c, n, s)
INPUT_SHAPE = (1, 3, 96, 96)


def _randomize_batch_norms(model: Any, seed: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=generator) * 0.3)
            module.running_var.copy_(torch.rand(c, generator=generator) * 1.5 + 0.5)
            module.weight.data.copy_(torch.rand(c, generator=generator) + 0.5)
            module.bias.data.copy_(torch.randn(c, generator=generator) * 0.2)


def residual(seed: int = 0) -> Any:
    """The residual network of the module docstring, in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                             if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + self.shortcut(x))

    class ResidualNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
            blocks: list[Any] = []
            cin = 32
            for c, stride, n in RESIDUAL_STAGES:
                for i in range(n):
                    blocks.append(Block(cin, c, stride if i == 0 else 1))
                    cin = c
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(cin, 10)

        def forward(self, x: Any) -> Any:
            pooled = nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), (1, 1))
            return self.fc(torch.flatten(pooled, 1))

    model = ResidualNet().eval()
    _randomize_batch_norms(model, seed)
    return model


def inverted_residual(seed: int = 0) -> Any:
    """The inverted-residual network of the module docstring, in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(seed)

    def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu6: bool = True) -> Any:
        layers: list[Any] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6()) if relu6 else nn.Sequential(*layers)

    class Inverted(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            self.residual = stride == 1 and cin == cout
            self.conv = nn.Sequential(conv_bn(cin, hidden, 1), conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                      conv_bn(hidden, cout, 1, relu6=False))

        def forward(self, x: Any) -> Any:
            return x + self.conv(x) if self.residual else self.conv(x)

    class InvertedResidualNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers: list[Any] = [conv_bn(3, 16, 3, 2)]
            cin = 16
            for t, c, n, s in INVERTED_STAGES:
                for i in range(n):
                    layers.append(Inverted(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers.append(conv_bn(cin, 256, 1))
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(256, 10)

        def forward(self, x: Any) -> Any:
            pooled = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.fc(torch.flatten(pooled, 1))

    model = InvertedResidualNet().eval()
    _randomize_batch_norms(model, seed)
    return model


def random_batches(count: int, seed: int) -> list[np.ndarray]:
    """``count`` standard-normal float32 inputs of ``INPUT_SHAPE``."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(INPUT_SHAPE).astype(np.float32) for _ in range(count)]


def example() -> tuple[Any, tuple[Any, ...]]:
    """``(residual(), (one input,))``: ``xnnquant export xnnquant.models.cnn:example``."""
    import torch

    return residual(), (torch.from_numpy(random_batches(1, 100)[0]),)


def calibration() -> list[tuple[Any, ...]]:
    """16 calibration batches for ``example()``: ``--calibration xnnquant.models.cnn:calibration``."""
    import torch

    return [(torch.from_numpy(x),) for x in random_batches(16, 1)]
