"""ember: a CPU-native, OpenAI-compatible embedding server.

The offline API is `Embedder`; `ember serve` runs the HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.version import __version__

__all__ = ["Embedder", "Embeddings", "__version__"]

if TYPE_CHECKING:
    from ember.embedder import Embedder, Embeddings


def __getattr__(name: str) -> Any:
    # Lazy, so `import ember` (and the CLI's env/thread setup) happens before torch is imported.
    if name in ("Embedder", "Embeddings"):
        from ember import embedder

        return getattr(embedder, name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
