"""BERT and XLM-RoBERTa encoders (MiniLM, BGE, E5, GTE, bge-m3, multilingual-e5).

Runs packed: x is (T, hidden) for all sequences of a batch laid end to end, with
bidirectional attention inside each sequence. Parameter names are the checkpoint's, except that
query, key and value are one layer (a load hook concatenates the checkpoint's three).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.models.checkpoint import concat_hook
from ember.models.heads import Head, HeadContext
from ember.models.m3 import M3Head
from ember.ops.attention import varlen_attention
from ember.ops.linear import ACTIVATIONS, linear_act
from ember.ops.norms import layer_norm
from ember.ops.tokenwise import by_token_slices

__all__ = ["BertArgs", "BertModel"]


@dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int
    """XLM-R numbers positions from padding_idx + 1; BERT from 0."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BertArgs:
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"position_embedding_type {cfg['position_embedding_type']!r} is not supported (only absolute)"
            )
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        is_xlmr = cfg.get("model_type") in ("xlm-roberta", "roberta")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=act,
            position_offset=cfg.get("pad_token_id", 1) + 1 if is_xlmr else 0,
        )


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = LayerNorm(a.hidden_size, a.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.token_type_embeddings(token_types) + self.position_embeddings(positions)
        return self.LayerNorm(x)  # (T, H)


class SelfAttention(nn.Module):
    """query, key and value as one (3 x hidden, hidden) layer: one GEMM instead of three (a load hook
    concatenates the checkpoint's three)."""

    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.num_attention_heads, a.hidden_size // a.num_attention_heads
        self.qkv = nn.Linear(a.hidden_size, 3 * a.hidden_size)
        self._register_load_state_dict_pre_hook(concat_hook("qkv", ("query", "key", "value")))

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3 * self.n_heads, self.head_dim).split(self.n_heads, dim=1)  # (T, H, D) each
        return varlen_attention(q, k, v, seqlens, causal=False).reshape(T, -1)  # (T, hidden)


class DenseNorm(nn.Module):
    """BERT's `*.output`: projection, residual, LayerNorm."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = LayerNorm(d_out, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # eager on purpose: LayerNorm and GELU are single ATen kernels already, and at MiniLM's sizes a
        # compiled wrapper's per-call cost made it slower (benchmarks/NOTES.md)
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.self = SelfAttention(a)
        self.output = DenseNorm(a.hidden_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        return self.output(self.self(x, seqlens), x)


class Intermediate(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = a.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_act(self.dense, x, self.act)  # one kernel once the layer is packed


class Layer(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.intermediate = Intermediate(a)
        self.output = DenseNorm(a.intermediate_size, a.hidden_size, a.layer_norm_eps)

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = self.attention(x, seqlens)
        return by_token_slices(self._feed_forward, x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(a) for _ in range(a.num_hidden_layers))


class BertModel(Architecture):
    """A BERT or XLM-R encoder without its pooler: token ids in, final hidden states out."""

    int8_layers = r"(intermediate\.dense|layer\.\d+\.output\.dense)$"  # feed-forward, for --quantization int8

    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        self.encoder = Encoder(a)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BertModel:
        return cls(BertArgs.from_config(cfg))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings - self.args.position_offset

    def head(self, ctx: HeadContext) -> Head:
        """Pooling and Dense, with bge-m3's sparse and ColBERT heads where it has them (ember.models.m3)."""
        return M3Head.build_m3(ctx, self.hidden_size) if M3Head.wanted(ctx) else super().head(ctx)

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        """Our name for a checkpoint key; None for keys an embedding model does not use."""
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith(("pooler.", "cls.", "lm_head.", "classifier.")) or name.endswith("position_ids"):
            return None
        # Old BERT checkpoints name LayerNorm parameters gamma/beta.
        return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqlens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (from 0 per sequence), token_types (segments of a pair; None: all 0): (T,);
        returns (T, hidden)."""
        if token_types is None or self.args.type_vocab_size < 2:  # XLM-R and RoBERTa have one segment
            token_types = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions + self.args.position_offset, token_types)
        for layer in self.encoder.layer:
            x = layer(x, seqlens)
        return x
