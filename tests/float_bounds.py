"""Tolerances for float results that do not depend on which CPU ran the test.

XNNPACK picks its micro-kernels by CPU (SSE, AVX2, AVX-512, VNNI, ...): different tiles,
different vector widths, different polynomial approximations, different summation
orders.  torch's and numpy's float kernels do the same.  A test that compares a float
result with a reference therefore uses one of these bounds, each of which every kernel
on every x86-64 CPU meets:

* **sums in any order**: a float32 sum of ``n`` terms evaluated in any order (with or
  without FMA) is within ``gamma(n) * sum|terms|`` of the exact sum, where
  ``gamma(n) = n u / (1 - n u)`` and ``u = 2^-24`` (Higham, *Accuracy and Stability of
  Numerical Algorithms*, 2nd ed., eq. 3.5 and Lemma 3.4).  ``sum|terms|`` is what the
  same operation gives on ``|inputs|`` (``magnitude``).
* **XNNPACK's own acceptance bounds**: XNNPACK tests every micro-kernel of an operator
  against a double-precision reference with one tolerance per operator
  (``test/unary-ops.h``, ``test/vbinary-microkernel-tester.cc``,
  ``test/operators/softmax-operator-tester.h`` at commit 1adaa7c7, the XNNPACK inside
  executorch 1.4.1); a kernel ships only if it meets it.  ``XNNPACK_F32`` restates
  those numbers.
* **rounding once**: a float32 result computed exactly (or in float64) and rounded once
  is within half an ulp of the exact value (``half_ulp``).

The references in the tests are computed in float64 (the interpreter, numpy, torch
``.double()``), so their own error (about ``n * 2^-53`` relative) is far below these.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Unit roundoff of float32 (round to nearest): half of ``EPS``.
U = 2.0**-24
#: Unit roundoff of float16.
U16 = 2.0**-11
#: float32 machine epsilon (``std::numeric_limits<float>::epsilon()``), 2 ulp of 1.0 / 2.
EPS = 2.0**-23


def gamma(n: int | np.ndarray, unit: float = U) -> np.ndarray:
    """``n u / (1 - n u)``: relative bound of a float32 sum (or dot product) of ``n`` terms
    (``unit=U16`` for float16 arithmetic)."""
    n = np.asarray(n, np.float64)
    return n * unit / (1 - n * unit)


def half_ulp(x: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """Half an ulp of ``x`` in ``dtype`` (float64): the error of rounding an exact value once."""
    return np.spacing(np.abs(np.asarray(x).astype(dtype))).astype(np.float64) / 2


def mixed(ref: np.ndarray, absolute: float, relative: float) -> np.ndarray:
    """``max(absolute, |ref| * relative)``, the form of most of XNNPACK's tolerances."""
    return np.maximum(absolute, np.abs(np.asarray(ref, np.float64)) * relative)


def _exact(ref: np.ndarray) -> np.ndarray:
    return np.zeros(np.shape(ref))


#: XNNPACK's acceptance bound for f32 results of each node kind, as a function of the
#: (double-precision) reference result: any kernel XNNPACK runs on any CPU meets it.
XNNPACK_F32: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    # test/vbinary-microkernel-tester.cc: |y - ref| <= (|ref| + 1) * 1e-6 for f32 ops
    **{kind: (lambda y: (np.abs(y) + 1.0) * 1e-6) for kind in (
        "XNNAdd", "XNNSubtract", "XNNMultiply", "XNNDiv", "XNNMinimum", "XNNMaximum", "XNNPReLU")},
    # test/unary-ops.h
    "XNNSigmoid": lambda y: mixed(y, EPS, EPS),
    "XNNELU": lambda y: mixed(y, 5e-6, 1e-5),
    "XNNHardswish": lambda y: mixed(y, 5e-6, 1e-5),
    "XNNLeakyReLU": lambda y: mixed(y, EPS, 5 * EPS),
    "XNNSquare": lambda y: mixed(y, EPS, EPS),
    "XNNSquareRoot": lambda y: np.abs(y) * 2 * EPS,
    "XNNReciprocalSquareRoot": lambda y: np.abs(y) * 2 * EPS,
    "XNNTanh": lambda y: mixed(y, EPS, 4 * EPS),
    "XNNExp": lambda y: mixed(y, 2 * EPS, 6 * EPS),
    "XNNLog": lambda y: mixed(y, 2 * EPS, 6 * EPS),
    "XNNSin": lambda y: mixed(y, 3 * EPS, 5 * EPS),
    "XNNCos": lambda y: mixed(y, 3 * EPS, 5 * EPS),
    "XNNGelu": lambda y: mixed(y, 10 * EPS, 5 * EPS),
    **dict.fromkeys(("XNNAbs", "XNNNegate", "XNNFloor", "XNNCeiling", "XNNClamp"), _exact),
    # test/operators/softmax-operator-tester.h: |y - ref| <= |ref| * 1e-5 for f32
    "XNNSoftmax": lambda y: np.abs(y) * 1e-5,
}


def bound_of_kind(kind: str, ref: np.ndarray) -> np.ndarray:
    """What XNNPACK may differ from the float64 ``ref`` by for one node of ``kind``, plus
    the half ulp by which the reference itself was rounded to float32."""
    return XNNPACK_F32[kind](np.asarray(ref, np.float64)) + half_ulp(ref)


def assert_within(got: np.ndarray, ref: np.ndarray, bound: np.ndarray, what: str = "") -> None:
    """``|got - ref| <= bound`` element by element, naming the worst element if not."""
    err = np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64))
    bound = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    bad = err > bound
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.size} elements outside the bound; worst at {worst}: "
            f"got {got[worst]!r}, reference {ref[worst]!r}, |error| {err[worst]:.3g} > bound {bound[worst]:.3g}"
        )


def dynamic_gemm_bound(codes: np.ndarray, zero_point: np.ndarray, x_scale: np.ndarray, w_codes: np.ndarray,
                       w_scale: np.ndarray, group_size: int | None, bias: np.ndarray | None) -> np.ndarray:
    """Bound on |XNNPACK - exact| for ``y = dequant(qd8 x) @ dequant(w).T + bias``, any kernel.

    ``codes`` int ``(M, K)`` with per-row ``zero_point`` and ``x_scale`` ``(M,)`` (the
    per-token quantization, bit-exact on every CPU); ``w_codes`` int ``(N, K)`` with
    ``w_scale`` ``(N,)`` (per channel) or ``(N, K // group_size)`` (blockwise); result
    float64 ``(M, N)``.

    Per channel (qc8w, qc4w): every kernel, signed (qd8) or unsigned (qdu8, codes + 128),
    sums integers exactly in int32, the zero-point correction included, then rounds at
    most 4 times in float32 (int32 -> float above 2^24, times the input scale, times the
    filter scale, plus the bias): ``gamma(4) * (sum_k |q - zp| |w| s xs + |b|)``.

    Blockwise (qb4w): each block's integer sum uses the codes *before* the zero point is
    taken off (``|q|`` or ``|q + 128|``, at most ``|q - zp| + z`` with
    ``z = max(|zp|, |zp + 128|)``) and is scaled and added in float32 (2 roundings per
    block); the packed correction ``-sum(chunk sums * s)`` was accumulated in float32 over
    the ``K / kr`` chunks (kr >= 4 in every x86 kernel) and is multiplied by the zero
    point; then the same 4 roundings: ``gamma(2 B + K / 4 + 4) * (sum_k (|q - zp| + z) |w| s xs + |b|)``.
    """
    centered = np.abs(codes.astype(np.float64) - zero_point[:, None])
    w_abs = np.abs(w_codes.astype(np.float64))
    xs = x_scale.astype(np.float64)[:, None]
    b_abs = 0.0 if bias is None else np.abs(bias.astype(np.float64))
    if group_size is None:
        return gamma(4) * ((centered @ (w_abs * w_scale.astype(np.float64)[:, None]).T) * xs + b_abs)
    k = codes.shape[1]
    z = np.maximum(np.abs(zero_point), np.abs(zero_point + 128)).astype(np.float64)[:, None]
    w_real = w_abs * np.repeat(w_scale.astype(np.float64), group_size, axis=1)
    return gamma(2 * (k // group_size) + k // 4 + 4) * (((centered + z) @ w_real.T) * xs + b_abs)
