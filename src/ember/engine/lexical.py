"""Lexical (sparse) weights from a weight per token, as bge-m3 defines them (FlagEmbedding's BGE-M3 model): per
distinct token id, the largest weight it got anywhere in the input; special tokens and weights of zero left out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ember.types import ModelInfo

__all__ = ["TokenWeights", "lexical", "sparse_output"]


@dataclass(frozen=True)
class TokenWeights:
    """One input's token ids (n,) int64 and the weight of each (n,) float32, in input order."""

    ids: np.ndarray
    weights: np.ndarray

    def lexical(self, skip: frozenset[int] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
        """(distinct token ids ascending, the largest weight of each), leaving out the ids in `skip` and weights
        that are not > 0."""
        keep = self.weights > 0
        if skip:
            keep &= ~np.isin(self.ids, np.fromiter(skip, dtype=np.int64, count=len(skip)))
        ids, weights = self.ids[keep], self.weights[keep]
        order = np.lexsort((-weights, ids))  # by id, the largest weight first
        ids, weights = ids[order], weights[order]
        first = np.ones(len(ids), dtype=bool)
        first[1:] = ids[1:] != ids[:-1]
        return ids[first], weights[first]


def sparse_output(info: ModelInfo) -> Literal["embed", "token_classify"] | None:
    """What the engine computes for an input's sparse weights: the pooled vector of a head whose vector is a weight
    per vocabulary entry (SPLADE), else a weight per token (bge-m3's token_classify); None for a model that has
    neither."""
    if info.head.vocabulary:
        return "embed"
    return "token_classify" if "token_classify" in info.head.outputs else None


def lexical(answer: Any, skip: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """An input's sparse weights from the engine's answer for `sparse_output` (a SPLADE vocabulary vector, or
    bge-m3's TokenWeights merged leaving out the ids in `skip`): (token ids ascending, weights)."""
    if isinstance(answer, TokenWeights):
        return answer.lexical(skip)
    vector = np.asarray(answer)
    ids = np.flatnonzero(vector)
    return ids, vector[ids]
