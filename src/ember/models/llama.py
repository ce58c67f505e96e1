"""Llama-family decoders: Llama, Mistral, Qwen2 and Qwen3 (Qwen3-Embedding, gte-Qwen2, e5-mistral, SFR-Embedding).

GQA, RoPE, SwiGLU, RMSNorm; Qwen3 adds per-head q/k RMSNorm, Qwen2 q/k/v biases. Attention is causal unless
config.json (or --hf-overrides) says `"is_causal": false`, as for embedders trained bidirectionally.
Runs packed: x is (T, hidden) for all sequences of a batch laid end to end.
Parameter names are the checkpoint's, except that q/k/v and gate/up are each one matrix (one GEMM,
one activation quantisation with int8); load hooks concatenate the checkpoint's separate matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self, cast

import torch
from torch import nn

from ember.errors import UnsupportedModelError
from ember.models.base import Architecture
from ember.models.checkpoint import concat_hook
from ember.ops.attention import packed_attention, rows_attention, seq_offsets, varlen_attention
from ember.ops.bf16_pairs import PairLinear
from ember.ops.fused import Fused, qk_norm_rope, qk_rope, rms_norm, swiglu
from ember.ops.linear import StripLinear
from ember.ops.prefix import PrefixLayout
from ember.ops.quant import Int8Linear
from ember.ops.rope import rope_cos_sin, rope_inv_freq
from ember.ops.tokenwise import TOKEN_SLICE, by_token_slices

__all__ = ["LlamaArgs", "LlamaModel"]

_QK_NORM = ("qwen3",)
"""model_type of the families with per-head q/k RMSNorm."""
_QKV_BIAS = ("qwen2",)
"""model_type of the families whose q/k/v projections (not o) always have a bias."""


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    inv_freq: tuple[float, ...]
    """RoPE frequencies (head_dim / 2), with the checkpoint's rope scaling applied."""
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    causal: bool = True
    """False for embedders trained with bidirectional attention (config.json `is_causal: false`)."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> LlamaArgs:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        family = _family(cfg)
        bias = bool(cfg.get("attention_bias", False))
        positions = cfg.get("max_position_embeddings", 32768)
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None
        if window and cfg.get("is_causal", True):
            # Mistral's sliding window: a token sees the `window` before it, so up to `window` tokens the model
            # is exact; ember's max length stops there and longer inputs are truncated or chunked by its flags.
            positions = min(positions, int(window))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=positions,
            inv_freq=tuple(rope_inv_freq(head_dim, _rope_parameters(cfg)).tolist()),
            qk_norm=family in _QK_NORM,
            qkv_bias=bias or family in _QKV_BIAS,
            o_bias=bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            causal=bool(cfg.get("is_causal", True)),
        )


def _family(cfg: dict[str, Any]) -> str:
    """config.json's model_type, or the family its architecture names (configs saved without one)."""
    if cfg.get("model_type"):
        return str(cfg["model_type"])
    for name in cfg.get("architectures") or []:
        for family in ("qwen3", "qwen2", "mistral", "llama"):
            if name.lower().startswith(family):
                return family
    return "llama"


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope scaling from config.json, in either layout (transformers 4 `rope_theta` +
    `rope_scaling`, transformers 5 `rope_parameters`)."""
    params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    params["rope_theta"] = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")
    return params


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.causal = a.causal
        self.qkv_proj = nn.Linear(a.hidden_size, (self.n_heads + 2 * self.n_kv) * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_attention_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self._register_load_state_dict_pre_hook(concat_hook("qkv_proj", ("q_proj", "k_proj", "v_proj")))

    def norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per token: q/k norms (Qwen3) and rotary on the (T, (Hq + 2 Hkv) * D) projection; (T, Hq + 2 Hkv, D)."""
        qkv = qkv.view(qkv.shape[0], self.n_heads + 2 * self.n_kv, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            return qk_rope(qkv, self.n_kv, cos, sin)
        return qk_norm_rope(qkv, self.n_kv, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)

    def attend(self, qkv: torch.Tensor, seqlens: list[int], rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention within each sequence: (T, Hq + 2 Hkv, D) -> (T, Hq * D); with `rows` (causal), those rows'
        alone, (len(rows), Hq * D)."""
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=1)
        if rows is not None and self.causal:
            return rows_attention(q, k, v, seqlens, rows).flatten(1)
        y = varlen_attention(q, k, v, seqlens, causal=self.causal).flatten(1)
        return y if rows is None else y.index_select(0, rows)


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self._register_load_state_dict_pre_hook(concat_hook("gate_up_proj", ("gate_proj", "up_proj")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj, x))


def _one_region(module: Block | LlamaModel) -> bool:
    """Whether a layer's stretches, or the model's layers, compile as whole regions, GEMMs included (see
    LlamaModel._stack): with int8 weights, with float32 ones on ember's float32 product, and with bf16 ones on its
    bf16 product."""
    if isinstance(module, LlamaModel):
        return all(_one_region(cast(Block, b)) for b in module.layers)
    return isinstance(module.mlp.down_proj, Int8Linear | StripLinear | PairLinear)


class Block(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seqlens: list[int],
        cu: torch.Tensor,
        shared: PrefixLayout | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With `rows`, only those rows' outputs are wanted (the last layer of a model pooled on each sequence's last
        token): every row's keys and values still feed attention, whose queries (causal) and then the output
        projection and the MLP are `rows` alone, (len(rows), hidden)."""
        # Everything but attention is per token: run it in slices, so a long window never holds
        # more than a slice of intermediates at once (and GEMMs stay in cache).
        qkv = by_token_slices(self._project, x, cos, sin)  # (T, Hq + 2 Hkv, D)
        if shared is None:
            y = self.self_attn.attend(qkv, seqlens, rows)  # (T or len(rows), Hq * D)
        else:  # each continuation attends with its prefix's rows ahead of its own
            y = self.self_attn.attend(qkv.index_select(0, shared.gather), shared.seqlens).index_select(0, shared.keep)
            y = y if rows is None else y.index_select(0, rows)
        del qkv
        if rows is not None:
            x = x.index_select(0, rows)
        return by_token_slices(self._out_mlp, x, y)

    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The whole layer at once (a batch of up to a token slice), inside LlamaModel's one compiled region."""
        qkv = self._project(x, cos, sin)
        y = packed_attention(qkv, cu, self.self_attn.n_kv, self.self_attn.causal).flatten(1)  # (T, Hq * D)
        return self._out_mlp(x, y)

    @Fused.region(when=_one_region)
    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.self_attn.qkv_proj(self.input_layernorm(x))
        return self.self_attn.norm_rope(qkv, cos, sin)

    @Fused.region(when=_one_region)
    def _out_mlp(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(y)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(Architecture):
    """A Llama-family decoder without its LM head: token ids in, final hidden states out."""

    is_decoder = True
    int8_layers = r"\.(mlp|self_attn)\.\w+_proj$"  # every linear layer, for --quantization int8
    swiglu_layers = r"\.mlp\.gate_up_proj$"  # SwiGLU's gate and up, side by side

    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(LlamaArgs.from_config(cfg))

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def shares_prefixes(self) -> bool:
        return self.args.causal

    @property
    def max_positions(self) -> int:
        return self.args.max_position_embeddings

    @property
    def selects_rows(self) -> bool:
        return True

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
        shared: PrefixLayout | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,); returns hidden states (T, hidden), or with `rows` those rows' alone, the last
        layer's output projection and MLP computed for them only. (No token types in these decoders.) With
        `shared`, sequences continue shared prefixes held once in the batch (ember.ops.prefix)."""
        x = self.embed_tokens(input_ids)  # (T, H)
        cos, sin = rope_cos_sin(positions, torch.tensor(self.args.inv_freq), x.dtype)
        cu = seq_offsets(seqlens)
        last, first = len(self.layers) - 1, 0
        if x.shape[0] <= TOKEN_SLICE and shared is None and last > 0 and _one_region(self):
            x, first = self._stack(x, cos, sin, cu), last
        for i in range(first, last + 1):
            x = self.layers[i](x, cos, sin, seqlens, cu, shared, rows if i == last else None)
        return self.norm(x)

    # With int8 weights, and float32 ones on ember's float32 product, a batch of up to a token slice runs every layer
    # but the last as one compiled region, GEMMs included (attention is the op packed_attention inside it): the
    # residual adds and norms fuse around the GEMMs and across layers, and a forward enters one region instead of one
    # per layer, with no Python between layers. Against one region per layer it shortened short queries and small
    # batches by a tenth (benchmarks/NOTES.md). The last layer runs apart, on the rows the head reads; longer batches
    # run per layer, in token slices around attention. bf16 layers on ember's bf16 product (AMD Zen 4/5) do the same:
    # a 20-token query's forward 0.88x the time of the per-function fused kernels. On oneDNN's bf16 layers an A/B of
    # one region per layer against the per-function fused kernels was inconclusive, so those keep the latter.
    @Fused.region(when=_one_region)
    def _stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """Every layer but the last."""
        for layer in cast(list[Block], self.layers[:-1]):
            x = layer._layer(x, cos, sin, cu)
        return x
