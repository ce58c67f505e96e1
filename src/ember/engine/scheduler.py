"""Forming batches: a pure function of lengths and a token budget.

Packed batches cost the sum of their lengths, so a batch holds as many sequences
as fit in `max_tokens` (and `max_seqs`); a sequence longer than the budget runs alone.
"""

from __future__ import annotations

__all__ = ["plan_batches"]


def plan_batches(lengths: list[int], max_tokens: int, max_seqs: int) -> list[list[int]]:
    """Indices of `lengths` grouped into batches, longest first within the plan."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and (tokens + lengths[i] > max_tokens or len(current) >= max_seqs):
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        batches.append(current)
    return batches
