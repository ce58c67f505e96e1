"""Rotary position embeddings (the rotate-half form used by Qwen and Llama checkpoints)."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape (T, 1, head_dim) for integer positions (T,), computed in float32.

    The sin's first half is negated, so rotate-half becomes a swap of halves (see apply_rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # (T, head_dim)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, head_dim): x*cos + rotate_half(x)*sin, one half at a time (with the signed sin,
    rotate-half is a swap of halves). Written by halves, a compiled kernel reads x twice in place
    instead of building the swapped copy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s1, s2 = cos[..., :half], sin[..., :half], sin[..., half:]
    return torch.cat((x1 * c + x2 * s1, x2 * c + x1 * s2), dim=-1)
