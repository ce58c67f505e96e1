"""int8 weights with per-token dynamic int8 activations, applied to a built model from outside.

Weights are quantised once per output channel (symmetric), activations per token at run time,
and the product is computed by `torch._int_mm` (int8 x int8 -> int32, VNNI/AMX-INT8 on x86);
the result is rescaled into the model's dtype. Each model names the layers to quantise: the
feed-forward ones (two thirds of the weights and FLOPs); attention projections, embeddings and
norms stay in the compute dtype, where per-token int8 costs accuracy (see docs/benchmarks.md).
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["Int8Linear", "quantize_int8"]


class Int8Linear(nn.Module):
    """A drop-in for nn.Linear holding int8 weights (K, N) and float32 per-channel scales (N,)."""

    def __init__(self, linear: nn.Linear, out_dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (N, K)
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,)
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).t().contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.out_dtype = out_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, K) -> per-token symmetric int8
        xs = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127.0  # (T, 1)
        xq = (x / xs.to(x.dtype)).round_().clamp_(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.qweight)  # (T, N) int32
        y = acc.float().mul_(xs).mul_(self.scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(self.out_dtype)


def quantize_int8(model: nn.Module, dtype: torch.dtype, pattern: str) -> int:
    """Replace each nn.Linear whose full name matches `pattern` by an Int8Linear; returns how many."""
    wanted = re.compile(pattern)
    targets = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and wanted.search(name)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Int8Linear(getattr(parent, child), dtype))
    return len(targets)
