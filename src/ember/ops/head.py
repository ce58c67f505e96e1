"""The embedding head, in vLLM's order: Matryoshka truncation, then L2 normalisation.

Numpy only: it runs after pooling and after chunk merging, off the model thread.
"""

from __future__ import annotations

import numpy as np

__all__ = ["embed_windows", "embedding_head", "weighted_mean"]


def embedding_head(x: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Truncate a float32 vector (D,) to `dimensions`, then L2-normalise when asked."""
    if dimensions is not None:
        x = x[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(x))
        x = x / max(norm, 1e-12)
    return np.ascontiguousarray(x, dtype=np.float32)


def weighted_mean(vectors: list[np.ndarray], weights: list[int]) -> np.ndarray:
    """Token-weighted mean of window vectors (D,), computed in float64."""
    w = np.asarray(weights, dtype=np.float64)
    stacked = np.stack(vectors).astype(np.float64)  # (W, D)
    return (stacked * w[:, None]).sum(0) / w.sum()


def embed_windows(parts: list[np.ndarray], lengths: list[int], dimensions: int | None, normalize: bool) -> np.ndarray:
    """One input's embedding from its pooled windows: head on each, token-weighted mean, head again.

    A single window is just the head. For several, each window goes through the head as it
    would alone (as vLLM's chunked processing does); the mean is normalised again when the
    model normalises, so clients always get unit vectors.
    """
    if len(parts) == 1:
        return embedding_head(parts[0], dimensions, normalize)
    heads = [embedding_head(p, dimensions, normalize) for p in parts]
    return embedding_head(weighted_mean(heads, lengths).astype(np.float32), None, normalize)
