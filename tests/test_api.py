"""The HTTP edge on a fake runner: schemas, encodings, usage, errors, auth, metrics."""

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ember.api.app import create_app
from ember.config import EngineConfig, ServerConfig
from ember.engine.engine import AsyncEngine


def make_client(runner, tokenizer, *, keys=(), engine_config=None, pooler=None, max_bytes=1024 * 1024):
    engine = AsyncEngine(runner, tokenizer, engine_config or EngineConfig(), pooler)
    config = ServerConfig(served_model_names=("fake-model", "alias"), api_keys=keys, max_request_bytes=max_bytes)
    return TestClient(create_app(engine, config), raise_server_exceptions=False)


@pytest.fixture
def client(runner, tokenizer):
    with make_client(runner, tokenizer) as c:
        yield c


def test_embeddings_float_shape_order_and_exact_usage(client, runner, tokenizer):
    texts = ["hello world", "a somewhat longer sentence here", "x"]
    r = client.post("/v1/embeddings", json={"model": "fake-model", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "fake-model" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    ids = [tokenizer.encode(t) for t in texts]
    for d, seq in zip(body["data"], ids, strict=True):
        np.testing.assert_allclose(d["embedding"], runner.expected(seq), rtol=1e-6, atol=1e-6)
    n = sum(len(s) for s in ids)
    assert body["usage"] == {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


@pytest.mark.parametrize("fmt", [None, "float", "base64"])
def test_encoding_formats_agree(client, fmt):
    ref = client.post("/v1/embeddings", json={"input": "same text"}).json()["data"][0]["embedding"]
    payload = {"input": "same text", "encoding_format": fmt}
    got = client.post("/v1/embeddings", json=payload).json()["data"][0]["embedding"]
    if fmt == "base64":
        got = np.frombuffer(base64.b64decode(got), dtype="<f4")
    # JSON carries the shortest decimal of each float32: exact once read back as float32
    assert (np.asarray(got, dtype=np.float32) == np.asarray(ref, dtype=np.float32)).all()


def test_string_token_ids_and_lists_of_token_ids(client, runner, tokenizer):
    ids = tokenizer.encode("token input")
    one = client.post("/v1/embeddings", json={"input": ids}).json()
    many = client.post("/v1/embeddings", json={"input": [ids, ids[:2]]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], runner.expected(ids), atol=1e-6)
    assert one["usage"]["prompt_tokens"] == len(ids) and many["usage"]["prompt_tokens"] == len(ids) + 2
    text = client.post("/v1/embeddings", json={"input": "token input"}).json()
    assert text["data"][0]["embedding"] == one["data"][0]["embedding"]


def test_dimensions_truncate_then_normalise(client):
    full = np.array(client.post("/v1/embeddings", json={"input": "abc"}).json()["data"][0]["embedding"])
    r = client.post("/v1/embeddings", json={"input": "abc", "dimensions": 4}).json()
    got = np.array(r["data"][0]["embedding"])
    assert got.shape == (4,)
    np.testing.assert_allclose(got, full[:4] / np.linalg.norm(full[:4]), atol=1e-6)


def test_exactly_max_model_len_is_served_and_one_more_is_refused_with_vllm_message(client):
    ok = client.post("/v1/embeddings", json={"input": [5] * 32})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 32
    r = client.post("/v1/embeddings", json={"input": [5] * 33})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "This model's maximum context length is 32 tokens. However, you requested 33 tokens"
    )


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 17}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["a", 1]}, "input"),
        ({"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"nope": 1}, "input"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(client, payload, param):
    r = client.post("/v1/embeddings", json=payload)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] == param
    assert error["message"]
    assert client.post("/v1/embeddings", json={"input": "still fine"}).status_code == 200


def test_malformed_json_unknown_model_and_oversized_body(runner, tokenizer):
    with make_client(runner, tokenizer, max_bytes=1000) as c:
        r = c.post("/v1/embeddings", content=b'{"input": ', headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = c.post("/v1/embeddings", json={"model": "gpt-4", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["message"] == "The model `gpt-4` does not exist."
        assert c.post("/v1/embeddings", json={"model": "alias", "input": "x"}).status_code == 200
        r = c.post("/v1/embeddings", json={"input": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert c.post("/v1/embeddings", json={"input": "after"}).status_code == 200


def test_api_key_protects_inference_not_probes(runner, tokenizer):
    with make_client(runner, tokenizer, keys=("k1", "k2")) as c:
        for path, body in [
            ("/v1/embeddings", {"input": "x"}),
            ("/tokenize", {"prompt": "x"}),
            ("/pooling", {"input": "x"}),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert (
            c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        assert c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_models_tokenize_detokenize_pooling_version(client, tokenizer):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model", "alias"] and models["data"][0]["max_model_len"] == 32
    tok = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert tok["tokens"] == tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"] and tok["max_model_len"] == 32
    detok = client.post("/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "hello world"}
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    pooled = client.post("/pooling", json={"input": "hello world"}).json()
    emb = client.post("/v1/embeddings", json={"input": "hello world"}).json()
    assert pooled["data"][0]["object"] == "pooling" and pooled["data"][0]["data"] == emb["data"][0]["embedding"]
    assert client.get("/version").json()["version"]


def test_request_id_echo_openapi_and_metrics(client):
    r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "embd-abc-123"
    assert client.post("/v1/embeddings", json={"input": "x"}).headers["x-request-id"]
    assert "/v1/embeddings" in client.get("/openapi.json").json()["paths"]
    assert client.get("/docs").status_code == 200
    text = client.get("/metrics").text
    assert 'ember_requests_total{endpoint="/v1/embeddings",status="200"} 2.0' in text
    for name in (
        "ember_request_duration_seconds_bucket",
        "ember_batch_tokens_bucket",
        "ember_queue_requests",
        "ember_prompt_tokens_total",
        "process_resident_memory_bytes",
        "ember_inference_duration_seconds",
    ):
        assert name in text
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("ember_batch_duration_seconds_count", "ember_batch_tokens_count"))
    }
    label = '{model_name="fake-model"}'  # every model series carries vLLM's model_name label
    assert counts[f"ember_batch_duration_seconds_count{label}"] == counts[f"ember_batch_tokens_count{label}"] >= 1


def test_unknown_fields_are_ignored_and_prompt_name_applies(client, runner, tokenizer):
    r = client.post("/v1/embeddings", json={"input": "abc", "user": "u", "priority": 3, "whatever": {"x": 1}})
    assert r.status_code == 200
    q = client.post("/v1/embeddings", json={"input": "abc", "prompt_name": "query"}).json()
    np.testing.assert_allclose(q["data"][0]["embedding"], runner.expected(tokenizer.encode("query: abc")), atol=1e-6)


def test_model_failure_fails_that_batch_and_the_server_keeps_serving(client, runner):
    runner.fail_when = lambda batch: any(len(s) == 7 for s in batch)
    r = client.post("/v1/embeddings", json={"input": [1, 2, 3, 4, 5, 6, 7]})
    assert r.status_code == 500 and "simulated model failure" in r.json()["error"]["message"]
    assert client.post("/v1/embeddings", json={"input": "fine"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_json_body_of_10mb_is_refused_cleanly(client):
    r = client.post(
        "/v1/embeddings",
        content=json.dumps({"input": "a" * (10 * 1024 * 1024)}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413


def test_a_body_sent_without_json_content_type_is_still_read(client):
    r = client.post(
        "/v1/embeddings",
        content=b'{"input": "curl -d style"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "embedding"


def test_client_closed_status_has_an_openai_body():
    from ember.api.errors import error_response

    r = error_response(499, "client closed the request")
    assert r.status_code == 499 and b"ClientClosedRequest" in r.body


def test_info_reports_the_model_and_each_kernel_and_metrics_gauge_them(client, runner):
    for _ in range(500):  # the kernel thread reports once it has run
        info = client.get("/info").json()
        if "attention" in info["kernels"]:
            break
    assert info["model"] == "fake-model" and info["task"] == "embed" and info["dimension"] == runner.info.dimension
    assert info["kernels"]["attention"] == {"active": False, "detail": runner.load_kernels()[0].detail}
    assert info["kernels"]["fused"]["active"] is False
    metrics = client.get("/metrics").text
    assert 'ember_kernel_active{kernel="attention",model_name="fake-model"} 0.0' in metrics


def test_docs_page_loads_its_assets_from_the_server_not_a_cdn(client):
    page = client.get("/docs").text
    assert "cdn.jsdelivr.net" not in page and "unpkg.com" not in page
    js = [part.split('"')[0] for part in page.split('src="')[1:] if part.split('"')[0].endswith(".js")]
    assert js and all(client.get(url).status_code == 200 for url in js)


def test_the_openapi_document_names_the_key_scheme_and_tags_every_route(client):
    doc = client.get("/openapi.json").json()
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"}
    assert doc["components"]["securitySchemes"]["apiKey"]["name"] == "x-api-key"
    tags = {t["name"] for t in doc["tags"]}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            assert len(op["tags"]) == 1 and op["tags"][0] in tags, (path, method)
            guarded = "401" in op["responses"]
            assert (op.get("security") == [{"bearer": []}, {"apiKey": []}]) == guarded, (path, method)
    assert doc["paths"]["/v1/embeddings"]["post"]["tags"] == ["embeddings"]
    assert doc["paths"]["/v2/rerank"]["post"]["tags"] == ["rerank and score"]
    assert "security" not in doc["paths"]["/health"]["get"] and doc["paths"]["/health"]["get"]["tags"] == ["operations"]
