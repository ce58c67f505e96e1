"""How torch uses this CPU: its thread pools, the compute dtype, and a matrix-multiply probe.

The CPU's facts (ISA flags, a compiler) are in ember.hardware; the container's limits in ember.resources.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ember.config import DType
from ember.hardware import auto_dtype

__all__ = ["best_seconds", "gemm_gflops", "set_threads", "torch_dtype"]


def set_threads(threads: int) -> None:
    """Size torch's intra-op pool (OMP, MKL, oneDNN follow it) and keep inter-op work on one thread."""
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # settable only before the first parallel region
        torch.set_num_interop_threads(1)


def torch_dtype(dtype: DType) -> torch.dtype:
    """The compute dtype: `auto` is bfloat16 where the CPU has bf16 matrix instructions (from its flags)."""
    name = auto_dtype() if dtype == "auto" else dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def gemm_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 3) -> float:
    """Measured matrix-multiply throughput for `dtype` on the current threads (best of `repeats`)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats) / 1e9


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run`, after one untimed call (kernel selection)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
