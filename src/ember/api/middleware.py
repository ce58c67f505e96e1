"""The edge middleware: request ids, body-size limit, access log and request metrics.

Pure ASGI (no BaseHTTPMiddleware), so it adds no task per request and never buffers bodies.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.metrics import Metrics

__all__ = ["EdgeMiddleware"]

access_log = logging.getLogger("ember.access")

_KNOWN_PATHS = {
    "/v1/embeddings", "/embeddings", "/pooling", "/tokenize", "/detokenize", "/v1/models", "/health", "/ping",
    "/version", "/info", "/metrics", "/docs", "/openapi.json",
    "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score",
}  # fmt: skip


class PayloadTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            # `curl -d` sends a form type; every ember body is JSON, so read it as such
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        limit = self.max_body_bytes
        if int(headers.get(b"content-length", b"0") or 0) > limit:
            receive = _refuse(limit)
        else:
            receive = _counting(receive, limit)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, status, time.perf_counter() - start, request_id)

    def _record(self, scope: Scope, status: int, seconds: float, request_id: str) -> None:
        path = scope["path"]
        endpoint = path if path in _KNOWN_PATHS else "other"
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(seconds)
        state: dict[str, Any] = scope.get("state", {})
        if endpoint in ("/metrics", "/health", "/ping"):
            return  # probes and scrapes would drown the access log
        access_log.info(
            '%s "%s %s" %d id=%s total=%.1fms queue=%.1fms inference=%.1fms tokens=%d',
            (scope.get("client") or ("-",))[0], scope["method"], path, status, request_id, seconds * 1000,
            state.get("queue_seconds", 0.0) * 1000, state.get("inference_seconds", 0.0) * 1000,
            state.get("tokens", 0),
        )  # fmt: skip


def _refuse(limit: int) -> Receive:
    async def receive() -> Message:
        raise PayloadTooLarge(limit)

    return receive


def _counting(receive: Receive, limit: int) -> Receive:
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise PayloadTooLarge(limit)
        return message

    return counted
