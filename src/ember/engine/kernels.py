"""Preparing faster kernels beside serving: ember's native ones, then torch.compile's fused regions."""

from __future__ import annotations

import logging
import time

from ember.types import KernelStatus, Runner

__all__ = ["prepare_kernels"]

log = logging.getLogger("ember.engine.engine")


def prepare_kernels(runner: Runner, kernels: dict[str, KernelStatus], compile_kernels: bool) -> None:
    """Native kernels, then torch.compile's fused regions (when asked), on a thread of their own beside serving: the
    model thread keeps running with what it has meanwhile. Each outcome goes into `kernels` (for logs, /info and
    /metrics). A failure here must never take serving down."""
    try:
        for status in runner.load_kernels():
            kernels[status.name] = status
            log.info("kernel %s: %s%s", status.name, "active, " if status.active else "", status.detail)
    except Exception:
        log.warning("native kernels could not be loaded; serving with torch's", exc_info=True)
    if not compile_kernels:
        return
    start = time.perf_counter()
    try:
        runner.compile()
    except Exception:
        kernels["fused"] = KernelStatus("fused", False, "compile failed: eager kernels")
        log.warning("fused kernels could not be compiled; serving with eager kernels", exc_info=True)
        return
    seconds = time.perf_counter() - start
    kernels["fused"] = KernelStatus("fused", True, f"torch.compile regions, built in {seconds:.1f}s")
    log.info("fused kernels compiled in %.1fs; serving with them", seconds)
