"""The CPU an answer came from: this machine's (or an injected /proc/cpuinfo), named for reports,
and the static int8 kernels XNNPACK runs on it.

What an export decides or measures on the machine that runs it (the run times of a static
int8 program, the time estimate of its islands and budget, the memory check of
``pte.planned``) is reported with ``Cpu.label``: ``"AMD EPYC (Zen 4, AVX-512 VNNI)"``.
``Cpu.int8_class`` names the family of XNNPACK's static int8 (qs8 x qc8w) GEMM kernels that
the executorch 1.4.1 wheel runs there, the unit in which ``static_int8.mixed`` keeps its
time ratios:

===============  ===========================================  =======================================
class            qs8 x qc8w GEMM / IGEMM kernel (gemm-config.c)  CPUs (issue 42)
===============  ===========================================  =======================================
``avx512vnni``   7x16c8 avx512vnni: ``vpdpbusd``                AMD Zen 4 / Zen 5, Intel Ice Lake-SP,
                                                             Sapphire Rapids (the wheel has no AMX)
``avx512``       7x16c8 avx512skx: ``vpmaddwd`` + ``vpaddd``    Intel Skylake-SP / Cascade Lake without VNNI
``avx2``         3x8c8 avx2: ``vpmaddwd`` + ``vpaddd``          AMD Zen 1 to 3, Intel Haswell to Alder Lake
                                                             (the wheel has no AVX-VNNI kernels)
``sse``          3x4c8 sse4.1 / sse2                          older than AVX2
===============  ===========================================  =======================================

``QS8_GEMM`` is that table as XNNPACK 1adaa7c7's ``init_qs8_qc8w_gemm_config`` orders it for
x86-64, with the one fact of each branch that changes the codes it writes (``int32_zero_point``:
``graph.int8.requantize_fp32``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..packing.gemm_configs import EXECUTORCH_1_4_1, XnnpackBuild, xnnpack_isas


@dataclass(frozen=True)
class Qs8Gemm:
    """One x86-64 branch of ``init_qs8_qc8w_gemm_config``: the ISA flag that selects it, its tile,
    and how its fp32 requantization adds the output zero point.

    ``int32_zero_point``: the kernel converts the scaled accumulator to int32
    (``cvtps2dq``), adds the zero point in int32 (``vpaddd``) and then saturates to int8
    (``vpmovsdb``, or ``vpackssdw`` + ``vpacksswb``): a scaled accumulator at or below
    ``-2^31`` converts to ``INT32_MIN``, which a negative zero point wraps to a large positive
    value, written as 127.  The other kernels saturate to int16 first (``vpackssdw``), add the
    zero point with saturation (``vpaddsw``), and write -128.
    """

    isa: str  # XNNPACK's ISA name (gemm_configs.ISA_FLAGS)
    kernel: str  # micro-kernel name, without the xnn_qs8_qc8w_gemm_minmax_fp32_ukernel_ prefix
    int32_zero_point: bool


#: x86-64 branches of ``init_qs8_qc8w_gemm_config`` (XNNPACK 1adaa7c7), in XNNPACK's order.
#: (An avxvnniint8 branch stands between avx512vnni and avxvnni; it needs AVX-VNNI, which
#: the executorch 1.4.1 wheel leaves out, and no CPU class of issue 42 has it.)
QS8_GEMM: tuple[Qs8Gemm, ...] = (
    Qs8Gemm("avx512amx", "16x64c4__avx512amx", True),
    Qs8Gemm("avx512vnni", "7x16c8__avx512vnni_prfm", True),
    Qs8Gemm("avxvnni", "5x8c8__avxvnni_prfm", True),
    Qs8Gemm("avx512skx", "7x16c8__avx512skx_prfm", True),
    Qs8Gemm("avx256skx", "4x8c8__avx256skx", False),
    Qs8Gemm("avx2", "3x8c8__avx2", False),
    Qs8Gemm("avx", "2x4c8__avx_ld128", False),
    Qs8Gemm("sse4.1", "3x4c8__sse41_ld64", False),
    Qs8Gemm("sse2", "3x4c8__sse2_ld64", False),
)

#: ``Cpu.int8_class`` of each ``QS8_GEMM`` ISA.
#: (AMX and AVX-VNNI kernels are not in the executorch 1.4.1 wheel, whose classes these are; in
#: another build they would be faster than their class's ratios say.)
INT8_CLASSES = {"avx512amx": "avx512vnni", "avx512vnni": "avx512vnni", "avxvnni": "avx2", "avx512skx": "avx512",
                "avx256skx": "avx512", "avx2": "avx2", "avx": "sse", "sse4.1": "sse", "sse2": "sse"}
#: How a report names each int8 class.
CLASS_NAMES = {"avx512vnni": "AVX-512 VNNI", "avx512": "AVX-512 without VNNI", "avx2": "AVX2", "sse": "SSE"}
_UARCH_NAMES = {"zen": "Zen", "zen4": "Zen 4", "zen5": "Zen 5"}


@dataclass(frozen=True)
class Cpu:
    """A CPU as /proc/cpuinfo shows it: flags, XNNPACK's micro-architecture ("", "zen", "zen4",
    "zen5"), vendor and model name."""

    flags: frozenset[str]
    uarch: str = ""
    vendor: str = ""
    model_name: str = ""

    @classmethod
    def from_cpuinfo(cls, cpuinfo: str) -> Cpu:
        """The first processor of a /proc/cpuinfo text."""
        from .capture import cpu_features

        flags, uarch = cpu_features(cpuinfo)
        fields = {}
        for line in cpuinfo.split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        return cls(flags, uarch, fields.get("vendor_id", ""), fields.get("model name", ""))

    def qs8_gemm(self, build: XnnpackBuild = EXECUTORCH_1_4_1) -> Qs8Gemm | None:
        """The static int8 GEMM branch XNNPACK takes here (None: not x86-64 as far as the flags say)."""
        isas = xnnpack_isas(self.flags, build)
        return next((g for g in QS8_GEMM if g.isa in isas), None)

    @property
    def int8_class(self) -> str:
        """``"avx512vnni"``, ``"avx512"``, ``"avx2"`` or ``"sse"`` (module docstring)."""
        gemm = self.qs8_gemm()
        return INT8_CLASSES[gemm.isa] if gemm is not None else "sse"

    @property
    def label(self) -> str:
        """How a report names the CPU: ``"AMD EPYC (Zen 4, AVX-512 VNNI)"``."""
        name = self.model_name or {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(self.vendor, "") or "a CPU"
        uarch = _UARCH_NAMES.get(self.uarch, "")
        return f"{name} ({uarch + ', ' if uarch else ''}{CLASS_NAMES[self.int8_class]})"


@functools.cache
def this_cpu() -> Cpu:
    """This machine's CPU (read once); no flags where /proc/cpuinfo is unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return Cpu.from_cpuinfo(f.read())
    except OSError:
        return Cpu(frozenset())


#: A dynamically quantized filter's datatype name -> its weight layout in ``gemm_configs``.
_DYNAMIC_LAYOUTS = {"qcint8": "qc8w", "qcint4": "qc4w", "qbint4": "qb4w"}


def fully_connected_kernels(graphs: list[Any], cpu: Cpu | None = None) -> list[str]:
    """What the fully connected nodes of ``graphs`` (XNNPACK ``Graph``s) run on ``cpu`` (default:
    this machine's), one entry per kind: ``"qb4w (qdint8 input): qdu8 avx512vnni 8x16c8"``, with
    ``", an SSE2 fallback"`` where XNNPACK has nothing faster for it there."""
    from ..datatypes import Datatype
    from ..packing.gemm_configs import runtime_config, select_f32_config

    cpu = this_cpu() if cpu is None else cpu
    kinds: dict[str, Any] = {}
    for graph in graphs:
        for node in graph.nodes:
            if node.kind != "XNNFullyConnected":
                continue
            x, w = graph.value(node.inputs[0]), graph.value(node.inputs[1])
            if x.datatype is Datatype.qdint8 and w.datatype.name in _DYNAMIC_LAYOUTS:
                layout = _DYNAMIC_LAYOUTS[w.datatype.name]
                kinds.setdefault(f"{layout} (qdint8 input)", runtime_config(layout, cpu.flags, cpu.uarch))
            elif x.datatype is Datatype.fp32 and w.datatype is Datatype.fp32:
                kinds.setdefault("fp32", select_f32_config(int(w.dims[0]), cpu.flags, cpu.uarch))
    out = []
    for kind, config in kinds.items():
        if config is None:
            out.append(f"{kind}: no kernel")
            continue
        slow = ", an SSE2 fallback" if config.isa_name == "sse2" else ""
        prefix = "" if config.operator == "f32" else config.operator.split("_")[0] + " "
        out.append(f"{kind}: {prefix}{config.isa_name} {config.mr}x{config.nr}"
                   f"{f'c{config.kr}' if config.kr > 1 else ''}{slow}")
    return out
