"""Long inputs: split into model-sized windows (or truncated), and the windows' vectors merged back (pure).

A window is a well-formed model input: the tokenizer's special prefix and suffix
([CLS] ... [SEP], or ... <|endoftext|>) wrap each window's share of the content. After pooling, each window
goes through the embedding head in vLLM's order (Matryoshka truncation, then L2 normalisation), and an input's
windows are merged by their token-weighted mean (numpy only: this runs off the model thread).
"""

from __future__ import annotations

import numpy as np

from ember.errors import ConfigError
from ember.types import Specials

__all__ = [
    "embed_windows",
    "embedding_head",
    "split_windows",
    "token_head",
    "truncate",
    "weighted_mean",
    "window_overlap",
]


def truncate(ids: list[int], keep: int, side: str, specials: Specials) -> list[int]:
    """Keep `keep` tokens (specials included, as the HF tokenizer does): the start, or the end for side=left."""
    if len(ids) <= keep:
        return ids
    content, wrapped = specials.unwrap(ids)
    room = keep - len(specials) if wrapped else keep
    if room < 1:
        room, wrapped, content = keep, False, ids
    kept = content[:room] if side != "left" else content[len(content) - room :]
    return specials.wrap(kept) if wrapped else kept


def split_windows(ids: list[int], max_len: int, specials: Specials, overlap: int = 0) -> list[list[int]]:
    """Windows of at most `max_len` tokens covering `ids`, each wrapped in the specials."""
    content, wrapped = specials.unwrap(ids)
    room = max_len - len(specials) if wrapped else max_len
    if room < 1:
        raise ConfigError(f"max_len {max_len} leaves no room for content next to {len(specials)} special tokens")
    overlap = window_overlap(max_len, specials, overlap, wrapped)
    step = room - overlap
    windows = []
    for start in range(0, len(content), step):
        piece = content[start : start + room]
        windows.append(specials.wrap(piece) if wrapped else piece)
        if start + room >= len(content):
            break
    return windows


def window_overlap(max_len: int, specials: Specials, overlap: int, wrapped: bool) -> int:
    """The content tokens each window of split_windows repeats from the one before it: the asked overlap, at most
    half a window's content."""
    room = max_len - len(specials) if wrapped else max_len
    return min(max(overlap, 0), room // 2)


def embedding_head(x: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Truncate a float32 vector (D,) to `dimensions`, then L2-normalise when asked."""
    if dimensions is not None:
        x = x[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(x))
        x = x / max(norm, 1e-12)
    return np.ascontiguousarray(x, dtype=np.float32)


def token_head(states: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The embedding head on every row of (tokens, D) float32 states: truncate, then L2-normalise each row."""
    x = states[:, :dimensions] if dimensions is not None else states
    if normalize:
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(x, dtype=np.float32)


def weighted_mean(vectors: list[np.ndarray], weights: list[int]) -> np.ndarray:
    """Token-weighted mean of window vectors (D,), computed in float64."""
    w = np.asarray(weights, dtype=np.float64)
    stacked = np.stack(vectors).astype(np.float64)  # (W, D)
    return (stacked * w[:, None]).sum(0) / w.sum()


def embed_windows(
    parts: list[np.ndarray], lengths: list[int], dimensions: int | None, normalize: bool, merge: str = "mean"
) -> np.ndarray:
    """One input's embedding from its pooled windows: head on each, token-weighted mean, head again.

    A single window is just the head. For several, each window goes through the head as it
    would alone (as vLLM's chunked processing does); the mean is normalised again when the
    model normalises, so clients always get unit vectors. A sparse (SPLADE) model's windows merge as its tokens
    do (`merge` max or sum), so a chunked input gets the weights it would have whole.
    """
    if len(parts) == 1:
        return embedding_head(parts[0], dimensions, normalize)
    if merge != "mean":
        stacked = np.stack(parts)  # (W, vocabulary)
        return stacked.max(0) if merge == "max" else stacked.sum(0)
    heads = [embedding_head(p, dimensions, normalize) for p in parts]
    return embedding_head(weighted_mean(heads, lengths).astype(np.float32), None, normalize)
