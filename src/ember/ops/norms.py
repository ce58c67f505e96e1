"""Normalisation layers as plain functions; statistics are computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["layer_norm"]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm; torch's CPU kernel accumulates reduced-precision inputs in float32."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
