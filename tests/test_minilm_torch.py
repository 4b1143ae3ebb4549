"""The torch MiniLM encoder against the numpy model (itself checked against torch's
TransformerEncoderLayer and the tokenizers library in test_models.py)."""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

from xnnquant import XnnquantError
from xnnquant.models import minilm

torch = pytest.importorskip("torch")


def test_importing_minilm_does_not_import_torch() -> None:
    code = "import sys, xnnquant.models.minilm; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_encoder_matches_the_numpy_model() -> None:
    """Both float32 models against the torch module run in float64: each is judged by its
    own float32 rounding error, which depends on the CPU's kernels only through the order
    of the roundings, not their size (the float64 run's own error is ~1e-15 here)."""
    encoder = minilm.encoder()
    assert isinstance(encoder, minilm.MiniLMEncoder) and not encoder.training
    hidden, mask = minilm.encoder_inputs(minilm.SAMPLE_SENTENCES, tokens=32)
    assert hidden.shape == (16, 32, 384) and mask.dtype == torch.float32
    with torch.no_grad():
        out = encoder(hidden, mask).numpy()
        exact = copy.deepcopy(encoder).double()(hidden.double(), mask.double()).numpy()
    ids, real = minilm.tokenize_batch(minilm.SAMPLE_SENTENCES)
    numpy_model = minilm.forward(ids, real)[-1].output
    exact_real = exact[:, :ids.shape[1]][real]
    # float32 rounding through six layers against float64, on hidden states up to 6.0:
    # measured 2.1e-6 (torch) and 1.6e-6 (numpy), i.e. ~6 float32 ulps of the largest
    # value; 8e-6 is 4x the larger
    assert np.abs(out[:, :ids.shape[1]][real] - exact_real).max() < 8e-6
    assert np.abs(numpy_model[real] - exact_real).max() < 8e-6
    # padding to 32 tokens changes nothing on real tokens, and the embeddings agree:
    # measured 1.4e-7 for both against float64 (unit vectors); 6e-7 is 4x
    exact_embeddings = minilm.mean_pooled(exact, mask.numpy())
    assert np.abs(minilm.mean_pooled(out, mask.numpy()) - exact_embeddings).max() < 6e-7
    assert np.abs(minilm.sentence_embeddings(minilm.SAMPLE_SENTENCES) - exact_embeddings).max() < 6e-7


def test_example_and_bad_arguments() -> None:
    module, (hidden, mask) = minilm.example(batch=2, tokens=24)
    assert hidden.shape == (2, 24, 384) and mask.shape == (2, 24) and len(module.layer) == 6
    with pytest.raises(XnnquantError, match="tokens too small: got 4, the longest sentence has"):
        minilm.encoder_inputs(minilm.SAMPLE_SENTENCES, tokens=4)
    with pytest.raises(XnnquantError, match=r"batch out of range: got 17, expected 1..16"):
        minilm.example(batch=17)
    with pytest.raises(XnnquantError, match=r"num_layers out of range: got 0, expected 1..6"):
        minilm.MiniLMEncoder(0)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        minilm.nothing  # noqa: B018
