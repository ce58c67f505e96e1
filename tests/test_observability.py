"""Traces, JSON logs and timing headers end to end: a real `ember serve` exports each request's spans to an OTLP/HTTP
receiver started here (the client's trace id and parent kept, a child per stage), writes one JSON object per log line
with the request's fields and never its text, and answers with TEI's timing headers, whose figures match /metrics."""

import http.server
import itertools
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from checkpoints import build_bert
from ember.api.tracing import traces_url
from ember.errors import ConfigError
from server import Server

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class _Receiver(http.server.BaseHTTPRequestHandler):
    spans: list = []  # noqa: RUF012  (shared by the handler instances of one receiver)
    paths: list = []  # noqa: RUF012

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        export = ExportTraceServiceRequest.FromString(body)
        type(self).paths.append(self.path)
        for resource in export.resource_spans:
            service = {a.key: a.value.string_value for a in resource.resource.attributes}.get("service.name")
            for scope in resource.scope_spans:
                type(self).spans.extend((service, s) for s in scope.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    handler = type("Handler", (_Receiver,), {"spans": [], "paths": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert") / "m", layers=1, hidden=32)


def test_a_traced_request_reaches_the_receiver_under_the_clients_trace_with_a_span_per_stage(model, receiver, tmp_path):
    url, handler = receiver
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    server = Server([str(model), "--otlp-traces-endpoint", url], tmp_path / "log", env={"OTEL_SERVICE_NAME": "rag"})
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ["one", "two two"]},
                       headers={"traceparent": f"00-{trace_id}-{parent}-01"}, timeout=30)  # fmt: skip
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        assert httpx.get(server.url + "/v1/models").status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(handler.spans) < 6:
            time.sleep(0.2)
    finally:
        server.stop()
    assert set(handler.paths) == {"/v1/traces"}
    spans = [s for service, s in handler.spans if service == "rag"]
    roots = [s for s in spans if s.name == "POST /v1/embeddings"]
    assert len(roots) == 1
    root = roots[0]
    assert root.trace_id.hex() == trace_id and root.parent_span_id.hex() == parent
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["ember.request_id"].string_value == request_id
    assert attributes["http.response.status_code"].int_value == 200
    assert attributes["ember.tokens"].int_value == r.json()["usage"]["prompt_tokens"]
    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert set(children) == {"tokenize", "queue", "forward", "serialize"}
    assert all(s.trace_id == root.trace_id for s in children.values())
    forward = {a.key: a.value.int_value for a in children["forward"].attributes}
    assert forward["ember.batch.sequences"] == 2 and forward["ember.batch.tokens"] >= r.json()["usage"]["prompt_tokens"]
    order = [children[n] for n in ("tokenize", "queue", "forward", "serialize")]
    assert root.start_time_unix_nano <= order[0].start_time_unix_nano
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano + 1000 for a, b in itertools.pairwise(order))
    assert order[-1].end_time_unix_nano <= root.end_time_unix_nano
    # a request that never reached the model is traced too, on its own trace, without stages
    models = [s for s in spans if s.name == "GET /v1/models"]
    assert len(models) == 1 and models[0].trace_id != root.trace_id
    assert not any(s.parent_span_id == models[0].span_id for s in spans)


def test_the_endpoint_is_read_as_an_otlp_http_collector():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/custom/path") == "https://otel.example/custom/path"
    with pytest.raises(ConfigError, match="OTLP over HTTP"):
        traces_url("grpc://collector:4317")


def test_json_logs_carry_the_requests_fields_and_never_its_text(model, tmp_path):
    log = tmp_path / "log"
    server = Server([str(model), "--log-format", "json"], log)
    secret = "a confidential sentence about the merger"
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": secret}, headers={"x-request-id": "req-7"})
        assert r.status_code == 200
        httpx.post(server.url + "/v1/embeddings", json={"input": 7})  # 400
    finally:
        server.stop()
    text = log.read_text()
    assert secret not in text
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any(x["logger"].startswith("uvicorn") for x in lines)  # uvicorn's own lines too
    access = {x.get("request_id"): x for x in lines if x["logger"] == "ember.access"}
    line = access["req-7"]
    assert line["status"] == 200 and line["route"] == "/v1/embeddings" and line["method"] == "POST"
    assert line["model"] == str(model) and line["tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["total_ms"] >= line["inference_ms"] >= 0 and "queue_ms" in line and "tokenize_ms" in line
    assert any(x.get("status") == 400 for x in access.values())


def test_answers_from_the_model_carry_teis_timing_headers_and_metrics_count_tokenising(model, tmp_path):
    server = Server([str(model)], tmp_path / "log")
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ["timed"] * 3})
        health = httpx.get(server.url + "/health")
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    ms = {k: int(r.headers[k]) for k in ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time",
                                          "x-compute-time")}  # fmt: skip
    assert all(v >= 0 for v in ms.values())
    parts = ms["x-tokenization-time"] + ms["x-queue-time"] + ms["x-inference-time"]
    assert abs(ms["x-compute-time"] - parts) <= 2 and ms["x-compute-time"] <= ms["x-total-time"] + 1
    assert int(r.headers["x-compute-tokens"]) == r.json()["usage"]["prompt_tokens"]
    assert "x-inference-time" not in health.headers  # only answers the model computed
    assert re.search(r'^ember_tokenization_duration_seconds_count\{model_name="[^"]+"\} 1\.0$', metrics, re.M)


def test_serving_without_tracing_never_imports_the_sdk_or_exporter():
    # (FastAPI itself imports OpenTelemetry's API package where it is installed; the SDK and exporter are ember's)
    code = ("import sys, ember.cli.serve, ember.api.app, ember.api.middleware; "
            "print(any(m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')) for m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tracing_without_the_extra_is_refused_naming_it(model, tmp_path, monkeypatch):
    code = ("import sys; sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None; "
            "from ember.api.tracing import Tracing\n"
            "try:\n    Tracing('http://127.0.0.1:1')\nexcept Exception as e:\n    print(type(e).__name__, e)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ConfigError") and "pip install 'ember[otel]'" in out.stdout
