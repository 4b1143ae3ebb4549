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

from xnnquant import QuantizedTensor, quantize_per_token

#: Unit roundoff of float32 (round to nearest): half of ``EPS``.
U = 2.0**-24
#: Unit roundoff of float16.
U16 = 2.0**-11
#: float32 machine epsilon (``std::numeric_limits<float>::epsilon()``), 2 ulp of 1.0 / 2.
EPS = 2.0**-23


def relative_error(got: object, ref: object) -> float:
    """``max |got - ref| / max |ref|`` (numpy arrays or torch tensors): the measure the export
    tests bound a program's output by."""
    g, r = (np.asarray(v.detach().numpy() if hasattr(v, "detach") else v, np.float64) for v in (got, ref))
    return float(np.abs(g - r).max() / np.abs(r).max())


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


#: XNNPACK's bound for f32 results of each node kind on x86-64, as a function of the
#: (double-precision) reference result: any kernel XNNPACK runs on any x86-64 CPU meets it.
XNNPACK_F32: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    # test/vbinary-microkernel-tester.cc allows (|ref| + 1) * 1e-6 for f32 ops, for other
    # architectures' reciprocal-based division; every x86 kernel (SSE, AVX, AVX-512) is one
    # IEEE vaddps / vsubps / vmulps / vdivps / vminps / vmaxps per element: correctly
    # rounded, so the same bits as the float64 reference rounded once (53 >= 2 * 24 + 2
    # makes that double rounding innocuous, division included)
    **dict.fromkeys(("XNNAdd", "XNNSubtract", "XNNMultiply", "XNNDiv", "XNNMinimum", "XNNMaximum", "XNNPReLU"), _exact),
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


#: Relative to a float32 program output's largest magnitude: what the programs of the export
#: tests may differ from torch by on any x86-64 CPU when they run XNNPACK's approximated kinds.
#: The loosest acceptance above is 1e-5 of the value (XNNSoftmax; ELU and hardswish add 5e-6
#: absolute; GELU, sigmoid, tanh, exp and log are within 6 EPS = 7e-7), which is as much as
#: ``SUMS`` allows for everything: a softmax kernel at its tolerance moves an attention's output
#: by up to 1e-5 of the largest value it averages, and the layers after it scale that by their
#: gain (``sum |w| |x| / |y|``, about the square root of the fan-in for random weights: below 10
#: for the two-layer models of width <= 128, with a norm after each block, the tests export).
#: So ``1e-4``, still four orders below a wrong row, layout or size (an error of the output's
#: own magnitude).  On one CPU the programs measure a few 1e-7.
APPROXIMATED = 1e-4
#: Relative to a float32 program output's largest magnitude, for programs of sums and exactly
#: rounded ops only (linear, convolution, add, multiply, norms of them): float32 sums of at
#: most a few hundred products in another order (``gamma``: a few ulps), two orders above that.
SUMS = 1e-5


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
    ``z = max(|zp|, |zp + 128|)``); the float32 accumulator starts at the packed
    correction times the zero point (that correction was itself accumulated in float32
    over the ``K / 16`` chunks of 16 values: kr = 8 in every x86 qb4w kernel), adds each
    block's sum times its scale with one FMA (``B`` roundings), is reduced across lanes
    (at most 3 additions) and scaled and biased (2): ``gamma(B + K / 16 + 8) *
    (sum_k (|q - zp| + z) |w| s xs + |b|)``.
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
    return gamma(k // group_size + k // 16 + 8) * (((centered + z) @ w_real.T) * xs + b_abs)


def uncertain_codes(x: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Which per-token codes of ``x`` a runtime holding ``y`` instead, ``y >= 0`` and
    ``|y - x| <= delta``, may round the other way: bool, shape of ``x`` (float32 rows of
    non-negative values, as after a ReLU, so the zero point is -128 whatever the row).

    A code is ``round_half_even(x * s) - 128`` with ``s = 255 / max(row)``; perturbing the
    row moves ``x * s`` by at most ``delta * s + |x * s| * ds / s`` (``ds``: the change of
    ``s`` when the maximum moves by ``delta``) plus two float32 roundings.  A code is
    certain when that is below the value's distance to the nearest half integer; an
    uncertain one differs by at most one step.
    """
    x64, d = x.astype(np.float64), np.broadcast_to(delta, x.shape).astype(np.float64)
    assert (x64 >= 0).all()  # so the row minimum XNNPACK uses, min(0, min(row)), is 0
    top = x64.max(axis=1, keepdims=True)
    worst = d.max(axis=1, keepdims=True)
    s = 255 / np.where(top > 0, top, 1)
    ds_over_s = worst / np.maximum(top - worst, 1e-30)
    t = x64 * s
    moves = d * s + np.abs(t) * ds_over_s + 2 * U * np.abs(t)
    return np.abs(t - np.floor(t) - 0.5) <= moves


def dynamic_chain_bound(x: np.ndarray, layers: list[tuple[QuantizedTensor, np.ndarray | None, bool]],
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Reference output and bound of fully-connected layers each fed through a qdint8
    Convert: ``layers`` = ``(filter, bias or None, relu)`` in order, ``x`` float32 ``(M, K)``.

    Each layer after the first quantizes what the previous one computed, on the runtime
    from its own (slightly different) floats.  A layer's error is its own
    (``dynamic_gemm_bound``), plus the change of its input scale (1/s moves with the row
    maximum by at most the previous error), plus one input step times the filter column
    for every input code the previous error may have rounded the other way
    (``uncertain_codes``; hidden layers must end in a ReLU).  Returns the float32
    reference (float64 arithmetic rounded once, as the interpreter computes it), the
    bound, and nothing depends on the CPU.
    """
    h, d = x, np.zeros(x.shape)
    for i, (w, b, relu) in enumerate(layers):
        q = quantize_per_token(h)
        w_abs = np.abs(w.dequantize()).astype(np.float64)
        flips = np.zeros((h.shape[0], w.shape[0]))
        if i:
            assert layers[i - 1][2], "a hidden layer's codes are bounded only after a ReLU"
            step = np.asarray(q.scale, np.float64).reshape(-1, 1)
            flips = (uncertain_codes(h, d) * step) @ w_abs.T
        real = q.dequantize().astype(np.float64)
        y = real @ w.dequantize().astype(np.float64).T + (0 if b is None else b.astype(np.float64))
        y = np.maximum(y, 0) if relu else y  # a ReLU does not increase the error
        size = np.abs(real) @ w_abs.T
        top = np.abs(h).max(axis=1, keepdims=True).astype(np.float64)
        scale_moved = d.max() / np.maximum(top - d.max(), 1e-30)  # relative change of 1/s
        group = w.group_size if w.datatype.name == "qbint4" else None
        own = dynamic_gemm_bound(q.codes, q.zero_point, q.scale, w.codes, w.scale, group, b)
        h = y.astype(np.float32)
        d = own + scale_moved * size + flips + half_ulp(h)
    return h, d
