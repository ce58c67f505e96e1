"""Connections a client opens and never finishes: a cap on open connections and a read timeout keep the
descriptors free and /health answering, with one warning instead of a traceback per connection."""

import socket
import time

import httpx
import pytest

from checkpoints import build_bert
from server import Server, closed_by_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"), layers=1, hidden=32)


def _half_sent(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Le")  # headers never finish
    return s


def test_half_sent_connections_are_capped_and_timed_out(model_dir, tmp_path):
    srv = Server([str(model_dir), "--max-connections", "20", "--http-read-timeout", "1.5"], tmp_path / "log")
    try:
        held = [_half_sent(srv.port) for _ in range(120)]
        start = time.monotonic()
        r = httpx.get(srv.url + "/health", timeout=10)  # gets in: it evicts the longest-waiting half-sent one
        assert r.status_code == 200 and time.monotonic() - start < 5
        # beyond the cap, the oldest were evicted as new ones came; the last 20 go once they stall past the timeout
        assert sum(closed_by_server(s, 0.5) for s in held[:100]) == 100
        assert all(closed_by_server(s, 5) for s in held[100:])
        body = {"input": "after the storm"}
        assert httpx.post(srv.url + "/v1/embeddings", json=body, timeout=10).status_code == 200
        slow = socket.create_connection(("127.0.0.1", srv.port))  # a body that stops half-way
        slow.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"input\": ")  # fmt: skip
        assert closed_by_server(slow, 5)
        for s in held:
            s.close()
        log = srv.log.read_text()
        assert "Traceback" not in log, log
        assert 1 <= log.count("beyond --max-connections 20") <= 3
    finally:
        srv.stop()
