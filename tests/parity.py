"""The reference implementations tests compare ember with: sentence-transformers on the same checkpoint directory,
and the cosine they are compared by."""

import numpy as np


def cos(a, b):
    """Row-wise cosine similarity of two (N, D) arrays (or two vectors)."""
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def st_reference(path, texts, **kw):
    """sentence-transformers' embeddings of `texts` from the model directory `path` (its own modules and prompts)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=4, **kw)
