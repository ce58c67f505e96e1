"""Splitting long inputs into model-sized windows, and truncating them (pure functions).

A window is a well-formed model input: the tokenizer's special prefix and suffix
([CLS] ... [SEP], or ... <|endoftext|>) wrap each window's share of the content.
"""

from __future__ import annotations

from ember.types import Specials

__all__ = ["split_windows", "truncate"]


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
        raise ValueError(f"max_len {max_len} leaves no room for content next to {len(specials)} special tokens")
    overlap = min(max(overlap, 0), room // 2)
    step = room - overlap
    windows = []
    for start in range(0, len(content), step):
        piece = content[start : start + room]
        windows.append(specials.wrap(piece) if wrapped else piece)
        if start + room >= len(content):
            break
    return windows
