"""bge-m3's two extra heads (BAAI/bge-m3, FlagEmbedding's BGE-M3 model), stored beside the checkpoint as
`sparse_linear.pt` (hidden -> 1: relu of it is a lexical weight per token) and `colbert_linear.pt` (hidden ->
hidden: a ColBERT vector per token). Both run in float32 on the encoder's last hidden states.

An XLM-R (BertModel) checkpoint gets them when the files are beside its weights, or when vLLM's architecture name
`BgeM3EmbeddingModel` asks for them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ember.errors import CheckpointError
from ember.models.heads import HeadContext, PooledHead
from ember.types import HeadSpec, Output

__all__ = ["HEAD_FILES", "M3Head", "M3Heads"]

HEAD_FILES = ("sparse_linear.pt", "colbert_linear.pt")


class M3Heads(nn.Module):
    """Hidden states (T, H) in; a weight per token (T,) from `weights`, a vector per token (T, H) from `vectors`."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.sparse_linear = nn.Linear(hidden, 1)
        self.colbert_linear = nn.Linear(hidden, hidden)  # bge-m3's (and vLLM's): as wide as the encoder

    def weights(self, states: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.sparse_linear(states.float())).squeeze(-1)  # (T,)

    def vectors(self, states: torch.Tensor) -> torch.Tensor:
        return self.colbert_linear(states.float())  # (T, H)

    @staticmethod
    def present(path: Path) -> bool:
        return all((path / name).is_file() for name in HEAD_FILES)

    @classmethod
    def load(cls, path: Path, hidden: int) -> M3Heads:
        """The heads in model directory `path`, for an encoder of width `hidden`."""
        sparse, colbert = (_read(path / name) for name in HEAD_FILES)
        heads = cls(hidden)
        try:
            heads.sparse_linear.load_state_dict(sparse)
            heads.colbert_linear.load_state_dict(colbert)
        except RuntimeError as e:  # shapes that do not fit the encoder
            raise CheckpointError(f"bge-m3 heads in {path} do not fit a {hidden}-wide encoder: {e}") from None
        return heads.float().eval().requires_grad_(False)


class M3Head(PooledHead):
    """bge-m3's: the pooled [CLS] vector for embed, its ColBERT vectors for token_embed and its lexical weight per
    token for token_classify (without the first token, token_classify without the last too, as vLLM serves them)."""

    spec = HeadSpec(outputs=("embed", "token_embed", "token_classify"), trim_specials=True)

    def __init__(self, pooled: PooledHead, heads: M3Heads) -> None:
        super().__init__(pooled.method, pooled.dimension, pooled.dense)
        self.heads = heads

    @staticmethod
    def wanted(ctx: HeadContext) -> bool:
        named = "BgeM3EmbeddingModel" in (ctx.config.get("architectures") or [])
        return named or (ctx.pooling.method != "SPLADE" and M3Heads.present(ctx.path))

    @classmethod
    def build_m3(cls, ctx: HeadContext, hidden: int) -> M3Head:
        return cls(PooledHead.build(ctx, hidden), M3Heads.load(ctx.path, hidden))

    def tokens(self, states: torch.Tensor, output: Output) -> torch.Tensor:
        if output == "token_classify":
            return self.heads.weights(states)
        if output == "token_embed":
            return self.heads.vectors(states)
        return super().tokens(states, output)


def _read(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)  # tensors only: never runs pickled code
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: bge-m3's heads need {' and '.join(HEAD_FILES)}") from None
    except Exception as e:  # torch raises a bare pickle/runtime error on a corrupt or non-tensor file
        raise CheckpointError(f"cannot read {file}: {e}") from None
    state = {k.removeprefix("module."): v for k, v in state.items()} if isinstance(state, dict) else {}
    tensors = all(isinstance(v, torch.Tensor) for v in state.values())
    if not tensors or not isinstance(state.get("weight"), torch.Tensor):
        raise CheckpointError(f"{file} holds no linear layer's weight")
    return {k: v.float() for k, v in state.items()}
