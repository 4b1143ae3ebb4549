"""The model of XNNPACK's kernel choice, per x86-64 CPU class, with the CPU's features injected.

The expected kernels below were read by hand from XNNPACK 1adaa7c7's ``gemm-config.c``,
``hardware-config.c`` and ``subgraph.c`` (``convert_gemm_to_qduint8``), and from how the
executorch 1.4.1 wheel built it (no AMX, no AVX512-VNNI-GFNI, no AVX-VNNI kernels); they
are not computed from the model.  The capture tests (``test_gemm_capture.py``) check the
same model against the real XNNPACK on whichever CPU runs the suite; these check it on
every class, both sides of each decision: the build (``ALL_ISAS``: the kernels an
XNNPACK with every ISA would take), AMX permission, the Zen micro-architecture tests, and
the unsigned-versus-signed ranking.
"""

from __future__ import annotations

import pytest
from cpu_classes import CLASSES, SAPPHIRE_RAPIDS, ZEN4

from xnnquant.errors import XnnquantError
from xnnquant.packing.gemm_configs import (
    ALL_ISAS,
    EXECUTORCH_1_4_1,
    kernel_configs,
    runtime_config,
    select_config,
    select_f32_config,
    xnnpack_isas,
)
from xnnquant.xnnpack.capture import cpu_features

OPERATORS = ("f32", "qd8_f32_qc8w", "qdu8_f32_qc8w", "qd8_f32_qc4w", "qdu8_f32_qc4w", "qd8_f32_qb4w", "qdu8_f32_qb4w")

# ISA branch per operator (None: no kernel), then the kernel the runtime runs per dynamic weight layout
_AVX2 = {"f32": "fma3 (other uarch)", "qd8_f32_qc8w": "avx2", "qdu8_f32_qc8w": None, "qd8_f32_qc4w": "sse2",
         "qdu8_f32_qc4w": "avx2", "qd8_f32_qb4w": "avx2", "qdu8_f32_qb4w": None}
_AVX2_RUNTIME = {"qc8w": ("qd8_f32_qc8w", "avx2"), "qc4w": ("qdu8_f32_qc4w", "avx2"), "qb4w": ("qd8_f32_qb4w", "avx2")}
_VNNI512 = {"f32": "avx512f", "qd8_f32_qc8w": "avx512skx", "qdu8_f32_qc8w": "avx512vnni (x86-64 asm)",
            "qd8_f32_qc4w": "sse2", "qdu8_f32_qc4w": "avx512vnni", "qd8_f32_qb4w": "avx2",
            "qdu8_f32_qb4w": "avx512vnni"}
_VNNI512_RUNTIME = {"qc8w": ("qdu8_f32_qc8w", "avx512vnni (x86-64 asm)"), "qc4w": ("qdu8_f32_qc4w", "avx512vnni"),
                    "qb4w": ("qdu8_f32_qb4w", "avx512vnni")}

EXECUTORCH = {  # the executorch 1.4.1 wheel
    "core2": ({"f32": "sse2", "qd8_f32_qc8w": "sse2", "qdu8_f32_qc8w": None, "qd8_f32_qc4w": "sse2",
               "qdu8_f32_qc4w": "ssse3", "qd8_f32_qb4w": "sse2", "qdu8_f32_qb4w": None},
              # SSE2 fallbacks set no ISA bit, so any unsigned kernel outranks them
              {"qc8w": ("qd8_f32_qc8w", "sse2"), "qc4w": ("qdu8_f32_qc4w", "ssse3"), "qb4w": ("qd8_f32_qb4w", "sse2")}),
    "zen1": ({**_AVX2, "f32": "fma3 (uarch zen, dhyana)"}, _AVX2_RUNTIME),
    "zen3": (_AVX2, _AVX2_RUNTIME),
    "alder_lake": (_AVX2, _AVX2_RUNTIME),  # AVX-VNNI kernels are not in the wheel
    "skylake_x": ({"f32": "avx512f", "qd8_f32_qc8w": "avx512skx", "qdu8_f32_qc8w": None, "qd8_f32_qc4w": "sse2",
                   "qdu8_f32_qc4w": "avx512skx", "qd8_f32_qb4w": "avx2", "qdu8_f32_qb4w": None},
                  {"qc8w": ("qd8_f32_qc8w", "avx512skx"), "qc4w": ("qdu8_f32_qc4w", "avx512skx"),
                   "qb4w": ("qd8_f32_qb4w", "avx2")}),
    "ice_lake": (_VNNI512, _VNNI512_RUNTIME),
    # issue 42's captures: qd8 x qc8w deduced avx512skx 8x16c8, qd8 x qc4w sse2 4x4c8
    "sapphire_rapids": (_VNNI512, _VNNI512_RUNTIME),
    "zen4": (_VNNI512, _VNNI512_RUNTIME),
    "zen5": (_VNNI512, _VNNI512_RUNTIME),
}

ALL = {  # XNNPACK with every ISA built: where the answer differs from the wheel's
    "sapphire_rapids": ({**_VNNI512, "qd8_f32_qc8w": "avx512amx", "qd8_f32_qc4w": "avx512amx",
                         "qdu8_f32_qc4w": "avx512vnnigfni (not zen4/zen5)",
                         "qdu8_f32_qb4w": "avx512vnnigfni (not zen4/zen5)"},
                        # AMX (bit 20) outranks VNNI (18) and VNNI-GFNI (19): the signed kernels win
                        {"qc8w": ("qd8_f32_qc8w", "avx512amx"), "qc4w": ("qd8_f32_qc4w", "avx512amx"),
                         "qb4w": ("qdu8_f32_qb4w", "avx512vnnigfni (not zen4/zen5)")}),
    "ice_lake": ({**_VNNI512, "qdu8_f32_qc4w": "avx512vnnigfni (not zen4/zen5)",
                  "qdu8_f32_qb4w": "avx512vnnigfni (not zen4/zen5)"},
                 {**_VNNI512_RUNTIME, "qc4w": ("qdu8_f32_qc4w", "avx512vnnigfni (not zen4/zen5)"),
                  "qb4w": ("qdu8_f32_qb4w", "avx512vnnigfni (not zen4/zen5)")}),
    "zen4": (_VNNI512, _VNNI512_RUNTIME),  # GFNI is there, but the branch skips Zen 4 and 5 (slow GFNI)
    "zen5": (_VNNI512, _VNNI512_RUNTIME),
    "alder_lake": ({**_AVX2, "qdu8_f32_qc8w": "avxvnni", "qdu8_f32_qc4w": "avxvnni"},
                   {**_AVX2_RUNTIME, "qc8w": ("qdu8_f32_qc8w", "avxvnni"), "qc4w": ("qdu8_f32_qc4w", "avxvnni")}),
    "skylake_x": EXECUTORCH["skylake_x"],
    "zen3": EXECUTORCH["zen3"],
}


def _answers(key: str, build, amx_permitted: bool = True):
    flags, uarch = cpu_features(CLASSES[key].cpuinfo())
    kernels = {}
    for op in OPERATORS:
        chosen = select_config(op, flags, uarch, build=build, amx_permitted=amx_permitted)
        kernels[op] = None if chosen is None else chosen.isa
    runtime = {}
    for weights in ("qc8w", "qc4w", "qb4w"):
        chosen = runtime_config(weights, flags, uarch, build=build, amx_permitted=amx_permitted)
        runtime[weights] = None if chosen is None else (chosen.operator, chosen.isa)
    return kernels, runtime


@pytest.mark.parametrize("key", sorted(EXECUTORCH))
def test_kernels_of_the_executorch_wheel_per_cpu_class(key: str) -> None:
    assert _answers(key, EXECUTORCH_1_4_1) == EXECUTORCH[key]


@pytest.mark.parametrize("key", sorted(ALL))
def test_kernels_of_a_build_with_every_isa(key: str) -> None:
    assert _answers(key, ALL_ISAS) == ALL[key]


def test_amx_refused_by_the_os_falls_back_to_vnni() -> None:
    """XNNPACK drops AMX when arch_prctl(ARCH_REQ_XCOMP_PERM) fails."""
    kernels, runtime = _answers("sapphire_rapids", ALL_ISAS, amx_permitted=False)
    assert kernels["qd8_f32_qc8w"] == "avx512skx" and kernels["qd8_f32_qc4w"] == "sse2"
    assert runtime["qc8w"] == ("qdu8_f32_qc8w", "avx512vnni (x86-64 asm)")
    assert runtime["qc4w"] == ("qdu8_f32_qc4w", "avx512vnnigfni (not zen4/zen5)")


def test_the_issue_42_captures_are_the_model_s() -> None:
    """The deduced tiles of the Sapphire Rapids captures in issue 42."""
    flags, uarch = cpu_features(SAPPHIRE_RAPIDS.cpuinfo())
    qc8 = select_config("qd8_f32_qc8w", flags, uarch)
    qc4 = select_config("qd8_f32_qc4w", flags, uarch)
    assert (qc8.isa, qc8.mr, qc8.nr, qc8.kr, qc8.pad_rows) == ("avx512skx", 8, 16, 8, "zero")
    assert (qc4.isa, qc4.mr, qc4.nr, qc4.kr, qc4.planes, qc4.pad_rows) == ("sse2", 4, 4, 8, 2, "zero")


def test_isa_flags_follow_hardware_config() -> None:
    """Each implication of hardware-config.c: GFNI alone is not VNNI-GFNI, AMX needs
    VNNI-GFNI, AVX-VNNI needs GFNI; a disabled ISA is never set."""
    spr = SAPPHIRE_RAPIDS.flag_set
    assert {"avx512amx", "avx512vnnigfni", "avxvnni"} <= xnnpack_isas(spr, ALL_ISAS)
    assert not {"avx512amx", "avx512vnnigfni", "avxvnni"} & xnnpack_isas(spr, EXECUTORCH_1_4_1)
    assert "avx512amx" not in xnnpack_isas(spr - {"gfni"}, ALL_ISAS)
    assert "avx512vnnigfni" not in xnnpack_isas(spr - {"avx512_vnni"}, ALL_ISAS)
    assert "avxvnni" not in xnnpack_isas(spr - {"gfni"}, ALL_ISAS)
    assert "avx512skx" not in xnnpack_isas(spr - {"avx512dq"}, ALL_ISAS)
    assert "avx512vnni" in xnnpack_isas(ZEN4.flag_set, EXECUTORCH_1_4_1)


@pytest.mark.parametrize("key,uarch", [("core2", ""), ("zen1", "zen"), ("zen3", ""), ("zen4", "zen4"),
                                       ("zen5", "zen5"), ("sapphire_rapids", ""), ("alder_lake", "")])
def test_uarch_from_cpuinfo(key: str, uarch: str) -> None:
    flags, got = cpu_features(CLASSES[key].cpuinfo())
    assert got == uarch and flags == CLASSES[key].flag_set


def test_hygon_is_zen_and_other_zen4_models() -> None:
    hygon = "vendor_id\t: HygonGenuine\ncpu family\t: 24\nmodel\t\t: 1\nflags\t\t: sse2 avx avx2 fma\n"
    assert cpu_features(hygon)[1] == "zen"
    for model, uarch in ((0x30, ""), (0x61, "zen4"), (0xA0, "zen4"), (0x21, "")):
        text = f"vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\nflags\t\t: sse2\n"
        assert cpu_features(text)[1] == uarch, hex(model)


@pytest.mark.parametrize("key,n,nr", [("zen4", 64, 32), ("zen4", 16, 16), ("zen3", 64, 16), ("zen3", 8, 8),
                                      ("zen1", 64, 16), ("core2", 64, 8), ("core2", 1, 2)])
def test_f32_small_n_table(key: str, n: int, nr: int) -> None:
    flags, uarch = cpu_features(CLASSES[key].cpuinfo())
    assert select_f32_config(n, flags, uarch).nr == nr


def test_every_row_is_reachable_in_some_build() -> None:
    """No dead row: each one is what some class of CPU selects in the wheel or in a build with every ISA."""
    chosen = set()
    for key in CLASSES:
        flags, uarch = cpu_features(CLASSES[key].cpuinfo())
        for build in (EXECUTORCH_1_4_1, ALL_ISAS):
            for op in OPERATORS:
                for nr2 in (False, True) if op == "f32" else (False,):
                    chosen.add(select_config(op, flags, uarch, nr2=nr2, build=build))
    unreachable = {(c.operator, c.isa) for c in kernel_configs() if c not in chosen}
    assert unreachable == {
        ("f32", "avx"), ("qd8_f32_qb4w", "avx"),  # AVX without FMA3 and AVX2 (Sandy Bridge): no class above
        ("qd8_f32_qc8w", "sse4.1"), ("qd8_f32_qb4w", "sse4.1"),  # SSE4.1 without AVX (Nehalem): no class above
        # same flags as the avx512skx rows before them: reached only by builds without AVX512SKX
        ("qd8_f32_qc8w", "avx256skx"), ("qdu8_f32_qc4w", "avx256skx"),
        ("qdu8_f32_qc8w", "avx512vnni"),  # after the assembly row: builds without assembly, or Windows
    }


def test_runtime_config_refuses_unknown_weights() -> None:
    with pytest.raises(XnnquantError, match=r"unknown dynamically quantized weights: got 'qb8w'"):
        runtime_config("qb8w", ZEN4.flag_set)


def test_the_report_names_each_fully_connected_kernel_and_an_sse2_fallback() -> None:
    """What an export's report says of its kernels, with the CPU injected: qb4w, qc8w and fp32
    layers on Zen 4, on Skylake-X (qb4w: the AVX2 kernel) and on an SSSE3 CPU,
    where qc8w and qb4w run XNNPACK's SSE2 fallbacks and the report says so."""
    import torch
    from cpu_classes import CORE2, SKYLAKE_X

    import xnnquant as xq
    from xnnquant.xnnpack.cpu import Cpu, fully_connected_kernels

    module = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    graphs = [xq.export(module, (torch.randn(2, 64),), weights=w, progress=False, check=False).graph
              for w in ("qb4w:32", "qc8w", "fp32")]
    got = {key: fully_connected_kernels(graphs, Cpu.from_cpuinfo(cls.cpuinfo()))
           for key, cls in (("zen4", ZEN4), ("skylake_x", SKYLAKE_X), ("core2", CORE2))}
    assert got == {
        "zen4": ["qb4w (qdint8 input): qdu8 avx512vnni 8x16c8", "qc8w (qdint8 input): qdu8 avx512vnni 5x64c4",
                 "fp32: avx512f 7x32"],
        "skylake_x": ["qb4w (qdint8 input): qd8 avx2 3x8c8", "qc8w (qdint8 input): qd8 avx512skx 8x16c8",
                      "fp32: avx512f 7x32"],
        "core2": ["qb4w (qdint8 input): qd8 sse2 4x4c8, an SSE2 fallback",
                  "qc8w (qdint8 input): qd8 sse2 4x4c8, an SSE2 fallback", "fp32: sse2 4x8, an SSE2 fallback"],
    }
