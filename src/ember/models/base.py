"""The contract every architecture implements, so the composition root builds any of them the same way.

An architecture is an `nn.Module` that runs packed batches (token ids and positions (T,), sequence lengths)
to hidden states (T, hidden). Its class says how it is built from config.json, how checkpoint keys map to its
parameters, whether it is a decoder (pooled on the last token, EOS appended), and which linear layers
`--quantization int8` may replace, and what its head is (ember.models.heads): the pooling it runs, the outputs it
gives. The engine asks the head; it never names a family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Self

import torch
from torch import nn

from ember.config import PoolerConfig
from ember.models.heads import Head, HeadContext, PooledHead
from ember.models.st_modules import STModules, resolve_pooling
from ember.tokenizer import Tokenizer
from ember.types import PoolingSpec, Task

__all__ = ["Architecture"]


class Architecture(nn.Module, ABC):
    """Token ids in, final hidden states out, for sequences laid end to end."""

    task: ClassVar[Task] = "embed"
    """score for models with a classification head (classify), else embed."""
    is_decoder: ClassVar[bool] = False
    """Causal attention and LAST pooling by default (an EOS token ends each input)."""
    int8_layers: ClassVar[str]
    """A regex over module names: the linear layers --quantization int8 stores at one byte."""
    swiglu_layers: ClassVar[str | None] = None
    """A regex over module names: the SwiGLU gate/up layers (gate and up side by side, silu(gate) * up taken of
    them), whose products compute SwiGLU in their epilogue where the kernel can (int8, and bf16 on ember's bf16
    product)."""

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        """The model for a config.json (with any --hf-overrides merged in), weightless until loaded."""

    @staticmethod
    @abstractmethod
    def checkpoint_key(name: str) -> str | None:
        """This model's parameter name for a checkpoint key; None for keys an embedding model does not use."""

    @property
    @abstractmethod
    def hidden_size(self) -> int:
        """Width of the hidden states."""

    @property
    @abstractmethod
    def max_positions(self) -> int:
        """The longest input the position embeddings (or rotary range) cover."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqlens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (from 0 per sequence), token_types (a pair's segments, where the model has them;
        None: all 0): (T,); returns (T, hidden)."""

    @property
    def selects_rows(self) -> bool:
        """Whether forward() takes `rows=` ((R,) packed token indices) and returns only those rows' final states,
        (R, hidden), sparing what the other rows' last layer would cost. Decoders pooled on the last token need one
        row per sequence."""
        return False

    @property
    def shares_prefixes(self) -> bool:
        """Whether forward() takes `shared=` (ember.ops.prefix.PrefixLayout): sequences of a batch continuing a
        prefix held once in it. Only causal models can: their prefix tokens' states do not depend on what follows."""
        return False

    @classmethod
    def head_pooling(cls, st: STModules, pooler: PoolerConfig) -> PoolingSpec:
        """The pooling its head runs: --pooler-config's, else the sentence-transformers files', else the family's
        default (LAST for decoders, CLS for encoders)."""
        return resolve_pooling(st, pooler, is_decoder=cls.is_decoder)

    @classmethod
    def head_memory(cls, cfg: dict[str, Any]) -> tuple[int, int]:
        """For the memory plan, before loading: (width of an answer the server holds, 0 for a score; bytes the head
        needs beside the model's activations)."""
        return int(cfg["hidden_size"]), 0

    @classmethod
    def with_tokenizer(cls, cfg: dict[str, Any], tokenizer: Tokenizer) -> dict[str, Any]:
        """config.json plus what the model needs from its tokenizer before its weights are read (token ids whose
        rows a head takes, say)."""
        return cfg

    def head(self, ctx: HeadContext) -> Head:
        """The head this model runs its hidden states through: pooling, then the sentence-transformers Dense
        modules if any."""
        return PooledHead.build(ctx, self.hidden_size)

    @staticmethod
    def standard_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """config.json with transformers' standard size names (hidden_size, num_attention_heads,
        num_hidden_layers, intermediate_size) added where the checkpoint spells them its own way, for sizing."""
        return cfg

    @staticmethod
    def checkpoint_rows(cfg: dict[str, Any]) -> dict[str, list[int]]:
        """Checkpoint tensors of which only some rows are needed, read row by row (e.g. two rows of a
        (vocabulary, hidden) LM head): name -> rows."""
        return {}
