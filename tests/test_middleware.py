"""The edge middleware on its own ASGI app: request ids, body limits, JSON bodies, the access log, metrics."""

import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from ember.api.errors import install_error_handlers
from ember.api.metrics import Metrics
from ember.api.middleware import EdgeMiddleware


@pytest.fixture
def app():
    app = FastAPI()

    @app.post("/v1/embeddings")
    async def echo(request: Request) -> dict:
        body = await request.json()
        request.state.tokens = 7
        return {"id": request.state.request_id, "got": body}

    metrics = Metrics()
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, metrics=metrics, max_body_bytes=100, endpoints={"/v1/embeddings"})
    app.state.metrics = metrics
    return app


def test_request_ids_are_echoed_or_made_and_reach_the_handler(app):
    client = TestClient(app)
    r = client.post("/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "abc"})
    assert r.headers["x-request-id"] == "abc" and r.json()["id"] == "abc"
    made = client.post("/v1/embeddings", json={"input": "x"})
    assert len(made.headers["x-request-id"]) == 32 and made.json()["id"] == made.headers["x-request-id"]


def test_a_body_over_the_limit_is_413_whether_announced_or_streamed(app):
    client = TestClient(app, raise_server_exceptions=False)
    big = '{"input": "' + "x" * 200 + '"}'
    announced = client.post("/v1/embeddings", content=big, headers={"content-type": "application/json"})
    assert announced.status_code == 413 and "limit of 100 bytes" in announced.json()["error"]["message"]

    def chunks():
        yield b'{"input": "'
        yield b"x" * 200
        yield b'"}'

    streamed = client.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413


def test_a_form_encoded_body_is_read_as_json(app):
    r = TestClient(app).post("/v1/embeddings", content=b'{"input": "y"}', headers={"content-type": "x-www-form"})
    assert r.status_code == 200 and r.json()["got"] == {"input": "y"}


def test_the_access_log_has_one_line_per_request_and_never_the_input(app, caplog):
    with caplog.at_level(logging.INFO, logger="ember.access"):
        TestClient(app).post("/v1/embeddings", json={"input": "secret text"}, headers={"x-request-id": "r1"})
    lines = [r.getMessage() for r in caplog.records if r.name == "ember.access"]
    assert len(lines) == 1 and "id=r1" in lines[0] and "tokens=7" in lines[0] and "secret" not in lines[0]


def test_requests_are_counted_by_endpoint_and_status(app):
    client = TestClient(app, raise_server_exceptions=False)
    client.post("/v1/embeddings", json={"input": "x"})
    client.post("/v1/embeddings", content="{" * 300, headers={"content-type": "application/json"})
    client.get("/nowhere")
    text = app.state.metrics.render().decode()
    assert 'ember_requests_total{endpoint="/v1/embeddings",status="200"} 1.0' in text
    assert 'ember_requests_total{endpoint="/v1/embeddings",status="413"} 1.0' in text
    assert 'ember_requests_total{endpoint="other",status="404"} 1.0' in text


def test_every_route_of_the_app_is_its_own_metrics_endpoint(client):
    """The endpoint label comes from the app's own routes (no hand-kept list that misses one)."""
    for path in ("/embed_sparse", "/v2/embed", "/invocations", "/v1/score", "/tokenize"):
        client.post(path, json={})
    client.post("/not-a-route", json={})
    text = client.app.state.ctx.metrics.render().decode()
    for path in ("/v2/embed", "/invocations", "/v1/score", "/tokenize"):
        assert f'ember_requests_total{{endpoint="{path}",status="400"}} 1.0' in text
    assert 'ember_requests_total{endpoint="/embed_sparse",status="422"} 1.0' in text  # TEI's route: TEI's 422
    assert 'ember_requests_total{endpoint="other",status="404"} 1.0' in text
