"""The GEMM tile configurations XNNPACK selects, per weight type, x86 ISA and build.

Read from XNNPACK 1adaa7c7 (``src/configs/gemm-config.c`` and the packing routines its
configs name).  Each ``KernelConfig`` is one branch of that file for x86-64: the ISA test
that selects it, the micro-kernel tile ``mr x nr`` with ``kr``/``sr`` interleaving and
nibble ``planes``, and the facts that decide the packed bytes (``weights`` layout family,
nibble encoding, how padding rows of the last tile are filled).  ``pack_gemm`` takes the
same parameters, so any row of the table can be packed offline.

Which branch runs on a CPU takes three steps, each one function here:

1. ``xnnpack_isas``: the ISA flags ``src/configs/hardware-config.c`` sets, from the CPU's
   features *and the build*: an ISA whose kernels the build left out is never set.  The
   ExecuTorch 1.4.1 wheel (``EXECUTORCH_1_4_1``) has no AVX512-AMX, no AVX512-VNNI-GFNI
   and no AVX-VNNI kernels, so on a Sapphire Rapids Xeon it runs the same kernels as on
   an AMD Zen 4 (see ``XnnpackBuild``).
2. ``select_config``: per operator, the first row (XNNPACK's order of preference) whose
   ISA is set and whose micro-architecture test passes.
3. ``runtime_config``: what a subgraph (ExecuTorch's path) runs for a dynamically
   quantized fully-connected layer: the unsigned-input (qdu8) kernel when it exists and
   its ISA flag is a higher bit of ``enum xnn_arch_flags`` than the signed (qd8) one's
   (``convert_gemm_to_qduint8`` in ``src/subgraph.c``), else the signed one.

Branches are listed in XNNPACK's order of preference: for one ``operator`` the first row
whose ISA flag is set is the one XNNPACK picks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import XnnquantError

#: Weight layout families ``pack_gemm`` writes.
#:  f32   fp32 weights and bias                        (fully_connected_nc_f32)
#:  qc8w  int8 per-channel weights                     (qd8/qdu8 x qc8w)
#:  qc4w  int4 per-channel, signed nibbles, corr x16   (packer xnn_pack_qs4_weights_and_biases)
#:  qc4uw int4 per-channel, unsigned nibbles, corr x1  (packer xnn_pack_qs8_qc4uw_gemm_goi_w)
#:  qb4w  int4 blockwise with bf16 scales              (packer xnn_pack_qs8_qb4w_gemm_goi_w)
WEIGHT_LAYOUTS = ("f32", "qc8w", "qc4w", "qc4uw", "qb4w")

#: How ``pack_gemm`` fills the padding rows of a last, partial tile.
#:  zero       rows left as the zeroed buffer holds them (XNNPACK's reference packers)
#:  replicate  f32: copies of the last real row, except the tile's last row, which is zero
#:             in the columns below 4 * floor(K / 4) (XNNPACK's x86 AVX/AVX-512 x32 packw
#:             micro-kernels, ``src/x32-packw/avx.c.in``; verified by capture on AVX2)
#:  replicate_all  every padding row a copy of the last real row: f32 with the SSE2 packw
#:             micro-kernel x8__sse2_u4; qc8w, correction terms included, with the qs8 VNNI
#:             packw micro-kernels x16c8/x64c4 avx256vnni and x8c8 avxvnni (both read from
#:             their source, not verifiable on this AVX2 CPU)
PAD_ROWS = ("zero", "replicate", "replicate_all")


@dataclass(frozen=True)
class KernelConfig:
    """One GEMM configuration of XNNPACK: tile shape plus the facts that fix its bytes."""

    operator: str  # XNNPACK operator, e.g. "qdu8_f32_qc4w" (fully_connected_nc_<operator>)
    weights: str  # one of WEIGHT_LAYOUTS
    isa: str  # the hardware_config test that selects this branch, e.g. "avx2"
    mr: int
    nr: int
    kr: int
    sr: int
    planes: int  # nibble planes of 4-bit weights (1 for 8/32-bit weights)
    pad_rows: str = "zero"  # one of PAD_ROWS
    note: str = ""
    nr2: bool = False  # f32 only: the alternative small-nr config (xnn_use_nr2)
    arch_set: bool = True  # False: the branch leaves config.arch 0 (XNNPACK's SSE2 fallbacks)

    @property
    def isa_name(self) -> str:
        """XNNPACK's name of the tested ISA, e.g. "fma3" for "fma3 (other uarch)"."""
        return self.isa.split(" ")[0]

    @property
    def cpu_flags(self) -> frozenset[str]:
        """Linux /proc/cpuinfo flags the ISA test of this branch needs."""
        return ISA_FLAGS[self.isa_name]

    @property
    def arch_bit(self) -> int:
        """The ``enum xnn_arch_flags`` bit XNNPACK ranks this kernel by (0: none set)."""
        return ARCH_BITS[self.isa_name] if self.arch_set else 0

    @property
    def uarch(self) -> str:
        """Micro-architecture condition of the branch: "", "zen" or "not zen4/zen5"."""
        if "uarch zen" in self.isa:
            return "zen"
        return "not zen4/zen5" if "not zen4/zen5" in self.isa else ""

    def pack_args(self) -> dict[str, object]:
        """Keyword arguments of ``pack_gemm`` for this configuration."""
        return {"nr": self.nr, "kr": self.kr, "sr": self.sr, "planes": self.planes,
                "layout": self.weights, "pad_rows": self.pad_rows}


#: XNNPACK's ISA names -> the Linux cpuinfo flags ``hardware-config.c`` tests for each
#: (through cpuinfo, which also checks the OS saves the registers).  Some ISAs imply
#: others there: AVX512-VNNI-GFNI needs AVX512-VNNI, AVX512-AMX needs AVX512-VNNI-GFNI.
_SKX = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
ISA_FLAGS: dict[str, frozenset[str]] = {
    "avx512amx": _SKX | {"avx512_vnni", "gfni", "amx_int8"},
    "avx512vnnigfni": _SKX | {"avx512_vnni", "gfni"},
    "avx512vnni": _SKX | {"avx512_vnni"},
    "avx512skx": _SKX,
    "avx256skx": _SKX,
    "avx512f": frozenset({"avx512f"}),
    "avxvnni": frozenset({"avx2", "avx_vnni", "gfni"}),
    "avx2": frozenset({"avx2"}),
    "fma3": frozenset({"fma", "avx"}),
    "avx": frozenset({"avx"}),
    "sse4.1": frozenset({"sse4_1"}),
    "ssse3": frozenset({"ssse3"}),
    "sse2": frozenset({"sse2"}),
}

#: ``enum xnn_arch_flags`` (``src/xnnpack/hardware-config.h``): XNNPACK ranks two kernels
#: for the same layer by these bits (a higher bit is the newer, preferred ISA).
ARCH_BITS: dict[str, int] = {
    "sse2": 1, "ssse3": 2, "sse4.1": 3, "avx": 4, "fma3": 6, "avx2": 7, "avx256skx": 8,
    "avx512f": 9, "avx512skx": 10, "avxvnni": 14, "avx512vnni": 18, "avx512vnnigfni": 19, "avx512amx": 20,
}


@dataclass(frozen=True)
class XnnpackBuild:
    """Which ISAs' kernels one build of XNNPACK holds.

    ``disabled``: XNNPACK ISA names compiled out (``XNNPACK_ENABLE_<ISA>=OFF``): their
    branches of gemm-config.c are gone (``#if XNN_ENABLE_<ISA>``) and ``hardware-config.c``
    never sets their flag, whatever the CPU has.
    """

    name: str
    disabled: frozenset[str]
    why: str = ""


#: The XNNPACK inside the executorch 1.4.1 wheel, the runtime this project targets:
#:  avx512vnnigfni, avxvnni  set OFF by ExecuTorch (``backends/xnnpack/cmake/Dependencies.cmake``)
#:  avx512amx                set OFF by XNNPACK's CMakeLists.txt for GCC, and the wheel is built
#:                           with GCC 13.3 (its ``.comment`` section); AMX also needs the
#:                           avx512vnnigfni flag at run time, which is off anyway
#: Checked on the machine code of ``_portable_lib.so``: no AMX instruction (``tdpbssd``,
#: ``ldtilecfg``), no GFNI one (``vgf2p8affineqb``), and all of its ``vpdpbusd`` are EVEX
#: (AVX512-VNNI), none VEX (AVX-VNNI).  So an AMX Xeon runs what a Zen 4 runs, and an
#: Alder Lake (AVX2 + AVX-VNNI) what a Zen 3 runs.
EXECUTORCH_1_4_1 = XnnpackBuild(
    "executorch 1.4.1", frozenset({"avx512amx", "avx512vnnigfni", "avxvnni"}),
    "ExecuTorch builds XNNPACK without AVX512-VNNI-GFNI and AVX-VNNI kernels, and XNNPACK leaves AMX out "
    "of GCC builds")

#: XNNPACK at the same commit with every x86 ISA built (Clang 17 or newer, default options):
#: the other side of every build-dependent branch, for tests and for other runtimes.
ALL_ISAS = XnnpackBuild("XNNPACK 1adaa7c7, every ISA", frozenset())


def xnnpack_isas(cpu_flags: frozenset[str] | set[str], build: XnnpackBuild = EXECUTORCH_1_4_1,
                 amx_permitted: bool = True) -> frozenset[str]:
    """The x86 ISA flags XNNPACK's ``hardware-config.c`` sets on a CPU with ``cpu_flags``
    (Linux /proc/cpuinfo names) in ``build``.

    ``amx_permitted``: whether Linux grants the process AMX tile data
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` returns 0); XNNPACK asks, and
    drops AMX when refused.
    """
    flags = set(cpu_flags)
    isas = {isa for isa, needs in ISA_FLAGS.items() if needs <= flags and isa not in build.disabled}
    # implications that are not flags of their own: VNNI-GFNI needs the VNNI flag set, AMX the VNNI-GFNI one
    if "avx512vnni" not in isas:
        isas.discard("avx512vnnigfni")
    if "avx512vnnigfni" not in isas or not amx_permitted:
        isas.discard("avx512amx")
    return frozenset(isas)


def _c(operator: str, weights: str, isa: str, mr: int, nr: int, kr: int = 1, sr: int = 1,
       planes: int = 1, pad_rows: str = "zero", note: str = "", nr2: bool = False,
       arch_set: bool = True) -> KernelConfig:
    return KernelConfig(operator, weights, isa, mr, nr, kr, sr, planes, pad_rows, note, nr2, arch_set)


_AVX_PACKW = "replicate"
_NR2 = "chosen instead of the main f32 config when xnn_use_nr2(nr, nr2, N) holds (small or awkward N)"

#: x86-64 branches of gemm-config.c at XNNPACK 1adaa7c7, in order of preference per operator.
_X86_CONFIGS: tuple[KernelConfig, ...] = (
    # f32 (init_f32_gemm_config_impl); the avx512f "c2" branch is compiled out (#if false)
    _c("f32", "f32", "avx512f", 7, 32, pad_rows=_AVX_PACKW),
    _c("f32", "f32", "fma3 (uarch zen, dhyana)", 4, 16, sr=4,
       note="packer x16s4__avx_u4: padding rows not verified, packed as the reference packer"),
    _c("f32", "f32", "fma3 (other uarch)", 6, 16, pad_rows=_AVX_PACKW),
    _c("f32", "f32", "avx", 5, 16, pad_rows=_AVX_PACKW),
    _c("f32", "f32", "sse2", 4, 8, pad_rows="replicate_all", note="packer x8__sse2_u4"),
    # f32 nr2 (init_f32_gemm_nr2_config_impl)
    _c("f32", "f32", "avx512f", 7, 16, pad_rows=_AVX_PACKW, note=_NR2, nr2=True),
    _c("f32", "f32", "fma3 (uarch zen, dhyana)", 4, 8, pad_rows=_AVX_PACKW, note=_NR2, nr2=True),
    _c("f32", "f32", "fma3 (other uarch)", 10, 8, pad_rows=_AVX_PACKW, note=_NR2, nr2=True),
    _c("f32", "f32", "avx", 5, 8, pad_rows=_AVX_PACKW, note=_NR2, nr2=True),
    _c("f32", "f32", "sse2", 4, 2, kr=4, note=_NR2 + "; packer x2c4__sse2_u4 not verified", nr2=True),
    # qd8 x qc8w: signed int8 input
    _c("qd8_f32_qc8w", "qc8w", "avx512amx", 16, 64, kr=4, pad_rows="replicate_all",
       note="packer x64c4__avx256vnni_prfm (builds with AVX256VNNI)"),
    _c("qd8_f32_qc8w", "qc8w", "avx512skx", 8, 16, kr=8),
    _c("qd8_f32_qc8w", "qc8w", "avx256skx", 8, 8, kr=8),
    _c("qd8_f32_qc8w", "qc8w", "avx2", 4, 8, kr=8),
    _c("qd8_f32_qc8w", "qc8w", "sse4.1", 4, 4, kr=8),
    _c("qd8_f32_qc8w", "qc8w", "sse2", 4, 4, kr=8, arch_set=False),
    # qdu8 x qc8w: unsigned input (x + 128); the packed correction is the same (input zero point 1)
    _c("qdu8_f32_qc8w", "qc8w", "avx512vnni (x86-64 asm)", 5, 64, kr=4),
    _c("qdu8_f32_qc8w", "qc8w", "avx512vnni", 10, 16, kr=8, pad_rows="replicate_all",
       note="packer x16c8__avx256vnni_prfm (builds with AVX256VNNI; the scalar fallback differs)"),
    _c("qdu8_f32_qc8w", "qc8w", "avxvnni", 5, 8, kr=8, pad_rows="replicate_all", note="packer x8c8__avxvnni_prfm"),
    # qd8 x qc4w
    _c("qd8_f32_qc4w", "qc4w", "avx512amx", 16, 64, kr=4, planes=2),
    _c("qd8_f32_qc4w", "qc4w", "sse2", 4, 4, kr=8, planes=2, arch_set=False,
       note="the only qd8 x qc4w kernel below AMX; no runtime runs it where a qdu8 x qc4w kernel exists (SSSE3 up)"),
    # qdu8 x qc4w: VNNI kernels read signed nibbles, the "madd" kernels unsigned ones
    _c("qdu8_f32_qc4w", "qc4w", "avx512vnnigfni (not zen4/zen5)", 14, 16, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4w", "avx512vnni", 8, 16, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4w", "avxvnni", 5, 8, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4uw", "avx512skx", 8, 16, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4uw", "avx256skx", 8, 8, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4uw", "avx2", 4, 8, kr=8, planes=2),
    _c("qdu8_f32_qc4w", "qc4uw", "ssse3", 5, 4, kr=8, planes=2),
    # qd8 x qb4w
    _c("qd8_f32_qb4w", "qb4w", "avx2", 3, 8, kr=8, planes=2),
    _c("qd8_f32_qb4w", "qb4w", "avx", 4, 4, kr=8, planes=1),
    _c("qd8_f32_qb4w", "qb4w", "sse4.1", 3, 4, kr=8, planes=1),
    _c("qd8_f32_qb4w", "qb4w", "sse2", 4, 4, kr=8, planes=1, arch_set=False),
    # qdu8 x qb4w (no branch below AVX-512 VNNI: such CPUs use qd8_f32_qb4w)
    _c("qdu8_f32_qb4w", "qb4w", "avx512vnnigfni (not zen4/zen5)", 14, 16, kr=8, planes=2),
    _c("qdu8_f32_qb4w", "qb4w", "avx512vnni", 8, 16, kr=8, planes=2),
)


def kernel_configs(weights: str | None = None) -> tuple[KernelConfig, ...]:
    """The x86-64 GEMM configurations ``pack_gemm`` can pack for.

    ``weights``: restrict to one layout of ``WEIGHT_LAYOUTS`` (``None``: all).  Per XNNPACK
    operator, rows come in XNNPACK's order of preference; ``isa`` names the hardware test
    of gemm-config.c that selects the row.
    """
    if weights is None:
        return _X86_CONFIGS
    if weights not in WEIGHT_LAYOUTS:
        raise XnnquantError(f"unknown weight layout: got {weights!r}, expected one of {WEIGHT_LAYOUTS}")
    return tuple(c for c in _X86_CONFIGS if c.weights == weights)


def select_config(operator: str, cpu_flags: frozenset[str] | set[str], uarch: str = "",
                  nr2: bool = False, build: XnnpackBuild = EXECUTORCH_1_4_1,
                  amx_permitted: bool = True) -> KernelConfig | None:
    """The branch gemm-config.c takes for ``operator`` on a CPU: the first row whose ISA
    flag ``xnnpack_isas`` sets (None: XNNPACK has no kernel,
    ``xnn_status_unsupported_hardware``).

    ``cpu_flags``: Linux /proc/cpuinfo flags; ``uarch``: "zen" for AMD Zen 1 (what
    XNNPACK calls xnn_uarch_zen), "zen4"/"zen5", or "" for anything else.  ``nr2``
    selects the f32 small-nr table instead of the main one.  ``build``: which ISAs the
    XNNPACK build holds (the executorch 1.4.1 wheel's by default).
    """
    isas = xnnpack_isas(cpu_flags, build, amx_permitted)
    for config in _X86_CONFIGS:
        if config.operator != operator or config.nr2 != nr2 or config.isa_name not in isas:
            continue
        if config.uarch == "zen" and uarch != "zen":
            continue
        if config.uarch == "not zen4/zen5" and uarch in ("zen4", "zen5"):
            continue
        return config
    return None


#: Weight layout of a dynamically quantized fully-connected layer -> its (signed, unsigned) operators.
DYNAMIC_OPERATORS = {"qc8w": ("qd8_f32_qc8w", "qdu8_f32_qc8w"), "qc4w": ("qd8_f32_qc4w", "qdu8_f32_qc4w"),
                     "qb4w": ("qd8_f32_qb4w", "qdu8_f32_qb4w")}


def runtime_config(weights: str, cpu_flags: frozenset[str] | set[str], uarch: str = "",
                   build: XnnpackBuild = EXECUTORCH_1_4_1, amx_permitted: bool = True) -> KernelConfig | None:
    """The kernel a subgraph runs for a fully-connected layer with ``weights`` ("qc8w",
    "qc4w" or "qb4w") and a dynamically quantized fp32 input, as ExecuTorch's programs run it.

    XNNPACK's ``convert_gemm_to_qduint8``: the unsigned-input (qdu8) configuration when it
    exists and its ``arch_bit`` is higher than the signed (qd8) one's; else the signed one.
    """
    if weights not in DYNAMIC_OPERATORS:
        raise XnnquantError(f"unknown dynamically quantized weights: got {weights!r}, expected one of "
                            f"{tuple(DYNAMIC_OPERATORS)}")
    signed, unsigned = (select_config(op, cpu_flags, uarch, build=build, amx_permitted=amx_permitted)
                        for op in DYNAMIC_OPERATORS[weights])
    if unsigned is not None and (signed is None or unsigned.arch_bit > signed.arch_bit):
        return unsigned
    return signed


def use_nr2(nr: int, nr2: int, n: int) -> bool:
    """Whether XNNPACK's f32 fully-connected switches to the small-nr table for ``n``
    output channels (``xnn_use_nr2``): when the main tile is wider than ``n``, or when the
    nr2 tile wastes fewer padding rows and the main one wastes more than 1% of ``n``."""
    waste, waste2 = (nr - n % nr) % nr, (nr2 - n % nr2) % nr2
    return nr > n or (waste2 < waste and waste * 100 > n)


def select_f32_config(n: int, cpu_flags: frozenset[str] | set[str], uarch: str = "",
                      build: XnnpackBuild = EXECUTORCH_1_4_1) -> KernelConfig | None:
    """The f32 configuration XNNPACK uses for a fully-connected layer with ``n`` outputs."""
    main = select_config("f32", cpu_flags, uarch, build=build)
    small = select_config("f32", cpu_flags, uarch, nr2=True, build=build)
    if main is not None and small is not None and use_nr2(main.nr, small.nr, n):
        return small
    return main
