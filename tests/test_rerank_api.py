"""/rerank, /v1/rerank, /v2/rerank and /score on a real (tiny) cross-encoder, and on an embedding model; and the
clients that call them against a real `ember serve`."""

import os

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from checkpoints import build_bert, build_cross_encoder
from corpus import DOCUMENTS, QUERIES
from ember import Reranker
from ember.api.app import create_app
from ember.config import EngineConfig, ModelConfig, ServerConfig
from ember.engine.build import build_engine, load
from server import Server

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def ce_dir(tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp("ce") / "m", kind="bert")


@pytest.fixture(scope="module")
def offline(ce_dir):
    return Reranker(str(ce_dir), dtype="float32", max_model_len=64, enforce_eager=True)


def _client(path, max_len=64):
    loaded = load(ModelConfig(str(path), dtype="float32", max_model_len=max_len))
    engine = build_engine(loaded, EngineConfig())
    return TestClient(create_app(engine, ServerConfig(served_model_names=("rr",))), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(ce_dir):
    with _client(ce_dir) as c:
        yield c


def _pair_tokens(offline, query, docs):
    return sum(len(ids) for ids, _ in offline.tokenizer.encode_pairs([(query, d) for d in docs]))


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_ranks_best_first_with_documents_usage_and_meta(client, offline, route):
    docs = DOCUMENTS[:8]
    r = client.post(route, json={"model": "rr", "query": QUERIES[1], "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = offline.score([(QUERIES[1], d) for d in docs])
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == len(docs)
    for x in body["results"]:
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-5 and x["document"] == {"text": docs[x["index"]]}
    tokens = _pair_tokens(offline, QUERIES[1], docs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["meta"]["billed_units"]["total_tokens"] == tokens and body["model"] == "rr"


def test_rerank_options_top_n_objects_return_documents_and_raw_logits(client, offline):
    docs = [{"text": d} for d in DOCUMENTS[:6]]
    r = client.post("/rerank", json={"query": "q", "documents": docs, "top_n": 2, "return_documents": False})
    assert len(r.json()["results"]) == 2 and all("document" not in x for x in r.json()["results"])
    everything = client.post("/rerank", json={"query": "q", "documents": docs, "top_n": 0, "use_activation": None})
    assert len(everything.json()["results"]) == 6
    raw = client.post("/rerank", json={"query": "q", "documents": docs, "use_activation": False}).json()["results"]
    for x in raw:  # the logit: sigmoid of it is the default score
        p = 1 / (1 + np.exp(-x["relevance_score"]))
        assert abs(p - offline.score([("q", DOCUMENTS[x["index"]])])[0]) < 1e-5


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(client, offline):
    one = client.post("/score", json={"text_1": "q", "text_2": "d"}).json()
    assert one["object"] == "list" and one["data"][0]["object"] == "score" and len(one["data"]) == 1
    assert abs(one["data"][0]["score"] - offline.score([("q", "d")])[0]) < 1e-5
    many = client.post("/v1/score", json={"queries": "q", "documents": ["a", "b", "c"]}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    assert np.allclose([d["score"] for d in many["data"]], offline.score([("q", t) for t in "abc"]), atol=1e-5)
    paired = client.post("/score", json={"data_1": ["x", "y"], "data_2": ["a", "b"]}).json()
    assert np.allclose([d["score"] for d in paired["data"]], offline.score([("x", "a"), ("y", "b")]), atol=1e-5)
    assert paired["usage"]["prompt_tokens"] == _pair_tokens(offline, "x", ["a"]) + _pair_tokens(offline, "y", ["b"])


@pytest.mark.parametrize(
    ("route", "payload", "needle"),
    [
        ("/rerank", {"query": "q", "documents": []}, "At least one text_pair element must be given"),
        ("/rerank", {"query": "q", "documents": [3]}, "documents"),
        ("/rerank", {"documents": ["d"]}, "query"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_1 has 2 items and text_2 3"),
        ("/score", {"text_1": "a"}, "required"),
        ("/rerank", {"query": "q " * 80, "documents": ["d"]}, "maximum context length is 64 tokens"),
        ("/v1/embeddings", {"input": "x"}, "use /rerank or /score"),
    ],
)
def test_bad_requests_are_400_in_openai_shape(client, route, payload, needle):
    r = client.post(route, json=payload)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_unknown_model_is_404_and_a_thousand_documents_work(client):
    assert client.post("/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}).status_code == 404
    docs = [f"document number {i}" for i in range(1000)]
    r = client.post("/rerank", json={"query": "which number", "documents": docs, "top_n": 5})
    assert r.status_code == 200 and len(r.json()["results"]) == 5


def test_models_and_info_say_the_task(client):
    assert client.get("/v1/models").json()["data"][0]["task"] == "score"
    assert client.get("/info").json()["task"] == "score"


def test_an_embedding_model_reranks_by_cosine(tmp_path):
    path = build_bert(tmp_path / "emb", layers=1, hidden=32)
    with _client(path) as c:
        body = c.post("/rerank", json={"query": "cats", "documents": ["dogs", "cats", "cars"]}).json()
        embedded = c.post("/v1/embeddings", json={"input": ["cats", "dogs", "cats", "cars"]}).json()["data"]
    v = [np.array(e["embedding"]) for e in embedded]
    cosines = {i: float(v[0] @ v[i + 1]) for i in range(3)}
    assert [x["index"] for x in body["results"]] == sorted(cosines, key=lambda i: -cosines[i])
    assert all(abs(x["relevance_score"] - cosines[x["index"]]) < 1e-5 for x in body["results"])


@pytest.fixture(scope="module")
def server(ce_dir, tmp_path_factory):
    srv = Server([str(ce_dir), "--served-model-name", "rr", "--api-key", "k", "--dtype", "float32"],
                 tmp_path_factory.mktemp("log") / "server.log")  # fmt: skip
    yield srv
    srv.stop()


def test_litellm_rerank_through_hosted_vllm_and_cohere_routes(server, offline):
    import litellm

    docs = DOCUMENTS[:5]
    expected = offline.score([(QUERIES[0], d) for d in docs])
    for model in ("hosted_vllm/rr", "cohere/rr"):
        r = litellm.rerank(model=model, api_base=server.url, api_key="k", query=QUERIES[0], documents=docs, top_n=3)
        assert [x["index"] for x in r.results] == sorted(range(5), key=lambda i: -expected[i])[:3], model
        assert all(abs(x["relevance_score"] - expected[x["index"]]) < 1e-4 for x in r.results)
        assert r.meta["billed_units"]["total_tokens"] == _pair_tokens(offline, QUERIES[0], docs)


def test_the_api_key_guards_rerank_and_score(server):
    assert httpx.post(server.url + "/rerank", json={"query": "q", "documents": ["d"]}).status_code == 401
    ok = httpx.post(server.url + "/score", json={"text_1": "q", "text_2": "d"}, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200
    assert 'ember_requests_total{endpoint="/score",status="200"} 1.0' in httpx.get(server.url + "/metrics").text


def test_the_cohere_sdk_reranks_through_v2(server, offline):
    cohere = pytest.importorskip("cohere")
    docs = DOCUMENTS[:5]
    expected = offline.score([(QUERIES[0], d) for d in docs])
    client = cohere.ClientV2(api_key="k", base_url=server.url)
    r = client.rerank(model="rr", query=QUERIES[0], documents=docs, top_n=2)
    assert [x.index for x in r.results] == sorted(range(5), key=lambda i: -expected[i])[:2]
    assert all(abs(x.relevance_score - expected[x.index]) < 1e-4 for x in r.results)
    assert r.meta.billed_units.search_units == 1


def _order(offline, query, docs, n):
    scores = offline.score([(query, d) for d in docs])
    return sorted(range(len(docs)), key=lambda i: -scores[i])[:n], scores


def test_langchain_and_llamaindex_cohere_rerankers_take_ember_as_base_url(server, offline):
    pytest.importorskip("langchain_cohere")
    pytest.importorskip("llama_index.postprocessor.cohere_rerank")
    from langchain_cohere import CohereRerank as LangChainRerank
    from langchain_core.documents import Document
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.cohere_rerank import CohereRerank as LlamaIndexRerank

    docs = DOCUMENTS[:5]
    best, scores = _order(offline, QUERIES[0], docs, 2)
    lc = LangChainRerank(cohere_api_key="k", base_url=server.url, model="rr", top_n=2)
    ranked = lc.compress_documents([Document(page_content=d) for d in docs], QUERIES[0])
    assert [docs.index(d.page_content) for d in ranked] == best
    assert abs(ranked[0].metadata["relevance_score"] - scores[best[0]]) < 1e-4
    li = LlamaIndexRerank(api_key="k", base_url=server.url, model="rr", top_n=2)
    nodes = li.postprocess_nodes([NodeWithScore(node=TextNode(text=d)) for d in docs], QueryBundle(QUERIES[0]))
    assert [docs.index(n.node.get_content()) for n in nodes] == best
    assert abs(nodes[0].score - scores[best[0]]) < 1e-4
