"""Normalisation layers as plain functions; statistics are computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["layer_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen/Llama, in torch's fused kernel: it accumulates bf16 in float32 and rounds once,
    so it needs no float32 copy of x (memory) and is closer to float32 than normalise-round-scale."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm; torch's CPU kernel accumulates reduced-precision inputs in float32."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
