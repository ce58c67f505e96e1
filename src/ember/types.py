"""Plain records and protocols shared by every layer (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

__all__ = [
    "Activation",
    "KernelStatus",
    "ModelInfo",
    "Output",
    "PoolingSpec",
    "PoolingType",
    "Runner",
    "Specials",
    "Task",
]

PoolingType = Literal["CLS", "MEAN", "LAST", "SPLADE"]
"""SPLADE: a sparse model's vocabulary weights (max of log(1 + relu(MLM logits)) over the tokens)."""
Task = Literal["embed", "score"]
"""embed: a vector per input (embedding models); score: a relevance score per (query, document) pair
(cross-encoders and rerankers)."""
Activation = Literal["sigmoid", "softmax", "identity"]
Output = Literal["embed", "token_embed", "token_classify"]
"""What a request wants of each input (vLLM's pooling task names): embed, its pooled vector; token_embed, a vector
per token; token_classify, a weight per token (bge-m3's sparse head)."""


@dataclass(frozen=True)
class PoolingSpec:
    """How token states become one vector: the method, then whether to normalise."""

    method: PoolingType
    normalize: bool
    source: str = "default"
    """Where the choice came from: a file name, "override" or "default"."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of ember needs to know about a loaded model."""

    name: str
    architecture: str
    dimension: int
    """Width of the pooled vector (after any sentence-transformers Dense layer)."""
    max_model_len: int
    dtype: str
    pooling: PoolingSpec
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    """Applied when a request names no prompt (sentence-transformers' default_prompt_name)."""
    vocab_size: int = 0
    task: Task = "embed"
    num_labels: int = 0
    """Outputs of a score model's classifier (its pooled output is then (num_labels,) logits)."""
    activation: Activation = "identity"
    """What turns a score model's logits into scores (sentence-transformers' and vLLM's choice)."""
    pair_template: Literal["tokenizer", "qwen3-reranker"] = "tokenizer"
    """How a (query, document) pair becomes one input: the tokenizer's pair template ([CLS] q [SEP] d [SEP]),
    or Qwen3-Reranker's chat prompt."""
    splade_strategy: Literal["max", "sum"] | None = None
    """A sparse (SPLADE) model's merge over tokens; its vector is then a weight per vocabulary entry
    (`dimension` = vocabulary size), served dense on /v1/embeddings and as {index, value} pairs on /embed_sparse."""
    token_heads: bool = False
    """bge-m3's two extra heads are loaded: token_classify gives its sparse head's weight per token, token_embed its
    ColBERT vectors (both without the first token, token_classify without the last too, as vLLM serves them)."""


@dataclass(frozen=True)
class Specials:
    """The special tokens the tokenizer puts around a single input."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def unwrap(self, ids: list[int]) -> tuple[list[int], bool]:
        """The content of `ids` without the specials, and whether they were there."""
        p, s = len(self.prefix), len(self.suffix)
        if (
            (p or s)
            and len(ids) >= p + s
            and tuple(ids[:p]) == self.prefix
            and tuple(ids[len(ids) - s :]) == self.suffix
        ):
            return ids[p : len(ids) - s], True
        return ids, False

    def wrap(self, content: list[int]) -> list[int]:
        return [*self.prefix, *content, *self.suffix]

    def __len__(self) -> int:
        return len(self.prefix) + len(self.suffix)


@dataclass(frozen=True)
class KernelStatus:
    """Whether one kernel (native attention, int8 GEMM, elementwise; torch.compile's fused regions) is in use."""

    name: str
    active: bool
    detail: str
    """Why: where it came from when active, else what stops it and what runs instead."""


class Runner(Protocol):
    """The backend contract: pooled float32 vectors for a batch of token-id sequences."""

    info: ModelInfo

    def embed(
        self, batch: list[list[int]], token_types: list[list[int]] | None = None, outputs: list[Output] | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Returns (B, dimension) float32, pooled but before the head (no truncation/normalisation); for a score
        model (B, num_labels) logits. `token_types`: segment ids per token (pairs), else all 0. `outputs`: what
        each row wants when not all want the pooled vector (the result is then a list): token_embed rows get
        (tokens, dimension) token vectors, token_classify rows (tokens,) token weights."""
        ...

    def load_kernels(self) -> list[KernelStatus]:
        """Builds or loads ember's native kernels (as configured) and moves the model onto them; reports each.
        Called once, on its own thread, while embed() keeps serving."""
        ...

    def compile(self) -> None:
        """Compiles the fused regions (torch.compile); called once, after load_kernels, on the same thread."""
        ...
