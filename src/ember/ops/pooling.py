"""Pooling over packed sequences: CLS, MEAN, LAST."""

from __future__ import annotations

import torch

from ember.types import PoolingType

__all__ = ["pool"]


def pool(hidden: torch.Tensor, seqlens: list[int], method: PoolingType) -> torch.Tensor:
    """Pool packed hidden states (T, H) into (B, H) float32, one row per sequence."""
    lens = torch.tensor(seqlens)
    ends = lens.cumsum(0)
    if method == "CLS":
        return hidden[ends - lens].float()
    if method == "LAST":
        return hidden[ends - 1].float()
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqlens)), lens)  # (T,)
    sums = torch.zeros(len(seqlens), hidden.shape[-1], dtype=torch.float32)
    sums.index_add_(0, seq_of_token, hidden.float())  # summed in float32, as vLLM
    return sums / lens[:, None].float()
