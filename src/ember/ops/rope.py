"""Rotary position embeddings (the rotate-half form used by Qwen and Llama checkpoints)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """The (head_dim / 2,) float32 frequencies for config.json's rope parameters: `rope_theta`, and the scaling
    `rope_type` default, linear (`factor`) or llama3 (Llama 3.1's long-context smoothing), as transformers
    computes them."""
    theta = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind != "llama3":
        return inv_freq
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape (T, 1, head_dim) for integer positions (T,) and frequencies (head_dim / 2,),
    computed in float32.

    The sin's first half is negated, so rotate-half becomes a swap of halves (see apply_rope)."""
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
