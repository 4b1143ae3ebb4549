"""The fast quantize and pack paths against the reference, bit for bit.

The reference is the unfused implementation the library had before the kernels:
``search.minmax_scales`` / ``search.quantize_blocks`` / ``rounding.quantize_values`` on
the whole tensor at once, and nibble packing written here element by element.  The
fast paths (``schemes.kernels``, ``packing.int4``) cut the input into cache-sized
pieces spread over threads, each piece through numba's compiled loops (``jit``) or
numpy's ufuncs; every test runs both ways, on arrays larger than one piece, with 1 and 3
threads, and on inputs built to catch a changed rounding: exact ties at .5,
subnormals, zeros and all-zero blocks, values near the float32 maximum, fp16 / bf16 /
float64 inputs and torch tensors.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import xnnquant as xq
from xnnquant.arrays import as_float32
from xnnquant.compute import jit
from xnnquant.packing.int4 import pack_int4_bytes
from xnnquant.rounding import quantize_values
from xnnquant.schemes import kernels, search
from xnnquant.schemes.checks import reciprocal

PIECE = 1 << 14  # small pieces, so arrays of a few hundred thousand values make many
FLOAT32_MAX = np.finfo(np.float32).max


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", PIECE)
    monkeypatch.setattr(xq.packing.int4, "PACK_CHUNK", PIECE)


@pytest.fixture(autouse=True, params=["jit", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test once with the compiled loops and once with numpy's (``XNNQUANT_JIT=0``)."""
    monkeypatch.setenv("XNNQUANT_JIT", "1" if request.param == "jit" else "0")
    if request.param == "jit" and jit.loops() is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("numba is missing: CI installs it from requirements/lock.txt")
        pytest.skip("numba is not installed")
    return str(request.param)


@pytest.fixture(params=[1, 3], ids=lambda n: f"{n}threads")
def threads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv("XNNQUANT_NUM_THREADS", str(request.param))
    return int(request.param)


def adversarial(rng: np.random.Generator, rows: int, cols: int, half: float) -> np.ndarray:
    """float32 ``[rows, cols]``: rows of normal values at scales 1e-38 .. 1e30, heavy tails,
    exact ties, subnormals, zeros, and values near the float32 maximum.

    Tie rows: each group of 32 holds ``-half * 2**e`` (so the min-max scale is exactly
    ``2**e``, a bf16 value) and odd multiples of ``2**(e-1)``, which sit exactly on .5
    after ``x * (1 / scale)``.
    """
    w = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    w[1::7] = rng.standard_t(1.2, (len(w[1::7]), cols)).astype(np.float32)
    ties = w[2::7]
    e = np.exp2(rng.integers(-100, 100, (len(ties), 1))).astype(np.float32)
    ties[:] = (2 * rng.integers(-int(half), int(half), ties.shape) + 1).astype(np.float32) * e / 2
    ties[:, ::32] = -np.float32(half) * e
    w[3::7] = 0.0
    w[4::7, : cols // 2] = 0.0  # all-zero groups next to normal ones
    sub = w[5::7]  # subnormals of either sign: exponent bits 0, mantissa 1 .. 2**23 - 1
    signs = rng.choice(np.array([0, 0x80000000], np.uint32), sub.shape)
    sub[:] = (rng.integers(1, 2**23, sub.shape).astype(np.uint32) | signs).view(np.float32)
    big = w[6::7]
    big[:] = (rng.uniform(-1, 1, big.shape) * FLOAT32_MAX).astype(np.float32)
    big[:, ::5] = FLOAT32_MAX
    return w


def reference_pack(codes: np.ndarray) -> bytes:
    """Nibbles element by element: low nibble code[2j] + 8, high nibble code[2j + 1] + 8."""
    q = codes.astype(np.int64) + 8
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.full(q.shape[:-1] + (1,), 8)], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8).tobytes()


def reference_blockwise(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = as_float32(w).reshape(-1, g)
    scale = search.minmax_scales(blocks, -8, 7, bf16=True)
    return search.quantize_blocks(blocks, scale, -8, 7, "int8").reshape(w.shape), scale.reshape(w.shape[0], -1)


def reference_per_channel(w: np.ndarray, bits: int, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    qmin, qmax = (-8, 7) if bits == 4 else (-128, 127)
    moved = np.moveaxis(as_float32(w), axis, 0)
    blocks = moved.reshape(moved.shape[0], -1)
    scale = search.minmax_scales(blocks, qmin, qmax)
    codes = search.quantize_blocks(blocks, scale, qmin, qmax, "int8").reshape(moved.shape)
    return np.moveaxis(codes, 0, axis), scale


def assert_same(qt: xq.QuantizedTensor, codes: np.ndarray, scale: np.ndarray) -> None:
    np.testing.assert_array_equal(qt.codes, codes)
    assert qt.codes.dtype == codes.dtype
    assert qt.scale.tobytes() == np.asarray(scale, np.float32).tobytes()
    expected = reference_pack(codes) if qt.bits == 4 else codes.tobytes()
    assert qt.to_bytes() == expected


@pytest.mark.parametrize("g", [32, 64, 4096])
def test_blockwise_matches_reference(threads: int, g: int) -> None:
    w = adversarial(np.random.default_rng(g), 70, 4096, 7.5)  # 17.5 pieces
    assert_same(xq.quantize_blockwise(w, g), *reference_blockwise(w, g))


@pytest.mark.parametrize("bits", [4, 8])
def test_per_channel_matches_reference(threads: int, bits: int) -> None:
    w = adversarial(np.random.default_rng(bits), 60, 3000, 7.5 if bits == 4 else 127.5)
    assert_same(xq.quantize_per_channel(w, bits), *reference_per_channel(w, bits))


def test_per_channel_rows_longer_than_a_piece(threads: int) -> None:
    """A row of 2.3 pieces is cut into parts; the max joins them."""
    w = adversarial(np.random.default_rng(7), 7, int(2.3 * PIECE), 127.5)
    assert_same(xq.quantize_per_channel(w, 8), *reference_per_channel(w, 8))


@pytest.mark.parametrize("axis", [1, 3, -1])
def test_per_channel_other_axes_match_reference(threads: int, axis: int) -> None:
    w = adversarial(np.random.default_rng(axis + 5), 24, 3 * 3 * 16, 7.5).reshape(24, 3, 3, 16)
    assert_same(xq.quantize_per_channel(w, 4, axis=axis), *reference_per_channel(w, 4, axis % 4))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("datatype", [xq.Datatype.qint8, xq.Datatype.quint8])
def test_per_tensor_matches_reference(threads: int, symmetric: bool, datatype: xq.Datatype) -> None:
    rng = np.random.default_rng(int(datatype) + 2 * symmetric)
    x = (rng.standard_normal((3, 41, 1999)) * 3 + 0.5).astype(np.float32)  # 15 pieces
    x[1, 7, 3] = 0.0
    qt = xq.quantize_per_tensor(x, datatype, symmetric=symmetric)
    qmin, qmax = (-128, 127) if datatype is xq.Datatype.qint8 else (0, 255)
    if symmetric:
        scale = search.minmax_scales(x.reshape(1, -1), qmin, qmax).reshape(())
        zp = (qmin + qmax + 1) // 2
    else:  # PyTorch's asymmetric rule, in float32
        lo, hi = np.minimum(x.min(), np.float32(0)), np.maximum(x.max(), np.float32(0))
        scale = (hi - lo) / np.float32(qmax - qmin)
        zp = int(np.clip(qmin - np.rint(lo / scale), qmin, qmax))
    assert qt.zero_point == zp
    codes = quantize_values(x, reciprocal(scale), zp, qmin, qmax, "int8" if qmin < 0 else "uint8")
    assert_same(qt, codes, scale)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # the reference's x * (1 / scale)
def test_given_scales_match_reference(threads: int) -> None:
    rng = np.random.default_rng(3)
    w = adversarial(rng, 40, 2048, 7.5)
    scale = xq.packing.to_bf16(np.exp2(rng.uniform(-120, 120, (40, 64))).astype(np.float32)).values
    qt = xq.quantize_blockwise(w, 32, scale=scale)
    blocks = w.reshape(-1, 32)
    assert_same(qt, search.quantize_blocks(blocks, scale.reshape(-1), -8, 7, "int8").reshape(w.shape), scale)
    x = rng.standard_normal((5, 30001)).astype(np.float32) * 100
    qt = xq.quantize_per_tensor(x, xq.Datatype.quint8, scale=0.37, zero_point=131)
    assert_same(qt, quantize_values(x, reciprocal(np.float32(0.37)), 131, 0, 255, "uint8"), np.float32(0.37))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_narrow_and_wide_inputs_match_their_float32_widening(threads: int, dtype: type) -> None:
    w = np.random.default_rng(1).standard_normal((40, 2048)).astype(dtype)
    w[3] = 0
    assert_same(xq.quantize_blockwise(w, 32), *reference_blockwise(w, 32))
    assert_same(xq.quantize_per_channel(w, 8), *reference_per_channel(w, 8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_tensors_give_the_bytes_of_numpy(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(64, 2048, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    as_numpy = t.float().numpy().astype({"float32": np.float32, "float16": np.float16,
                                          "bfloat16": ml_dtypes.bfloat16}[dtype])
    assert xq.quantize_blockwise(t, 32).to_bytes() == xq.quantize_blockwise(as_numpy, 32).to_bytes()
    assert xq.quantize_blockwise(t.t().contiguous().t(), 32).to_bytes() == xq.quantize_blockwise(as_numpy, 32).to_bytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("call", ["blockwise", "per_channel", "per_tensor", "given_scale"])
def test_non_finite_values_raise_the_reference_error_naming_the_index(threads: int, bad: float,
                                                                       call: str) -> None:
    w = np.ones((40, 4096), np.float32)
    w[37, 1001] = bad
    w[38, 5] = np.nan
    expected = f"must be finite: got {bad} at index (37, 1001) (2 non-finite value(s) in all)"
    with pytest.raises(xq.XnnquantError) as info:
        if call == "blockwise":
            xq.quantize_blockwise(w, 32)
        elif call == "per_channel":  # the kernel sees [40, 4096]; the error names the caller's index
            w = w.reshape(40, 64, 64)
            expected = expected.replace("(37, 1001)", "(37, 15, 41)")
            xq.quantize_per_channel(w, 8)
        elif call == "per_tensor":
            xq.quantize_per_tensor(w)
        else:
            xq.quantize_blockwise(w, 32, scale=np.ones((40, 128), np.float32))
    assert str(info.value) == ("x " if call == "per_tensor" else "w ") + expected


def test_float64_beyond_float32_range_is_refused_as_infinite() -> None:
    w = np.ones((4, 64), np.float64)
    w[2, 9] = 1e300
    with pytest.raises(xq.XnnquantError, match=r"w must be finite: got inf at index \(2, 9\)"):
        xq.quantize_blockwise(w, 32)


@pytest.mark.parametrize("pack", [xq.packing.pack_int4, pack_int4_bytes])
def test_codes_out_of_range_are_refused_by_the_fast_pack(threads: int, pack) -> None:  # type: ignore[no-untyped-def]
    codes = np.zeros((50, 4096), np.int8)
    codes[41, 17] = 8
    with pytest.raises(xq.XnnquantError, match=r"int4 codes must lie in \[-8, 7\]: got 8 at index \(41, 17\)"):
        pack(codes)


@pytest.mark.parametrize("where", [0, 63, 64, 127, 130, 133], ids=lambda i: f"code{i}")
def test_every_code_out_of_range_is_refused_wherever_it_lies(where: int) -> None:
    """In the first vector of 64 codes (0, 63), the second (64, 127), the pairs after them."""
    codes = np.zeros((1, 134), np.int8)
    for bad in [v for v in range(-128, 128) if not -8 <= v <= 7]:
        codes[0, where] = bad
        with pytest.raises(xq.XnnquantError, match=rf"got {bad} at index \(0, {where}\)"):
            xq.packing.pack_int4(codes)
        with pytest.raises(xq.XnnquantError, match=rf"got {bad} at index \(0, {where}\)"):
            pack_int4_bytes(codes)


def test_pack_matches_reference_on_every_pair(threads: int) -> None:
    pairs = np.array([(a, b) for a in range(-8, 8) for b in range(-8, 8)], np.int8).reshape(1, -1)
    codes = np.tile(pairs, (300, 1))  # 300 rows of all 256 pairs: 4.7 pieces
    assert xq.packing.pack_int4(codes).tobytes() == reference_pack(codes)
    assert pack_int4_bytes(codes) == reference_pack(codes)
    odd = codes[:, :-1]
    assert xq.packing.pack_int4(odd).tobytes() == reference_pack(odd)
    assert pack_int4_bytes(odd) == reference_pack(odd)


SHAPES = st.tuples(st.integers(1, 5), st.sampled_from([32, 64, 96, 160]))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_hypothesis_blockwise_and_per_channel_match_reference(data: st.DataObject) -> None:
    """Any finite float32 values, subnormals included, at any magnitude."""
    shape = data.draw(SHAPES)
    w = data.draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False,
                                                                        allow_infinity=False)))
    assert_same(xq.quantize_blockwise(w, 32), *reference_blockwise(w, 32))
    assert_same(xq.quantize_per_channel(w, 4), *reference_per_channel(w, 4))
    assert_same(xq.quantize_per_channel(w, 8), *reference_per_channel(w, 8))


def reference_mse_scales(blocks: np.ndarray, qmin: int, qmax: int, bf16: bool) -> np.ndarray:
    """The search as it was before threading and pruning: one chunk after the other, in one
    thread, every candidate scored."""
    n_blocks, block_len = blocks.shape
    out = np.empty(n_blocks, np.float32)
    step = max(1, (1 << 20) // (block_len * (len(search.COARSE_RATIOS) + 1)))
    for start in range(0, n_blocks, step):
        chunk = blocks[start : start + step]
        cols = np.arange(len(chunk))
        _, exponent = np.frexp(np.abs(chunk).max(axis=-1))
        x = np.ldexp(chunk, -exponent[:, None])
        maxpos = np.maximum(x.max(axis=-1), 0)
        maxneg = np.maximum(-x.min(axis=-1), 0)
        base = np.maximum(maxpos, maxneg) / search.half_range(qmin, qmax)
        all_zero = base == 0
        no_clip = np.maximum(maxpos / np.float32(qmax), maxneg / np.float32(-qmin))
        raw = np.concatenate([search.COARSE_RATIOS[:, None] * base[None], no_clip[None]])
        best, cand = reference_best(x, raw, exponent, all_zero, qmin, qmax, bf16)
        kept = np.ldexp(cand[best, cols], -exponent)
        fine_raw = np.concatenate([kept[None], search.FINE_FACTORS[:, None] * raw[best, cols][None]])
        best, cand = reference_best(x, fine_raw, exponent, all_zero, qmin, qmax, bf16)
        out[start : start + step] = cand[best, cols]
    return out


def reference_best(blocks: np.ndarray, raw: np.ndarray, exponent: np.ndarray, all_zero: np.ndarray, qmin: int,
                   qmax: int, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every candidate scored, the first least error kept."""
    cand = search.finish_scales(np.ldexp(raw, exponent), all_zero[None], bf16)
    errors = search.block_errors(blocks, np.ldexp(cand, -exponent), qmin, qmax)
    return errors.argmin(axis=0), cand


@pytest.mark.parametrize(("bits", "g"), [(4, 32), (4, None), (8, None)])
def test_threaded_pruned_mse_search_matches_the_exhaustive_one(threads: int, bits: int, g: int | None) -> None:
    """Blocks are searched independently, so cutting them over threads changes no scale; a
    candidate skipped by its clipping bound could not have won."""
    qmin, qmax = (-8, 7) if bits == 4 else (-128, 127)
    w = adversarial(np.random.default_rng(bits), 210, 1536, qmax + 0.5)
    blocks = w.reshape(-1, g) if g else w
    found = search.mse_scales(blocks, qmin, qmax, bf16=g is not None)
    assert found.tobytes() == reference_mse_scales(blocks, qmin, qmax, g is not None).tobytes()


@pytest.mark.parametrize("width", [32, 13, 1536])
def test_block_errors_and_mse_scales_are_the_same_bits_both_ways(width: int, monkeypatch: pytest.MonkeyPatch,
                                                                  backend: str) -> None:
    """The compiled loop and numpy add the squares in the same lanes and order (widths that
    are not a multiple of 8 included), so errors and the scales they choose agree bit for bit."""
    rng = np.random.default_rng(width)
    w = adversarial(rng, 70, 3 * width * 8, 7.5).reshape(-1, width)
    _, exponent = np.frexp(np.abs(w).max(axis=-1))
    blocks = np.ldexp(w, -exponent[:, None])
    scales = np.abs(rng.standard_normal((5, len(blocks)))).astype(np.float32) / 7 + np.float32(0.01)
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("XNNQUANT_JIT", mode)
        results[mode] = (search.block_errors(blocks, scales, -8, 7).tobytes(),
                         search.mse_scales(w, -8, 7, bf16=width == 32).tobytes())
    assert results["1"] == results["0"]


@pytest.mark.parametrize("make", [lambda w: xq.quantize_blockwise(w, 32), lambda w: xq.quantize_per_channel(w, 4),
                                  lambda w: xq.quantize_per_channel(w, 8, axis=1)])
def test_weight_sqnr_is_metrics_sqnr(make, threads: int) -> None:  # type: ignore[no-untyped-def]
    """The export report's SQNR, pieces of residuals (compiled or numpy), against the one
    of ``metrics.sqnr_db`` on the whole dequantized weight (float64 sums: the pieces' float32
    dot products differ from it by far less than 1e-4 dB)."""
    from xnnquant.frontend.weight_sqnr import weight_sqnr
    from xnnquant.metrics import sqnr_db

    w = np.random.default_rng(1).standard_normal((300, 1024)).astype(np.float32)
    q = make(w)
    assert weight_sqnr(w, q) == pytest.approx(float(sqnr_db(w, q.dequantize())), abs=1e-4)


@pytest.mark.parametrize("width", [32, 13, 1536])
def test_block_errors_are_the_squared_error_of_the_codes(width: int, backend: str) -> None:
    """``block_errors`` against its definition written out in float64 from the codes
    ``clip(rint(x * float32(1 / s)), -8, 7)``.  Tolerance: each float32 residual is within
    a few ulps of its operands (cancellation makes that ~1e-6 of it), and a float32 sum of
    ``width`` squares is within ``width * 2**-24`` of exact: 2e-4 covers 1536 values."""
    rng = np.random.default_rng(width)
    blocks = rng.standard_normal((40, width)).astype(np.float32)
    scales = (np.abs(blocks).max(axis=1) / np.float32(7.5) * rng.uniform(0.5, 1.5, (3, 40))).astype(np.float32)
    codes = np.clip(np.rint(blocks[None] * (np.float32(1) / scales)[..., None]), -8, 7)
    expected = ((codes * scales[..., None].astype(np.float64) - blocks[None]) ** 2).sum(axis=-1)
    np.testing.assert_allclose(search.block_errors(blocks, scales, -8, 7), expected, rtol=2e-4)
