"""What this machine can do: the CPU's ISA flags and a C++ compiler (no torch here)."""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Literal

__all__ = ["auto_dtype", "cpu_flags", "find_compiler", "has_fast_bf16"]


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


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """True where bf16 matrix instructions exist (AVX512_BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & (cpu_flags() if flags is None else flags))


def auto_dtype(flags: frozenset[str] | None = None) -> Literal["bfloat16", "float32"]:
    """What `--dtype auto` means here, from the CPU flags alone, so the same machine always gives the same
    vectors: bfloat16 where the CPU has bf16 matrix instructions, else float32."""
    return "bfloat16" if has_fast_bf16(flags) else "float32"


def find_compiler(preferred: str | None = None) -> str | None:
    """The C++ compiler ember's native kernels and torch.compile's C++ backend build with: `preferred` (the CXX
    the operator named) when it is on PATH, else g++, c++ or clang++; None when there is none."""
    for name in (preferred, "g++", "c++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None
