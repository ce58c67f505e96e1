"""Attention over packed variable-length sequences: ember's native kernel where built, else SDPA.

Once ember.ops.native has built it, every sequence of a batch goes through one call of the native
flash-attention kernel (csrc/attention.cpp), which reads q, k and v in place and writes the packed output:
float32 on every x86-64 CPU from AVX2 up and on aarch64 (FMA register blocks, AVX2 or NEON), bf16 where the CPU
has AVX-512 BF16 or AMX. Its blocks (query rows x keys) are 32 x 32 for batches of short sequences (queries),
32 x 64 and 32 x 128 for longer ones, 64 x 256 from ~6,000 tokens (128 x 128 from ~3,000 on AMD Zen 1-3; bf16
without AMX stays on 32 x 128). The rest
of this module is the SDPA path, used everywhere else (bf16 on an AVX2 or ARM CPU, x86-64 below AVX2, head sizes
the kernel does not take, a kernel switched off or not yet built):

Sequences are laid end to end (T = sum of lengths). Attention runs per group of
similar-length sequences, padded only within the group, so no full T x T score matrix
is ever built and short sequences do not pay for long ones.

Lengths are rounded up to a multiple of 16 where that is cheap: torch's CPU flash attention is much
slower on some other lengths (benchmarks/experiments/attention_lengths.py; benchmarks/NOTES.md). Under a causal
mask the padding keys are seen only by padding queries, whose rows are dropped, so the result is
unchanged; the padding is the next sequence's tokens, where there are enough of them (a zero-padded
copy measured slower than no padding, so the last sequence of a batch is not padded). Bidirectional
attention would need a key mask for it, so only groups padded (and masked) anyway are rounded up.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.ops.native import attention_kernel, native_attention_dtypes

__all__ = [
    "group_by_length",
    "native_attention",
    "packed_attention",
    "rows_attention",
    "seq_offsets",
    "varlen_attention",
]

# A group may waste at most this fraction of its padded area on padding.
_MAX_PADDING = 0.25
# Causal sequences this long get an SDPA call of their own (faster than padded with a mask at a
# few x 512: benchmarks/NOTES.md); shorter ones are batched, where one call per sequence would cost more than it saves.
_OWN_CALL = 128
# Lengths from _ALIGN_FROM tokens are padded to a multiple of _ALIGN (shorter ones measured no faster).
_ALIGN, _ALIGN_FROM = 16, 64


def _native_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    d = q.shape[-1]
    return (
        q.dtype == k.dtype == v.dtype
        and q.dtype in native_attention_dtypes()
        and d % 32 == 0
        and d <= 256
        and q.shape[1] % k.shape[1] == 0
        and all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v))
        and not (q.requires_grad and torch.is_grad_enabled())
    )


def seq_offsets(seqlens: list[int]) -> torch.Tensor:
    """Where each sequence starts, and the total: (B + 1,) int64 (cu_seqlens), the same for every layer of a
    forward (cached)."""
    return _offsets(tuple(seqlens))


@functools.lru_cache(maxsize=32)
def _offsets(seqlens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int64)


torch.library.define(
    "ember::native_attention", "(Tensor q, Tensor k, Tensor v, Tensor cu, bool causal, int window=-1) -> Tensor"
)


@torch.library.register_fake("ember::native_attention")
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, causal: bool, window: int = -1
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def native_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool, window: int | None = None
) -> torch.Tensor | None:
    """The native kernel's attention of packed q (T, Hq, D) over k, v (T, Hkv, D), a token seeing the keys of its
    sequence within `window` positions of it (None: all): (T, Hq, D); None where the kernel does not run (not
    built, or this dtype or head size)."""
    if attention_kernel() is None or not _native_fits(q, k, v):
        return None
    return torch.ops.ember.native_attention(q, k, v, seq_offsets(seqlens), causal, -1 if window is None else window)


def packed_attention(qkv: torch.Tensor, cu: torch.Tensor, n_kv: int, causal: bool) -> torch.Tensor:
    """varlen_attention on a packed (T, Hq + 2 Hkv, D) projection (Hkv = n_kv), sequences given by their
    offsets cu (seq_offsets): (T, Hq, D). Operators, so that a compiled region can hold a whole layer,
    attention included, without being specialised on the batch's lengths: ember::native_attention, the
    native kernel registered in C++ by its library (no Python per call), where it runs; else
    ember::packed_sdpa."""
    n_q = qkv.shape[1] - 2 * n_kv
    q, k, v = qkv.split((n_q, n_kv, n_kv), dim=1)
    if attention_kernel() is not None and _native_fits(q, k, v):
        return torch.ops.ember.native_attention(q, k, v, cu, causal)
    return packed_sdpa(qkv, cu, n_kv, causal)


@torch.library.custom_op("ember::packed_sdpa", mutates_args=())
def packed_sdpa(qkv: torch.Tensor, cu: torch.Tensor, n_kv: int, causal: bool) -> torch.Tensor:
    """packed_attention where the native kernel does not run: varlen_attention's SDPA path."""
    n_q = qkv.shape[1] - 2 * n_kv
    q, k, v = qkv.split((n_q, n_kv, n_kv), dim=1)
    return varlen_attention(q, k, v, (cu[1:] - cu[:-1]).tolist(), causal)


@packed_sdpa.register_fake
def _(qkv: torch.Tensor, cu: torch.Tensor, n_kv: int, causal: bool) -> torch.Tensor:
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] - 2 * n_kv, qkv.shape[2]))


def group_by_length(seqlens: list[int]) -> list[list[int]]:
    """Indices of sequences grouped so each group pads to its longest with little waste."""
    order = sorted(range(len(seqlens)), key=lambda i: -seqlens[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups:
            group = groups[-1]
            longest = seqlens[group[0]]
            if (len(group) + 1) * longest * (1 - _MAX_PADDING) <= total + seqlens[i]:
                group.append(i)
                total += seqlens[i]
                continue
        groups.append([i])
        total = seqlens[i]
    return groups


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    # q: (B, Hq, L, D); k, v: (B, Hkv, L, D); grouped-query heads are shared inside the kernel
    gqa = k.shape[1] != q.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], causal: bool
) -> torch.Tensor:
    """Attention of packed q (T, Hq, D) over k, v (T, Hkv, D); returns (T, Hq, D)."""
    native = native_attention(q, k, v, seqlens, causal)
    if native is not None:
        return native
    if len(seqlens) == 1:
        out = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal, None)
        return out[0].transpose(0, 1)  # (T, Hq, D)
    out = torch.empty_like(q)
    for step in _plan(tuple(seqlens), causal):  # the same for every layer of a forward: built once
        if isinstance(step, _Group):
            step.attend(q, k, v, out, causal)
            continue
        s, n, b = step
        if b == 1:
            _alone(q, k, v, out, s, n, causal)
        else:  # consecutive, equal lengths: a view, no gather or scatter
            qv, kv, vv = (t[s : s + n * b].unflatten(0, (b, n)).transpose(1, 2) for t in (q, k, v))  # (B, H, L, D)
            out[s : s + n * b] = _sdpa(qv, kv, vv, causal, None).transpose(1, 2).flatten(0, 1)
    return out


def rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], rows: torch.Tensor
) -> torch.Tensor:
    """Causal attention of the packed rows `rows` (R,) alone, each over its sequence's keys up to itself, as
    varlen_attention computes that row: (R, Hq, D). A model pooled on each sequence's last token reads no other row
    of its last layer, so this spares that layer's attention but one row a sequence (1/28 of an 8,000-token
    document's attention in the 0.6B shape). One row at a time, so a row's result does not depend on its batch."""
    starts = list(itertools.accumulate(seqlens, initial=0))
    out = q.new_empty((rows.shape[0], q.shape[1], q.shape[2]))
    for i, t in enumerate(rows.tolist()):
        lo = starts[bisect.bisect_right(starts, t) - 1]
        qt, kt, vt = (x[a : t + 1].transpose(0, 1)[None] for x, a in ((q, t), (k, lo), (v, lo)))  # (1, H, L, D)
        out[i] = _sdpa(qt, kt, vt, False, None)[0, :, 0]
    return out


@dataclass(frozen=True)
class _Group:
    """Sequences padded into one (B, H, L, D) batch: where each padded slot reads from and writes to."""

    shape: tuple[int, int]  # (B, L)
    gather: torch.Tensor  # (B * L,) token index of each slot (padding reads token 0)
    real: torch.Tensor  # (N,) the slots holding real tokens
    dest: torch.Tensor  # (N,) their token indices
    mask: torch.Tensor | None  # (B, 1, 1, L) key mask, for bidirectional attention over padding

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool) -> None:
        """Pads, attends, scatters back into `out`. Padding is on the right: under a causal mask no real
        query sees it; padded queries compute garbage that is never read back."""
        b, width = self.shape
        qp, kp, vp = (t.index_select(0, self.gather).unflatten(0, (b, width)).transpose(1, 2) for t in (q, k, v))
        res = _sdpa(qp, kp, vp, causal, self.mask).transpose(1, 2).flatten(0, 1)  # (B * L, Hq, D)
        out.index_copy_(0, self.dest, res.index_select(0, self.real))


@functools.lru_cache(maxsize=32)
def _plan(seqlens: tuple[int, ...], causal: bool) -> list[_Group | tuple[int, int, int]]:
    """The attention calls for a batch: (start, length, count) for a sequence attended alone (count 1)
    or a run of equal consecutive ones, and padded _Groups."""
    starts = [0]
    for n in seqlens[:-1]:
        starts.append(starts[-1] + n)
    steps: list[_Group | tuple[int, int, int]] = []
    if causal:  # long sequences attend through views, one call each: no gather, no mask
        steps += [(starts[i], n, 1) for i, n in enumerate(seqlens) if n >= _OWN_CALL]
        short = [i for i, n in enumerate(seqlens) if n < _OWN_CALL]
        groups = [[short[j] for j in g] for g in group_by_length([seqlens[i] for i in short])]
    else:
        groups = group_by_length(list(seqlens))
    for group in groups:
        s, n, b = starts[group[0]], seqlens[group[0]], len(group)
        if b == 1 or (_is_run(group, seqlens) and (not causal or _aligned(n) == n)):
            steps.append((s, n, b))
        else:
            steps.append(_group([starts[i] for i in group], [seqlens[i] for i in group], causal))
    return steps


def _group(starts: list[int], lens: list[int], causal: bool) -> _Group:
    width = _aligned(max(lens))
    pos = torch.arange(width)
    valid = pos[None, :] < torch.tensor(lens)[:, None]  # (B, L)
    index = torch.where(valid, torch.tensor(starts)[:, None] + pos[None, :], 0)  # (B, L)
    real = valid.flatten().nonzero().squeeze(1)
    mask = None if causal or all(n == width for n in lens) else valid[:, None, None, :]
    return _Group((len(lens), width), index.flatten(), real, index.flatten()[real], mask)


def _aligned(n: int) -> int:
    return n if n < _ALIGN_FROM else -(-n // _ALIGN) * _ALIGN


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, s: int, n: int, causal: bool) -> None:
    """Attention of the one sequence at tokens [s, s + n), written into out[s : s + n]. Causal, it is
    padded with the tokens after it where there are enough (views: a padded copy measured slower)."""
    m = _aligned(n) if causal else n
    if s + m > q.shape[0]:
        m = n
    qs, ks, vs = (t[s : s + m].transpose(0, 1)[None] for t in (q, k, v))
    out[s : s + n] = _sdpa(qs, ks, vs, causal, None)[0, :, :n].transpose(0, 1)


def _is_run(group: list[int], seqlens: tuple[int, ...]) -> bool:
    first = group[0]
    return len(group) > 1 and all(i == first + j and seqlens[i] == seqlens[first] for j, i in enumerate(group))
