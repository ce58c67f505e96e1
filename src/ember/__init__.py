"""ember: a CPU-native, OpenAI-compatible embedding server.

The offline API is `Embedder` and `Reranker`; `ember serve` runs the HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.version import __version__

__all__ = ["Embedder", "Embeddings", "Reranker", "TokenEmbeddings", "__version__"]

if TYPE_CHECKING:
    from ember.offline import Embedder, Embeddings, Reranker, TokenEmbeddings


def __getattr__(name: str) -> Any:
    # Lazy, so `import ember` (and the CLI's env/thread setup) happens before torch is imported.
    if name in ("Embedder", "Embeddings", "Reranker", "TokenEmbeddings"):
        from ember import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
