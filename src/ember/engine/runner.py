"""The torch side: runs one packed batch through the model and its head.

This is the only engine module that imports torch; the async engine gets a runner
injected, so everything above it can be tested with a fake runner.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ember.config import NativeConfig
from ember.models.base import Architecture
from ember.models.heads import Head
from ember.ops.fused import compiled, compiling
from ember.ops.linear import per_row_kernels, release_bf16, release_pairs, release_strips
from ember.ops.native import build_kernels, linear_bf16_kernel, linear_f32_kernel, linear_kernel
from ember.ops.pages import huge_pages
from ember.ops.prefix import prefix_layout, share_prefixes
from ember.ops.quant import use_native_int8
from ember.ops.tokenwise import TOKEN_SLICE
from ember.types import POOLED, KernelStatus, ModelInfo, Output

__all__ = ["TorchRunner", "padded_tokens"]


class TorchRunner:
    """Runs packed batches: (B sequences of token ids) -> each input's answer from the model's head."""

    def __init__(self, model: Architecture, head: Head, info: ModelInfo, native: NativeConfig | None = None) -> None:
        self.model = model
        self.head = head
        self.info = info
        self.native = native or NativeConfig()
        self.compiled = False
        """True once compile() has built the fused kernels: run() then uses them."""
        self.share_prefixes = model.shares_prefixes and info.pooling.method == "LAST"
        """Whether sequences of a batch that start alike compute their common prefix once (ember.ops.prefix):
        causal models pooled on the last token."""
        self.last_rows = model.selects_rows and head.reads_last
        """Whether a batch wanting only pooled answers computes just each sequence's last row through the final
        layer's output projection and MLP (Architecture.selects_rows)."""
        self.pads = True
        """Whether a batch runs at padded_tokens' rounded token count: unless every linear layer runs any row count
        without a kernel built for it (ember.ops.linear.per_row_kernels; decided once the kernels load)."""

    @torch.inference_mode()
    def run(
        self, batch: list[list[int]], token_types: list[list[int]] | None = None, outputs: list[Output] | None = None
    ) -> np.ndarray | list[np.ndarray]:
        if outputs is not None and all(o in POOLED for o in outputs):
            outputs = None  # every row wants its pooled vector
        plan = None
        if self.share_prefixes and outputs is None:
            plan = share_prefixes(batch)  # sequences continuing a prefix held once in the batch, or None
        seqs = batch if plan is None else plan.segments
        seqlens = [len(ids) for ids in seqs]
        total = sum(seqlens)
        filler = (padded_tokens(total) if self.pads else total) - total  # one more sequence, of token 0, unread
        input_ids = torch.from_numpy(_flat(seqs, total + filler))  # (T,)
        types = torch.from_numpy(_flat(token_types, total + filler)) if token_types and plan is None else None
        lens = [*seqlens, filler] if filler else seqlens
        positions = _positions(lens)  # (T,)
        extra: dict[str, Any] = {}  # forward()'s optional arguments
        if plan is not None:  # a continuation's positions start after its prefix
            starts = torch.tensor([*plan.starts, 0][: len(lens)])
            positions += torch.repeat_interleave(starts, torch.tensor(lens))
            extra["shared"] = prefix_layout(lens, [*plan.parents, -1][: len(lens)])
        owners = None if plan is None else plan.owners
        if outputs is None and self.last_rows:  # the head reads each input's last state: compute those alone
            ends = torch.tensor(seqlens).cumsum(0) - 1
            extra["rows"] = ends if owners is None else ends[owners]  # (B,), in the batch's order
        with compiled(self.compiled):
            hidden = self.model(input_ids, positions, lens, types, **extra)[:total]  # (T, H); (B, H) with rows
        if "rows" in extra:
            answers = self.head(hidden, [1] * len(batch)).numpy()  # (B, dimension)
        else:
            answers = self.head(hidden, seqlens, owners).numpy()
        if outputs is None:
            return answers
        return [
            row if output in POOLED else self.head.tokens(states, output).numpy()
            for row, states, output in zip(answers, hidden.split(seqlens), outputs, strict=True)
        ]

    def load_kernels(self) -> list[KernelStatus]:
        """Builds or loads ember's native kernels (those `native` allows, where they can run) and moves int8
        layers onto its int8 kernel; every thread uses them from then on. Layers holding bf16 weights for a
        bf16-weight kernel that did not load go back to float32, and layers laid out for the float32 kernel to
        oneDNN's. Then the weight matrices, laid out for good, move onto huge pages (ember.ops.pages)."""
        try:
            report = build_kernels(self.native)
            use_native_int8(self.model, self.native.enabled("int8_gemm"), self.native.enabled("linear_f32"))
        finally:
            if linear_kernel() is None:
                release_bf16(self.model)
            if linear_f32_kernel() is None:
                release_strips(self.model)
            if linear_bf16_kernel() is None:
                release_pairs(self.model)
            self.pads = per_row_kernels(self.model)
        return [*report, huge_pages(self.model)]

    def compile(self) -> None:
        """Compiles the model's fused regions with small forwards on this thread; then every thread uses them."""
        with compiling():
            self.run([[1, 2, 3, 4, 5, 6, 7, 8], [3, 2, 1, 4, 5]])
            # then one of 600 tokens: torch.compile's graphs of a region hold up to 512 tokens (a guard it sets on
            # the token count), and a batch above would otherwise compile another while serving
            self.run(self._ones(600))
            # and a batch of just over a token slice: models may take another path there (Qwen3's layers run
            # in slices around attention instead of as one region), whose regions would otherwise stay eager
            self.run(self._ones(TOKEN_SLICE + 1))
        self.compiled = True

    def _ones(self, tokens: int) -> list[list[int]]:
        """Sequences of token 1, none longer than the model takes, `tokens` in all."""
        lengths: list[int] = []
        while sum(lengths) < tokens:
            lengths.append(min(self.info.max_model_len, tokens - sum(lengths)))
        return [[1] * n for n in lengths]


def padded_tokens(n: int) -> int:
    """The token count a batch of n tokens runs at: n itself below 16, then rounded up to a step of n / 8 to n / 16
    (2 from 16 tokens, 4 from 32, 8 from 64 ... 64 from 512), so no batch runs more than 1/8 of padding.

    oneDNN builds a matmul kernel for every row count it meets (config.ONEDNN_KERNEL_CACHE), so batches of ever-new
    sizes paid for new kernels in most forwards, far slower than a repeated batch. Rounded, ~80 sizes cover every batch
    up to the token slice (config.ONEDNN_KERNEL_CACHE keeps them all). A model none of whose layers runs on oneDNN
    runs each batch at its own count (TorchRunner.pads): a padded row costs it as much as a token.
    A short query runs at its own length: rounded to a multiple of 16, an 18-token query would run 32 rows, most of
    them padding, at nearly twice the GEMM work."""
    if n < 16:
        return n
    step = min(64, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


def _flat(seqs: list[list[int]], length: int) -> np.ndarray:
    """The sequences end to end, zero-filled to `length`: (length,) int64."""
    total = sum(len(s) for s in seqs)
    flat = np.zeros(length, dtype=np.int64)
    flat[:total] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=total)
    return flat


def _positions(seqlens: list[int]) -> torch.Tensor:
    """0..n-1 for each sequence, concatenated: (T,)."""
    lens = torch.tensor(seqlens)
    starts = torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    return torch.arange(int(lens.sum())) - starts
