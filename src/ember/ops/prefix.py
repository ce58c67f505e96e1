"""Shared prefixes: causal sequences of a batch that begin with the same tokens compute those tokens once.

Under causal attention a token's hidden state depends only on the tokens before it, so when sequences of a
batch start with the same k tokens (Qwen3-Reranker's system prompt, instruction and query before each of a
request's documents; an embedder's instruction before each query), those k tokens have the same states in
each. The batch then holds the prefix once and each sequence's other tokens as a continuation of it, at
positions from k. The per-token layers (projections, MLP, norms: nearly all of a forward's work) run on the
prefix once; attention gives each continuation the prefix's keys and values ahead of its own
(`PrefixLayout`), so every continuation attends exactly as its whole sequence would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MIN_SHARED", "PrefixLayout", "PrefixPlan", "prefix_layout", "share_prefixes"]

MIN_SHARED = 16
"""The shortest common start that is shared. Shorter ones would save little beside the per-layer gathers a shared
batch pays; the measured wins are at ~18 tokens (an instruction before queries) and ~70 (Qwen3-Reranker's head)."""


@dataclass(frozen=True)
class PrefixPlan:
    """A batch rewritten with its shared prefixes held once, as segments in packed order."""

    segments: list[list[int]]
    """Token ids of each segment: a whole sequence, a shared prefix, or a continuation of one."""
    starts: list[int]
    """The position of each segment's first token: 0, or the length of the prefix it continues."""
    parents: list[int]
    """The prefix segment each continuation follows; -1 for whole sequences and prefixes."""
    owners: list[int]
    """For each sequence of the batch, the segment holding its last token."""


def share_prefixes(batch: list[list[int]], min_shared: int = MIN_SHARED) -> PrefixPlan | None:
    """The batch with each run of sequences sharing at least `min_shared` first tokens split into the prefix
    (once) and continuations (each keeps at least its last token); None when no two sequences share one.

    Sequences are sorted so that those sharing a prefix are neighbours; a run extends while the next shares at
    least the run's prefix with the previous, so a long prefix (one query's documents) is never cut short by a
    shorter one (the system prompt every query has in common)."""
    order = sorted(range(len(batch)), key=batch.__getitem__)
    runs: list[tuple[int, list[int]]] = []  # (shared tokens, members)
    shared, run = 0, order[:1]
    for i in order[1:]:
        n = _common(batch[run[-1]], batch[i])
        if n >= min_shared and (len(run) == 1 or n >= shared):
            shared = n if len(run) == 1 else shared
            run.append(i)
        else:
            runs.append((shared, run))
            shared, run = 0, [i]
    runs.append((shared, run))
    if all(len(members) == 1 for _, members in runs):
        return None
    segments: list[list[int]] = []
    starts: list[int] = []
    parents: list[int] = []
    owners = [0] * len(batch)
    for n, members in runs:
        parent = -1
        if len(members) > 1:
            parent = len(segments)
            segments.append(batch[members[0]][:n])
            starts.append(0)
            parents.append(-1)
        for i in members:
            owners[i] = len(segments)
            segments.append(batch[i][n:] if parent >= 0 else batch[i])
            starts.append(n if parent >= 0 else 0)
            parents.append(parent)
    return PrefixPlan(segments, starts, parents, owners)


def _common(a: list[int], b: list[int]) -> int:
    """Leading tokens a and b share, leaving each at least its last token."""
    limit = min(len(a), len(b)) - 1
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class PrefixLayout:
    """How attention reads a batch of segments: each continuation behind a copy of its prefix's rows."""

    seqlens: list[int]
    """The attention sequences: each whole sequence or prefix, and each continuation with its prefix ahead."""
    gather: torch.Tensor
    """(T',) the packed token each attention row reads."""
    keep: torch.Tensor
    """(T,) the attention row each packed token's output comes from (a continuation's own rows)."""


def prefix_layout(seqlens: list[int], parents: list[int]) -> PrefixLayout:
    """The layout of packed segments of `seqlens` where segment i continues segment parents[i] (-1: none)."""
    starts = [0]
    for n in seqlens[:-1]:
        starts.append(starts[-1] + n)
    gather, keep, lens = [], [], []
    row = 0
    for start, n, parent in zip(starts, seqlens, parents, strict=True):
        ahead = seqlens[parent] if parent >= 0 else 0
        if ahead:
            gather.append(torch.arange(starts[parent], starts[parent] + ahead))
        gather.append(torch.arange(start, start + n))
        keep.append(torch.arange(row + ahead, row + ahead + n))
        lens.append(ahead + n)
        row += ahead + n
    return PrefixLayout(lens, torch.cat(gather), torch.cat(keep))
