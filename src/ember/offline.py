"""The offline API: `Embedder(model).embed(texts)` and `Reranker(model).rerank(query, documents)` for notebooks
and batch jobs.

Synchronous and single-threaded from the caller's view. They drive the same preprocessing and Scheduler as the
server (same validation, same batches by the same token budget, the one the memory plan allows), and results
come back in input order with the exact token count of each input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from ember.config import (
    DEFAULT_BATCH_TOKENS,
    ONEDNN_KERNEL_CACHE,
    EngineConfig,
    ModelConfig,
    NativeConfig,
    PoolerConfig,
    check_dtype,
)
from ember.engine.build import Loaded, load
from ember.engine.cpu import set_threads
from ember.engine.inputs import EmbedParams, Preprocessor
from ember.engine.lexical import lexical, sparse_output
from ember.engine.pairs import PairPreprocessor, ScoreParams, cosine_scores, distinct_texts
from ember.engine.results import ranked
from ember.engine.scheduler import Request, Scheduler, batch_inputs
from ember.errors import InputError
from ember.ops.fused import can_compile
from ember.resources import cpu_budget
from ember.tokenizer import Tokenizer
from ember.types import KernelStatus, ModelInfo, Output

__all__ = ["Embedder", "Embeddings", "Reranker", "TokenEmbeddings"]


class Embeddings(NamedTuple):
    """Vectors (N, D) float32 in input order, and the tokens each input used."""

    vectors: np.ndarray
    token_counts: list[int]


class TokenEmbeddings(NamedTuple):
    """A (tokens, D) float32 array per input, in input order, and the tokens each input used."""

    vectors: list[np.ndarray]
    token_counts: list[int]


class _Offline:
    """A model loaded once in this process, run through the server's Scheduler one request at a time."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = ModelConfig.dtype,
        max_model_len: int | None = None,
        pooler_config: PoolerConfig | dict[str, Any] | str | None = None,
        revision: str | None = None,
        hf_overrides: dict[str, Any] | None = None,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_seqs: int = EngineConfig.max_num_seqs,
        auto_truncate: bool = False,
        threads: int | None = None,
        quantization: Literal["int8"] | None = None,
        calibration: str | None = None,
        enforce_eager: bool = False,
        native: NativeConfig | None = None,
        config: ModelConfig | None = None,
    ) -> None:
        """`config`, when given, is the whole model configuration (as `ember serve`'s model flags build it, for
        `ember embed`): `model`, `dtype`, `max_model_len`, `pooler_config`, `revision`, `hf_overrides`,
        `max_batch_tokens`, `quantization` and `calibration` are then not read. `calibration`: with int8, a text file
        (one text per line) the weights are rounded against, "none" for plain rounding (ModelConfig.calibration)."""
        # oneDNN reads its kernel cache bound at the first matmul: set it (unless the caller did) before any
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNEL_CACHE))
        set_threads(threads or cpu_budget().usable)  # the container's CPUs, not the host's
        if config is None:
            pooler = pooler_config if isinstance(pooler_config, PoolerConfig) else PoolerConfig.parse(pooler_config)
            config = ModelConfig(
                model,
                dtype=check_dtype(dtype),
                max_model_len=max_model_len,
                pooler=pooler,
                revision=revision,
                hf_overrides=hf_overrides,
                quantization=quantization,
                calibration=calibration,
                max_batch_tokens=max_batch_tokens,
            )
        pooler = config.pooler
        # an API edge like the CLI: the operator's EMBER_NATIVE_*, EMBER_CACHE_DIR and CXX apply here too (the
        # image's prebuilt kernels are found through EMBER_CACHE_DIR)
        self._loaded: Loaded = load(config, native or NativeConfig.from_env(os.environ))
        self.kernels: list[KernelStatus] = self._loaded.runner.load_kernels()
        if not enforce_eager and can_compile():  # fused kernels, built now (a few seconds, cached on disk)
            self._loaded.runner.compile()
        self.engine_config = EngineConfig(
            max_num_batched_tokens=self._loaded.memory.max_batch_tokens,  # what the memory plan allows
            max_num_seqs=max_batch_seqs,
            auto_truncate=auto_truncate,
        )
        self.preprocessor = Preprocessor(self.info, self.tokenizer, pooler, auto_truncate)
        self.pairs = PairPreprocessor(self.info, self.tokenizer, auto_truncate)

    @property
    def info(self) -> ModelInfo:
        return self._loaded.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded.tokenizer

    @property
    def path(self) -> Path:
        """The local directory the model was loaded from (a hub id's snapshot)."""
        return self._loaded.plan.path

    def _embed(self, inputs: Any, params: EmbedParams) -> Embeddings:
        vectors, counts = self._vectors(inputs, params)
        return Embeddings(np.stack(vectors), counts)

    def _vectors(self, inputs: Any, params: EmbedParams) -> tuple[list[Any], list[int]]:
        prepared = self.preprocessor.check(inputs, params)
        fitted = self.preprocessor.fit(prepared, params)
        request = self._run([f.windows for f in fitted], [f.tokens for f in fitted], output=params.output)
        return self.preprocessor.vectors(request.windows, request.pooled, prepared), request.token_counts

    def _run(
        self,
        windows: list[list[list[int]]],
        counts: list[int],
        types: list[list[list[int]]] | None = None,
        *,
        output: Output = "embed",
    ) -> Request:
        """One request on a queue of its own, batched by the budget, until every window is computed."""
        scheduler = Scheduler(self.engine_config)
        request = scheduler.admit(windows, counts, 0.0, types, output)
        while batch := scheduler.next_batch(0.0):
            scheduler.complete(batch, self._loaded.runner.run(*batch_inputs(batch)), 0.0, 0.0)
        return request


class Embedder(_Offline):
    """Loads an embedding model once and embeds texts or token ids with it."""

    def _check_embeds(self) -> None:
        if self.info.task != "embed":
            raise InputError(f"this model ({self.info.architecture}) scores pairs: use ember.Reranker", "input")

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
        self._check_embeds()
        params = EmbedParams(dimensions, normalize, truncate_prompt_tokens, truncation_side, prompt_name=prompt_name)
        return self._embed(inputs, params)

    def embed_tokens(
        self,
        inputs: str | list[str] | list[int] | list[list[int]],
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
    ) -> TokenEmbeddings:
        """One vector per token (vLLM's `token_embed`, for multi-vector retrieval): `vectors` is a list of
        (tokens, D) arrays in input order, special tokens included; inputs longer than max-model-len are refused
        unless truncated."""
        self._check_embeds()
        params = EmbedParams(
            dimensions,
            normalize,
            truncate_prompt_tokens,
            truncation_side,
            prompt_name=prompt_name,
            output="token_embed",
        )
        return TokenEmbeddings(*self._vectors(inputs, params))

    def lexical_weights(
        self,
        inputs: str | list[str] | list[int] | list[list[int]],
        *,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
        truncation_side: Literal["left", "right"] | None = None,
    ) -> list[dict[int, float]]:
        """Each input's sparse weights, {token id: weight} for the non-zero ones: a SPLADE model's weight per
        vocabulary entry, or bge-m3's sparse head as FlagEmbedding gives them (each distinct token's largest
        weight, special tokens left out)."""
        self._check_embeds()
        params = EmbedParams(
            None,
            None,
            truncate_prompt_tokens,
            truncation_side,
            prompt_name=prompt_name,
            output=sparse_output(self.info) or "token_classify",
        )
        vectors, _ = self._vectors(inputs, params)
        pairs = (lexical(v, self.tokenizer.special_ids) for v in vectors)
        return [dict(zip(ids.tolist(), weights.tolist(), strict=True)) for ids, weights in pairs]


class Reranker(_Offline):
    """Loads a cross-encoder or reranker (or an embedding model, which scores by cosine) and scores pairs with it."""

    def score(
        self,
        pairs: list[tuple[str, str]],
        *,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_activation: bool | None = None,
    ) -> list[float]:
        """A relevance score per (query, document) pair, in order."""
        if not pairs:
            raise InputError("no pairs to score", "pairs")
        params = ScoreParams(
            truncate_prompt_tokens=truncate_prompt_tokens, use_activation=use_activation, instruction=instruction
        )
        if self.info.task == "embed":  # vLLM's bi-encoder score: the cosine of the two texts' embeddings
            texts = distinct_texts(pairs)
            out = self._embed(texts, EmbedParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens))
            return cosine_scores(pairs, texts, list(out.vectors), out.token_counts)[0]
        built = self.pairs.fit(pairs, params)
        request = self._run(*self.pairs.windows(built))
        return self.pairs.scores(request.pooled, len(built), params)

    def rerank(
        self, query: str, documents: list[str], top_n: int | None = None, **options: Any
    ) -> list[tuple[int, float]]:
        """(index into documents, score), best first; the top_n of them when given."""
        scores = self.score([(query, d) for d in documents], **options)
        return [(i, scores[i]) for i in ranked(scores, top_n)]
