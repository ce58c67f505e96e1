"""Local attention: bidirectional attention in which a token sees only the tokens within `window` positions of it
(ModernBERT's local layers, EmbeddingGemma's sliding layers), over packed variable-length sequences.

Where ember's native attention kernel runs (ember.ops.attention), every sequence of the batch goes through one call
of it with the window: its work items read only the key blocks their rows' windows reach, and the rows' band is
masked in the softmax. Elsewhere (SDPA): a sequence no longer than the window sees all of itself, so it goes to
varlen_attention. One shorter than three windows runs whole under an (L, L) band mask. A longer one is cut into
blocks of `window` queries, each attending to its own block and the window on either side: one SDPA call per
sequence over (blocks, window + 2 window) keys, so the score matrix grows with the length times the window, never
with the length squared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.ops.attention import native_attention, varlen_attention

__all__ = ["local_attention"]


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int], window: int | None
) -> torch.Tensor:
    """q (T, Hq, D), k and v (T, Hkv, D), sequences laid end to end; token i sees token j of its sequence when
    |i - j| <= window (None: every token of its sequence, a global layer). Returns (T, Hq, D)."""
    if window is None:
        return varlen_attention(q, k, v, seqlens, causal=False)
    native = native_attention(q, k, v, seqlens, causal=False, window=window)
    if native is not None:
        return native
    out = torch.empty_like(q)
    short: list[tuple[int, int]] = []  # (start, length) of the sequences that fit the window whole
    start = 0
    for n in seqlens:
        s = slice(start, start + n)
        if n <= window + 1:
            short.append((start, n))
        elif n < 3 * window:  # one (n, n) band mask costs less than blocks over 3 windows of keys each
            out[s] = _masked(q[s], k[s], v[s], window)
        else:
            out[s] = _banded(q[s], k[s], v[s], window)
        start += n
    if len(short) == len(seqlens):
        return varlen_attention(q, k, v, seqlens, causal=False)
    if short:
        index = torch.cat([torch.arange(s, s + n) for s, n in short])
        out[index] = varlen_attention(q[index], k[index], v[index], [n for _, n in short], causal=False)
    return out


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """One sequence (L, H, D) a little longer than the window: all of it at once under an (L, L) band mask."""
    i = torch.arange(q.shape[0])
    band = (i[:, None] - i[None, :]).abs() <= window  # (L, L)
    gqa = k.shape[1] != q.shape[1]
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, L, D)
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, enable_gqa=gqa)[0].transpose(0, 1)


def _banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """One sequence (L, H, D) longer than the window: blocks of `window` queries over their band of keys."""
    n, block = q.shape[0], window
    blocks = -(-n // block)
    span = block + 2 * window  # keys a block can see: the window before it, itself, the window after
    pad_q = blocks * block - n
    qb = F.pad(q, (0, 0, 0, 0, 0, pad_q)).view(blocks, block, *q.shape[1:]).transpose(1, 2)  # (B, Hq, block, D)
    # keys padded by the window on the left and up to the last block's band on the right, then cut into bands
    kp, vp = (F.pad(t, (0, 0, 0, 0, window, pad_q + window)) for t in (k, v))  # (blocks*block + 2w, Hkv, D)
    kb, vb = (t.unfold(0, span, block).permute(0, 1, 3, 2) for t in (kp, vp))  # (B, Hkv, span, D)
    rows = torch.arange(block)[:, None]  # query offset in its block
    cols = torch.arange(span)[None, :]  # key offset in its band; key position = block start - window + col
    band = (cols - rows >= 0) & (cols - rows <= 2 * window)  # |query - key| <= window
    key_pos = (torch.arange(blocks) * block - window)[:, None, None] + cols  # (B, 1, span)
    mask = band[None] & (key_pos >= 0) & (key_pos < n)  # (B, block, span): padding keys hidden
    gqa = kb.shape[1] != qb.shape[1]
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], enable_gqa=gqa)  # (B, Hq, block, D)
    return o.transpose(1, 2).reshape(blocks * block, *q.shape[1:])[:n]
