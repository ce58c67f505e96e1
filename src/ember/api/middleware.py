"""The edge middleware: request ids, the API key, body-size limit, access log and request metrics.

Pure ASGI (no BaseHTTPMiddleware), so it adds no task per request and never buffers bodies. The key is checked here,
before a body is read, so a client without one gets 401 whatever it sends; an unexpected error becomes one logged
traceback and an OpenAI-shaped 500 that still carries the request id.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from collections.abc import Collection
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.errors import error_response
from ember.api.metrics import Metrics

__all__ = ["EdgeMiddleware", "key_matches"]

access_log = logging.getLogger("ember.access")
log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
"""A client's X-Request-Id is used when it is this plain (no spaces, quotes or control characters that could forge
access-log fields); otherwise the server makes its own."""

_KNOWN_PATHS = {
    "/v1/embeddings", "/embeddings", "/pooling", "/tokenize", "/detokenize", "/v1/models", "/health", "/ping",
    "/version", "/info", "/metrics", "/docs", "/openapi.json",
    "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score", "/v2/embed", "/invocations",
}  # fmt: skip


def key_matches(authorization: str, x_api_key: str, keys: Collection[str]) -> bool:
    """Whether `Authorization: Bearer <key>` (else `x-api-key`) is one of `keys`, compared in constant time."""
    token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else x_api_key
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


class PayloadTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        max_body_bytes: int,
        api_keys: Collection[str] = (),
        protected: Collection[str] = (),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.api_keys = tuple(api_keys)
        self.protected = frozenset(protected)

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
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status, started, body_cut = 500, False, False
        limit = self.max_body_bytes
        if int(headers.get(b"content-length", b"0") or 0) > limit:
            receive = _refuse(limit)
        else:
            receive = _counting(receive, limit)

        async def watched() -> Message:
            nonlocal body_cut
            message = await receive()
            body_cut = body_cut or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            if self.api_keys and scope["path"] in self.protected and not self._authorized(headers):
                response = error_response(401, "invalid or missing API key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send_with_id)
            else:
                await self.app(scope, watched, send_with_id)
        except Exception:
            log.exception("unhandled error on %s %s (request %s)", scope["method"], scope["path"], request_id)
            if not started:
                await error_response(500, "internal error")(scope, receive, send_with_id)
        finally:
            if body_cut and status == 400:
                status = 499  # the client went away before its body was read whole: not a bad request
            self._record(scope, status, time.perf_counter() - start, request_id)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        return key_matches(auth, headers.get(b"x-api-key", b"").decode("latin-1"), self.api_keys)

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
