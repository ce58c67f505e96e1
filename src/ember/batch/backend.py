"""What an indexing job embeds with: a function from texts to vectors, whatever runs the model.

`local(embedder, ...)` runs the model in this process (`ember embed`); `ember.batch.remote.RemoteEmbedder` sends
the texts to running servers (`ember embed --url`). Both answer with an `Embedded`: a vector for every text the
model took, and the reason for every text it refused, so one bad row never fails the rows beside it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.batch.files import NOT_UTF8, TOO_LONG, decode_text
from ember.errors import ConfigError, InputError

__all__ = ["Embed", "Embedded", "local", "probe_dimension", "refusal", "stack_rows", "usable_texts"]


@dataclass
class Embedded:
    """Vectors for texts[i] for every i not in `refused`; the rows of refused texts are zeros."""

    vectors: np.ndarray
    """(N, D) float32, one row per text, in input order."""
    tokens: list[int] | None
    """Tokens each text used; None when the backend does not say per text (an OpenAI-style server)."""
    total_tokens: int
    refused: dict[int, str] = field(default_factory=dict)
    """Index of a text the model refused -> why ("too long", "refused")."""
    messages: dict[int, str] = field(default_factory=dict)
    """Index of a refused text -> the model's (or the server's) own words."""


Embed = Callable[[list[str]], Embedded]


def probe_dimension(embed: Embed) -> int:
    """The width of the vectors `embed` gives, from one short text, before a job does any work: a model that
    does not embed text (a reranker, a classifier) is refused here with its own words."""
    result = embed(["ember"])
    if result.refused or len(result.vectors) != 1 or not result.vectors.shape[1]:
        why = result.messages.get(0) or result.refused.get(0) or "no vector came back"
        raise ConfigError(f"the model does not embed text ({why}): name an embedding model")
    return int(result.vectors.shape[1])


def refusal(error: Exception) -> str:
    """The reason a text was refused, as counted in a job's summary."""
    text = str(error)
    return "too long" if "context length" in text or "input length" in text or "maximum" in text else "refused"


CHUNK = 1024
"""Texts given to the Embedder at once. Its tokenizer holds every text's encoding until the call returns (some
100 bytes a token), so a part of 10,000 long documents in one call took a gigabyte more than one of 2,000; in
slices of this size memory no longer grows with the part, and each slice still fills many batches."""


def local(embedder: Any, **params: Any) -> Embed:
    """Embed with an in-process `ember.Embedder` (params: dimensions, normalize, prompt_name), in slices of CHUNK
    texts."""

    def embed(texts: list[str]) -> Embedded:
        done = [_slice(embedder, texts[i : i + CHUNK], params) for i in range(0, len(texts), CHUNK)]
        if len(done) == 1:
            return done[0]
        dim = max(d.vectors.shape[1] for d in done)
        refused = {i * CHUNK + k: why for i, d in enumerate(done) for k, why in d.refused.items()}
        messages = {i * CHUNK + k: m for i, d in enumerate(done) for k, m in d.messages.items()}
        vectors = np.concatenate(
            [d.vectors if d.vectors.shape[1] == dim else np.zeros((len(d.vectors), dim), np.float32) for d in done]
        )
        tokens = [t for d in done for t in (d.tokens or [])]
        return Embedded(vectors, tokens, sum(d.total_tokens for d in done), refused, messages)

    return embed


def _slice(embedder: Any, texts: list[str], params: dict[str, Any]) -> Embedded:
    try:
        out = embedder.embed(texts, **params)
        return Embedded(out.vectors, list(out.token_counts), sum(out.token_counts))
    except InputError:  # find the texts at fault, one at a time (rare)
        return _one_by_one(embedder, texts, params)


def _one_by_one(embedder: Any, texts: list[str], params: dict[str, Any]) -> Embedded:
    rows: list[np.ndarray | None] = []
    tokens: list[int] = []
    refused: dict[int, str] = {}
    messages: dict[int, str] = {}
    for i, text in enumerate(texts):
        try:
            out = embedder.embed([text], **params)
        except InputError as e:
            refused[i], messages[i] = refusal(e), str(e)
            rows.append(None)
            tokens.append(0)
            continue
        rows.append(out.vectors[0])
        tokens.append(out.token_counts[0])
    return Embedded(stack_rows(rows), tokens, sum(tokens), refused, messages)


def stack_rows(rows: list[np.ndarray | None]) -> np.ndarray:
    """One (N, D) float32 array from per-text vectors; a refused text (None) gets a row of zeros."""
    dim = next((len(r) for r in rows if r is not None), 0)
    vectors = np.zeros((len(rows), dim), np.float32)
    for i, row in enumerate(rows):
        if row is not None:
            vectors[i] = row
    return vectors


_STAND_INS = {TOO_LONG: "line too long to read", NOT_UTF8: "not UTF-8 text"}


def usable_texts(values: list[Any]) -> tuple[list[int], list[str], Counter[str]]:
    """Row positions to embed and their texts; nulls, blank texts, bytes that are not UTF-8 and values that are not
    text (lists, maps) are skipped and counted; numbers are embedded as their text."""
    keep, texts, skipped = [], [], Counter[str]()
    for i, v in enumerate(values):
        text = None if isinstance(v, list | dict) else decode_text(v) if v is not None else None
        if v is None:
            skipped["null text"] += 1
        elif text is None:
            skipped["not UTF-8 text" if isinstance(v, bytes) else "not text"] += 1
        elif text in _STAND_INS:
            skipped[_STAND_INS[text]] += 1
        elif not text.strip():
            skipped["empty or whitespace-only text"] += 1
        else:
            keep.append(i)
            texts.append(text)
    return keep, texts, skipped
