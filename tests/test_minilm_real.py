"""The real all-MiniLM-L6-v2 (bundled default) against sentence-transformers on the same weights."""

import numpy as np
import pytest

from corpus import DOCUMENTS, QUERIES, SENTENCES
from ember import Embedder
from ember.models.checkpoint import bundled_default_model
from ember.ops.linear import PackedLinear, onednn_bf16


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bundled_default_model()), device="cpu")


@pytest.fixture(scope="module")
def embedder():
    return Embedder(dtype="float32")


def _cos(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_default_model_is_the_bundled_minilm(embedder):
    info = embedder.info
    assert info.architecture == "BertModel" and info.dimension == 384 and info.max_model_len == 256
    assert (info.pooling.method, info.pooling.normalize) == ("MEAN", True)


def test_minilm_matches_sentence_transformers_on_real_sentences(embedder, reference):
    ours, counts = embedder.embed(SENTENCES)
    ref = reference.encode(SENTENCES, convert_to_numpy=True)
    assert len(SENTENCES) >= 50
    assert _cos(ours, ref).min() >= 0.9999
    # usage is exact: the same token count sentence-transformers' tokenizer produces, specials included
    assert counts == [len(reference.tokenizer(s)["input_ids"]) for s in SENTENCES]


def test_retrieval_ranking_is_identical(embedder, reference):
    q, _ = embedder.embed(QUERIES)
    d, _ = embedder.embed(DOCUMENTS)
    rq, rd = reference.encode(QUERIES), reference.encode(DOCUMENTS)
    assert (np.argsort(-(q @ d.T), axis=1) == np.argsort(-(rq @ rd.T), axis=1)).all()


def test_token_embed_matches_sentence_transformers_token_embeddings(embedder, reference):
    texts = SENTENCES[:8]
    ours = embedder.embed_tokens(texts, normalize=False)
    ref = reference.encode(texts, output_value="token_embeddings", convert_to_numpy=False)
    for got, want in zip(ours.vectors, ref, strict=True):
        want = want.float().numpy()
        assert got.shape == want.shape  # every token, specials included
        assert _cos(got, want).min() >= 0.9999
    alone = embedder.embed_tokens(texts[3]).vectors[0]  # a text alone equals the same text in the batch
    np.testing.assert_allclose(alone, embedder.embed_tokens(texts).vectors[3], atol=1e-5)
    assert np.allclose(np.linalg.norm(alone, axis=1), 1.0, atol=1e-5)  # normalised by default, per token


def test_bfloat16_stays_close_to_the_reference(reference):
    embedder = Embedder(dtype="bfloat16")
    if onednn_bf16():  # the layers run packed, with bias and GELU inside oneDNN's matmul
        packed = [m for m in embedder._loaded.runner.model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == 6 * 4  # per layer: q/k/v as one, attention output, intermediate, output
    ours, _ = embedder.embed(SENTENCES)
    assert _cos(ours, reference.encode(SENTENCES)).min() >= 0.999
