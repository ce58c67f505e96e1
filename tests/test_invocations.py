"""SageMaker's /invocations (the body picks the endpoint, as vLLM's) and the per-request limits: inputs per request
(checked before tokenising) and a request larger than the whole queue (413, never admitted)."""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from checkpoints import build_cross_encoder
from ember.api.app import create_app
from ember.config import EngineConfig, ModelConfig, ServerConfig
from ember.engine.build import build_engine, load
from ember.engine.engine import AsyncEngine


def _client(runner, tokenizer, **server):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(max_queued_tokens=server.pop("queued", 1_000_000)), None)
    return TestClient(create_app(engine, ServerConfig(served_model_names=("m",), **server)))


def test_invocations_answers_each_request_as_its_own_endpoint_would(client):
    direct = client.post("/v1/embeddings", json={"input": ["a b", "c"]}).json()
    r = client.post("/invocations", json={"input": ["a b", "c"]})
    assert r.status_code == 200
    assert [d["embedding"] for d in r.json()["data"]] == [d["embedding"] for d in direct["data"]]
    assert r.json()["usage"] == direct["usage"]
    ranked = client.post("/invocations", json={"query": "q", "documents": ["x y", "q"]}).json()
    assert ranked == {**client.post("/rerank", json={"query": "q", "documents": ["x y", "q"]}).json(),
                      "id": ranked["id"]}  # fmt: skip
    scored = client.post("/invocations", json={"text_1": "q", "text_2": ["x y", "q"]}).json()
    assert [d["score"] for d in scored["data"]] == [
        d["score"] for d in client.post("/score", json={"text_1": "q", "text_2": ["x y", "q"]}).json()["data"]
    ]


def test_invocations_refuses_what_no_endpoint_takes(client):
    r = client.post("/invocations", json={"prompt": "generate me"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Cannot find suitable handler for request. Expected one of: "
        "['EmbeddingRequest', 'RerankRequest', 'ScoreRequest']"
    )
    r = client.post("/invocations", content=b'{"input": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("JSON decode error")
    r = client.post("/invocations", json={"input": "x", "encoding_format": "npy"})  # chosen, then validated
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"


def test_invocations_needs_the_key_as_every_inference_route(runner, tokenizer):
    with _client(runner, tokenizer, api_keys=("k",)) as c:
        assert c.post("/invocations", json={"input": "x"}).status_code == 401
        assert c.post("/invocations", json={"input": "x"}, headers={"Authorization": "Bearer k"}).status_code == 200


def test_invocations_on_a_score_model_ranks_and_scores_but_does_not_embed(tmp_path):
    path = build_cross_encoder(tmp_path / "ce", kind="bert")
    engine = build_engine(load(ModelConfig(str(path), dtype="float32", max_model_len=64)), EngineConfig())
    with TestClient(create_app(engine, ServerConfig(served_model_names=("rr",)))) as c:
        r = c.post("/invocations", json={"query": "q", "documents": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()["results"]) == 2
        r = c.post("/invocations", json={"queries": ["q"], "documents": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        r = c.post("/invocations", json={"input": "x"})
        assert r.status_code == 400 and "['RerankRequest', 'ScoreRequest']" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/embeddings", {"input": ["t"] * 5}, "input"),
        ("/pooling", {"input": [[1, 2]] * 5}, "input"),
        ("/v2/embed", {"texts": ["t"] * 5}, "texts"),
        ("/rerank", {"query": "q", "documents": ["d"] * 5}, "documents"),
        ("/score", {"text_1": "q", "text_2": ["d"] * 5}, "text_2"),
        ("/invocations", {"input": ["t"] * 5}, "input"),
    ],
)
def test_more_inputs_than_the_cap_are_refused_before_any_work(runner, tokenizer, route, body, param):
    with _client(runner, tokenizer, max_inputs_per_request=4) as c:
        batches = len(runner.batches)
        r = c.post(route, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param
        assert error["message"] == (
            f"{param} list length 5 exceeds the maximum allowed count of 4. To increase this limit, set "
            "--max-inputs-per-request (EMBER_MAX_INPUTS_PER_REQUEST)."
        )
        assert len(runner.batches) == batches  # nothing was computed
        four = {k: (v[:4] if isinstance(v, list) else v) for k, v in body.items()}
        assert c.post(route, json=four).status_code == 200
        assert c.post("/v1/embeddings", json={"input": list(range(1000, 1020))}).status_code == 200  # one input


def test_a_request_larger_than_the_whole_queue_is_413_and_never_admitted(runner, tokenizer):
    with _client(runner, tokenizer, queued=40) as c:
        r = c.post("/v1/embeddings", json={"input": ["one two three four five six seven"] * 8})
        assert r.status_code == 413
        assert "--max-queued-tokens" in r.json()["error"]["message"] and "(40" in r.json()["error"]["message"]
        r = c.post("/v1/embeddings", json={"input": ["fits"] * 4})  # the queue was never taken
        assert r.status_code == 200 and len(r.json()["data"]) == 4
        assert np.isfinite(np.asarray(r.json()["data"][0]["embedding"])).all()


def test_tokenize_has_the_same_per_request_bound(runner, tokenizer):
    with _client(runner, tokenizer, queued=40) as c:
        r = c.post("/tokenize", json={"prompt": "word " * 100, "return_token_strs": True})
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
        assert c.post("/tokenize", json={"prompt": "word " * 10}).json()["count"] == 12


def test_tokenize_refuses_a_huge_text_from_its_start_without_tokenising_the_rest(runner, tokenizer, monkeypatch):
    seen: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: seen.append(len(text)) or encode(text, *a, **k))
    with _client(runner, tokenizer, queued=40) as c:
        huge = "word " * 200_000  # 1 MB
        r = c.post("/tokenize", json={"prompt": huge})
        assert r.status_code == 413 and "more than" in r.json()["error"]["message"]
        assert seen and max(seen) < 1000  # only a start of ~8 characters per token of the limit was tokenised
        seen.clear()
        dense = "a" * 300 + " " + "b" * 300  # longer than 8 x 40 characters but few tokens: counted whole
        r = c.post("/tokenize", json={"prompt": dense})
        assert r.status_code == 200 and r.json()["count"] == len(encode(dense))


def test_a_request_whose_answer_outgrows_the_memory_plan_is_413(runner, tokenizer):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(max_queued_vectors=4), None)
    with TestClient(create_app(engine, ServerConfig(served_model_names=("m",)))) as c:
        r = c.post("/v1/embeddings", json={"input": ["a"] * 5})
        assert r.status_code == 413 and "memory plan keeps for answers (4)" in r.json()["error"]["message"]
        r = c.post("/pooling", json={"input": "one two three four five", "task": "token_embed"})
        assert r.status_code == 413  # 7 token vectors
        assert c.post("/v1/embeddings", json={"input": ["a"] * 4}).status_code == 200
