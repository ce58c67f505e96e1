"""SPLADE sparse encoders against sentence-transformers' SparseEncoder on the same tiny random weights."""

import numpy as np
import pytest

from checkpoints.families import build_splade
from corpus import SENTENCES
from ember import Embedder

TEXTS = [*SENTENCES[:8], SENTENCES[50]]


def st_sparse(path, texts):
    from sentence_transformers import SparseEncoder

    out = SparseEncoder(str(path), device="cpu").encode(texts, batch_size=4, convert_to_tensor=True)
    return out.to_dense().numpy()


@pytest.fixture(scope="module", params=["max", "sum"])
def splade_dir(request, tmp_path_factory):
    return build_splade(tmp_path_factory.mktemp(f"splade-{request.param}"), strategy=request.param)


def test_vocabulary_weights_equal_sentence_transformers(splade_dir):
    ref = st_sparse(splade_dir, TEXTS)
    embedder = Embedder(str(splade_dir), dtype="float32", enforce_eager=True)
    ours = embedder.embed(TEXTS).vectors
    assert embedder.info.dimension == ours.shape[1] == ref.shape[1] == embedder.tokenizer.vocab_size
    assert embedder.info.pooling.method == "SPLADE" and not embedder.info.pooling.normalize
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    assert (ours > 0).sum(1).min() > 0 and (ours >= 0).all()  # sparse and non-negative, as log(1 + relu)


def test_a_text_alone_equals_the_same_text_in_a_batch(splade_dir):
    embedder = Embedder(str(splade_dir), dtype="float32", enforce_eager=True)
    batch = embedder.embed(TEXTS).vectors
    alone = np.stack([embedder.embed([t]).vectors[0] for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)


def test_a_long_input_in_chunks_merges_as_its_tokens_do(tmp_path):
    """With chunked processing, a document longer than the model is embedded in windows whose weights merge by the
    pooling strategy (max), not by the dense models' mean."""
    path = build_splade(tmp_path)
    whole = Embedder(str(path), dtype="float32", enforce_eager=True)
    text = " ".join(SENTENCES[:40])
    ids = whole.tokenizer.encode(text)
    assert len(ids) > 128
    chunked = Embedder(
        str(path),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        pooler_config={"enable_chunked_processing": True},
    )
    got = chunked.embed([ids]).vectors[0]
    content = ids[1:-1]
    windows = [ids[:1] + content[i : i + 62] + ids[-1:] for i in range(0, len(content), 62)]  # [CLS] part [SEP]
    want = whole.embed(windows).vectors.max(0)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from ember.api.app import create_app
    from ember.config import EngineConfig, ModelConfig, ServerConfig
    from ember.engine.build import build_engine, load

    path = build_splade(tmp_path_factory.mktemp("splade-api"))
    loaded = load(ModelConfig(str(path), dtype="float32", max_model_len=32))
    app = create_app(build_engine(loaded, EngineConfig()), ServerConfig(served_model_names=("splade",)))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.ref = st_sparse(path, TEXTS[:3])  # type: ignore[attr-defined]
        yield c


def test_embed_sparse_has_teis_shape_and_the_reference_weights(client):
    r = client.post("/embed_sparse", json={"inputs": TEXTS[:3], "truncate": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body) == 3
    for pairs, ref in zip(body, client.ref, strict=True):
        index = [p["index"] for p in pairs]
        assert index == sorted(index) == list(np.flatnonzero(ref))  # every non-zero entry, by index
        np.testing.assert_allclose([p["value"] for p in pairs], ref[index], rtol=1e-4, atol=1e-5)
    one = client.post("/embed_sparse", json={"inputs": TEXTS[0], "truncate": True}).json()
    assert len(one) == 1  # a string is one input, answered as a list of one
    assert [p["index"] for p in one[0]] == [p["index"] for p in body[0]]
    np.testing.assert_allclose([p["value"] for p in one[0]], [p["value"] for p in body[0]], atol=1e-5)


def test_top_k_keeps_the_largest_weights_in_index_order(client):
    full = client.post("/embed_sparse", json={"inputs": TEXTS[1]}).json()[0]
    top = client.post("/embed_sparse", json={"inputs": TEXTS[1], "top_k": 5}).json()[0]
    want = sorted(sorted(full, key=lambda p: -p["value"])[:5], key=lambda p: p["index"])
    assert top == want


def test_pooling_token_classify_gives_the_weights_as_vllms_sparse_entries(client):
    r = client.post("/pooling", json={"input": TEXTS[:2], "task": "token_classify", "truncate_prompt_tokens": -1,
                                      "return_tokens": True})  # fmt: skip
    assert r.status_code == 200, r.text
    for item, ref in zip(r.json()["data"], client.ref[:2], strict=True):
        entries = item["sparse_embedding"]
        index = [e["token_id"] for e in entries]
        assert index == list(np.flatnonzero(ref)) and "data" not in item  # no weight per token in SPLADE
        np.testing.assert_allclose([e["weight"] for e in entries], ref[index], rtol=1e-4, atol=1e-5)
        assert all(isinstance(e["token"], str) for e in entries)
    r = client.post("/pooling", json={"input": "a", "task": "token_embed"})
    assert r.status_code == 400
    assert (
        r.json()["error"]["message"] == "Unsupported task: 'token_embed' Supported tasks: ('embed', 'token_classify')"
    )


def test_the_dense_vector_on_v1_embeddings_and_clear_errors(client):
    dense = client.post("/v1/embeddings", json={"input": TEXTS[:1], "truncate_prompt_tokens": -1}).json()
    vector = np.array(dense["data"][0]["embedding"])
    np.testing.assert_allclose(vector, client.ref[0], rtol=1e-4, atol=1e-5)  # not normalised: SPLADE's weights
    too_long = client.post("/embed_sparse", json={"inputs": " ".join(SENTENCES[:20]), "truncate": False})
    assert too_long.status_code == 422 and too_long.json()["error_type"] == "Validation"  # TEI's route, TEI's error
    for bad, status in (({"inputs": []}, 400), ({"inputs": 3}, 422), ({"inputs": "x", "top_k": 0}, 422)):
        r = client.post("/embed_sparse", json=bad)
        assert r.status_code == status and isinstance(r.json()["error"], str), (bad, r.text)


def test_a_dense_model_refuses_embed_sparse(tmp_path):
    from fastapi.testclient import TestClient

    from checkpoints import build_bert
    from ember.api.app import create_app
    from ember.config import EngineConfig, ModelConfig, ServerConfig
    from ember.engine.build import build_engine, load

    loaded = load(ModelConfig(str(build_bert(tmp_path)), dtype="float32"))
    with TestClient(create_app(build_engine(loaded, EngineConfig()), ServerConfig(("m",)))) as c:
        r = c.post("/embed_sparse", json={"inputs": "hello"})
    assert r.status_code == 424 and "/embed_sparse needs a sparse model" in r.json()["error"]
    assert r.json()["error_type"] == "Backend"


def test_vllms_architecture_override_makes_a_plain_mlm_checkpoint_splade(tmp_path):
    """Without sentence-transformers files, vLLM's `--hf-overrides '{"architectures":
    ["BertSpladeSparseEmbeddingModel"]}'` selects the same model (max pooling)."""
    path = build_splade(tmp_path)
    ref = Embedder(str(path), dtype="float32", enforce_eager=True).embed(TEXTS[:3]).vectors
    for name in ("modules.json", "config_sentence_transformers.json"):
        (path / name).unlink()
    override = {"architectures": ["BertSpladeSparseEmbeddingModel"]}
    embedder = Embedder(str(path), dtype="float32", enforce_eager=True, hf_overrides=override)
    assert embedder.info.pooling.method == "SPLADE" and embedder.info.head.merge == "max"
    np.testing.assert_allclose(embedder.embed(TEXTS[:3]).vectors, ref, atol=1e-6)
