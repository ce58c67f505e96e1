"""NomicBert (nomic-ai/nomic-embed-text-v1 / v1.5): a post-norm BERT with rotary positions and a SwiGLU MLP.

The checkpoint ships remote code (`NomicBertModel`); ember reads only its config.json keys (n_embd, n_layer, n_head,
n_inner, rotary_emb_base, ...) and runs its own code. No position embeddings: rotary (GPT-NeoX halves) on q and k;
token type 0 embedded and added; `emb_ln` after the embeddings, `norm1` after attention + residual, `norm2` after
the MLP + residual. The MLP is fc2(fc11(x) * silu(fc12(x))). Parameter names are the checkpoint's, except that
fc11 and fc12 are one matrix (a load hook concatenates them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.models.bert import LayerNorm
from ember.models.checkpoint import concat_hook
from ember.ops.attention import varlen_attention
from ember.ops.fused import swiglu
from ember.ops.rope import apply_rope, rope_cos_sin, rope_inv_freq
from ember.ops.tokenwise import by_token_slices

__all__ = ["NomicBertArgs", "NomicBertModel"]


@dataclass(frozen=True)
class NomicBertArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    type_vocab_size: int
    layer_norm_eps: float
    max_positions: int
    qkv_bias: bool
    fc1_bias: bool
    fc2_bias: bool
    inv_freq: tuple[float, ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> NomicBertArgs:
        problems = [
            f"{key} {cfg.get(key)!r}"
            for key, ok in (
                ("activation_function", cfg.get("activation_function", "swiglu") == "swiglu"),
                ("prenorm", not cfg.get("prenorm", False)),
                ("rotary_emb_fraction", float(cfg.get("rotary_emb_fraction", 1.0)) == 1.0),
                ("rotary_emb_interleaved", not cfg.get("rotary_emb_interleaved", False)),
                ("rotary_emb_scale_base", cfg.get("rotary_emb_scale_base") is None),
                ("causal", not cfg.get("causal", False)),
            )
            if not ok
        ]
        if problems:
            raise UnsupportedModelError(f"NomicBert with {', '.join(problems)} is not supported")
        hidden, heads = cfg["n_embd"], cfg["n_head"]
        # Up to the length it was trained at (v1.5: 2,048) the model is exact with its plain rotary base; beyond,
        # nomic's code rescales the base by the input's length (dynamic NTK). ember stops at the trained length:
        # longer inputs are truncated or chunked by its flags.
        positions = cfg.get("max_trained_positions") or cfg.get("n_positions", 2048)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("n_inner") or 4 * hidden,
            num_hidden_layers=cfg["n_layer"],
            num_attention_heads=heads,
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_epsilon", 1e-12),
            max_positions=positions,
            qkv_bias=bool(cfg.get("qkv_proj_bias", True)),
            fc1_bias=bool(cfg.get("mlp_fc1_bias", True)),
            fc2_bias=bool(cfg.get("mlp_fc2_bias", True)),
            inv_freq=tuple(rope_inv_freq(hidden // heads, {"rope_theta": cfg.get("rotary_emb_base", 1e4)}).tolist()),
        )


class Embeddings(nn.Module):
    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size) if a.type_vocab_size else None


class Attention(nn.Module):
    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.num_attention_heads, a.hidden_size // a.num_attention_heads
        self.Wqkv = nn.Linear(a.hidden_size, 3 * a.hidden_size, bias=a.qkv_bias)
        self.out_proj = nn.Linear(a.hidden_size, a.hidden_size, bias=a.qkv_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.Wqkv(x).view(T, 3 * self.n_heads, self.head_dim).split(self.n_heads, dim=1)  # (T, H, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.out_proj(varlen_attention(q, k, v, seqlens, causal=False).reshape(T, -1))


class MLP(nn.Module):
    """fc2(fc11(x) * silu(fc12(x))), fc12 and fc11 as one (gate, up) matrix."""

    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.fc1_bias)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.fc2_bias)
        self._register_load_state_dict_pre_hook(concat_hook("fc1", ("fc12", "fc11")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(swiglu(self.fc1, x))


class Layer(nn.Module):
    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.attn = Attention(a)
        self.norm1 = LayerNorm(a.hidden_size, a.layer_norm_eps)
        self.mlp = MLP(a)
        self.norm2 = LayerNorm(a.hidden_size, a.layer_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = self.norm1(self.attn(x, cos, sin, seqlens) + x)
        return by_token_slices(self._feed_forward, x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.mlp(x) + x)


class Encoder(nn.Module):
    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.num_hidden_layers))


class NomicBertModel(Architecture):
    """The NomicBert encoder: token ids in, final hidden states out."""

    int8_layers = r"\.(attn\.Wqkv|attn\.out_proj|mlp\.fc1|mlp\.fc2)$"
    swiglu_layers = r"\.mlp\.fc1$"  # (gate, up)

    def __init__(self, a: NomicBertArgs) -> None:
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        self.emb_ln = LayerNorm(a.hidden_size, a.layer_norm_eps)
        self.encoder = Encoder(a)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(NomicBertArgs.from_config(cfg))

    @staticmethod
    def standard_config(cfg: dict[str, Any]) -> dict[str, Any]:
        names = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
        sizes = {k: cfg[v] for k, v in names.items() if v in cfg}
        return {"intermediate_size": cfg.get("n_inner") or 4 * cfg.get("n_embd", 0), **sizes, **cfg}

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def max_positions(self) -> int:
        return self.args.max_positions

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        """Our name for a checkpoint key (NomicBertModel's bare keys, or `bert.` of a pre-training checkpoint);
        None for the pre-training heads."""
        name = name.removeprefix("bert.").removeprefix("model.")
        return None if name.startswith(("cls.", "lm_head.", "pooler.")) else name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqlens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (from 0 per sequence), token_types (None: all 0): (T,); returns (T, hidden)."""
        x = self.embeddings.word_embeddings(input_ids)  # (T, H)
        if self.embeddings.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_types is None else token_types
            x = x + self.embeddings.token_type_embeddings(types)
        x = self.emb_ln(x)
        cos, sin = rope_cos_sin(positions, torch.tensor(self.args.inv_freq), x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, seqlens)
        return x
