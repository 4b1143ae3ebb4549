"""float32 -> bf16 round-to-nearest-even, over every bf16 bit pattern."""

import numpy as np
import pytest

from xnnquant.packing import bf16_bits_to_float32, to_bf16

ALL = np.arange(1 << 16, dtype=np.uint32)  # every bf16 bit pattern (upper half of a float32)
FINITE = ALL[(ALL & 0x7F80) != 0x7F80]  # exponent not all ones


def f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint32).view(np.float32)


def test_every_bf16_value_passes_through_unchanged():
    x = f32(FINITE << 16)
    out = to_bf16(x)
    assert out.bits.dtype == np.uint16 and out.values.dtype == np.float32
    assert np.array_equal(out.bits, FINITE.astype(np.uint16))
    assert np.array_equal(out.values.view(np.uint32), FINITE << 16)


def test_nan_stays_nan_and_inf_stays_inf():
    out = to_bf16(np.array([np.nan, np.inf, -np.inf], np.float32))
    assert np.isnan(out.values[0]) and out.values[1] == np.inf and out.values[2] == -np.inf


@pytest.mark.parametrize("low, rounds_up_if_odd, rounds_up_if_even", [
    (0x8000, True, False),   # exact tie: to the even neighbour
    (0x8001, True, True),    # just above half: up
    (0x7FFF, False, False),  # just below half: down
    (0x0001, False, False),
    (0xFFFF, True, True),
])
def test_rounding_of_every_pattern(low, rounds_up_if_odd, rounds_up_if_even):
    # Finite patterns whose rounding up does not overflow into the Inf/NaN exponent.
    hi = FINITE[(FINITE & 0x7FFF) != 0x7F7F]
    out = to_bf16(f32((hi << 16) | low)).bits.astype(np.uint32)
    odd = (hi & 1) == 1
    up = np.where(odd, rounds_up_if_odd, rounds_up_if_even)
    assert np.array_equal(out, hi + up)


def test_ties_to_even_examples():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: even mantissa (1.0) wins.
    # 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: even (1 + 2^-6) wins.
    out = to_bf16(np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], np.float32))
    assert out.values.tolist() == [1.0, 1 + 2**-6, -1.0]
    assert out.bits.tolist() == [0x3F80, 0x3F82, 0xBF80]


def test_matches_torch_on_random_and_tie_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        (FINITE << 16) | 0x8000,
    ])
    x = f32(bits)
    x = x[np.isfinite(x)]
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16(x).bits, expected)


def test_bits_to_float32_is_exact():
    assert np.array_equal(bf16_bits_to_float32(FINITE.astype(np.uint16)).view(np.uint32), FINITE << 16)
