"""Comparing two sets of embeddings row by row."""

from __future__ import annotations

import numpy as np

__all__ = ["row_cosines"]


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The cosine between each row of a and the same row of b, in float64: (N,) for (N, D) inputs."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
