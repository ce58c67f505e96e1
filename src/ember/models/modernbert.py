"""ModernBERT (answerdotai/ModernBERT-base and its embedders: gte-modernbert-base, modernbert-embed-base): a
pre-norm bidirectional encoder with RoPE, GeGLU and no token types, alternating global and local attention.

Layer i is global when i % global_attn_every_n_layers == 0 (rope theta `global_rope_theta`), else local: a token
sees the `local_attention / 2` positions on either side (theta `local_rope_theta`), as transformers computes it.
LayerNorms have no bias unless `norm_bias`; the first layer has no attention norm (the embeddings are normed).
Runs packed: x is (T, hidden) for all sequences of a batch laid end to end; parameter names are the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.models.bert import LayerNorm
from ember.ops.linear import ACTIVATIONS
from ember.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ember.ops.tokenwise import by_token_slices
from ember.ops.window import local_attention

__all__ = ["ModernBertArgs", "ModernBertModel"]


@dataclass(frozen=True)
class ModernBertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_activation: str
    window: int
    """A local layer's token sees this many positions on either side (local_attention // 2)."""
    local: tuple[bool, ...]
    global_inv_freq: tuple[float, ...]
    local_inv_freq: tuple[float, ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModernBertArgs:
        n, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
        every = cfg.get("global_attn_every_n_layers") or 3
        types = cfg.get("layer_types") or [
            "full_attention" if i % every == 0 else "sliding_attention" for i in range(n)
        ]
        act = cfg.get("hidden_activation", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_activation {act!r} is not supported; known: {sorted(ACTIVATIONS)}")
        rope = cfg.get("rope_parameters") or {}
        global_theta = cfg.get("global_rope_theta") or 160000.0
        global_rope = {"rope_theta": global_theta, **rope.get("full_attention", {})}
        local_rope = {"rope_theta": cfg.get("local_rope_theta") or global_theta, **rope.get("sliding_attention", {})}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            norm_eps=cfg.get("norm_eps", 1e-5),
            norm_bias=bool(cfg.get("norm_bias", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_activation=act,
            window=int(cfg.get("local_attention") or 128) // 2,
            local=tuple(t == "sliding_attention" for t in types),
            global_inv_freq=tuple(rope_inv_freq(hidden // heads, global_rope).tolist()),
            local_inv_freq=tuple(rope_inv_freq(hidden // heads, local_rope).tolist()),
        )


class Embeddings(nn.Module):
    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.norm = LayerNorm(a.hidden_size, a.norm_eps, a.norm_bias)


class Attention(nn.Module):
    def __init__(self, a: ModernBertArgs, local: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.num_attention_heads, a.hidden_size // a.num_attention_heads
        self.window = a.window if local else None
        self.Wqkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=a.attention_bias)
        self.Wo = nn.Linear(a.hidden_size, a.hidden_size, bias=a.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.Wqkv(x).view(T, 3 * self.n_heads, self.head_dim).split(self.n_heads, dim=1)  # (T, H, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.Wo(local_attention(q, k, v, seqlens, self.window).reshape(T, -1))


class MLP(nn.Module):
    """GeGLU: Wi gives (input, gate) side by side; the activation goes on the input half."""

    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.Wi = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.Wo = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.act = ACTIVATIONS[a.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(inp) * gate)


class Layer(nn.Module):
    def __init__(self, a: ModernBertArgs, index: int) -> None:
        super().__init__()
        self.local = a.local[index]
        self.attn_norm = LayerNorm(a.hidden_size, a.norm_eps, a.norm_bias) if index else nn.Identity()
        self.attn = Attention(a, self.local)
        self.mlp_norm = LayerNorm(a.hidden_size, a.norm_eps, a.norm_bias)
        self.mlp = MLP(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, seqlens)
        return by_token_slices(self._feed_forward, x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(Architecture):
    """The ModernBERT encoder without its MLM head: token ids in, final hidden states out."""

    int8_layers = r"\.(attn\.Wqkv|attn\.Wo|mlp\.Wi|mlp\.Wo)$"

    def __init__(self, a: ModernBertArgs) -> None:
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        self.layers = nn.ModuleList(Layer(a, i) for i in range(a.num_hidden_layers))
        self.final_norm = LayerNorm(a.hidden_size, a.norm_eps, a.norm_bias)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(ModernBertArgs.from_config(cfg))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        """Our name for a checkpoint key (ModernBertModel's bare keys, or a ModernBertForMaskedLM's `model.`); None
        for the MLM head and classifier."""
        if name.startswith(("head.", "decoder.", "classifier.", "drop.")):
            return None
        return name.removeprefix("model.")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqlens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,); returns hidden states (T, hidden). (ModernBERT has no token types.)"""
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))  # (T, H)
        rope = {
            local: rope_cos_sin(positions, torch.tensor(freq), x.dtype)
            for local, freq in ((False, self.args.global_inv_freq), (True, self.args.local_inv_freq))
        }
        for layer, local in zip(self.layers, self.args.local, strict=True):
            x = layer(x, *rope[local], seqlens)
        return self.final_norm(x)
