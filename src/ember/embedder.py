"""The offline API: `Embedder(model).embed(texts)` for notebooks and batch jobs.

Synchronous and single-threaded from the caller's view; batches are packed by a token
budget and results come back in input order with the exact token count of each input.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

from ember.config import DType, PoolerConfig, check_dtype
from ember.engine.build import Loaded, load, set_threads
from ember.engine.inputs import check_dimensions, fit_length, prompt_text, split_inputs, tokenize
from ember.engine.scheduler import plan_batches
from ember.ops.fused import can_compile
from ember.ops.head import embed_windows
from ember.resources import cpu_budget
from ember.types import ModelInfo

__all__ = ["Embedder", "Embeddings"]


class Embeddings(NamedTuple):
    """Vectors (N, D) float32 in input order, and the tokens each input used."""

    vectors: np.ndarray
    token_counts: list[int]


class Embedder:
    """Loads a model once and embeds texts or token ids with it."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: DType | str = "auto",
        max_model_len: int | None = None,
        pooler_config: PoolerConfig | dict[str, Any] | str | None = None,
        revision: str | None = None,
        hf_overrides: dict[str, Any] | None = None,
        max_batch_tokens: int = 8192,
        max_batch_seqs: int = 256,
        auto_truncate: bool = False,
        threads: int | None = None,
        quantization: str | None = None,
        enforce_eager: bool = False,
    ) -> None:
        set_threads(threads or cpu_budget().usable)  # the container's CPUs, not the host's
        pooler = pooler_config if isinstance(pooler_config, PoolerConfig) else PoolerConfig.parse(pooler_config)
        self._loaded: Loaded = load(
            model,
            dtype=check_dtype(dtype),
            max_model_len=max_model_len,
            pooler=pooler,
            revision=revision,
            hf_overrides=hf_overrides,
            quantization=quantization,
        )
        if not enforce_eager and can_compile():  # fused kernels, built now (a few seconds, cached on disk)
            self._loaded.runner.compile()
        self.pooler = pooler
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.auto_truncate = auto_truncate

    @property
    def info(self) -> ModelInfo:
        return self._loaded.info

    @property
    def tokenizer(self) -> Any:
        return self._loaded.tokenizer

    def embed(
        self,
        inputs: str | list[str] | list[int] | list[list[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
    ) -> Embeddings:
        """Embed texts (or token-id lists, used as given); returns vectors in input order."""
        info = self.info
        dimensions = dimensions if dimensions is not None else self.pooler.dimensions
        check_dimensions(info, dimensions)
        tokenizer = self._loaded.tokenizer
        seqs = tokenize(tokenizer, split_inputs(inputs), prompt_text(info, prompt_name))
        fitted = [
            fit_length(ids, info.max_model_len, tokenizer.special_tokens, truncate_to=truncate_prompt_tokens,
                       side=truncation_side, pooler=self.pooler, auto_truncate=self.auto_truncate)
            for ids in seqs
        ]  # fmt: skip
        windows = [f.windows for f in fitted]
        flat = [(i, j) for i, ws in enumerate(windows) for j in range(len(ws))]
        pooled: dict[tuple[int, int], np.ndarray] = {}
        lengths = [len(windows[i][j]) for i, j in flat]
        for batch in plan_batches(lengths, self.max_batch_tokens, self.max_batch_seqs):
            out = self._loaded.runner.embed([windows[flat[k][0]][flat[k][1]] for k in batch])
            for row, k in enumerate(batch):
                pooled[flat[k]] = out[row]
        norm = info.pooling.normalize if normalize is None else normalize
        vectors = [
            embed_windows([pooled[(i, j)] for j in range(len(ws))], [len(w) for w in ws], dimensions, norm)
            for i, ws in enumerate(windows)
        ]
        return Embeddings(np.stack(vectors), [f.tokens for f in fitted])
