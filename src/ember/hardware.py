"""What the CPU can do, read from /proc/cpuinfo (no torch here)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

__all__ = ["cpu_flags", "has_fast_bf16"]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ISA flags of the first CPU listed in /proc/cpuinfo (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_fast_bf16() -> bool:
    """True where bf16 matrix instructions exist (AVX512_BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
