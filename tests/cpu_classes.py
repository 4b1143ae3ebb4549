"""The x86-64 CPU classes this project meets, as /proc/cpuinfo shows them, for tests that
inject a CPU's features instead of reading the machine's.

Each class is the first processor block of /proc/cpuinfo (vendor, family, model, flags):
what ``xnnquant.xnnpack.capture.cpu_features`` parses.  The flag lists are real ones,
trimmed of flags no decision reads: ZEN4 is this project's CI machine (AMD EPYC, family
0x19 model 0x11), SAPPHIRE_RAPIDS the Xeon of issue 42 (its flags as reported there, on
top of the baseline ones every x86-64 CPU of the last decade has).
"""

from __future__ import annotations

from dataclasses import dataclass

BASE = "fpu tsc cx8 cmov mmx fxsr sse sse2 ht syscall nx lm pni ssse3 cx16 sse4_1 sse4_2 popcnt xsave"
AVX2 = BASE + " avx f16c fma bmi1 avx2 bmi2"
SKX = AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"


@dataclass(frozen=True)
class CpuClass:
    name: str
    vendor: str
    family: int
    model: int
    flags: str

    def cpuinfo(self) -> str:
        """The text of /proc/cpuinfo for a two-core machine of this class."""
        block = (f"processor\t: {{n}}\nvendor_id\t: {self.vendor}\ncpu family\t: {self.family}\n"
                 f"model\t\t: {self.model}\nmodel name\t: {self.name}\nflags\t\t: {self.flags}\n")
        return "\n".join(block.format(n=n) for n in range(2))

    @property
    def flag_set(self) -> frozenset[str]:
        return frozenset(self.flags.split())


CORE2 = CpuClass("Intel Core 2 (SSSE3)", "GenuineIntel", 6, 0x0F, "fpu tsc cx8 cmov mmx fxsr sse sse2 nx lm pni ssse3")
ZEN1 = CpuClass("AMD Zen 1 (AVX2)", "AuthenticAMD", 0x17, 0x01, AVX2)
ZEN3 = CpuClass("AMD Zen 3 (AVX2)", "AuthenticAMD", 0x19, 0x21, AVX2)
ALDER_LAKE = CpuClass("Intel Alder Lake (AVX2, AVX-VNNI)", "GenuineIntel", 6, 0x97, AVX2 + " gfni avx_vnni")
SKYLAKE_X = CpuClass("Intel Skylake-SP (AVX-512, no VNNI)", "GenuineIntel", 6, 0x55, SKX)
ICE_LAKE = CpuClass("Intel Ice Lake-SP (AVX-512 VNNI, GFNI, no AMX)", "GenuineIntel", 6, 0x6A,
                    SKX + " avx512ifma avx512vbmi avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq")
SAPPHIRE_RAPIDS = CpuClass(
    "Intel Xeon Sapphire Rapids (AMX, AVX512-FP16)", "GenuineIntel", 6, 0x8F,
    SKX + " avx512ifma avx512vbmi avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16"
    " avx512_fp16 avx_vnni amx_int8 amx_bf16 amx_tile")
ZEN4 = CpuClass(
    "AMD EPYC (Zen 4)", "AuthenticAMD", 0x19, 0x11,
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave "
    "avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext "
    "cpuid_fault vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap "
    "avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero "
    "xsaveerptr arat avx512vbmi umip avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq "
    "rdpid fsrm")
ZEN5 = CpuClass("AMD Zen 5 (AVX-512 VNNI, GFNI)", "AuthenticAMD", 0x1A, 0x02, ZEN4.flags + " avx_vnni")

#: Every class, by a short key.
CLASSES = {"core2": CORE2, "zen1": ZEN1, "zen3": ZEN3, "alder_lake": ALDER_LAKE, "skylake_x": SKYLAKE_X,
           "ice_lake": ICE_LAKE, "sapphire_rapids": SAPPHIRE_RAPIDS, "zen4": ZEN4, "zen5": ZEN5}
