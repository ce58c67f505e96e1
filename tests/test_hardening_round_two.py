"""Abuse that held memory or the event loop: bodies of millions of tiny JSON values, slow readers and slowloris
senders, big `bytes` answers, empty keys, forged log lines by path, redirects that echo the Host header; and the
same shapes against a real server inside a 700 MB memory cgroup, with /health answering throughout."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from cgroups import join_cgroup, real_v1_cgroup
from checkpoints import build_bert
from ember.api.app import create_app, max_body_values
from ember.api.encoding import METADATA_ITEMS
from ember.api.middleware import json_values
from ember.config import EngineConfig, ServerConfig
from ember.engine.engine import AsyncEngine
from ember.engine.scheduler import Scheduler
from ember.errors import OverloadedError
from ember.sizing import request_bytes
from server import Server, closed_by_server

MiB = 1 << 20


def _app(runner, tokenizer, **server):
    engine = AsyncEngine(runner, tokenizer, EngineConfig(max_queued_tokens=100_000), None)
    config = ServerConfig(served_model_names=("m",), **server)
    return engine, config, create_app(engine, config)


def test_a_body_of_millions_of_tiny_values_is_refused_as_it_arrives_not_parsed(runner, tokenizer):
    engine, config, app = _app(runner, tokenizer)
    limit = max_body_values(engine, config)
    shapes = {
        "/v1/embeddings": {"input": [[1]] * (limit // 2 + 1)},
        "/rerank": {"query": "q", "documents": [{"text": ""}] * (limit // 2 + 1)},
        "/v2/embed": {"inputs": [{"content": []}] * (limit // 2 + 1), "input_type": "search_document"},
    }
    with TestClient(app, raise_server_exceptions=False) as c:
        for route, body in shapes.items():
            raw = json.dumps(body).encode()
            assert len(raw) < config.max_request_bytes  # within the byte limit: the bound on values refuses it
            r = c.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "more JSON values" in r.json()["error"]["message"], route
        fine = c.post("/v1/embeddings", json={"input": [[1, 2, 3]] * 100})
        assert fine.status_code == 200


def _values_by_hand(body: bytes) -> int:
    """Commas, brackets and braces outside strings, one character at a time."""
    count, in_string, escaped = 0, False, False
    for ch in map(chr, body):  # bytes: a multi-byte character never holds a quote, backslash or comma
        if in_string:
            in_string, escaped = (in_string, False) if escaped else (ch != '"', ch == "\\")
        elif ch == '"':
            in_string = True
        else:
            count += ch in ",[{"
    return count


@pytest.mark.parametrize(
    "body",
    [
        {"input": ["a, b, [c], {d}", 'say \\"hi\\", [x]', "back\\\\", '\\\\"', "é, ü \u2028"], "model": "m"},
        {"input": [[1, 2, 3], [4, 5]], "dimensions": 8},
        {"query": "q,,,", "documents": [{"text": "a\\,b"}, {"text": ",{[\\\\"}], "top_n": 1},
        {"input": ["line,\n" * 300 + 'a "quote", [x]' * 50, "tab\t" * 200], "model": "m"},  # runs of escapes
    ],
)
def test_json_values_count_structure_outside_strings(body):
    raw = json.dumps(body, ensure_ascii=False).encode()
    assert json_values(raw) == _values_by_hand(raw)
    for cut in range(0, len(raw), 7):  # a body cut anywhere (a string left open, on an escape) counts what it holds
        assert json_values(raw[:cut]) == _values_by_hand(raw[:cut]), cut


def test_a_long_text_of_commas_is_one_value_not_a_flood(runner, tokenizer):
    engine, config, app = _app(runner, tokenizer)
    limit = max_body_values(engine, config)
    text = "," * (limit + 10)  # more commas than the bound, all inside one string
    with TestClient(app) as c:
        r = c.post("/v1/embeddings", json={"input": text, "truncate_prompt_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 8


def test_a_trailing_slash_is_served_without_a_redirect_that_echoes_the_host(runner, tokenizer):
    _, _, app = _app(runner, tokenizer)
    with TestClient(app) as c:
        r = c.post("/v1/embeddings/", json={"input": "x"}, headers={"host": "evil.example"}, follow_redirects=False)
        assert r.status_code == 200 and "location" not in r.headers
        assert c.get("/health/", follow_redirects=False).status_code == 200


def test_a_path_cannot_forge_an_access_log_line(runner, tokenizer, caplog):
    _, _, app = _app(runner, tokenizer)
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="ember.access"):
        c.post('/v1/embeddings%0A127.0.0.1 "POST /v1/embeddings HTTP/1.1" 200', json={"input": "x"})
    lines = [r.getMessage() for r in caplog.records if r.name == "ember.access"]
    assert len(lines) == 1 and "\n" not in lines[0] and "\\n" in lines[0] and '"POST /v1/embeddings' in lines[0]


def test_bytes_for_more_vectors_than_a_header_holds_is_refused_before_computing(runner, tokenizer):
    _, _, app = _app(runner, tokenizer)
    with TestClient(app) as c:
        before = len(runner.batches)  # after the warm-up
        texts = ["t"] * (METADATA_ITEMS + 1)
        r = c.post("/v1/embeddings", json={"input": texts, "encoding_format": "bytes"})
        assert r.status_code == 400 and "bytes_only" in r.json()["error"]["message"]
        assert len(runner.batches) == before
        ok = c.post("/v1/embeddings", json={"input": texts, "encoding_format": "bytes_only"})
        assert ok.status_code == 200 and "metadata" not in ok.headers
        assert len(ok.content) == len(texts) * runner.info.dimension * 4
        small = c.post("/v1/embeddings", json={"input": texts[:METADATA_ITEMS], "encoding_format": "bytes"})
        assert small.status_code == 200 and len(small.headers["metadata"]) < 56 * 1024


def test_an_answer_being_written_holds_its_place_in_the_memory_plan():
    scheduler = Scheduler(EngineConfig(max_queued_vectors=100))
    scheduler.hold_answer(90)  # a slow reader's answer: computed, released, not yet taken
    with pytest.raises(OverloadedError):
        scheduler.admit([[[1, 2]]] * 20, [2] * 20, 0.0)
    scheduler.release_answer(90)
    request = scheduler.admit([[[1, 2]]] * 20, [2] * 20, 0.0)
    assert request.vectors == 20


def test_an_empty_api_key_is_refused_at_start_up(tmp_path):
    import subprocess
    import sys

    for argv in (["--api-key", ""], ["--api-key", "k1", "--api-key", " "]):
        done = subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", *argv], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and "--api-key '' is empty" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"), layers=1, hidden=32)


def test_slowloris_and_slow_readers_are_cut_off_and_an_open_server_says_so(model_dir, tmp_path):
    srv = Server([str(model_dir), "--http-read-timeout", "1.5", "--http-write-timeout", "1"], tmp_path / "log")
    try:
        drip = socket.create_connection(("127.0.0.1", srv.port))
        start, closed = time.monotonic(), False
        for byte in b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100:
            try:
                drip.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.25)  # each byte well inside the timeout: only a bound on the whole request stops it
            if time.monotonic() - start > 6:
                break
        assert closed or closed_by_server(drip, 1), "a request dripping a byte at a time was never cut off"
        assert time.monotonic() - start < 5
        reader = socket.create_connection(("127.0.0.1", srv.port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"input": ["a longer text to embed " * 20] * 2000, "encoding_format": "float"}).encode()
        reader.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        time.sleep(4)  # never read: the answer (megabytes) fills the buffers, then the write timeout closes it
        reader.settimeout(1)
        got = 0
        try:
            while chunk := reader.recv(1 << 20):
                got += len(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
        assert got < len(body), "the whole answer was still there for a reader that stopped"
        assert httpx.get(srv.url + "/health", timeout=2).status_code == 200
    finally:
        srv.stop()
    assert "no API key: any client that reaches this port may use it" in (tmp_path / "log").read_text()


def test_the_body_limit_follows_the_queue_unless_given(model_dir, tmp_path):
    assert request_bytes(10) == MiB and request_bytes(10**9) == 64 * MiB  # within its range
    srv = Server([str(model_dir), "--max-queued-tokens", "40000"], tmp_path / "log")
    try:
        limit = request_bytes(40_000)
        assert limit == 40_000 * 32
        text = "x" * (limit - 100)
        r = httpx.post(srv.url + "/v1/embeddings", json={"input": text + "y" * 200}, timeout=30)
        assert r.status_code == 413 and f"limit of {limit} bytes" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/embeddings", json={"input": text[:5000]}, timeout=30)
        assert ok.status_code == 200
    finally:
        srv.stop()
    assert (
        "request bodies up to 1.2 MiB (--max-request-bytes; from 40000 queued tokens)" in (tmp_path / "log").read_text()
    )


def _probe(url, stop, worst):
    while not stop.is_set():
        start = time.monotonic()
        try:
            httpx.get(url + "/health", timeout=5)
        except httpx.HTTPError:
            worst.append(5.0)
            continue
        worst.append(time.monotonic() - start)
        time.sleep(0.1)


def test_in_a_700_mb_cgroup_no_8_mb_shape_kills_the_server_and_health_answers_within_a_second(model_dir, tmp_path):
    shapes = [
        ("/v1/embeddings", b'{"input": [' + b",".join([b"[7]"] * 2_097_133) + b"]}"),
        ("/v1/embeddings", b'{"input": [' + b",".join([b"7"] * 4_190_000) + b"]}"),
        ("/rerank", b'{"query": "q", "documents": [' + b",".join([b'{"text": ""}'] * 700_000) + b"]}"),
        ("/v2/embed", b'{"input_type": "search_document", "inputs": [' + b",".join([b'{"content": []}'] * 520_000)
         + b"]}"),
    ]  # fmt: skip
    with real_v1_cgroup("memory", {"memory.limit_in_bytes": str(700 * MiB)}) as cgroup:
        # the shapes are within this byte limit, so the bound on JSON values is what refuses them
        srv = Server([str(model_dir), "--max-request-bytes", "9m"], tmp_path / "log", preexec_fn=join_cgroup(cgroup))
        stop, worst = threading.Event(), []
        prober = threading.Thread(target=_probe, args=(srv.url, stop, worst))
        prober.start()
        try:
            for route, body in shapes * 2:
                r = httpx.post(srv.url + route, content=body, headers={"content-type": "application/json"},
                               timeout=60)  # fmt: skip
                assert r.status_code == 413, (route, r.status_code, r.text[:200])
            assert srv.proc.poll() is None, "the server died"
            assert httpx.post(srv.url + "/v1/embeddings", json={"input": "still here"}).status_code == 200
        finally:
            stop.set()
            prober.join()
            srv.stop()
    assert worst and max(worst) < 1.0, f"/health took {max(worst):.2f} s"


def test_in_a_2_gib_cgroup_21_slow_readers_of_large_answers_do_not_kill_the_server(tmp_path_factory, tmp_path):
    wide = build_bert(tmp_path_factory.mktemp("wide"), layers=1, hidden=256, heads=4)
    text = "word " * 480
    body = json.dumps({"input": [f"{i} {text}" for i in range(64)], "task": "token_embed"}).encode()
    request = (b"POST /pooling HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % len(body)) + body  # fmt: skip
    with real_v1_cgroup("memory", {"memory.limit_in_bytes": str(2048 * MiB)}) as cgroup:
        srv = Server([str(wide), "--http-write-timeout", "30"], tmp_path / "log", preexec_fn=join_cgroup(cgroup))
        readers = []
        try:
            for _ in range(21):  # each answer is ~80 MB of JSON; none of them is read
                s = socket.create_connection(("127.0.0.1", srv.port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(request)
                readers.append(s)
            time.sleep(15)
            assert srv.proc.poll() is None, "the server was killed"
            assert httpx.get(srv.url + "/health", timeout=2).status_code == 200
            statuses = []
            for s in readers:
                s.settimeout(5)
                statuses.append(s.recv(12)[9:12])
            assert b"429" in statuses and b"200" in statuses, statuses  # the plan held some answers, refused the rest
        finally:
            for s in readers:
                s.close()
            srv.stop()


def test_largest_valid_bodies_are_parsed_while_health_answers_within_a_second(model_dir, tmp_path):
    """Three bodies of 2,048 x 250 token ids at once (half a million JSON values each, inside the value bound, so
    each is parsed and validated whole on the event loop), refused only after parsing (`dimensions` on a model
    without Matryoshka), so nothing is computed: the probes still answer within a second."""
    ids = [[1037 + (i % 500) for i in range(250)]] * 2048
    body = json.dumps({"input": ids, "dimensions": 8}).encode()
    srv = Server([str(model_dir), "--max-queued-tokens", "600000"], tmp_path / "log")
    stop, worst = threading.Event(), []
    prober = threading.Thread(target=_probe, args=(srv.url, stop, worst))
    prober.start()
    statuses = []

    def send() -> None:
        r = httpx.post(
            srv.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"}, timeout=60
        )
        statuses.append((r.status_code, r.json()["error"]["param"]))

    try:
        senders = [threading.Thread(target=send) for _ in range(3)]
        for s in senders:
            s.start()
        for s in senders:
            s.join()
    finally:
        stop.set()
        prober.join()
        srv.stop()
    assert statuses == [(400, "dimensions")] * 3
    assert worst and max(worst) < 1.0, f"/health took {max(worst):.2f} s"
