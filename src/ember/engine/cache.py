"""The embedding cache: what the model gave for a window it already computed, by the window's exact token ids.

A repeated input (the same query asked again, an unchanged chunk embedded again) is answered without the model.
The key is what decides the model's output: the output kind, the token ids (the prompt, truncation and special
tokens are already in them) and the token types of a pair; what a request asks beside that (dimensions, normalize,
encoding) is applied to the cached output exactly as to a computed one, so no two requests' parameters can mix.
One engine serves one model, so the model is the cache's own. Bounded in bytes (least recently used first out);
used only on the event loop, so it needs no lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

__all__ = ["CACHED_OUTPUTS", "EmbeddingCache"]

CACHED_OUTPUTS = frozenset({"embed"})
"""Outputs kept: a pooled vector (or a score model's logits) per window. Per-token outputs are too large to keep."""

ENTRY_BYTES = 120
"""An entry's cost beside its values: the key, the dictionary slot, the array's header."""


class EmbeddingCache:
    """Pooled outputs by key, at most `max_bytes` of them; counts hits and misses."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @staticmethod
    def key(output: str, ids: list[int], types: list[int] | None = None) -> bytes:
        h = hashlib.blake2b(output.encode(), digest_size=16)
        h.update(np.asarray(ids, np.int64).tobytes())
        if types is not None and any(types):
            h.update(b"\x00types")
            h.update(np.asarray(types, np.int8).tobytes())
        return h.digest()

    def lookup(
        self, windows: list[list[list[int]]], types: list[list[list[int]]] | None, output: str
    ) -> tuple[dict[tuple[int, int], bytes], dict[tuple[int, int], np.ndarray]]:
        """Each window's key (by (input, window)), and the outputs held for them (none for outputs not kept)."""
        if output not in CACHED_OUTPUTS:
            return {}, {}
        keys = {
            (i, j): self.key(output, ids, types[i][j] if types else None)
            for i, ws in enumerate(windows)
            for j, ids in enumerate(ws)
        }
        return keys, {at: value for at, key in keys.items() if (value := self.get(key)) is not None}

    def get(self, key: bytes) -> np.ndarray | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: bytes, value: object) -> None:
        if not isinstance(value, np.ndarray) or key in self._entries:
            return
        size = value.nbytes + ENTRY_BYTES
        if size > self.max_bytes:
            return
        kept = np.array(value, copy=True)  # a row of a batch's output would keep the whole batch alive
        kept.flags.writeable = False  # shared by every request that hits it
        self._entries[key] = kept
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes + ENTRY_BYTES

    def __len__(self) -> int:
        return len(self._entries)
