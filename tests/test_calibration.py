"""``Calibration`` statistics and the activation-aware methods' input checks.

References are written from the definition (``X^T X`` in float64 over the kept rows), not
from the code under test.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.schemes.calibration import MIN_TOKENS_PER_FEATURE

RNG = np.random.default_rng(20261130)
W = RNG.normal(size=(8, 64)).astype(np.float32)
X = (RNG.normal(size=(96, 64)) * np.linspace(0.1, 4, 64)).astype(np.float32)


def test_gram_is_xtx_over_every_batch() -> None:
    cal = xq.Calibration(64)
    for start in range(0, 96, 40):  # batches of 40, 40, 16 rows
        cal.add(X[start:start + 40])
    big = np.tile(X, (12, 1))  # 1,152 rows: more than one chunk of CHUNK_ROWS
    np.testing.assert_allclose(xq.Calibration.from_array(big).gram, 12 * cal.gram, rtol=1e-5,
                               atol=1e-6 * np.abs(cal.gram).max())
    x64 = X.astype(np.float64)
    assert cal.tokens == 96
    # float32 products of up to CHUNK_ROWS rows: ~1e-7 relative per term, ~1e-6 per sum
    np.testing.assert_allclose(cal.gram, x64.T @ x64, rtol=1e-5, atol=1e-6 * np.abs(x64.T @ x64).max())
    with pytest.raises(ValueError, match="read-only"):
        cal.gram[0, 0] = 1.0


def test_leading_dims_mask_and_torch_input() -> None:
    torch = pytest.importorskip("torch")
    x3 = X.reshape(4, 24, 64)
    mask = np.zeros((4, 24), bool)
    mask[:, :10] = True
    cal = xq.Calibration(64).add(torch.from_numpy(x3), mask=torch.from_numpy(mask))
    kept = x3[mask].astype(np.float64)
    assert cal.tokens == 40
    np.testing.assert_allclose(cal.gram, kept.T @ kept, rtol=1e-5, atol=1e-6 * np.abs(kept.T @ kept).max())
    bf16 = xq.Calibration.from_array(torch.from_numpy(X).to(torch.bfloat16))
    widened = torch.from_numpy(X).to(torch.bfloat16).float().numpy().astype(np.float64)
    np.testing.assert_allclose(bf16.gram, widened.T @ widened, rtol=1e-5, atol=1e-6 * np.abs(widened.T @ widened).max())


def test_runtime_quantized_accumulates_what_xnnpack_multiplies() -> None:
    cal = xq.Calibration.from_array(X, runtime_quantized=True)
    seen = xq.quantize_per_token(X).dequantize().astype(np.float64)
    np.testing.assert_allclose(cal.gram, seen.T @ seen, rtol=1e-5, atol=1e-6 * np.abs(seen.T @ seen).max())
    assert "runtime_quantized=True" in repr(cal) and "tokens=96" in repr(cal)


def test_array_and_calibration_give_the_same_weights() -> None:
    for method in ("act_mse", "gptq"):
        a = xq.quantize_blockwise(W, 32, method, calibration=X)
        b = xq.quantize_blockwise(W, 32, method, calibration=xq.Calibration(64).add(X[:50]).add(X[50:]))
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.scale, b.scale)


def test_few_tokens_warn_zero_tokens_refuse() -> None:
    needed = int(np.ceil(MIN_TOKENS_PER_FEATURE * 64))
    with pytest.warns(xq.CalibrationWarning,
                      match=rf"calibration has few tokens: got 8, expected at least {needed}") as caught:
        qt = xq.quantize_blockwise(W, 32, "gptq", calibration=X[:8])
    assert caught[0].filename == __file__  # the caller's line
    assert np.isfinite(qt.scale).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xq.quantize_blockwise(W, 32, "gptq", calibration=X[:needed])
    with pytest.raises(xq.XnnquantError, match=r"calibration has no tokens: got 0 rows, expected at least 1"):
        xq.quantize_blockwise(W, 32, "gptq", calibration=xq.Calibration(64))


def test_degenerate_inputs_never_raise_linalg_errors() -> None:
    """All-zero inputs, one repeated row, dead columns: singular Gram matrices."""
    dead = X.copy()
    dead[:, 5:20] = 0
    cases = [np.zeros((80, 64), np.float32), np.tile(X[:1], (80, 1)), dead]
    for x in cases:
        for method in ("act_mse", "gptq"):
            for qt in (xq.quantize_blockwise(W, 32, method, calibration=x),
                       xq.quantize_per_channel(W, 4, method=method, calibration=x)):
                assert np.all(qt.scale > 0) and np.isfinite(qt.scale).all()


BAD: list[tuple[str, Callable[[], Any], str]] = [
    ("needs calibration", lambda: xq.quantize_blockwise(W, 32, "gptq"),
     "method 'gptq' needs calibration activations: got calibration=None, expected a float array (tokens, in_features) or an xnnquant.Calibration"),
    ("needs calibration per channel", lambda: xq.quantize_per_channel(W, 4, method="act_mse"),
     "method 'act_mse' needs calibration activations: got calibration=None"),
    ("ignored by mse", lambda: xq.quantize_blockwise(W, 32, "mse", calibration=X),
     "method 'mse' does not use calibration: got a calibration, expected calibration=None (activation-aware methods: 'act_mse', 'gptq')"),
    ("ignored by minmax", lambda: xq.quantize_per_channel(W, 8, calibration=X),
     "method 'minmax' does not use calibration"),
    ("ignored by choose_qparams", lambda: xq.schemes.blockwise.choose_qparams(W, 32, "mse", calibration=X),
     "method 'mse' does not use calibration"),
    ("scale and calibration", lambda: xq.quantize_blockwise(W, 32, "gptq", scale=np.ones((8, 2), np.float32), calibration=X),
     "method 'gptq' chooses its own scales: got scale= and calibration=, expected one of them"),
    ("width", lambda: xq.quantize_blockwise(W, 32, "gptq", calibration=X[:, :32]),
     "calibration width does not match the weight: got 32 features, expected in_features=64"),
    ("width add", lambda: xq.Calibration(64).add(X[:, :63]),
     "calibration has the wrong width: got 63 features (shape (96, 63)), expected in_features=64"),
    ("nan", lambda: xq.quantize_blockwise(W, 32, "act_mse", calibration=np.where(X > 5, np.nan, X)),
     "calibration must be finite: got nan at index"),
    ("inf add", lambda: xq.Calibration(64).add(np.full((2, 64), np.inf, np.float32)),
     "calibration must be finite: got inf at index (0, 0)"),
    ("int", lambda: xq.Calibration(64).add(np.ones((2, 64), np.int32)),
     "calibration must be a floating-point array: got dtype int32"),
    ("mask shape", lambda: xq.Calibration(64).add(X, mask=np.ones(95, bool)),
     "mask must be bool of shape (96,) (x.shape[:-1]): got bool of shape (95,)"),
    ("mask dtype", lambda: xq.Calibration(64).add(X, mask=np.ones(96, np.int8)),
     "mask must be bool of shape (96,) (x.shape[:-1]): got int8 of shape (96,)"),
    ("in_features", lambda: xq.Calibration(0), "in_features must be positive: got 0"),
    ("in_features type", lambda: xq.Calibration(64.0), "in_features must be an integer: got 64.0"),  # type: ignore[arg-type]
    ("runtime_quantized", lambda: xq.Calibration(64, runtime_quantized=1),  # type: ignore[arg-type]
     "runtime_quantized must be True or False: got 1"),
    ("conv weight", lambda: xq.quantize_per_channel(np.ones((4, 3, 3, 8), np.float32), 8, method="gptq", calibration=X),
     "method 'gptq' quantizes linear weights: got shape (4, 3, 3, 8), expected a 2-D [out_features, in_features] weight"),
    ("axis 1", lambda: xq.quantize_per_channel(W, 8, axis=1, method="gptq", calibration=X),
     "method 'gptq' quantizes linear weights per output channel: got axis=1, expected axis=0"),
    ("unknown method", lambda: xq.quantize_blockwise(W, 32, "awq", calibration=X),
     "unknown method: got 'awq', expected one of 'minmax', 'mse', 'range', 'act_mse', 'gptq'"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_raises_with_what_got_expected(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(xq.XnnquantError, match=re.escape(message)):
        call()


def test_wide_inputs_in_column_blocks() -> None:
    """K = 300 spans three column blocks of ``GRAM_BLOCK`` (the last one short) and 2,500 rows
    three chunks: each block pair summed on its own, the lower blocks mirrored."""
    from xnnquant.schemes.calibration import GRAM_BLOCK

    assert GRAM_BLOCK < 300 < 3 * GRAM_BLOCK
    x = (RNG.normal(size=(2500, 300)) * np.linspace(0.1, 4, 300)).astype(np.float32)
    cal = xq.Calibration(300).add(x[:1000]).add(x[1000:])
    x64 = x.astype(np.float64)
    # float32 products of up to CHUNK_ROWS rows: ~1e-7 relative per term, ~1e-6 per sum
    np.testing.assert_allclose(cal.gram, x64.T @ x64, rtol=1e-5, atol=1e-6 * np.abs(x64.T @ x64).max())
    assert np.array_equal(cal.gram, cal.gram.T)


def test_rows_the_mask_drops_are_not_read_and_a_refused_add_changes_nothing() -> None:
    x = X.copy()
    x[5, 7] = np.nan
    keep = np.ones(96, bool)
    keep[5] = False
    cal = xq.Calibration(64).add(x, mask=keep)  # the NaN is in a padding row
    kept = X[keep].astype(np.float64)
    np.testing.assert_allclose(cal.gram, kept.T @ kept, rtol=1e-5, atol=1e-6 * np.abs(kept.T @ kept).max())
    before = cal.gram.copy()
    with pytest.raises(xq.XnnquantError, match=re.escape("calibration must be finite: got nan at index (5, 7) "
                                                         "(1 non-finite value(s) in all)")):
        cal.add(x)
    huge = np.full((2, 64), 2e19, np.float32)  # finite, but its squares overflow float32
    with pytest.raises(xq.XnnquantError, match=re.escape(
            "calibration values are too large: some |x| > 1.8e19, whose square overflows the float32 products; "
            "expected activations of a usable model")):
        cal.add(huge)
    assert np.array_equal(cal.gram, before) and cal.tokens == 95
