"""What a model does with its final hidden states: its head, built by the model's class and declaring its outputs.

The runner calls a head on every batch and never asks which family it belongs to: `__call__` gives each input's
answer to task embed (a pooled vector, a score model's logits, a SPLADE model's vocabulary weights), `tokens` an
input's per-token answer (token_embed, token_classify) where `spec.outputs` says the head has one. A model family
with a head of its own subclasses `Head` in its model file (ember.models.m3, ember.models.splade, classifier).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ember.errors import InputError
from ember.models.dense import Dense
from ember.ops.pooling import pool
from ember.types import HeadSpec, Output, PoolingSpec, PoolingType

if TYPE_CHECKING:
    from ember.models.st_modules import STModules

__all__ = ["Head", "HeadContext", "PooledHead"]


@dataclass(frozen=True)
class HeadContext:
    """What a model's class may build its head from: its config.json (with --hf-overrides), its directory (for
    files beside the weights), its sentence-transformers modules and the pooling decided for it."""

    config: dict[str, Any]
    path: Path
    st: STModules
    pooling: PoolingSpec


class Head:
    """Hidden states (T, hidden) of a packed batch in; per input its answer to task embed, (B, dimension) float32."""

    spec: HeadSpec = HeadSpec()
    dimension: int
    """Width of one input's answer to task embed."""

    def __init__(self, method: PoolingType, dimension: int) -> None:
        self.method, self.dimension = method, dimension

    @property
    def reads_last(self) -> bool:
        """Whether its answer to task embed reads only each sequence's last hidden state (LAST pooling), so the
        model may compute its final states for those rows alone (Architecture.selects_rows)."""
        return self.method == "LAST"

    def pool(self, hidden: torch.Tensor, seqlens: list[int], owners: list[int] | None = None) -> torch.Tensor:
        """The pooled states (B, hidden) float32; with `owners`, one row per sequence of a batch whose sequences
        continued prefixes held once in it (row i is owners[i]'s)."""
        pooled = pool(hidden, seqlens, self.method)
        return pooled if owners is None else pooled[owners]

    def __call__(self, hidden: torch.Tensor, seqlens: list[int], owners: list[int] | None = None) -> torch.Tensor:
        return self.pool(hidden, seqlens, owners)

    def tokens(self, states: torch.Tensor, output: Output) -> torch.Tensor:
        """One input's per-token answer from its states (n, hidden): (n, dimension) vectors for token_embed,
        (n,) weights for token_classify."""
        raise InputError(f"this model gives no {output} (its outputs: {', '.join(self.spec.outputs)})", "task")


class PooledHead(Head):
    """An embedding model's: pooled states through its sentence-transformers Dense modules, if any; token_embed is
    every token's state through them."""

    def __init__(self, method: PoolingType, hidden: int, dense: list[Dense] | None = None) -> None:
        self.dense = dense or []
        super().__init__(method, self.dense[-1].linear.out_features if self.dense else hidden)

    @classmethod
    def build(cls, ctx: HeadContext, hidden: int) -> PooledHead:
        return cls(ctx.pooling.method, hidden, [Dense.load(d) for d in ctx.st.dense_dirs])

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        for dense in self.dense:
            x = dense(x)
        return x

    def __call__(self, hidden: torch.Tensor, seqlens: list[int], owners: list[int] | None = None) -> torch.Tensor:
        return self._project(self.pool(hidden, seqlens, owners))

    def tokens(self, states: torch.Tensor, output: Output) -> torch.Tensor:
        if output != "token_embed":
            return super().tokens(states, output)
        return self._project(states.float())
