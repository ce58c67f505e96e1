"""SPLADE sparse encoders (naver/splade-v3, splade-cocondenser, opensearch neural-sparse): a BERT encoder, its MLM
head, and per input the max (or sum) over tokens of log(1 + relu(logits)): one weight per vocabulary entry, most
of them zero.

Found from sentence-transformers' SparseEncoder files (MLMTransformer + SpladePooling) or from vLLM's
`--hf-overrides '{"architectures": ["BertSpladeSparseEmbeddingModel"]}'`. As sentence-transformers computes it,
every token counts, special tokens included. The head runs a slice of tokens at a time, so a long input never
holds its full (tokens x vocabulary) logits.
"""

from __future__ import annotations

from typing import Any, Literal, Self

import torch
from torch import nn

from ember.config import PoolerConfig
from ember.models.bert import BertArgs, BertModel, LayerNorm
from ember.models.heads import Head, HeadContext
from ember.models.st_modules import STModules
from ember.ops.linear import ACTIVATIONS
from ember.types import HeadSpec, PoolingSpec

__all__ = ["SPLADE_SLICE", "SpladeHead", "SpladeModel"]

SPLADE_SLICE = 256
"""Tokens whose vocabulary logits the head holds at once: 256 x 30,522 float32 = 31 MB."""


class _Transform(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)
        self.LayerNorm = LayerNorm(a.hidden_size, a.layer_norm_eps)


class _Predictions(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.transform = _Transform(a)
        self.decoder = nn.Linear(a.hidden_size, a.vocab_size)


class _Head(nn.Module):
    def __init__(self, a: BertArgs) -> None:
        super().__init__()
        self.predictions = _Predictions(a)


class SpladeModel(BertModel):
    """BERT with its MLM head (`cls.predictions`, decoder tied to the word embeddings unless stored): hidden states
    in, a (vocabulary,) weight vector per input out, through `sparse`."""

    def __init__(self, a: BertArgs) -> None:
        super().__init__(a)
        self.cls = _Head(a)
        self._register_load_state_dict_pre_hook(self._tied_decoder)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Self:
        return cls(BertArgs.from_config(cfg))

    @classmethod
    def head_pooling(cls, st: STModules, pooler: PoolerConfig) -> PoolingSpec:
        return PoolingSpec("SPLADE", False, "modules.json" if st.splade_strategy else "architecture")

    @classmethod
    def head_memory(cls, cfg: dict[str, Any]) -> tuple[int, int]:
        vocabulary = int(cfg["vocab_size"])
        return vocabulary, 3 * 4 * SPLADE_SLICE * vocabulary  # a slice's vocabulary logits, float32

    def head(self, ctx: HeadContext) -> Head:
        strategy = ctx.st.splade_strategy or ctx.config.get("splade_pooling_strategy") or "max"
        return SpladeHead(self, "sum" if strategy == "sum" else "max")

    @staticmethod
    def checkpoint_key(name: str) -> str | None:
        if name.startswith("cls.predictions."):
            # older checkpoints keep the decoder's bias beside it as cls.predictions.bias
            return "cls.predictions.decoder.bias" if name == "cls.predictions.bias" else name
        return BertModel.checkpoint_key(name)

    def _tied_decoder(self, state: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        key = f"{prefix}cls.predictions.decoder.weight"
        if key not in state:  # tied: the decoder is the word-embedding matrix
            state[key] = state[f"{prefix}embeddings.word_embeddings.weight"]

    def sparse(self, hidden: torch.Tensor, seqlens: list[int], strategy: str = "max") -> torch.Tensor:
        """Packed hidden states (T, H) -> (B, vocabulary) float32: per input, the max (or sum) over its tokens of
        log(1 + relu(MLM logits))."""
        head = self.cls.predictions
        act = ACTIVATIONS[self.args.hidden_act]
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))  # (T,)
        out = torch.zeros(len(seqlens), self.args.vocab_size, dtype=torch.float32)
        for start in range(0, hidden.shape[0], SPLADE_SLICE):
            h = hidden[start : start + SPLADE_SLICE]
            logits = head.decoder(head.transform.LayerNorm(act(head.transform.dense(h))))  # (slice, V)
            weights = torch.log1p(torch.relu(logits.float()))
            rows = seq_of_token[start : start + SPLADE_SLICE]
            if strategy == "sum":
                out.index_add_(0, rows, weights)
            else:  # weights are >= 0 and out starts at 0, so the running max over slices is the max
                for b in range(int(rows[0]), int(rows[-1]) + 1):
                    mine = weights[rows == b]
                    if len(mine):
                        torch.maximum(out[b], mine.amax(0), out=out[b])
        return out


class SpladeHead(Head):
    """A weight per vocabulary entry per input. Its token_classify (vLLM serves SPLADE's sparse weights under that
    task) is this same vector (ember.engine.lexical), never a weight per token."""

    def __init__(self, model: SpladeModel, strategy: Literal["max", "sum"]) -> None:
        super().__init__("SPLADE", model.args.vocab_size)
        self.model, self.strategy = model, strategy
        self.spec = HeadSpec(outputs=("embed", "token_classify"), vocabulary=True, merge=strategy)

    def __call__(self, hidden: torch.Tensor, seqlens: list[int], owners: list[int] | None = None) -> torch.Tensor:
        return self.model.sparse(hidden, seqlens, self.strategy)  # (B, vocabulary) float32
