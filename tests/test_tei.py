"""TEI's native API: its routes' request and answer shapes and error bodies on tiny models, then TEI's own clients
(huggingface_hub's InferenceClient, LangChain, Haystack, LlamaIndex) against a real `ember serve`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from fastapi.testclient import TestClient

from checkpoints import build_bert, build_cross_encoder
from corpus import DOCUMENTS, QUERIES
from ember import Embedder
from ember.api.app import create_app
from ember.config import EngineConfig, ModelConfig, ServerConfig
from ember.engine.build import build_engine, load
from server import Server

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

LABELS = {0: "negative", 1: "neutral", 2: "positive"}
KEY = "tei-key"


def _client(path, **server):
    loaded = load(ModelConfig(str(path), dtype="float32", max_model_len=64, hf_overrides={"is_matryoshka": True}))
    engine = build_engine(loaded, EngineConfig())
    config = ServerConfig(served_model_names=("m",), model_path=str(path), **server)
    return TestClient(create_app(engine, config), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m", layers=2, hidden=64)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("clf") / "m", labels=3, id2label=LABELS)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("ce") / "m", labels=1)


@pytest.fixture(scope="module")
def embedder(bert_dir):
    with _client(bert_dir, max_inputs_per_request=8) as c:
        yield c


@pytest.fixture(scope="module")
def classifier(classifier_dir):
    with _client(classifier_dir) as c:
        yield c


@pytest.fixture(scope="module")
def reranker(reranker_dir):
    with _client(reranker_dir) as c:
        yield c


@pytest.fixture(scope="module")
def offline(bert_dir):
    return Embedder(str(bert_dir), dtype="float32", max_model_len=64, hf_overrides={"is_matryoshka": True})


def test_embed_a_list_of_vectors_as_the_embedder_gives(embedder, offline):
    one = embedder.post("/embed", json={"inputs": DOCUMENTS[0]})
    assert one.status_code == 200, one.text
    want = offline.embed(DOCUMENTS[:3]).vectors
    np.testing.assert_allclose(one.json(), [want[0]], atol=1e-5)
    many = embedder.post("/embed", json={"inputs": DOCUMENTS[:3]}).json()
    np.testing.assert_allclose(many, want, atol=1e-5)
    raw = np.asarray(embedder.post("/embed", json={"inputs": DOCUMENTS[0], "normalize": False}).json()[0])
    assert abs(np.linalg.norm(raw) - 1) > 1e-3 and np.allclose(raw / np.linalg.norm(raw), want[0], atol=1e-5)
    short = embedder.post("/embed", json={"inputs": DOCUMENTS[0], "dimensions": 16}).json()
    np.testing.assert_allclose(short, offline.embed(DOCUMENTS[:1], dimensions=16).vectors, atol=1e-5)
    ids = offline.tokenizer.encode(DOCUMENTS[0])
    np.testing.assert_allclose(embedder.post("/embed", json={"inputs": ids}).json(), [want[0]], atol=1e-5)


def test_embed_all_gives_every_tokens_vector(embedder, offline):
    r = embedder.post("/embed_all", json={"inputs": [DOCUMENTS[0], DOCUMENTS[1]]})
    assert r.status_code == 200, r.text
    rows = r.json()
    assert [len(x) for x in rows] == [len(offline.tokenizer.encode(d)) for d in DOCUMENTS[:2]]
    assert len(rows[0][0]) == 64


def test_predict_single_pair_and_batch_best_first(classifier):
    want = classifier.post("/classify", json={"input": QUERIES[0]}).json()["data"][0]["probs"]
    single = classifier.post("/predict", json={"inputs": QUERIES[0]})
    assert single.status_code == 200, single.text
    got = single.json()
    assert [x["score"] for x in got] == sorted(want, reverse=True)
    assert {x["label"]: x["score"] for x in got} == pytest.approx({LABELS[i]: p for i, p in enumerate(want)})
    raw = classifier.post("/predict", json={"inputs": [QUERIES[0]], "raw_scores": True}).json()
    logits = classifier.post("/classify", json={"input": QUERIES[0], "use_activation": False}).json()["data"][0]
    assert sorted(x["score"] for x in raw) == pytest.approx(sorted(logits["probs"]), abs=1e-5)
    pair = classifier.post("/predict", json={"inputs": [QUERIES[0], DOCUMENTS[0]]}).json()
    assert len(pair) == 3 and abs(sum(x["score"] for x in pair) - 1) < 1e-5 and pair != got
    batch = classifier.post("/predict", json={"inputs": [[QUERIES[0]], [QUERIES[0], DOCUMENTS[0]]]}).json()
    assert batch[0] == pytest.approx(got) and batch[1] == pytest.approx(pair)


def test_rerank_in_teis_form_and_vllms(reranker):
    texts = DOCUMENTS[:5]
    r = reranker.post("/rerank", json={"query": QUERIES[1], "texts": texts, "return_text": True})
    assert r.status_code == 200, r.text
    got = r.json()
    vllm = reranker.post("/rerank", json={"query": QUERIES[1], "documents": texts}).json()["results"]
    assert [x["index"] for x in got] == [x["index"] for x in vllm]
    assert [x["score"] for x in got] == pytest.approx([x["relevance_score"] for x in vllm])
    assert all(x["text"] == texts[x["index"]] for x in got)
    raw = reranker.post("/rerank", json={"query": QUERIES[1], "texts": texts, "raw_scores": True}).json()
    assert "text" not in raw[0]
    for x in raw:
        p = 1 / (1 + np.exp(-x["score"]))
        assert abs(p - got[[y["index"] for y in got].index(x["index"])]["score"]) < 1e-5


def test_tokenize_decode_in_teis_shapes(embedder, offline):
    text = "naïve café"
    r = embedder.post("/tokenize", json={"inputs": text})
    assert r.status_code == 200, r.text
    (tokens,) = r.json()
    assert [t["id"] for t in tokens] == offline.tokenizer.encode(text)
    assert tokens[0]["special"] and tokens[0]["start"] is None and tokens[-1]["special"]
    raw = text.encode()
    for t in tokens[1:-1]:
        assert not t["special"] and raw[t["start"] : t["stop"]].decode() == t["text"]
    assert tokens[-2]["stop"] == len(raw)  # UTF-8 bytes, not characters
    two = embedder.post("/tokenize", json={"inputs": ["a", "b c"], "add_special_tokens": False}).json()
    assert [len(x) for x in two] == [1, 2]
    vllm = embedder.post("/tokenize", json={"prompt": text}).json()
    assert vllm["tokens"] == [t["id"] for t in tokens]
    ids = offline.tokenizer.encode("hello world")
    assert embedder.post("/decode", json={"ids": ids}).json() == ["hello world"]
    both = embedder.post("/decode", json={"ids": [ids, ids], "skip_special_tokens": False}).json()
    assert len(both) == 2 and both[0].startswith("[CLS]")


def test_similarity_is_the_cosine_to_the_source(embedder, offline):
    body = {"inputs": {"source_sentence": QUERIES[0], "sentences": DOCUMENTS[:3]}}
    got = embedder.post("/similarity", json=body).json()
    v = offline.embed([QUERIES[0], *DOCUMENTS[:3]]).vectors
    assert got == pytest.approx([float(v[0] @ x) for x in v[1:]], abs=1e-5)


def test_info_has_teis_fields(embedder, classifier, reranker, bert_dir):
    info = embedder.get("/info").json()
    assert info["model_id"] == str(bert_dir) and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 64 and info["max_client_batch_size"] == 8 and info["model_dtype"] == "float32"
    assert info["model"] == "m" and "kernels" in info  # ember's own fields stay
    labels = classifier.get("/info").json()["model_type"]["classifier"]
    assert (
        labels["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"} and labels["label2id"]["neutral"] == 1
    )
    assert "reranker" in reranker.get("/info").json()["model_type"]


def test_root_answers_as_teis_for_the_model(embedder, classifier, reranker, offline):
    vectors = embedder.post("/", json={"inputs": [DOCUMENTS[0]]}).json()
    np.testing.assert_allclose(vectors, offline.embed(DOCUMENTS[:1]).vectors, atol=1e-5)
    labels = classifier.post("/", json={"inputs": QUERIES[0], "parameters": {"top_k": None}}).json()
    assert {x["label"] for x in labels} == set(LABELS.values())
    ranked = reranker.post("/", json={"query": QUERIES[0], "texts": DOCUMENTS[:3]}).json()
    assert sorted(x["index"] for x in ranked) == [0, 1, 2]


@pytest.mark.parametrize(
    ("path", "body", "status", "kind"),
    [
        ("/embed", {"inputs": []}, 400, "Empty"),
        ("/embed", {"inputs": ""}, 400, "Empty"),
        ("/embed", {"inputs": 5}, 422, "Validation"),
        ("/embed", {"inputs": ["x"] * 9}, 422, "Validation"),
        ("/embed", {"inputs": "x", "dimensions": 0}, 422, "Validation"),
        ("/embed", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation"),
        ("/predict", {"inputs": "x"}, 424, "Backend"),
        ("/embed_sparse", {"inputs": "x"}, 424, "Backend"),
        ("/decode", {"ids": []}, 400, "Empty"),
        ("/decode", {"ids": [10**9]}, 422, "Validation"),
        ("/tokenize", {"inputs": ""}, 422, "Validation"),
        ("/", b"{not json", 422, "Validation"),
    ],
)
def test_errors_in_teis_body(embedder, path, body, status, kind):
    r = embedder.post(path, content=body) if isinstance(body, bytes) else embedder.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == kind and isinstance(r.json()["error"], str)


def test_embed_on_a_classifier_and_openai_routes_keep_their_shape(classifier, embedder):
    r = classifier.post("/embed", json={"inputs": "x"})
    assert r.status_code == 424 and r.json()["error_type"] == "Backend"
    openai = embedder.post("/v1/embeddings", json={"input": []})
    assert openai.status_code == 400 and openai.json()["error"]["type"] == "BadRequestError"


# --------------------------------------------------------------------------- TEI's clients, real server


@pytest.fixture
def hub_online(monkeypatch):
    """huggingface_hub refuses every URL, a local server's too, under HF_HUB_OFFLINE=1 (as CI runs): its
    clients talk to ember only with offline mode off in their process."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture(scope="module")
def embed_server(bert_dir, tmp_path_factory):
    srv = Server([str(bert_dir), "--api-key", KEY, "--max-model-len", "64", "--dtype", "float32"],
                 tmp_path_factory.mktemp("l") / "e.log")  # fmt: skip  # as `offline`: bf16 is auto on some CPUs
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def rank_server(reranker_dir, tmp_path_factory):
    srv = Server([str(reranker_dir), "--api-key", KEY, "--max-model-len", "64", "--dtype", "float32"],
                 tmp_path_factory.mktemp("l") / "r.log")  # fmt: skip
    yield srv.url
    srv.stop()


def test_huggingface_hub_inference_client(hub_online, embed_server, offline):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=embed_server, token=KEY)
    got = client.feature_extraction(DOCUMENTS[:2])
    np.testing.assert_allclose(got, offline.embed(DOCUMENTS[:2]).vectors, atol=1e-5)


def test_huggingface_hub_text_classification(hub_online, classifier_dir, tmp_path):
    from huggingface_hub import InferenceClient

    srv = Server([str(classifier_dir), "--api-key", KEY, "--max-model-len", "64"], tmp_path / "c.log")
    try:
        got = InferenceClient(model=srv.url, token=KEY).text_classification(QUERIES[0])
    finally:
        srv.stop()
    got = got if isinstance(got, list) else [got]
    assert got[0].label in LABELS.values() and 0 < got[0].score <= 1


def test_langchain_huggingface_endpoint_embeddings(hub_online, embed_server, offline):
    """langchain-huggingface 1.2 refuses a URL as `model` (older releases took the TEI URL there): the class is
    built with a repo id and given an InferenceClient on ember's URL, as docs/clients.md shows."""
    pytest.importorskip("langchain_huggingface")
    from huggingface_hub import AsyncInferenceClient, InferenceClient
    from langchain_huggingface import HuggingFaceEndpointEmbeddings

    emb = HuggingFaceEndpointEmbeddings(model="sentence-transformers/all-MiniLM-L6-v2", huggingfacehub_api_token=KEY)
    emb.client = InferenceClient(model=embed_server, token=KEY)
    emb.async_client = AsyncInferenceClient(model=embed_server, token=KEY)
    np.testing.assert_allclose(emb.embed_documents(DOCUMENTS[:2]), offline.embed(DOCUMENTS[:2]).vectors, atol=1e-5)
    np.testing.assert_allclose(emb.embed_query(QUERIES[0]), offline.embed(QUERIES[:1]).vectors[0], atol=1e-5)


def test_haystack_tei_embedder_and_ranker(hub_online, embed_server, rank_server, offline):
    from haystack import Document
    from haystack.utils import Secret
    from haystack_integrations.components.embedders.huggingface_api import HuggingFaceAPIDocumentEmbedder
    from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker

    embedder = HuggingFaceAPIDocumentEmbedder(
        api_type="text_embeddings_inference", api_params={"url": embed_server}, token=Secret.from_token(KEY)
    )
    docs = embedder.run(documents=[Document(content=d) for d in DOCUMENTS[:2]])["documents"]
    np.testing.assert_allclose(
        [d.embedding for d in docs], offline.embed(DOCUMENTS[:2], normalize=False).vectors, atol=1e-4
    )
    ranker = HuggingFaceTEIRanker(url=rank_server, token=Secret.from_token(KEY), top_k=2)
    ranked = ranker.run(query=QUERIES[0], documents=[Document(content=d) for d in DOCUMENTS[:4]])["documents"]
    assert len(ranked) == 2 and ranked[0].score >= ranked[1].score


def test_llamaindex_text_embeddings_inference(embed_server, offline):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    emb = TextEmbeddingsInference(model_name="m", base_url=embed_server, auth_token=KEY)
    got = emb.get_text_embedding_batch(DOCUMENTS[:2])
    np.testing.assert_allclose(got, offline.embed(DOCUMENTS[:2]).vectors, atol=1e-5)
    assert json.loads(json.dumps(got))  # plain lists


def test_tei_paths_are_the_tei_routers_paths():
    from ember.api.errors import TEI_PATHS
    from ember.api.sparse import sparse
    from ember.api.tei import tei

    assert {r.path for r in (*tei.routes, *sparse.routes)} == TEI_PATHS  # type: ignore[attr-defined]
