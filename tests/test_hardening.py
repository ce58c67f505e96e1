"""Abuse at the HTTP edge: text that is not Unicode, loose types, the key checked before the body, request ids that
could forge log lines, unexpected errors, and a client that leaves mid-body."""

import logging

import pytest
from fastapi.testclient import TestClient

from ember.api.app import create_app
from ember.config import EngineConfig, ServerConfig
from ember.engine.engine import AsyncEngine


def _client(runner, tokenizer, **server):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(), None)
    app = create_app(engine, ServerConfig(served_model_names=("m",), **server))
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/embeddings", '{"input": "\\ud800"}'),
        ("/v1/embeddings", '{"input": ["fine", "bad \\udfff here"]}'),
        ("/pooling", '{"input": "\\ud800"}'),
        ("/tokenize", '{"prompt": "\\ud800"}'),
        ("/rerank", '{"query": "q", "documents": ["\\ud800"]}'),
        ("/v2/embed", '{"texts": ["\\ud800"]}'),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_it_not_a_500(client, route, body):
    r = client.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "lone surrogate" in r.json()["error"]["message"] and r.headers["x-request-id"]
    assert client.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"input": [True, False]},
        {"input": [["102", "7"]]},
        {"input": [[1.0, 2.0]]},
        {"input": "x", "normalize": "yes"},
        {"input": "x", "dimensions": "8"},
        {"input": "x", "add_special_tokens": 1},
    ],
)
def test_loose_types_are_400_not_coerced(client, body):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"


def test_the_key_is_checked_before_the_body_is_read(runner, tokenizer):
    with _client(runner, tokenizer, api_keys=("k",)) as c:
        for route in ("/v1/embeddings", "/rerank", "/v2/embed", "/invocations", "/tokenize"):
            r = c.post(route, content=b'{"input": ', headers={"content-type": "application/json"})
            assert r.status_code == 401, route
            assert r.json()["error"]["type"] == "AuthenticationError" and r.headers["x-request-id"]
        r = c.post("/v1/embeddings", content=b'{"input": ', headers={"authorization": "Bearer k"})
        assert r.status_code == 400  # with the key, the body's fault is reported
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # probes stay open


def test_a_request_id_that_could_forge_a_log_line_is_replaced(client, caplog):
    forged = 'x" 200 id=admin total=0.1ms\nINFO fake line'
    with caplog.at_level(logging.INFO, logger="ember.access"):
        r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": forged.replace("\n", " ")})
    assert r.status_code == 200 and r.headers["x-request-id"] != forged.replace("\n", " ")
    assert len(r.headers["x-request-id"]) == 32
    assert not any("id=admin" in rec.getMessage() for rec in caplog.records)
    r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "trace-42.abc"})
    assert r.headers["x-request-id"] == "trace-42.abc"  # a plain id is kept, so traces join up


def test_an_unexpected_error_is_one_openai_500_with_the_request_id(client, runner, caplog, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr("ember.api.routes.usage", broken)
    with caplog.at_level(logging.ERROR):
        r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "req-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "req-1"
    assert r.json() == {"error": {"message": "internal error", "type": "InternalServerError", "param": None,
                                  "code": 500}}  # fmt: skip
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "req-1" in tracebacks[0].getMessage()
    monkeypatch.undo()
    assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 200


def test_a_client_that_leaves_mid_body_is_counted_as_499_not_400():
    import asyncio

    from ember.api.metrics import Metrics
    from ember.api.middleware import EdgeMiddleware

    async def app(scope, receive, send):
        while (await receive())["type"] != "http.disconnect":
            pass
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    messages = iter([{"type": "http.request", "body": b'{"inp', "more_body": True}, {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    async def send(message):
        pass

    metrics = Metrics()
    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [(b"content-length", b"100")]}
    asyncio.run(EdgeMiddleware(app, metrics, 1000, endpoints={scope["path"]})(scope, receive, send))
    assert metrics.requests.labels("/v1/embeddings", "499")._value.get() == 1
    assert metrics.requests.labels("/v1/embeddings", "400")._value.get() == 0


@pytest.mark.parametrize("value", ["soon", "-1", "0", "inf", "nan"])
def test_a_bad_request_timeout_header_is_a_400_naming_it(client, value):
    r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-timeout": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
    assert client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-timeout": "2.5"}).status_code == 200
