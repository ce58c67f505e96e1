"""The torch side: runs one packed batch through the model and its pooler.

This is the only engine module that imports torch; the async engine gets a runner
injected, so everything above it can be tested with a fake runner.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ember.models.dense import Dense
from ember.ops.fused import compiled, compiling
from ember.ops.pooling import pool
from ember.types import ModelInfo

__all__ = ["TorchRunner"]


class TorchRunner:
    """Embeds packed batches: (B sequences of token ids) -> (B, dimension) float32 pooled vectors."""

    def __init__(self, model: nn.Module, info: ModelInfo, dense: list[Dense] | None = None) -> None:
        self.model = model
        self.info = info
        self.dense = dense or []
        self.compiled = False
        """True once compile() has built the fused kernels: embed() then uses them."""

    @torch.inference_mode()
    def embed(self, batch: list[list[int]]) -> np.ndarray:
        seqlens = [len(ids) for ids in batch]
        flat = np.fromiter((t for ids in batch for t in ids), dtype=np.int64, count=sum(seqlens))
        input_ids = torch.from_numpy(flat)  # (T,)
        positions = _positions(seqlens)  # (T,)
        with compiled(self.compiled):
            hidden = self.model(input_ids, positions, seqlens)  # (T, H)
        pooled = pool(hidden, seqlens, self.info.pooling.method)  # (B, H) float32
        for dense in self.dense:
            pooled = dense(pooled)
        return pooled.numpy()

    def compile(self) -> None:
        """Compiles the model's fused kernels with a small forward on this thread; then every thread uses them."""
        with compiling():
            self.embed([[1, 2, 3, 4, 5, 6, 7, 8], [3, 2, 1, 4, 5]])
        self.compiled = True


def _positions(seqlens: list[int]) -> torch.Tensor:
    """0..n-1 for each sequence, concatenated: (T,)."""
    lens = torch.tensor(seqlens)
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(int(lens.sum())) - starts
