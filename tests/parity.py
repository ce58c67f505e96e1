"""The reference implementations tests compare ember with: sentence-transformers on the same checkpoint directory,
and the cosine they are compared by."""

import numpy as np


def cos(a, b):
    """Row-wise cosine similarity of two (N, D) arrays (or two vectors)."""
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def st_reference(path, texts, model_kwargs=None, **kw):
    """sentence-transformers' embeddings of `texts` from the model directory `path` (its own modules and prompts);
    model_kwargs go to transformers (`{"dtype": torch.float32}`: a bf16 checkpoint computed in float32)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", model_kwargs=model_kwargs)
    return model.encode(texts, convert_to_numpy=True, batch_size=4, **kw)
