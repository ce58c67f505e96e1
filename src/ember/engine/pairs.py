"""Scoring inputs: (query, document) pairs turned into one model input each, and logits into scores (pure).

A cross-encoder reads the pair through its tokenizer's pair template ([CLS] q [SEP] d [SEP], <s> q </s></s> d </s>)
with token types marking the document. A model that declares a prompt of its own (HeadSpec.pair_prompt:
Qwen3-Reranker's chat prompt) reads query and document inside it; a query a client already formatted that way (as
vLLM's examples do) is used as it is. Too long a pair loses tokens from the document's end, never the query's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ember.engine.inputs import check_length, truncation_length
from ember.errors import InputError
from ember.tokenizer import Tokenizer
from ember.types import Activation, ModelInfo, PairPrompt

__all__ = ["Pair", "PairPreprocessor", "ScoreParams", "activate", "cosine_scores", "distinct_texts"]


@dataclass(frozen=True)
class ScoreParams:
    """Per-request options of /rerank and /score (vLLM's and Cohere's field names)."""

    truncate_prompt_tokens: int | None = None
    """Cut each pair to this many tokens from the document's end (-1: max-model-len)."""
    max_tokens_per_doc: int | None = None
    """Cut each document to this many tokens before it is joined to the query."""
    use_activation: bool | None = None
    """False: raw logits; None or True: the model's activation (sigmoid, softmax or none)."""
    instruction: str | None = None
    """The task instruction of a model whose prompt has one (Qwen3-Reranker); None: the model's default."""


class Pair(NamedTuple):
    """One (query, document) input: token ids, token types, and the tokens it counts for in usage."""

    ids: list[int]
    types: list[int]

    @property
    def tokens(self) -> int:
        return len(self.ids)


class PairPreprocessor:
    """Builds the model input of each pair, within the model's length, and reads scores from logits."""

    def __init__(self, info: ModelInfo, tokenizer: Tokenizer, auto_truncate: bool) -> None:
        self.info, self.tokenizer, self.auto_truncate = info, tokenizer, auto_truncate

    def fit(self, pairs: list[tuple[str, str]], params: ScoreParams) -> list[Pair]:
        per_doc = params.max_tokens_per_doc
        if per_doc is not None and per_doc >= self.info.max_model_len:
            raise InputError(
                f"max_tokens_per_doc ({per_doc}) must be less than max_model_len ({self.info.max_model_len}).",
                "max_tokens_per_doc",
            )
        if per_doc == 0:  # vLLM's: no cut
            params = replace(params, max_tokens_per_doc=None)
        limit = self._limit(params)
        prompt = self.info.head.pair_prompt
        if prompt is not None:
            built = self._prompted(prompt, pairs, params, limit)
        else:
            built = self.tokenizer.encode_pairs(pairs, limit, params.max_tokens_per_doc)
        out = []
        for ids, types in built:
            check_length(len(ids), self.info.max_model_len)  # the query alone may not fit
            out.append(Pair(ids, types))
        return out

    def _limit(self, params: ScoreParams) -> int | None:
        max_len, cut = self.info.max_model_len, params.truncate_prompt_tokens
        if cut is None:
            return max_len if self.auto_truncate else None
        return truncation_length(cut, max_len)

    def _prompted(
        self, prompt: PairPrompt, pairs: list[tuple[str, str]], params: ScoreParams, limit: int | None
    ) -> list[tuple[list[int], list[int]]]:
        """The prompt's head with the query, the document in its frame, then the suffix; the document cut from its
        end to fit."""
        tok = self.tokenizer
        firsts = {q: q if q.startswith(prompt.formatted) else prompt.head(q, params.instruction) for q, _ in pairs}
        first_ids = dict(zip(firsts, tok.encode_batch(list(firsts.values()), False), strict=True))
        docs = tok.encode_batch([d if firsts[q] == q else prompt.document.format(document=d) for q, d in pairs], False)
        suffix = [] if not firsts else tok.encode(prompt.suffix, False)
        out = []
        for (q, _), doc in zip(pairs, docs, strict=True):
            head, tail = first_ids[q], [] if firsts[q] == q else suffix
            if params.max_tokens_per_doc is not None:
                doc = doc[: params.max_tokens_per_doc]
            if limit is not None and len(head) + len(doc) + len(tail) > limit:
                doc = doc[: max(0, limit - len(head) - len(tail))]
            ids = head + doc + tail
            out.append((ids, [0] * len(ids)))
        return out

    @staticmethod
    def windows(built: list[Pair]) -> tuple[list[list[list[int]]], list[int], list[list[list[int]]]]:
        """What the scheduler admits for the pairs: one window each, its token count, its token types."""
        return [[p.ids] for p in built], [p.tokens for p in built], [[p.types] for p in built]

    def scores(self, pooled: dict[tuple[int, int], np.ndarray], count: int, params: ScoreParams) -> list[float]:
        """Each pair's score from the scheduler's computed windows (keyed (pair, 0))."""
        return [self.score(pooled[(i, 0)], params) for i in range(count)]

    def score(self, logits: np.ndarray, params: ScoreParams) -> float:
        """One pair's score from its logits (num_labels,): the model's activation unless use_activation is false;
        with several labels, the last one's (the "relevant" class of a two-label classifier)."""
        act = self.info.head.activation if params.use_activation is not False else "identity"
        return float(activate(logits, act)[-1])


def activate(logits: np.ndarray, act: Activation) -> np.ndarray:
    """A classifier's (num_labels,) logits through `act`, in float64: sigmoid each, softmax over all, or as they are."""
    x = np.asarray(logits, np.float64)
    if act == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if act == "softmax":
        x = np.exp(x - x.max())
        return x / x.sum()
    return x


def distinct_texts(pairs: list[tuple[str, str]]) -> list[str]:
    """Each text of the pairs once, in order of appearance: what an embedding model embeds to score them."""
    return list(dict.fromkeys(t for pair in pairs for t in pair))


def cosine_scores(
    pairs: list[tuple[str, str]], texts: list[str], vectors: list[np.ndarray], token_counts: list[int]
) -> tuple[list[float], list[int]]:
    """vLLM's bi-encoder score from the unit vectors of `texts` (distinct_texts(pairs)): the cosine per pair, and the
    tokens each pair counts for in usage (each text once, with the first pair it appears in)."""
    at = {t: i for i, t in enumerate(texts)}
    scores = [float(vectors[at[a]] @ vectors[at[b]]) for a, b in pairs]
    counted: set[str] = set()
    counts = []
    for pair in pairs:
        counts.append(sum(token_counts[at[t]] for t in dict.fromkeys(pair) if t not in counted))
        counted.update(pair)
    return scores, counts
