"""Plain tensor functions: attention, norms, rotary embeddings, pooling."""
