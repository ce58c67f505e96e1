"""Gemma 3 as a bidirectional text encoder (google/embeddinggemma-300m): GQA with q/k RMSNorm, RoPE, GeGLU
(tanh GELU), sandwich norms around attention and MLP, and sliding-window layers between global ones.

EmbeddingGemma's config says `use_bidirectional_attention: true`: every token sees the whole input in the global
(`full_attention`) layers, and the tokens within `sliding_window / 2` positions on either side in the
`sliding_attention` layers, as transformers computes it. Local layers use `rope_local_base_freq` (10,000), global
ones `rope_theta`. RMSNorm scales by (1 + weight); the embeddings by sqrt(hidden) rounded to the model's dtype.
Runs packed: x is (T, hidden) for all sequences of a batch laid end to end; parameter names are the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.ops.fused import rms_norm
from ember.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ember.ops.tokenwise import by_token_slices
from ember.ops.window import local_attention

__all__ = ["Gemma3Args", "Gemma3Model"]


@dataclass(frozen=True)
class Gemma3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    window: int
    """A sliding layer's token sees this many positions on either side (config.json's sliding_window // 2)."""
    local: tuple[bool, ...]
    """Per layer: a sliding (local) layer, else global."""
    query_scale: float
    global_inv_freq: tuple[float, ...]
    local_inv_freq: tuple[float, ...]
    attention_bias: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Gemma3Args:
        if not cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "Gemma 3 is served as a bidirectional encoder (EmbeddingGemma: use_bidirectional_attention true); "
                "this config is the causal language model"
            )
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError("Gemma 3 with attn_logit_softcapping is not supported")
        n = cfg["num_hidden_layers"]
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
        head_dim = cfg.get("head_dim") or 256
        rope = cfg.get("rope_parameters") or {}
        global_rope = {
            "rope_theta": cfg.get("rope_theta") or 1e6,
            **(cfg.get("rope_scaling") or {}),
            **rope.get("full_attention", {}),
        }
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq") or 1e4, **rope.get("sliding_attention", {})}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=n,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            window=int(cfg.get("sliding_window") or 512) // 2,
            local=tuple(t == "sliding_attention" for t in types),
            query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            global_inv_freq=tuple(rope_inv_freq(head_dim, global_rope).tolist()),
            local_inv_freq=tuple(rope_inv_freq(head_dim, local_rope).tolist()),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight.float(), self.eps)


class Attention(nn.Module):
    def __init__(self, a: Gemma3Args, local: bool) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.window = a.window if local else None
        # SDPA scales by 1/sqrt(head_dim); Gemma by query_pre_attn_scalar^-1/2: q carries the difference
        self.q_factor = a.query_scale * a.head_dim**0.5
        self.q_proj = nn.Linear(a.hidden_size, a.num_attention_heads * a.head_dim, bias=a.attention_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.attention_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_key_value_heads * a.head_dim, bias=a.attention_bias)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.n_heads, self.head_dim))  # (T, Hq, D)
        k = self.k_norm(self.k_proj(x).view(T, self.n_kv, self.head_dim))  # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        return self.o_proj(local_attention(q, k, v, seqlens, self.window).reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, a: Gemma3Args) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: Gemma3Args, local: bool) -> None:
        super().__init__()
        self.local = local
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a, local)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, seqlens))
        return by_token_slices(self._feed_forward, x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(Architecture):
    """The Gemma 3 text encoder: token ids in, final hidden states out (EmbeddingGemma's sentence-transformers
    modules pool, project and normalise them)."""

    int8_layers = r"\.(mlp|self_attn)\.\w+_proj$"

    def __init__(self, a: Gemma3Args) -> None:
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a, local) for local in a.local)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(Gemma3Args.from_config(cfg))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        """Our name for a checkpoint key (Gemma3TextModel's bare keys, or a *ForCausalLM's `model.`); None for the
        LM head."""
        if name.startswith("lm_head."):
            return None
        return name.removeprefix("model.")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqlens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,); returns hidden states (T, hidden)."""
        x = self.embed_tokens(input_ids)  # (T, H)
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as Gemma does
        rope = {
            local: rope_cos_sin(positions, torch.tensor(freq), x.dtype)
            for local, freq in ((False, self.args.global_inv_freq), (True, self.args.local_inv_freq))
        }
        for layer, local in zip(self.layers, self.args.local, strict=True):
            x = layer(x, *rope[local], seqlens)
        return self.norm(x)
