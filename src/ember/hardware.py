"""What this machine can do: the CPU's ISA flags, its tier, and a C++ compiler (no torch here).

The flags can be capped to a lower tier for the whole process (`limit_isa`, from EMBER_MAX_ISA at the CLI): an
AMX Xeon then chooses, builds and tests what an AMD EPYC (avx512_bf16) or an AVX2-only Xeon (avx2) would.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from ember.errors import ConfigError

__all__ = [
    "AMX_FLAGS",
    "ISA_TIERS",
    "amx_granted",
    "auto_dtype",
    "bf16_outruns_float32",
    "check_tier",
    "cpu_flags",
    "cpu_model",
    "cpu_vendor",
    "find_compiler",
    "has_fast_bf16",
    "isa_tier",
    "limit_isa",
    "native_cpu_flags",
    "onednn_isa",
    "usable_cpu_flags",
]

# x86-64 tiers, best first: what each adds over the next is what a cap to the next removes.
ISA_TIERS = ("amx", "avx512_bf16", "avx512", "avx2")
_ABOVE = {  # flags a CPU capped to the tier does not show
    "amx": frozenset(),
    "avx512_bf16": frozenset({"amx_bf16", "amx_tile", "amx_int8", "amx_fp16", "amx_complex"}),
    "avx512": frozenset({"avx512_bf16", "avx512_fp16"}),
    "avx2": frozenset(),  # every avx512* flag, by prefix
}
AMX_FLAGS = _ABOVE["avx512_bf16"]
"""The flags of AMX: a process the OS refuses AMX's tile state sees none of them (cpu_flags)."""
_ONEDNN = {"amx": "AVX512_CORE_AMX", "avx512_bf16": "AVX512_CORE_BF16", "avx512": "AVX512_CORE", "avx2": "AVX2"}
# oneMKL's MKL_ENABLE_INSTRUCTIONS: torch's float32 GEMMs are MKL's, which ONEDNN_MAX_CPU_ISA does not reach
# (AVX512_E3: AVX-512 with VNNI and BF16, no AMX; E4 adds AMX).
_MKL = {"amx": "AVX512_E4", "avx512_bf16": "AVX512_E3", "avx512": "AVX512", "avx2": "AVX2"}
_max_isa: str | None = None


def limit_isa(tier: str | None) -> None:
    """Caps what cpu_flags() reports to `tier` (one of ISA_TIERS) for this process; None lifts the cap. Call
    before anything reads the flags (the CLI does, from EMBER_MAX_ISA)."""
    global _max_isa
    if tier is not None and tier not in ISA_TIERS:
        raise ConfigError(f"unknown ISA tier {tier!r}; expected one of {', '.join(ISA_TIERS)}")
    _max_isa = tier


def check_tier(tier: str) -> str:
    """`tier` when it is one of ISA_TIERS no higher than this CPU's own; else a ConfigError saying why (a cap can
    only lower the tier: running above the CPU would stop on an illegal instruction)."""
    if tier not in ISA_TIERS:
        raise ConfigError(f"EMBER_MAX_ISA={tier!r} is not a tier; expected one of {', '.join(ISA_TIERS)}")
    native = isa_tier(native_cpu_flags())
    if native not in ISA_TIERS or ISA_TIERS.index(tier) < ISA_TIERS.index(native):
        raise ConfigError(f"EMBER_MAX_ISA={tier}: this CPU only reaches {native}; a cap can only lower the tier")
    return tier


def onednn_isa(tier: str) -> str:
    """oneDNN's ONEDNN_MAX_CPU_ISA value for a tier (torch's GEMMs then stay inside it too)."""
    return _ONEDNN[tier]


def mkl_isa(tier: str) -> str:
    """oneMKL's MKL_ENABLE_INSTRUCTIONS value for a tier (torch's float32 GEMMs are MKL's, not oneDNN's)."""
    return _MKL[tier]


@lru_cache(maxsize=1)
def native_cpu_flags() -> frozenset[str]:
    """The ISA flags of the first CPU listed in /proc/cpuinfo, uncapped (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    """/proc/cpuinfo's model name (e.g. "AMD EPYC 9R14"), else what the platform reports, else "unknown"."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    return name or platform.processor() or "unknown"


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...; empty where it has none, as on ARM)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


def amx_granted() -> bool:
    """Whether this process may use the CPU's AMX tiles: Linux grants their state on request (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA, as oneDNN asks too), and a sandbox or a kernel that refuses it leaves AMX
    unusable. True where there is no AMX to ask about."""
    return "amx_tile" not in native_cpu_flags() or _request_amx_tiles()


@lru_cache(maxsize=1)
def _request_amx_tiles() -> bool:
    if sys.platform != "linux" or platform.machine() != "x86_64" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False  # (158 is another syscall to a 32-bit process)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(158, 0x1023, 18)) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        return False


def usable_cpu_flags() -> frozenset[str]:
    """This CPU's ISA flags that this process may use, uncapped: less AMX's where the OS refuses its tile state
    (amx_granted)."""
    return native_cpu_flags() if amx_granted() else native_cpu_flags() - AMX_FLAGS


def cpu_flags() -> frozenset[str]:
    """usable_cpu_flags(), less those above the tier `limit_isa` capped the process to."""
    flags = usable_cpu_flags()
    if _max_isa is None:
        return flags
    drop: set[str] = set()
    for tier in ISA_TIERS[: ISA_TIERS.index(_max_isa) + 1]:
        drop |= _ABOVE[tier]
    if _max_isa == "avx2":
        drop |= {f for f in flags if f.startswith(("avx512", "amx"))}
    return flags - drop


def isa_tier(flags: frozenset[str] | None = None) -> str:
    """The best tier these flags (default: this CPU's, capped) reach: one of ISA_TIERS, or "aarch64" (NEON,
    with "+sve", "+bf16", "+i8mm" where present), or "baseline" (x86-64 without AVX2)."""
    f = cpu_flags() if flags is None else flags
    if {"amx_bf16", "amx_tile"} <= f:
        return "amx"
    if {"avx512_bf16", "avx512f", "avx512bw"} <= f:
        return "avx512_bf16"
    if {"avx512f", "avx512bw"} <= f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    if "asimd" in f:  # aarch64's /proc/cpuinfo "Features"
        return "aarch64" + "".join(f"+{x}" for x in ("sve", "bf16", "i8mm") if x in f)
    return "baseline"


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True where bf16 matrix instructions exist (AVX512_BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))


def bf16_outruns_float32(flags: frozenset[str] | None = None, vendor: str | None = None) -> bool:
    """Whether bf16 products outrun float32 ones here: with AMX-BF16, and with AVX512_BF16 on AMD (Zen 4 and 5, whose
    vdpbf16ps does twice the multiply-adds of a float32 FMA). An Intel Xeon without AMX, or whose AMX a hypervisor
    or the OS withholds (Cooper Lake; Sapphire, Emerald and Granite Rapids in such a VM), issues vdpbf16ps at half
    the rate of its float32 FMAs: there bf16 products run at half float32's speed (benchmarks/NOTES.md)."""
    f = cpu_flags() if flags is None else flags
    if "amx_bf16" in f:
        return True
    return "avx512_bf16" in f and (cpu_vendor() if vendor is None else vendor) != "GenuineIntel"


def auto_dtype(flags: frozenset[str] | None = None, vendor: str | None = None) -> Literal["bfloat16", "float32"]:
    """What `--dtype auto` means here, from the CPU alone (its flags and vendor), so the same machine always gives
    the same vectors: bfloat16 where its bf16 products outrun float32 ones (bf16_outruns_float32), else float32."""
    return "bfloat16" if bf16_outruns_float32(flags, vendor) else "float32"


def find_compiler(preferred: str | None = None) -> str | None:
    """The C++ compiler ember's native kernels and torch.compile's C++ backend build with: `preferred` (the CXX
    the operator named) when it is on PATH, else g++, c++ or clang++; None when there is none."""
    for name in (preferred, "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None
