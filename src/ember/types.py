"""Plain records and protocols shared by every layer (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

__all__ = [
    "POOLED",
    "Activation",
    "HeadSpec",
    "KernelStatus",
    "ModelInfo",
    "Output",
    "PairPrompt",
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
Output = Literal["embed", "classify", "token_embed", "token_classify"]
"""What a request wants of each input (vLLM's pooling task names): embed, its pooled vector; classify, a
classifier's logits (one row per input, as embed, never chunked nor normalised); token_embed, a vector per token;
token_classify, a weight per token (bge-m3's sparse head)."""
POOLED: frozenset[Output] = frozenset({"embed", "classify"})
"""The outputs answered by the head's pooled row (one per input)."""


@dataclass(frozen=True)
class PoolingSpec:
    """How token states become one vector: the method, then whether to normalise."""

    method: PoolingType
    normalize: bool
    source: str = "default"
    """Where the choice came from: a file name, "override" or "default"."""


@dataclass(frozen=True)
class PairPrompt:
    """How a score model that reads a prompt (Qwen3-Reranker) wants a (query, document) pair: `query` (with
    {instruction} and {query}), then `document` (with {document}), then `suffix`. A query that already starts with
    `formatted` is taken as a whole prompt head and its document as it is (vLLM's examples format it themselves)."""

    query: str
    document: str
    suffix: str
    default_instruction: str
    formatted: str

    def head(self, query: str, instruction: str | None = None) -> str:
        """The prompt before the document."""
        return self.query.format(instruction=instruction or self.default_instruction, query=query)


@dataclass(frozen=True)
class HeadSpec:
    """What a model's head gives, declared by the model (ember.models.heads): engine/ and api/ read this, never the
    model's family."""

    task: Task = "embed"
    outputs: tuple[Output, ...] = ("embed", "token_embed")
    """The pooling tasks it answers (vLLM's names); a score model declares ("classify",) and answers /score and
    /rerank."""
    vocabulary: bool = False
    """The pooled vector is a weight per vocabulary entry (SPLADE): served dense on /v1/embeddings, as
    {index, value} pairs on /embed_sparse."""
    merge: Literal["mean", "max", "sum"] = "mean"
    """How the windows of a chunked input merge: token-weighted mean, or a SPLADE model's max or sum."""
    trim_specials: bool = False
    """Per-token outputs leave out the first special token (and token_classify the last too), as vLLM serves
    bge-m3's heads."""
    num_labels: int = 0
    """Outputs of a score model's classifier: (num_labels,) logits per pair."""
    activation: Activation = "identity"
    """What turns a score model's logits into scores (sentence-transformers' and vLLM's choice)."""
    labels: tuple[str, ...] = ()
    """A classifier's label per logit (config.json's id2label, LABEL_i where it has none)."""
    classify_activation: Activation = "softmax"
    """What turns a classifier's logits into /classify's probabilities (config.json's problem_type, as
    transformers' pipeline and vLLM decide)."""
    pair_prompt: PairPrompt | None = None
    """How a pair becomes one input: None, the tokenizer's pair template ([CLS] q [SEP] d [SEP]); else this prompt."""


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
    head: HeadSpec = field(default_factory=lambda: HeadSpec())
    """What the model's head gives, as the model declares it."""

    @property
    def task(self) -> Task:
        return self.head.task


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
    """The backend contract: a batch of token-id sequences in, each one's answer from the model's head out."""

    info: ModelInfo

    def run(
        self, batch: list[list[int]], token_types: list[list[int]] | None = None, outputs: list[Output] | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Returns (B, dimension) float32, each input's answer to task embed from the model's head (ModelInfo.head):
        a pooled vector (before Matryoshka truncation and normalisation), a score model's (num_labels,) logits, or a
        SPLADE model's vocabulary weights. `token_types`: segment ids per token (pairs), else all 0. `outputs`: what
        each row wants when not all want the pooled vector (the result is then a list): token_embed rows get
        (tokens, dimension) token vectors, token_classify rows (tokens,) token weights."""
        ...

    def load_kernels(self) -> list[KernelStatus]:
        """Builds or loads ember's native kernels (as configured) and moves the model onto them; reports each.
        Called once, on its own thread, while run() keeps serving."""
        ...

    def compile(self) -> None:
        """Compiles the fused regions (torch.compile); called once, after load_kernels, on the same thread."""
        ...
