"""Embedding a slice of a part's rows: each distinct text once (not again in the same part, none a cache holds),
texts too long to ever be used cut or skipped before they are tokenized, and slices sized to a few seconds of work.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ember.batch.backend import Embed, Embedded
from ember.batch.cache import VectorCache

if TYPE_CHECKING:
    from ember.batch.job import EmbedJob

__all__ = ["Memo", "Rows", "Slices", "embed_rows", "fit_texts"]


@dataclass
class Rows:
    """A slice's texts embedded: which of them were kept, their vectors and tokens, and what was skipped."""

    kept: list[int]
    vectors: np.ndarray
    tokens: list[int | None]
    skipped: Counter[str]
    embedded: int = 0
    cached: int = 0
    model_tokens: int = 0


Memo = dict[str, tuple[np.ndarray, int | None] | str]
"""A part's texts done so far: vector and tokens, or why the model refused it."""


def embed_rows(embed: Embed, texts: list[str], cache: VectorCache | None, memo: Memo, dim: int) -> Rows:
    """Embed each distinct text once (not again in the same part, and none the cache holds); a text the model
    refuses is skipped and counted."""
    distinct = [t for t in dict.fromkeys(texts) if t not in memo]
    hits = cache.get(distinct) if cache is not None else {}
    for j, (vector, count) in hits.items():
        memo[distinct[j]] = (vector, count)
    misses = [t for j, t in enumerate(distinct) if j not in hits]
    result = embed(misses) if misses else Embedded(np.zeros((0, dim), np.float32), [], 0)
    ok = [k for k in range(len(misses)) if k not in result.refused]
    for k, why in result.refused.items():
        memo[misses[k]] = why
    for k in ok:
        memo[misses[k]] = (result.vectors[k], result.tokens[k] if result.tokens is not None else None)
    if cache is not None and ok:
        tokens = None if result.tokens is None else [result.tokens[k] for k in ok]
        cache.put([misses[k] for k in ok], result.vectors[ok], tokens)
    kept = [i for i, t in enumerate(texts) if not isinstance(memo[t], str)]
    done = [d for i in kept if not isinstance(d := memo[texts[i]], str)]
    vectors = np.stack([d[0] for d in done]) if done else np.zeros((0, dim), np.float32)
    hit_texts = {distinct[j] for j in hits}
    return Rows(
        kept,
        vectors.reshape(len(kept), dim),
        [d[1] for d in done],
        Counter(str(memo[t]) for t in texts if isinstance(memo[t], str)),
        len(misses),
        sum(1 for i in kept if texts[i] in hit_texts),
        result.total_tokens,
    )


def fit_texts(job: EmbedJob, texts: list[str], skipped: Counter[str]) -> tuple[list[int], list[str]]:
    """Texts too long to ever be used whole: cut (with truncation on) or skipped, before any is tokenized."""
    limit, cut = job.max_text_bytes, bool(job.options.get("truncate"))
    keep, fitted = [], []
    for i, text in enumerate(texts):
        if len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
            if not cut:
                skipped["too long"] += 1
                continue
            text = text.encode("utf-8", "surrogatepass")[:limit].decode("utf-8", "ignore")
        keep.append(i)
        fitted.append(text)
    return keep, fitted


class Slices:
    """Rows per call to the model: about SECONDS of work, so progress moves and a stop is seen within seconds."""

    SECONDS = 5.0
    SMALLEST, LARGEST = 16, 1024

    def __init__(self) -> None:
        self.rows = self.SMALLEST

    def observe(self, rows: int, seconds: float) -> None:
        rate = rows / max(seconds, 1e-3)
        self.rows = int(min(self.LARGEST, max(self.SMALLEST, rate * self.SECONDS)))
