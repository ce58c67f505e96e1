"""A fake runner: deterministic vectors without weights, so API and engine tests run in milliseconds."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ember.models.checkpoint import bundled_default_model
from ember.tokenizer import Tokenizer
from ember.types import KernelStatus, ModelInfo, PoolingSpec


def minilm_tokenizer() -> Tokenizer:
    path = bundled_default_model()
    assert path is not None
    return Tokenizer.from_dir(path)


class FakeRunner:
    """MEAN of a fixed random vector per token id; records every batch it runs."""

    def __init__(self, vocab_size: int, *, dim: int = 16, max_model_len: int = 32, delay: float = 0.0) -> None:
        self.table = np.random.default_rng(0).standard_normal((vocab_size, dim)).astype(np.float32)
        self.info = ModelInfo(
            name="fake-model",
            architecture="Fake",
            dimension=dim,
            max_model_len=max_model_len,
            dtype="float32",
            pooling=PoolingSpec("MEAN", True),
            is_matryoshka=True,
            vocab_size=vocab_size,
            prompts={"query": "query: "},
        )
        self.delay = delay
        self.batches: list[list[list[int]]] = []
        self.fail_when = None  # a predicate on the batch that makes it raise
        self.gate = threading.Event()
        self.gate.set()
        self.compile_error: Exception | None = None
        self.compiled = threading.Event()

    def run(
        self, batch: list[list[int]], token_types: list[list[int]] | None = None, outputs: list[str] | None = None
    ) -> Any:
        self.gate.wait(10)
        self.batches.append([list(ids) for ids in batch])
        if self.fail_when is not None and self.fail_when(batch):
            raise RuntimeError("simulated model failure")
        if self.delay:
            time.sleep(self.delay * sum(len(s) for s in batch))
        if outputs is not None:
            rows = zip(batch, outputs, strict=True)
            return [self.table[ids] if out == "token_embed" else self.table[ids].mean(0) for ids, out in rows]
        return np.stack([self.table[ids].mean(0) for ids in batch])

    def load_kernels(self) -> list[KernelStatus]:
        return [KernelStatus("attention", False, "this CPU lacks amx_bf16; torch's SDPA instead")]

    def compile(self) -> None:
        if self.compile_error is not None:
            raise self.compile_error
        self.compiled.set()

    def expected(self, ids: list[int]) -> np.ndarray:
        v = self.table[ids].mean(0)
        return v / np.linalg.norm(v)
