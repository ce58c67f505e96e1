"""Qwen3 (Qwen3-Embedding-0.6B/4B/8B): GQA, q/k RMSNorm, RoPE, SwiGLU, causal attention.

Runs packed: x is (T, hidden) for all sequences of a batch laid end to end.
Parameter names are the checkpoint's, except that q/k/v and gate/up are each one matrix (one GEMM,
one activation quantisation with int8); load hooks concatenate the checkpoint's separate matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ember.models.base import Architecture
from ember.models.checkpoint import concat_hook
from ember.ops.attention import packed_attention, seq_offsets, varlen_attention
from ember.ops.fused import Fused, qk_norm_rope, rms_norm, swiglu
from ember.ops.quant import Int8Linear
from ember.ops.rope import rope_cos_sin
from ember.ops.tokenwise import TOKEN_SLICE, by_token_slices

__all__ = ["Qwen3Args", "Qwen3Model"]


@dataclass(frozen=True)
class Qwen3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Qwen3Args:
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, (self.n_heads + 2 * self.n_kv) * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self._register_load_state_dict_pre_hook(concat_hook("qkv_proj", ("q_proj", "k_proj", "v_proj")))

    def norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per token: q/k norms and rotary on the (T, (Hq + 2 Hkv) * D) projection; (T, Hq + 2 Hkv, D)."""
        qkv = qkv.view(qkv.shape[0], self.n_heads + 2 * self.n_kv, self.head_dim)
        return qk_norm_rope(qkv, self.n_kv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)

    def attend(self, qkv: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        """Causal attention within each sequence: (T, Hq + 2 Hkv, D) -> (T, Hq * D)."""
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=1)
        return varlen_attention(q, k, v, seqlens, causal=True).flatten(1)


class MLP(nn.Module):
    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self._register_load_state_dict_pre_hook(concat_hook("gate_up_proj", ("gate_proj", "up_proj")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj, x))


def _holds_int8(block: Block) -> bool:
    return isinstance(block.mlp.down_proj, Int8Linear)


class Block(nn.Module):
    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int], cu: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] <= TOKEN_SLICE and _holds_int8(self):  # one region (bf16 has none: see below)
            return self._layer(x, cos, sin, cu)
        # Everything but attention is per token: run it in slices, so a long window never holds
        # more than a slice of intermediates at once (and GEMMs stay in cache).
        qkv = by_token_slices(self._project, x, cos, sin)  # (T, Hq + 2 Hkv, D)
        y = self.self_attn.attend(qkv, seqlens)  # (T, Hq * D)
        del qkv
        return by_token_slices(self._out_mlp, x, y)

    # With int8 weights each layer (up to a slice of tokens; longer batches: each per-token stretch between
    # attentions) is compiled as one region, so the residual adds and norms fuse around the int8 GEMMs, and
    # a forward enters one compiled region per layer rather than two with Python between them (attention
    # is the op packed_attention inside it): one query of 21 tokens 0.95x the time, 8 of them 0.99x, 2,048
    # tokens unchanged (two models in one process, alternating). In bf16 an A/B against the per-function
    # fused kernels was inconclusive, so bf16 keeps those.
    @Fused.region(when=_holds_int8)
    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        qkv = self._project(x, cos, sin)
        y = packed_attention(qkv, cu, self.self_attn.n_kv, True).flatten(1)  # (T, Hq * D)
        return self._out_mlp(x, y)

    @Fused.region(when=_holds_int8)
    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        return self.self_attn.norm_rope(qkv, cos, sin)

    @Fused.region(when=_holds_int8)
    def _out_mlp(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(y)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(Architecture):
    """The Qwen3 decoder without its LM head: token ids in, final hidden states out."""

    is_decoder = True
    int8_layers = r"\.(mlp|self_attn)\.\w+_proj$"  # every linear layer, for --quantization int8
    int8_glu_layers = r"\.mlp\.gate_up_proj$"  # of which SwiGLU's gate and up (Int8Linear's glu)

    def __init__(self, a: Qwen3Args) -> None:
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Qwen3Model:
        return cls(Qwen3Args.from_config(cfg))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        """Our name for a checkpoint key; None for keys an embedding model does not use."""
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
        """input_ids, positions: (T,); returns hidden states (T, hidden). (No token types in Qwen3.)"""
        x = self.embed_tokens(input_ids)  # (T, H)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, x.dtype)
        cu = seq_offsets(seqlens)
        for layer in self.layers:
            x = layer(x, cos, sin, seqlens, cu)
        return self.norm(x)
