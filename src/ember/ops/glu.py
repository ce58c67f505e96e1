"""A SwiGLU layer's gate and up channels interleaved in blocks of 16, so that a product's epilogue holds a block of
gates beside their ups and writes silu(gate) * up itself: the int8 kernel's tiles of 16 channels (ember.ops.quant)
and the bf16 product's strips of 32 (ember.ops.bf16_pairs), whose intermediate (T, 2 I) is then never written."""

from __future__ import annotations

import torch

__all__ = ["deinterleave_columns", "deinterleave_glu", "interleave_glu"]

BLOCK = 16


def interleave_glu(t: torch.Tensor) -> torch.Tensor:
    """Rows (or entries) [gate; up] of a SwiGLU layer -> gates and ups alternating in blocks of 16."""
    half = t.shape[0] // 2
    return t.reshape(2, half // BLOCK, BLOCK, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def deinterleave_glu(t: torch.Tensor) -> torch.Tensor:
    """interleave_glu's rows (or entries) back to [gate; up]."""
    half = t.shape[0] // 2
    return t.reshape(half // BLOCK, 2, BLOCK, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def deinterleave_columns(y: torch.Tensor) -> torch.Tensor:
    """The columns of a product on interleave_glu's weights, back to [gate, up]: (T, 2 I)."""
    t, n = y.shape
    return y.view(t, n // (2 * BLOCK), 2, BLOCK).transpose(1, 2).reshape(t, n)
