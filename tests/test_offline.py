"""The offline Embedder: the server's validation and batching, in-process (the Reranker: test_rerank.py)."""

import numpy as np
import pytest

from checkpoints import build_bert
from corpus import SENTENCES
from ember import Embedder
from ember.errors import InputError
from ember.resources import MemoryBudget


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_bert(tmp_path_factory.mktemp("bert"), layers=2, hidden=64)
    (path / "config_sentence_transformers.json").write_text('{"prompts": {"query": "query: "}}')
    return path


@pytest.fixture(scope="module")
def embedder(model_dir):
    return Embedder(str(model_dir), dtype="float32", max_model_len=64, max_batch_tokens=40, enforce_eager=True)


def _recording(embedder):
    seen = []
    embed = embedder._loaded.runner.run

    def record(batch, token_types=None, outputs=None):
        seen.append([len(ids) for ids in batch])
        return embed(batch, token_types, outputs)

    embedder._loaded.runner.run = record
    return seen


def test_batches_stay_within_the_budget_the_memory_plan_allows(embedder):
    seen = _recording(embedder)
    try:
        embedder.embed(SENTENCES[:30])
    finally:
        del embedder._loaded.runner.run
    budget = embedder._loaded.memory.max_batch_tokens
    assert budget == embedder.engine_config.max_num_batched_tokens == 40
    assert len(seen) > 1 and all(len(b) == 1 or sum(b) <= budget for b in seen)


def test_a_tight_memory_plan_lowers_the_batch_it_runs(model_dir, monkeypatch):
    tight = MemoryBudget(limit_bytes=1 << 30, available_bytes=1 << 30, total_bytes=1 << 36, source="test")
    monkeypatch.setattr("ember.engine.build.memory_budget", lambda: tight)
    small = Embedder(str(model_dir), dtype="float32", max_model_len=64, max_batch_tokens=1 << 24, enforce_eager=True)
    assert small.engine_config.max_num_batched_tokens == small._loaded.memory.max_batch_tokens < 1 << 24


def test_a_text_alone_equals_the_same_text_inside_a_batch(embedder):
    batch = embedder.embed(SENTENCES[:25]).vectors
    for i in (0, 7, 24):
        np.testing.assert_allclose(embedder.embed(SENTENCES[i]).vectors[0], batch[i], atol=1e-5)


def test_prompts_dimensions_and_errors_are_the_servers(embedder):
    query = embedder.embed("what is ember?", prompt_name="query")
    assert np.allclose(query.vectors, embedder.embed("query: what is ember?").vectors, atol=1e-6)
    assert query.token_counts == embedder.embed("query: what is ember?").token_counts
    with pytest.raises(InputError, match="unknown prompt_name"):
        embedder.embed("x", prompt_name="passage")
    with pytest.raises(InputError, match="does not support Matryoshka"):
        embedder.embed("x", dimensions=8)
    with pytest.raises(InputError, match="maximum context length is 64 tokens"):
        embedder.embed("word " * 100)
    assert embedder.embed("word " * 100, truncate_prompt_tokens=10).token_counts == [10]


def test_usage_counts_are_the_tokens_embedded(embedder):
    texts = ["a", "two words", "and a few more words here"]
    out = embedder.embed(texts)
    assert out.vectors.shape == (3, 64) and out.token_counts == [len(embedder.tokenizer.encode(t)) for t in texts]


def test_token_states_are_the_models_last_hidden_states(embedder, model_dir):
    import torch
    from transformers import AutoModel

    reference = AutoModel.from_pretrained(str(model_dir)).eval()
    texts = SENTENCES[:5]
    out = embedder.embed_tokens(texts, normalize=False)
    for text, states, count in zip(texts, out.vectors, out.token_counts, strict=True):
        ids = embedder.tokenizer.encode(text)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).last_hidden_state[0].numpy()
        assert states.shape == want.shape and count == len(ids)
        np.testing.assert_allclose(states, want, atol=1e-4)
    pooled = embedder.embed(texts, normalize=False).vectors  # MEAN of the same states
    np.testing.assert_allclose(np.stack([s.mean(0) for s in out.vectors]), pooled, atol=1e-5)
