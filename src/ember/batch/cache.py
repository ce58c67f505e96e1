"""`--cache DIR`: vectors kept on disk by (model, options, text), so re-indexing a corpus embeds only what changed.

One SQLite file per cache directory (the standard library's, safe against a kill mid-write: a transaction is
whole or absent). A key is a hash of the model's fingerprint (its files' names, sizes and modification times:
new weights at the same path are a new model), the options that change a vector (dtype, quantization,
dimensions, normalize, prompt, pooling, truncation) and the text. Keys and vectors only: no text is stored.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["VectorCache", "model_fingerprint"]

_SCHEMA = "CREATE TABLE IF NOT EXISTS vectors (key BLOB PRIMARY KEY, tokens INTEGER, vector BLOB) WITHOUT ROWID"


def model_fingerprint(path: Path | str) -> str:
    """A hash of the files a model is loaded from (names, sizes, modification times), read in no time."""
    root = Path(path)
    entries = sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    )
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


class VectorCache:
    """get/put many vectors at once by text, under one (model, options) namespace."""

    def __init__(self, directory: str | Path, model: str, options: dict[str, Any]) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(Path(directory) / "ember-cache.sqlite3", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        self._namespace = hashlib.sha256(json.dumps([model, options], sort_keys=True, default=str).encode()).digest()

    def _key(self, text: str) -> bytes:
        return hashlib.sha256(self._namespace + text.encode("utf-8", "surrogatepass")).digest()[:20]

    def get(self, texts: list[str]) -> dict[int, tuple[np.ndarray, int | None]]:
        """Index of each text found -> (vector, tokens)."""
        keys = [self._key(t) for t in texts]
        found: dict[bytes, tuple[bytes, int | None]] = {}
        for start in range(0, len(keys), 500):  # SQLite's bound on parameters
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for key, tokens, blob in self._db.execute(
                f"SELECT key, tokens, vector FROM vectors WHERE key IN ({marks})", chunk
            ):
                found[key] = (blob, tokens)
        return {i: (np.frombuffer(found[k][0], np.float32), found[k][1]) for i, k in enumerate(keys) if k in found}

    def put(self, texts: list[str], vectors: np.ndarray, tokens: list[int] | None) -> None:
        rows = [
            (
                self._key(t),
                None if tokens is None else tokens[i],
                np.ascontiguousarray(vectors[i], np.float32).tobytes(),
            )
            for i, t in enumerate(texts)
        ]
        with self._db:  # one transaction: whole or absent
            self._db.executemany("INSERT OR REPLACE INTO vectors VALUES (?, ?, ?)", rows)

    def close(self) -> None:
        self._db.close()
