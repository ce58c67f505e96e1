"""Running per-token layers over a long packed batch in slices of tokens.

A GEMM over 8,192 tokens spills the CPU caches and runs at a third of the speed of one
over 2,048; per-token layers (MLP, projections, norms) give the same result in slices,
which also bounds the size of their intermediate activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TOKEN_SLICE", "by_token_slices"]

TOKEN_SLICE = 2048
"""Tokens per slice: where GEMM throughput peaks on AVX-512/AMX CPUs (measured in benchmarks/)."""


def by_token_slices(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, size: int = TOKEN_SLICE) -> torch.Tensor:
    """fn(*tensors) for a per-token fn of tensors sharing their first (token) axis, `size` tokens at a time."""
    n_tokens = tensors[0].shape[0]
    if n_tokens <= size:
        return fn(*tensors)
    first = fn(*(t[:size] for t in tensors))
    out = first.new_empty((n_tokens, *first.shape[1:]))
    out[:size] = first
    for start in range(size, n_tokens, size):
        out[start : start + size] = fn(*(t[start : start + size] for t in tensors))
    return out
