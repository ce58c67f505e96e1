"""What an engine call answers: the outputs, exact token counts, and where the time went; and how many vectors
an answer holds, as the memory plan counts them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.engine.scheduler import BatchSpan
from ember.types import POOLED, Output

__all__ = ["EmbedResult", "ScoreResult", "answer_vectors", "ranked"]


@dataclass(frozen=True)
class EmbedResult:
    """Vectors in input order, exact token counts, and where the time went."""

    vectors: list[Any]  # (D,) float32 arrays; (tokens, D) for token_embed; TokenWeights for token_classify
    token_counts: list[int]
    queue_seconds: float
    inference_seconds: float
    tokenize_seconds: float = 0.0
    batches: tuple[BatchSpan, ...] = ()  # the batches it ran in (none when the cache held every input)


def answer_vectors(output: Output, inputs: int, tokens: int, dimension: int) -> int:
    """The vectors of the model's width a request's answer holds, as the memory plan counts answers: one per input;
    one per token for token_embed; for token_classify a weight per token and a sparse entry (id, weight, text) per
    distinct token, some 8 numbers a token."""
    if output in POOLED:
        return inputs
    if output == "token_embed":
        return tokens
    return inputs + -(-8 * tokens // max(1, dimension))


@dataclass(frozen=True)
class ScoreResult:
    """A score per pair in request order, exact token counts, and where the time went."""

    scores: list[float]
    token_counts: list[int]
    queue_seconds: float
    inference_seconds: float
    tokenize_seconds: float = 0.0
    batches: tuple[BatchSpan, ...] = ()
    logits: tuple[Any, ...] = ()
    """A score model's (num_labels,) logits per pair, before its activation (none for an embedding model's cosine)."""


def ranked(scores: list[float], top_n: int | None = None) -> list[int]:
    """Indices of `scores`, best first (ties keep input order); the first top_n when given."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return order[:top_n] if top_n else order
