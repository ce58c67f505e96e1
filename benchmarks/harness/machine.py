"""What machine a figure was measured on: the CPU's name and the instruction sets that decide ember's paths."""

from __future__ import annotations

import os

__all__ = ["cpu_description", "cpu_name"]


def cpu_name() -> str:
    """The CPU's model name, e.g. "AMD EPYC 9R14" (ember.hardware.cpu_model)."""
    from ember.hardware import cpu_model

    return cpu_model()


def cpu_description() -> str:
    """The CPU's name, its CPU count and the ISA that decides ember's paths (AMX, AVX-512 BF16/VNNI, AVX2)."""
    from ember.hardware import cpu_flags

    isa = [f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in cpu_flags()]
    return f"{cpu_name()} ({os.cpu_count()} CPUs; {' '.join(isa)})"
