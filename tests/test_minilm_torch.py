"""The torch MiniLM encoder against the numpy model (itself checked against torch's
TransformerEncoderLayer and the tokenizers library in test_models.py)."""

from __future__ import annotations

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
    encoder = minilm.encoder()
    assert isinstance(encoder, minilm.MiniLMEncoder) and not encoder.training
    hidden, mask = minilm.encoder_inputs(minilm.SAMPLE_SENTENCES, tokens=32)
    assert hidden.shape == (16, 32, 384) and mask.dtype == torch.float32
    with torch.no_grad():
        out = encoder(hidden, mask).numpy()
    ids, real = minilm.tokenize_batch(minilm.SAMPLE_SENTENCES)
    reference = minilm.forward(ids, real)[-1].output
    tokens = ids.shape[1]
    # float32 matmuls summed in different orders through six layers: measured 2.0e-6 on
    # hidden states of magnitude 6; the bound leaves 10x for other CPUs' kernels
    assert np.abs(out[:, :tokens][real] - reference[real]).max() < 2e-5
    # padding to 32 tokens changes nothing on real tokens, and the embeddings agree
    np.testing.assert_allclose(minilm.mean_pooled(out, mask.numpy()),
                               minilm.sentence_embeddings(minilm.SAMPLE_SENTENCES), atol=2e-6)


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
