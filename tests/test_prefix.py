"""Shared prefixes: sequences of a batch that start alike compute their common tokens once, and give the same
vectors and scores as when each runs whole."""

from contextlib import contextmanager

import numpy as np
import pytest

from checkpoints import build_qwen3, build_qwen3_reranker
from corpus import DOCUMENTS, QUERIES
from ember import Embedder, Reranker
from ember.ops.prefix import prefix_layout, share_prefixes
from parity import cos

RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def test_sequences_sharing_a_prefix_hold_it_once():
    a = list(range(100, 140))  # 40 shared tokens
    b = list(range(200, 230))  # 30 shared by another group
    batch = [[*a, 1, 2], [7, 8, 9], [*b, 5], [*a, 3], [*b, 6, 6], [*a, 4, 4, 4]]
    plan = share_prefixes(batch, min_shared=16)
    assert plan is not None
    assert sorted(map(tuple, plan.segments)) == sorted(
        map(tuple, [a, [1, 2], [3], [4, 4, 4], b, [5], [6, 6], [7, 8, 9]])
    )
    for i, seq in enumerate(batch):  # each sequence is its prefix then its own segment, at the right positions
        own = plan.owners[i]
        parent = plan.parents[own]
        whole = (plan.segments[parent] if parent >= 0 else []) + plan.segments[own]
        assert whole == seq
        assert plan.starts[own] == (len(plan.segments[parent]) if parent >= 0 else 0)
    assert len({plan.owners[i] for i in range(len(batch))}) == len(batch)


def test_a_longer_prefix_is_not_cut_short_by_a_shorter_one_and_the_last_token_stays_own():
    system = list(range(50))
    q1, q2 = system + list(range(500, 530)), system + list(range(600, 630))
    batch = [[*q1, 1], [*q1, 2], [*q2, 3], [*q2, 4], q1]  # q1 alone: its last token stays its own
    plan = share_prefixes(batch, min_shared=16)
    assert plan is not None
    prefixes = sorted(len(plan.segments[p]) for p in set(plan.parents) if p >= 0)
    assert prefixes == [79, 80]  # q1's run is capped by q1 itself (79 + its last token); q2's own 80
    assert all(len(plan.segments[o]) >= 1 for o in plan.owners)


def test_nothing_to_share():
    assert share_prefixes([[1, 2, 3], [4, 5, 6]]) is None
    assert share_prefixes([[*list(range(20)), 1], list(range(10)) + [9] * 11], min_shared=16) is None
    assert share_prefixes([list(range(20))]) is None


def test_the_layout_puts_each_continuation_behind_its_prefix():
    layout = prefix_layout([3, 2, 1, 4], [-1, 0, 0, -1])
    assert layout.seqlens == [3, 5, 4, 4]
    assert layout.gather.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9]
    assert layout.keep.tolist() == [0, 1, 2, 6, 7, 11, 12, 13, 14, 15]


@contextmanager
def _tokens_seen(runner):
    """The token counts the model's layers run on, per forward, while the block runs."""
    seen = []
    hook = runner.model.embed_tokens.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    try:
        yield seen
    finally:
        hook.remove()


def _tokens_run(runner, batch, share):
    """The runner's output for `batch` with sharing on or off, and the tokens the model's layers ran."""
    runner.share_prefixes = share
    try:
        with _tokens_seen(runner) as seen:
            return runner.run(batch), seen[0]
    finally:
        runner.share_prefixes = True


def _batch(tokenizer):
    """Queries behind one instruction, two queries' documents behind a long shared head, and one loner."""
    instruct = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
    batch = [tokenizer.encode(instruct + q) for q in QUERIES[:4]]
    for q in QUERIES[:2]:
        batch += [tokenizer.encode(f"{q} {q} {q} {q}\n<Document>: {d}") for d in DOCUMENTS[:5]]
    return [*batch, tokenizer.encode(DOCUMENTS[-1])]


@pytest.mark.parametrize(
    "dtype,head_dim,quantization,floor",
    [("float32", 16, None, 0.99999), ("bfloat16", 64, None, 0.999), ("bfloat16", 64, "int8", 0.995)],
)
def test_a_shared_batch_equals_the_same_batch_run_whole(tmp_path, dtype, head_dim, quantization, floor):
    """float32 through SDPA; bfloat16 with head_dim 64 through the native attention kernel where this CPU runs it."""
    path = build_qwen3(tmp_path / "q", hidden=128, heads=2, kv_heads=1, head_dim=head_dim, seed=3)
    emb = Embedder(str(path), dtype=dtype, quantization=quantization, enforce_eager=True)
    runner = emb._loaded.runner
    assert runner.share_prefixes
    batch = _batch(emb.tokenizer)
    whole, whole_tokens = _tokens_run(runner, batch, share=False)
    shared, shared_tokens = _tokens_run(runner, batch, share=True)
    assert shared_tokens < 0.7 * whole_tokens
    assert whole.shape == shared.shape == (len(batch), 128)
    assert min(cos(a, b) for a, b in zip(whole, shared, strict=True)) >= floor
    alone = np.stack([runner.run([ids])[0] for ids in batch[:3]])  # and each alone, where nothing is shared
    assert min(cos(a, b) for a, b in zip(alone, shared[:3], strict=True)) >= floor


def test_bidirectional_decoders_and_other_poolings_do_not_share(tmp_path):
    path = build_qwen3(tmp_path / "mean", st_pooling="mean", seed=4)
    assert not Embedder(str(path), dtype="float32", enforce_eager=True)._loaded.runner.share_prefixes
    bidirectional = Embedder(
        str(build_qwen3(tmp_path / "bi", seed=5)), dtype="float32", hf_overrides={"is_causal": False},
        enforce_eager=True,
    )  # fmt: skip
    assert not bidirectional._loaded.runner.share_prefixes


def test_a_rerank_request_scores_the_same_with_its_head_computed_once(tmp_path):
    path = build_qwen3_reranker(tmp_path / "r", seed=6)
    ours = Reranker(str(path), dtype="float32", hf_overrides=RERANKER_OVERRIDES, enforce_eager=True)
    documents = [d + f" ({i})" for i, d in enumerate(DOCUMENTS * 3)][:40]
    runner = ours._loaded.runner
    with _tokens_seen(runner) as shared_seen:
        shared = ours.score([(QUERIES[1], d) for d in documents])
    runner.share_prefixes = False
    with _tokens_seen(runner) as whole_seen:
        whole = ours.score([(QUERIES[1], d) for d in documents])
    np.testing.assert_allclose(shared, whole, atol=1e-5)
    assert sum(shared_seen) < 0.8 * sum(whole_seen)
