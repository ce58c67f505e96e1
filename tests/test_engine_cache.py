"""The embedding cache: a repeated input is answered with exactly what the model gave, without the model; what a
request asks beside its tokens (dimensions, normalize, prompt, truncation, pair segments) never mixes; partial
hits; the byte bound; and its counters in /metrics."""

import asyncio

import numpy as np
from fastapi.testclient import TestClient

from ember.api.app import create_app
from ember.config import EngineConfig, PoolerConfig, ServerConfig
from ember.engine.cache import ENTRY_BYTES, EmbeddingCache
from ember.engine.engine import AsyncEngine, EmbedParams


async def _embed_all(engine, calls):
    await engine.start()
    try:
        return [await engine.embed(inputs, params) for inputs, params in calls]
    finally:
        await engine.stop()


def _run(runner, tokenizer, calls, cache_bytes):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(cache_bytes=cache_bytes), PoolerConfig())
    return engine, asyncio.run(_embed_all(engine, calls))


CALLS = [
    (["what is ember?"], EmbedParams()),
    (["what is ember?"], EmbedParams(dimensions=8)),
    (["what is ember?"], EmbedParams(normalize=False)),
    (["what is ember?"], EmbedParams(prompt_name="query")),
    (["what is ember? " * 5], EmbedParams(truncate_prompt_tokens=5)),
    (["what is ember?", "a new text", "what is ember? " * 5], EmbedParams()),
    (["what is ember?"], EmbedParams()),
]


def test_cached_answers_are_exactly_the_models_and_parameters_never_mix(runner, tokenizer):
    _, plain = _run(runner, tokenizer, CALLS, 0)
    runner.batches.clear()
    engine, cached = _run(runner, tokenizer, CALLS, 1 << 20)
    for (inputs, params), a, b in zip(CALLS, plain, cached, strict=True):
        assert a.token_counts == b.token_counts, params  # usage unchanged on a hit
        for x, y in zip(a.vectors, b.vectors, strict=True):
            assert x.shape == y.shape and np.array_equal(x, y), (inputs, params)
    computed = [ids for batch in runner.batches[1:] for ids in batch]  # after the warm-up
    distinct = {tuple(ids) for ids in computed}
    assert len(computed) == len(distinct)  # no window ran twice
    assert engine.cache.hits == 4 and engine.cache.misses == len(distinct)  # dims, normalize, in a batch, again


def test_a_request_whose_windows_are_all_cached_never_reaches_the_model(runner, tokenizer):
    calls = [(["again and again"], EmbedParams())] * 3
    engine, results = _run(runner, tokenizer, calls, 1 << 20)
    ids = tokenizer.encode("again and again")
    assert sum(batch.count(ids) for batch in runner.batches) == 1
    assert all(np.array_equal(r.vectors[0], results[0].vectors[0]) for r in results)
    assert (engine.cache.hits, engine.cache.misses) == (2, 1)
    assert engine.queued_requests == 0  # nothing left admitted


def test_pairs_are_cached_by_their_segments_too():
    cache = EmbeddingCache(1 << 20)
    ids = [101, 7, 8, 102, 9, 102]
    assert cache.key("embed", ids, [0, 0, 0, 0, 1, 1]) != cache.key("embed", ids, None)
    assert cache.key("embed", ids, [0] * 6) == cache.key("embed", ids, None)
    assert cache.key("token_embed", ids) != cache.key("embed", ids)


def test_the_cache_keeps_at_most_its_bytes_least_recently_used_out_first():
    row = np.ones(16, np.float32)
    cache = EmbeddingCache(3 * (row.nbytes + ENTRY_BYTES))
    for i in range(3):
        cache.put(bytes([i]), row * i)
    assert cache.get(bytes([0])) is not None  # 0 is now the most recent
    cache.put(bytes([3]), row * 3)
    assert cache.get(bytes([1])) is None and cache.get(bytes([0])) is not None and len(cache) == 3
    assert cache.bytes <= cache.max_bytes
    batch = np.arange(64, dtype=np.float32).reshape(4, 16)
    cache.put(b"row", batch[1])
    kept = cache.get(b"row")
    assert kept.base is None or kept.base is not batch  # a copy: the batch is not kept alive
    assert not kept.flags.writeable


def test_metrics_count_hits_and_misses(runner, tokenizer):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(cache_bytes=1 << 20), PoolerConfig())
    with TestClient(create_app(engine, ServerConfig(served_model_names=("m",)))) as c:
        first = c.post("/v1/embeddings", json={"input": ["hello there", "hello there"]}).json()
        second = c.post("/v1/embeddings", json={"input": "hello there"}).json()
        assert first["usage"]["prompt_tokens"] == 2 * second["usage"]["prompt_tokens"]
        text = c.get("/metrics").text
    hits = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("ember_embedding_cache_hits")))
    assert hits >= 1 and "ember_embedding_cache_misses_total" in text and "ember_embedding_cache_bytes" in text
