"""What the self-check's bounds and the static int8 decisions rest on, on every x86-64 CPU class
issue 42 names (``cpu_classes.py``, features injected as /proc/cpuinfo text), and on this
machine's real XNNPACK where a test needs the runtime.

Static int8 codes are the same on every class but in one corner.  Read from XNNPACK
1adaa7c7, per kernel family each class's x86 branch selects in the executorch 1.4.1 wheel:

* GEMM and IGEMM (fully connected, convolution; ``gemm-config.c``
  ``init_qs8_qc8w_gemm_config``): 7x16c8 avx512vnni (Zen 4/5, Ice Lake, Sapphire Rapids),
  7x16c8 avx512skx (Skylake-SP), 3x8c8 avx2 (Zen 1-3, Alder Lake), 3x4c8 sse2/sse4.1.  The sums
  are exact in wrapping int32 in all of them (``vpmaddwd`` + ``vpaddd`` on sign-extended codes;
  ``vpdpbusd`` on inputs XORed with 0x80, the ``-128 * sum(w)`` this adds folded into the bias
  by ``xnn_pack_qs8_to_qu8_gemm_goi_w``); every one requantizes with
  ``xnn_init_qs8_qc8w_conv_minmax_fp32_scalar_params``: ``cvtepi32_ps`` (round to nearest
  even), one ``mul_ps`` by the per-channel scale, ``min_ps`` with ``output_max - zp``,
  ``cvtps_epi32`` (round half to even: the default MXCSR, which neither XNNPACK nor ExecuTorch
  changes).  They part in how the zero point is added: avx2, avx, sse4.1 and sse2 saturate to
  int16 first (``packs_epi32`` then ``adds_epi16``); avx512skx, avx512vnni, avx512amx and
  avxvnni add it in int32 (``add_epi32``) and saturate after (``cvtsepi32_epi8`` /
  ``packs``), so a scaled accumulator at or below ``-2^31`` (``cvtps_epi32`` gives
  ``INT32_MIN``) plus a negative zero point wraps to 127.  ``graph.int8.requantize_fp32``
  models both; the static int8 rewrite keeps every layer's reach within 2^30 output steps.
* depthwise (``dwconv-config.c``): 3p/9p/25p avx512skx_mul32 or avx2_mul32 or sse41/sse2 mul16,
  all ``packs_epi32`` + ``adds_epi16``: the same codes.
* add (``qs8_vadd``: avx512skx/avx2 mul32, avx mul32, sse41/sse2 mul16: the same int32 products,
  ``sra`` and saturating zero point), multiply (``qs8_vmul``: avx mul16 on every AVX class),
  conversions (``f32_qs8_vcvt`` avx512skx/avx2: multiply, ``min_ps``, ``cvtps_epi32``, saturating
  packs; ``qs8_f32_vcvt``: exact int32 ``x - zp`` then one multiply), qint8 -> qint8 and leaky
  ReLU (``qs8_vcvt``/``qs8_vlrelu`` avx2 on every AVX2 and AVX-512 class): the same codes.
* tables (sigmoid, tanh, GELU, ELU, hardswish: ``x8_lut``) are filled once by XNNPACK's
  reference C++ (``src/reference/unary-elementwise.cc``), whose ``std::exp`` is glibc's: the
  same FMA variant on every class here (all have FMA and AVX2); the lookup kernels only move
  bytes.  The mean's requantization is the reference ``int32 -> qint8`` convert.

Dynamically quantized layers: the per-row quantization (``xq.quantize_per_token``) is computed
by scalar code and the same conversion kernels on every class, so its codes are equal; the
qd8 and qdu8 GEMMs sum the same integers (qdu8 reads ``x + 128`` and a zero point 128 higher),
and differ only in the float epilogue (``fmadd`` or ``mul`` + ``add``), a few ulps, which
``graph.divergence.TOLERANCE`` covers as it covers fp32 nodes.

fp32 nodes: every x86 f32 GEMM kernel of the model (``gemm_configs.select_f32_config``) sums
each output along K in order, one accumulator (kr 1), with FMA from AVX2 up; Zen 1's 4x16s4
rotates K within blocks of 4, SSE2's small-N 4x2c4 keeps 4 partial sums; torch's kernels block
K.  ``test_the_float_tolerance_holds_for_each_class_s_summation`` computes each of those
orders and checks the error ``TOLERANCE`` allows for.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from cpu_classes import CLASSES, ZEN4

import xnnquant as xq
from xnnquant import Datatype as D
from xnnquant import QuantizedTensor
from xnnquant.errors import SelfCheckError, XnnquantError
from xnnquant.graph import Graph, PerTensorQuant, interpret, run
from xnnquant.graph import int8 as q
from xnnquant.graph.divergence import TOLERANCE
from xnnquant.packing.gemm_configs import ALL_ISAS, KernelConfig, select_f32_config
from xnnquant.xnnpack import cpu as cpu_module
from xnnquant.xnnpack.cpu import Cpu, this_cpu

F32 = np.float32

# ------------------------------------------------------------------ the classes

#: key -> (int8 class, qs8 GEMM branch, zero point added in int32), read from gemm-config.c by hand
INT8_KERNELS = {
    "core2": ("sse", "sse2", False),  # SSSE3 without SSE4.1
    "zen1": ("avx2", "avx2", False), "zen3": ("avx2", "avx2", False),
    "alder_lake": ("avx2", "avx2", False),  # AVX-VNNI kernels are not in the wheel
    "skylake_x": ("avx512", "avx512skx", True),
    "ice_lake": ("avx512vnni", "avx512vnni", True),
    "sapphire_rapids": ("avx512vnni", "avx512vnni", True),  # no AMX kernels in the wheel
    "zen4": ("avx512vnni", "avx512vnni", True), "zen5": ("avx512vnni", "avx512vnni", True),
}


def _cpu(key: str) -> Cpu:
    return Cpu.from_cpuinfo(CLASSES[key].cpuinfo())


@pytest.mark.parametrize("key", sorted(INT8_KERNELS))
def test_each_class_s_static_int8_kernels(key: str) -> None:
    cpu = _cpu(key)
    gemm = cpu.qs8_gemm()
    assert (cpu.int8_class, gemm.isa, gemm.int32_zero_point) == INT8_KERNELS[key]


def test_a_build_with_every_isa_takes_amx_and_avx_vnni() -> None:
    """The other side of the build: AMX on Sapphire Rapids, AVX-VNNI on Alder Lake, both adding
    the zero point in int32."""
    assert _cpu("sapphire_rapids").qs8_gemm(ALL_ISAS) == cpu_module.QS8_GEMM[0]
    alder = _cpu("alder_lake").qs8_gemm(ALL_ISAS)
    assert (alder.isa, alder.int32_zero_point) == ("avxvnni", True)


def test_how_reports_name_a_cpu() -> None:
    machine = ZEN4.cpuinfo().replace("AMD EPYC (Zen 4)", "AMD EPYC")  # this project's CI machine
    assert Cpu.from_cpuinfo(machine).label == "AMD EPYC (Zen 4, AVX-512 VNNI)"
    assert _cpu("skylake_x").label == "Intel Skylake-SP (AVX-512, no VNNI) (AVX-512 without VNNI)"
    assert Cpu(frozenset({"sse2", "avx", "avx2", "fma"}), vendor="GenuineIntel").label == "Intel (AVX2)"
    assert Cpu(frozenset()).label == "a CPU (SSE)"


# ------------------------------------------------------------------ static int8 codes

#: An accumulator no CPU class agrees on: -255 * 127 * 1024 codes times a multiplier of 100 is
#: -3.3e9 output steps, below -2^31; the zero point -5 then wraps on the int32 kernels.
FAR = np.array([-255 * 127 * 1024], np.int64)


@pytest.mark.parametrize("key", sorted(INT8_KERNELS))
def test_requantization_per_class(key: str) -> None:
    """The codes each class's static int8 GEMM writes: the same for every accumulator whose
    scaled value stays above -2^31 (1000 random ones, bounds or not), and for the far one 127
    on the classes that add the zero point in int32, the lower bound elsewhere."""
    wraps = _cpu(key).qs8_gemm().int32_zero_point
    rng = np.random.default_rng(0)
    acc = rng.integers(-(2**24), 2**24, 1000)
    scales = np.exp(rng.uniform(-12, 0, 1000)).astype(F32)
    for lo, hi in ((-128, 127), (-100, 90)):
        ordinary = q.requantize_fp32(acc, scales, -5, lo, hi, int32_zero_point=wraps)
        assert np.array_equal(ordinary, q.requantize_fp32(acc, scales, -5, lo, hi))
        far = q.requantize_fp32(FAR, F32(100), -5, lo, hi, int32_zero_point=wraps)
        assert far.tolist() == ([127] if wraps else [lo])
        # a non-negative zero point never wraps: INT32_MIN + zp stays negative
        assert q.requantize_fp32(FAR, F32(100), 5, lo, hi, int32_zero_point=wraps).tolist() == [lo]


def _far_fully_connected() -> tuple[Graph, list[np.ndarray]]:
    """A qint8 fully connected layer whose one input drives every output to ``FAR * 100``."""
    k = 1024
    g = Graph(target="xn01")
    x = g.input((1, k), D.qint8, PerTensorQuant(1.0, 127))
    w = g.constant(QuantizedTensor(D.qcint8, np.full((4, k), 127, np.int8), np.ones(4, F32), 0, channel_dim=0))
    y = g.tensor((1, 4), D.qint8, PerTensorQuant(0.01, -5))
    g.output(g.fully_connected(x, w, None, output=y))
    return g, [np.full((1, k), -128, np.int8)]


@pytest.mark.xnnpack
def test_the_runtime_here_writes_what_its_kernel_computes() -> None:
    """On the machine running the suite, XNNPACK's codes for the far accumulator are those of the
    kernel the model says this CPU runs (127 on this project's Zen 4; -128 on an AVX2 CPU); the
    interpreter computes the saturating kernels' -128."""
    g, inputs = _far_fully_connected()
    wraps = this_cpu().qs8_gemm().int32_zero_point
    want = q.requantize_fp32(FAR, F32(100), -5, int32_zero_point=wraps)
    assert run(g.to_bytes(), inputs)[0].tolist() == [want.tolist() * 4]
    assert interpret(g, inputs)[0].tolist() == [[-128] * 4]


def _cancelling_export(check: bool = True) -> Any:
    """A linear layer of 1024 inputs whose weights (512 of +1, 512 of -1) cancel on the calibration
    inputs (every feature -1, 0 or 1; its bias 2^-14): every partial sum is exact in float32 (24
    significant bits from 2^9 to 2^-14), so its calibrated output is 2^-14 on any CPU, in any
    order, and its output grid [0, 2^-14] is fine while an input of 1s then -1s reaches -1024."""
    import torch
    from torch import nn

    k = 1024
    linear = nn.Linear(k, 4)
    with torch.no_grad():
        linear.weight[:] = torch.cat([-torch.ones(4, k // 2), torch.ones(4, k // 2)], 1)
        linear.bias[:] = 2.0**-14
    cal = [(torch.full((1, k), float(c)),) for c in (-1, 0, 1, 0)]
    return xq.export(linear.eval(), cal[1], weights="qc8w", calibration=cal, progress=False, check=check,
                     activations=xq.StaticInt8(ranges="minmax", equalize=False, bias_correction=False))


@pytest.mark.xnnpack
@pytest.mark.parametrize("fitted", [True, False], ids=["reach fitted", "as before"])
def test_static_int8_layers_compute_alike_on_every_class(fitted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the layer's output scale came from calibration alone (raised only to keep the
    multiplier below 256): an input of 1s then -1s drives its accumulator past -2^31 output
    steps, which a Zen 4 writes as 127 and an AVX2 CPU as -128 (real 0).  Now its output scale is
    raised until the largest |sum x w| its int8 inputs allow (1024) is 2^30 steps, and every CPU
    computes 0, as the interpreter; the self-check refuses a layer that could still get there."""
    import torch

    from xnnquant.frontend.static_int8 import rewrite as rewriting

    if not fitted:
        monkeypatch.setattr(rewriting, "ACCUMULATOR_STEPS", math.inf)
        with pytest.raises(SelfCheckError, match=r"^self-check failed at aten.linear.default \(node linear, module "
                                                 r"<top level>\): some int8 input would drive output channel 0's "
                                                 r"accumulator to 3.419e\+09 output steps, where XNNPACK's static "
                                                 r"int8 kernels compute differently on AVX-512 and AVX-VNNI CPUs "
                                                 r"than on others \(past 2\^31: graph.int8.requantize_fp32\); please "
                                                 r"report it$"):
            _cancelling_export()
    exported = _cancelling_export(check=fitted)
    fc = next(n for n in exported.graph.nodes if n.kind == "XNNFullyConnected")
    s_x, zp_x = q.quant(exported.graph.value(fc.inputs[0]))
    s_y, zp_y = q.quant(exported.graph.value(fc.outputs[0]))
    m = float(F32(s_x) * F32(1 / 127) / F32(s_y))  # the filter's scale is 1/127: every weight is +-1
    steps = max(127 - zp_x, zp_x + 128) * 127 * 1024 * m  # the reach, in output steps
    assert zp_y == -128 and (steps <= 2**30 * (1 + 1e-6) if fitted else steps > 2**31), (s_x, zp_x, s_y)
    x = np.concatenate([np.ones((1, 512)), -np.ones((1, 512))], 1).astype(F32)
    (got,) = exported.run(torch.from_numpy(x))
    wraps = this_cpu().qs8_gemm().int32_zero_point and not fitted
    assert np.array_equal(got, np.full((1, 4), 255 * F32(s_y) if wraps else 0.0, F32))
    assert np.array_equal(interpret(exported.graph, [x])[0], np.zeros((1, 4), F32))


# ------------------------------------------------------------------ fp32 sums


def _summed(config: KernelConfig | str, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x @ w + b`` in float32 in the order of ``config``'s micro-kernel (or ``"blocked"``: K in
    blocks of 256 summed apart, then added, as torch's GEMMs block it).  FMA is modelled as the
    float64 sum of the exact product rounded once to float32 (double rounding apart: a bound,
    not a bit-exact model); without FMA the product is rounded first."""
    m, k = x.shape
    n = w.shape[1]
    fma = (config in ("blocked", "sequential-fma") or
           (isinstance(config, KernelConfig) and config.isa_name in ("avx512f", "fma3")))

    def step(acc: np.ndarray, xs: np.ndarray, ws: np.ndarray) -> np.ndarray:
        if fma:
            return (acc.astype(np.float64) + xs.astype(np.float64) * ws.astype(np.float64)).astype(F32)
        return (acc + (xs * ws).astype(F32)).astype(F32)

    if config == "blocked":
        total = np.zeros((m, n), F32)
        for start in range(0, k, 256):
            total = (total + _summed("sequential-fma", x[:, start:start + 256], w[start:start + 256],
                                     np.zeros(n, F32))).astype(F32)
        return (total + b).astype(F32)
    kr = config.kr if isinstance(config, KernelConfig) else 1
    sr = config.sr if isinstance(config, KernelConfig) else 1
    parts = [np.zeros((m, n), F32) for _ in range(kr)]
    parts[0] = np.broadcast_to(b, (m, n)).astype(F32)
    cols = np.arange(n)
    for base in range(0, k, sr):
        for t in range(sr):
            kk = base + (t + cols) % sr if sr > 1 else np.full(n, base)  # sr: K rotated per column within a block
            kk = np.minimum(kk, k - 1) if sr > 1 else kk
            part = (base + t) % kr
            parts[part] = step(parts[part], x[:, kk], w[kk, cols][None, :])
    while len(parts) > 1:  # kr partial sums added pairwise at the end
        parts = [(parts[i] + parts[i + 1]).astype(F32) for i in range(0, len(parts), 2)]
    return parts[0]


@pytest.mark.parametrize("key", ["core2", "zen1", "zen3", "skylake_x", "zen4"])
def test_the_float_tolerance_holds_for_each_class_s_summation(key: str) -> None:
    """``TOLERANCE`` (1e-4 of a value's largest magnitude) against the sums of K = 2048 float32
    terms in the order each class's f32 GEMM kernels take (main and small-N tables), and in
    torch's blocked order, on post-ReLU and offset inputs with weights of variance 1/K.  The
    error of any order is a random walk of roundings, ~u sqrt(K) of the value (u = 2^-24);
    measured here at most 1.6e-6 of the largest magnitude (FMA or not, any of these orders),
    so TOLERANCE has a margin of more than 10x, and it does not depend on the class: the
    classes change the order, not the unit roundoff."""
    from xnnquant.xnnpack.capture import cpu_features

    flags, uarch = cpu_features(CLASSES[key].cpuinfo())
    configs = [select_f32_config(32, flags, uarch), select_f32_config(2, flags, uarch)]
    rng = np.random.default_rng(1)
    k = 2048
    worst = 0.0
    for x in (np.maximum(rng.standard_normal((16, k)), 0), rng.normal(3, 1, (16, k))):
        x = x.astype(F32)
        w = (rng.standard_normal((k, 32)) / np.sqrt(k)).astype(F32)
        b = rng.standard_normal(32).astype(F32)
        exact = x.astype(np.float64) @ w.astype(np.float64) + b
        for config in (*configs, "blocked"):
            got = _summed(config, x, w, b)
            worst = max(worst, float(np.max(np.abs(got - exact)) / np.max(np.abs(exact))))
    assert worst <= TOLERANCE / 10, worst
    assert worst > 1e-8  # the orders were computed in float32, not in float64


# ------------------------------------------------------------------ the time estimate


def test_time_ratios_per_int8_class() -> None:
    """Measured on AVX-512 VNNI (conv 0.3, fully connected 0.35, depthwise 0.6 of fp32); the other
    classes scaled by instructions per MAC (mixed.GEMM_OPS_PER_MAC), e.g. AVX2:
    ((31 / 192) / (12 / 96)) / ((42 / 1792) / (14 / 224)) = 1.2917 / 0.375 = 3.444, so int8
    convolutions cost 1.033 of fp32 there: no faster (vpmaddwd does 16 MACs a 256-bit
    instruction and needs a vpaddd and sign extensions, an FMA does 8)."""
    from xnnquant.frontend.static_int8.mixed import cost_model

    assert cost_model("avx512vnni").int8_mac == {"XNNConv2d": 0.3, "XNNFullyConnected": 0.35,
                                                 "XNNDepthwiseConv2d": 0.6}
    for key, factor in (("avx512", 1.32143 / 0.375), ("avx2", 1.29167 / 0.375), ("sse", 1.29167 / 0.375)):
        model = cost_model(key)
        assert model.int8_mac["XNNConv2d"] == pytest.approx(0.3 * factor, rel=1e-4)
        assert model.int8_mac["XNNFullyConnected"] == pytest.approx(0.35 * factor, rel=1e-4)
        assert model.int8_mac["XNNDepthwiseConv2d"] == 0.6  # the same mul32 kernels on AVX2 and AVX-512
        assert (model.f32_element, model.int8_element, model.convert_element) == (4.0, 1.0, 4.0)
    assert cost_model("avx2").basis == ("ratios derived from those measured on an AMD Zen 4 (AVX-512 VNNI), one "
                                        "thread, by the instructions per multiply-accumulate of XNNPACK's AVX2 GEMM "
                                        "kernels (not measured)")


def _pooled_conv() -> tuple[Any, list[tuple[Any, ...]]]:
    """A convolution between two average poolings (which have no int8 form): an island."""
    import torch
    from torch import nn

    class PooledConv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(32, 32, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = nn.functional.avg_pool2d(x, 3, stride=1, padding=1)
            return nn.functional.avg_pool2d(self.conv(pooled), 3, stride=1, padding=1)

    gen = torch.Generator().manual_seed(3)
    return PooledConv().eval(), [(torch.randn(1, 32, 16, 16, generator=gen),) for _ in range(4)]


ISLAND = "it reads and feeds only fp32 values and nodes"


@pytest.mark.xnnpack
@pytest.mark.parametrize(("key", "cpu", "int8"), [
    ("zen4", "avx512vnni", True), ("zen3", "avx512vnni", True), ("zen3", "this", False), ("skylake_x", "this", False),
    ("zen4", "avx2", False)])
def test_islands_follow_the_cpu_class_the_estimate_is_for(key: str, cpu: str, int8: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The 32-channel 3x3 convolution between two poolings: 2.36M MACs, its converts 2 x 8192
    elements.  In int8 it is estimated at 0.3 x 2.36M + 4 x 16384 = 0.77M fp32 MACs on AVX-512
    VNNI, kept int8; at 1.057 x 2.36M + 0.07M = 2.56M on AVX-512 without VNNI and 1.033 x 2.36M +
    0.07M = 2.50M on AVX2, both above its 2.36M in fp32: kept fp32.  The class is the default's
    (AVX-512 VNNI) or the one ``StaticInt8(cpu=...)`` names, whatever machine exports (here
    injected), unless ``cpu="this"`` asks for the exporting machine's; the report says which,
    and how this machine relates to it."""
    monkeypatch.setattr(cpu_module, "this_cpu", lambda: _cpu(key))
    module, cal = _pooled_conv()
    exported = xq.export(module, cal[0], weights="qc8w", calibration=cal, progress=False,
                         activations=xq.StaticInt8(ranges="minmax", cpu=cpu))
    kept = [b for b in exported.boundaries if ISLAND in b]
    assert (not kept) == int8, exported.boundaries
    line = next(t for t in str(exported).splitlines() if t.startswith("time estimate"))
    label = _cpu(key).label
    measured = "ratios measured on an AMD Zen 4 (AVX-512 VNNI), one thread"
    derived = ("ratios derived from those measured on an AMD Zen 4 (AVX-512 VNNI), one thread, by the instructions per "
               "multiply-accumulate of XNNPACK's {} GEMM kernels (not measured)")
    expected = {
        ("zen4", "avx512vnni"): f"for AVX-512 VNNI kernels (StaticInt8(cpu='avx512vnni') (the default); this machine, "
                                f"{label}, is of that class): {measured}",
        ("zen3", "avx512vnni"): f"for AVX-512 VNNI kernels (StaticInt8(cpu='avx512vnni') (the default); this machine, "
                                f"{label}, runs AVX2 kernels: cpu='this' prices those): {measured}",
        ("zen3", "this"): f"for AVX2 kernels (this machine's, {label}, as StaticInt8(cpu='this') asks): "
                          + derived.format("AVX2"),
        ("skylake_x", "this"): f"for AVX-512 without VNNI kernels (this machine's, {label}, as StaticInt8(cpu='this') "
                               "asks): " + derived.format("AVX-512"),
        ("zen4", "avx2"): f"for AVX2 kernels (StaticInt8(cpu='avx2'); this machine, {label}, runs AVX-512 VNNI kernels: "
                          "cpu='this' prices those): " + derived.format("AVX2"),
    }[key, cpu]
    assert line == "time estimate (which int8 nodes between fp32 ones stay fp32, what a budget buys) " + expected
    measured_line = str(exported.static_int8.int8.measured)
    assert f"run time on this machine, {label}, " in measured_line  # the times are this machine's, named


def test_the_cpu_option_is_checked() -> None:
    assert str(xq.StaticInt8(cpu=" AVX2")) == "qint8(cpu=avx2)" and str(xq.StaticInt8(cpu="This")) == "qint8(cpu=this)"
    assert str(xq.StaticInt8(cpu="avx512vnni")) == "qint8"
    for bad in ("neon", None):
        with pytest.raises(XnnquantError) as info:
            xq.StaticInt8(cpu=bad)
        assert str(info.value) == (f"unknown CPU class for the time estimate: got cpu={bad!r}, expected one of "
                                   "'avx512vnni', 'avx512', 'avx2', 'sse' or 'this' (the exporting machine's)")
