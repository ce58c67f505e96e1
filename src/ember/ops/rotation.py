"""Randomised Hadamard rotations, which make activations easy to quantise to int8.

A transformer's activations carry a few channels far larger than the rest; with one int8 scale per token, set by
its largest value, the ordinary channels keep only a few int8 steps, and that rounding is what moves an int8
model's vectors (benchmarks/NOTES.md, "int8 retrieval quality on real weights"). Multiplying the inputs of a
linear layer by an orthogonal matrix R, and its weights by the same R, leaves the product unchanged
((x R)(W R)^T = x W^T) while R spreads each large channel evenly over the channels it mixes: the rotated token's
largest value sits close to its typical one, and int8 keeps far more of it (QuaRot, Ashkboos et al. 2024).

R here is block-diagonal: the same block of up to `BLOCK` channels (a Hadamard matrix with a fixed pattern of signs on
its rows, orthonormal) repeated along the inputs, so rotating costs one small matrix product per token, needs no
calibration data, and is the same for every model. The weights are rotated once, when they are quantised. bf16 rows
go through the native elementwise library's fast Walsh-Hadamard transform once it is loaded (`rotate_rows`): the
same product with its sums in another order, ~0.1 of the matrix product's time on a query's rows.
"""

from __future__ import annotations

import functools

import torch

from ember.ops.native import elementwise_kernel

__all__ = ["BLOCK", "block_size", "hadamard", "native_rotation", "rotate", "rotate_rows"]

BLOCK = 64
"""The largest block rotated as one; an input width takes the largest power of two up to this that divides it.
Rotating costs BLOCK multiply-adds per input, and on real MiniLM weights blocks of 32 to 512 kept the same recall
(benchmarks/NOTES.md has both measured)."""


def block_size(k: int, largest: int = BLOCK) -> int:
    """The rotation block for `k` inputs: the largest power of two <= `largest` dividing k (1: none)."""
    b = largest
    while b > 1 and k % b:
        b //= 2
    return b


@functools.lru_cache(maxsize=8)
def hadamard(b: int) -> torch.Tensor:
    """An orthonormal (b, b) float32 Hadamard matrix (b a power of two) with rows' signs flipped at random
    (a fixed seed: the same matrix in every process)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (b,), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    return (signs[:, None] * h / b**0.5).float()


@torch.library.custom_op("ember::rotate", mutates_args=())
def rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(T, K) rows times the block-diagonal rotation made of `h` (b, b), b dividing K: (T, K), bfloat16 for
    bfloat16 rows (one rounding, far below an int8 step), else float32.

    An op of its own so compiled regions call one matrix product for it (inductor, left to itself, wrote the
    small product with a constant matrix as loops, slowing the whole int8 forward: benchmarks/NOTES.md)."""
    t, k = x.shape
    rows = x if x.dtype == torch.bfloat16 else x.float()
    return (rows.reshape(-1, h.shape[0]) @ h.to(rows.dtype)).reshape(t, k)


@rotate.register_fake
def _(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=x.dtype if x.dtype == torch.bfloat16 else torch.float32)


torch.library.define("ember::hadamard_rotate", "(Tensor x, Tensor h) -> Tensor")


@torch.library.register_fake("ember::hadamard_rotate")
def _(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def native_rotation(b: int) -> bool:
    """Whether bf16 rows rotated in blocks of `b` take the native transform (csrc/elementwise.cpp), now."""
    return b in (16, 32, 64) and elementwise_kernel() is not None


def rotate_rows(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """`rotate`, on the native transform for bf16 rows where it runs: the signs, the Walsh-Hadamard butterflies in
    float32 and one rounding to bf16, called from compiled regions without Python (the matrix product's op costs a
    Python call and a oneDNN product of T * K / b rows: 3.6 ms of a 20 ms int8 query on Zen 5)."""
    if x.dtype == torch.bfloat16 and x.dim() == 2 and native_rotation(h.shape[0]):
        return torch.ops.ember.hadamard_rotate(x, h)
    return rotate(x, h)
