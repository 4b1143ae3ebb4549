"""The GEMM tile configurations XNNPACK selects, per weight type and x86 ISA.

Read from XNNPACK 1adaa7c7 (``src/configs/gemm-config.c`` and the packing routines its
configs name).  Each ``KernelConfig`` is one branch of that file for x86-64: the ISA test
that selects it, the micro-kernel tile ``mr x nr`` with ``kr``/``sr`` interleaving and
nibble ``planes``, and the facts that decide the packed bytes (``weights`` layout family,
nibble encoding, how padding rows of the last tile are filled).  ``pack_gemm`` takes the
same parameters, so any row of the table can be packed offline.

Branches are listed in XNNPACK's order of preference: for one ``operator`` the first row
whose ISA the CPU has is the one XNNPACK picks.
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

    @property
    def cpu_flags(self) -> frozenset[str]:
        """Linux /proc/cpuinfo flags the ISA test of this branch needs."""
        return ISA_FLAGS[self.isa.split(" ")[0]]

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


_SKX = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
#: XNNPACK's ISA names -> the Linux cpuinfo flags its hardware check amounts to.
ISA_FLAGS: dict[str, frozenset[str]] = {
    "avx512amx": _SKX | {"avx512_vnni", "amx_tile", "amx_int8"},
    "avx512vnnigfni": _SKX | {"avx512_vnni", "gfni"},
    "avx512vnni": _SKX | {"avx512_vnni"},
    "avx512skx": _SKX,
    "avx256skx": _SKX,
    "avx512f": frozenset({"avx512f"}),
    "avxvnni": frozenset({"avx_vnni", "avx2"}),
    "avx2": frozenset({"avx2"}),
    "fma3": frozenset({"fma", "avx"}),
    "avx": frozenset({"avx"}),
    "sse4.1": frozenset({"sse4_1"}),
    "ssse3": frozenset({"ssse3"}),
    "sse2": frozenset({"sse2"}),
}


def _c(operator: str, weights: str, isa: str, mr: int, nr: int, kr: int = 1, sr: int = 1,
       planes: int = 1, pad_rows: str = "zero", note: str = "", nr2: bool = False) -> KernelConfig:
    return KernelConfig(operator, weights, isa, mr, nr, kr, sr, planes, pad_rows, note, nr2)


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
    _c("qd8_f32_qc8w", "qc8w", "sse2", 4, 4, kr=8),
    # qdu8 x qc8w: unsigned input (x + 128); the packed correction is the same (input zero point 1)
    _c("qdu8_f32_qc8w", "qc8w", "avx512vnni (x86-64 asm)", 5, 64, kr=4),
    _c("qdu8_f32_qc8w", "qc8w", "avx512vnni", 10, 16, kr=8, pad_rows="replicate_all",
       note="packer x16c8__avx256vnni_prfm (builds with AVX256VNNI; the scalar fallback differs)"),
    _c("qdu8_f32_qc8w", "qc8w", "avxvnni", 5, 8, kr=8, pad_rows="replicate_all", note="packer x8c8__avxvnni_prfm"),
    # qd8 x qc4w
    _c("qd8_f32_qc4w", "qc4w", "avx512amx", 16, 64, kr=4, planes=2),
    _c("qd8_f32_qc4w", "qc4w", "sse2", 4, 4, kr=8, planes=2),
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
    _c("qd8_f32_qb4w", "qb4w", "sse2", 4, 4, kr=8, planes=1),
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
                  nr2: bool = False) -> KernelConfig | None:
    """The branch gemm-config.c takes for ``operator`` on a CPU: the first row whose ISA
    test passes (None: XNNPACK has no kernel, ``xnn_status_unsupported_hardware``).

    ``cpu_flags``: Linux /proc/cpuinfo flags; ``uarch``: "zen" for AMD Zen 1/2 (what
    XNNPACK calls xnn_uarch_zen), "zen4"/"zen5", or "" for anything else.  ``nr2``
    selects the f32 small-nr table instead of the main one.
    """
    for config in _X86_CONFIGS:
        if config.operator != operator or config.nr2 != nr2 or not config.cpu_flags <= set(cpu_flags):
            continue
        if config.uarch == "zen" and uarch != "zen":
            continue
        if config.uarch == "not zen4/zen5" and uarch in ("zen4", "zen5"):
            continue
        return config
    return None


def use_nr2(nr: int, nr2: int, n: int) -> bool:
    """Whether XNNPACK's f32 fully-connected switches to the small-nr table for ``n``
    output channels (``xnn_use_nr2``): when the main tile is wider than ``n``, or when the
    nr2 tile wastes fewer padding rows and the main one wastes more than 1% of ``n``."""
    waste, waste2 = (nr - n % nr) % nr, (nr2 - n % nr2) % nr2
    return nr > n or (waste2 < waste and waste * 100 > n)


def select_f32_config(n: int, cpu_flags: frozenset[str] | set[str], uarch: str = "") -> KernelConfig | None:
    """The f32 configuration XNNPACK uses for a fully-connected layer with ``n`` outputs."""
    main = select_config("f32", cpu_flags, uarch)
    small = select_config("f32", cpu_flags, uarch, nr2=True)
    if main is not None and small is not None and use_nr2(main.nr, small.nr, n):
        return small
    return main
