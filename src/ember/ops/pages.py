"""A model's weight matrices on the kernel's huge pages (2 MB on x86-64), where Linux allows it.

A short query streams every weight of the model from memory once per forward, a page of 4 KB at a time: each page
costs the CPU a TLB miss, and under a hypervisor each miss walks two page tables. On 2 MB pages the same stream ran
0.89x the time in a bare loop, and a Qwen3-0.6B forward of an 18-token query 0.945x (8 tokens 0.92x; a batch of 8
queries, bound by its multiply-adds, level) on a Xeon with AMX hidden (benchmarks/NOTES.md). So once a model is laid
out, huge_pages moves the 2 MB-aligned inside of every weight matrix onto huge pages with `madvise(MADV_COLLAPSE)`
(Linux 6.1+; it copies each 2 MB into a huge page and frees the small ones, so memory stays the same). Where Linux
refuses (a kernel before 6.1 or without transparent huge pages, memory it will not move) the range is only advised
`MADV_HUGEPAGE`, for the kernel's background collapsing if it runs, and serving goes on as it was: this only ever
changes speed.

Embedding tables are left alone: a batch reads a few of their rows, not a stream.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from ember.types import KernelStatus

__all__ = ["collapse", "huge_page_size", "huge_pages", "weight_spans"]

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")


def huge_page_size(path: Path = _PMD_SIZE) -> int | None:
    """The size of a transparent huge page here (2 MB on x86-64; 512 MB on arm64 with 64 KB pages), or None when the
    kernel has none."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def weight_spans(model: nn.Module, page: int) -> list[tuple[int, int]]:
    """The [start, end) address ranges of whole huge pages inside the model's parameters and buffers: each storage
    once; not embedding tables, nor oneDNN's opaque tensors (torch does not expose their memory)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    spans: list[tuple[int, int]] = []
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in skip or t.device.type != "cpu" or t.layout is not torch.strided:
            continue
        storage = t.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if address in seen:
            continue
        seen.add(address)
        start, end = -(-address // page) * page, (address + size) // page * page
        if end > start:
            spans.append((start, end))
    return spans


def collapse(
    spans: Iterable[tuple[int, int]], madvise: Callable[[int, int, int], int] | None = None
) -> tuple[int, int]:
    """madvise(MADV_COLLAPSE) on each span, MADV_HUGEPAGE where that is refused: (bytes collapsed, bytes advised)."""
    if madvise is None:
        libc_madvise = ctypes.CDLL(None, use_errno=True).madvise
        libc_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise = libc_madvise
    collapsed = advised = 0
    for start, end in spans:
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += end - start
        elif madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += end - start
    return collapsed, advised


def huge_pages(model: nn.Module, page: int | None = None) -> KernelStatus:
    """Moves the model's weight matrices onto huge pages (see the module's doc); what happened, as a status for
    logs, /info and /metrics. It never raises: speed is all it changes."""
    try:
        return _huge_pages(model, huge_page_size() if page is None else page)
    except Exception as e:  # a failure here must not stop the kernels' report
        return KernelStatus("huge_pages", False, f"not moved ({type(e).__name__}: {e}): small pages")


def _huge_pages(model: nn.Module, page: int | None) -> KernelStatus:
    if not sys.platform.startswith("linux") or page is None:
        return KernelStatus("huge_pages", False, "no transparent huge pages here: weights on small pages")
    spans = weight_spans(model, page)
    if not spans:
        return KernelStatus("huge_pages", False, "no weight matrix spans a huge page")
    collapsed, advised = collapse(spans)
    mb = 1 << 20
    if collapsed:
        rest = f"; {advised / mb:.0f} MB advised" if advised else ""
        return KernelStatus("huge_pages", True, f"{collapsed / mb:.0f} MB of weights on {page // 1024} KB pages{rest}")
    if advised:
        return KernelStatus(
            "huge_pages", False, f"collapsing refused (Linux before 6.1?); {advised / mb:.0f} MB advised MADV_HUGEPAGE"
        )
    return KernelStatus("huge_pages", False, "huge pages refused for the weights: small pages")
