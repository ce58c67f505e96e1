"""The edge middleware: request ids, the API key, body bounds, answers held in the memory plan, access log, metrics.

Pure ASGI (no BaseHTTPMiddleware), so it adds no task per request and never buffers bodies. The key is checked here,
before a body is read, so a client without one gets 401 whatever it sends. A body is bounded twice as it streams in,
before anything parses it: in bytes, and in JSON values (its commas, brackets and braces outside strings: parsing
multiplies a body of millions of tiny values into gigabytes of objects, and would hold the event loop for seconds).
A large answer is written in slices, each waiting for the client to take the one before, and counted in the memory plan
(`AsyncEngine.hold_answer`) until its last byte is taken, so slow readers cannot hold more than the plan allows. A
path with a trailing slash is served as without it (no redirect, which would echo the Host header). An unexpected
error becomes one logged traceback and an OpenAI-shaped 500 that still carries the request id. An answer from the
model carries its timings as TEI's headers (TIMING_HEADERS); with tracing on, a request's spans are made from the
same recorded times once it ends (ember.api.tracing), so the path costs nothing more while it runs.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.api.errors import error_response, route_path
from ember.api.metrics import Metrics
from ember.resources import release_free_memory

if TYPE_CHECKING:
    from ember.api.tracing import Tracing

__all__ = ["TIMING_HEADERS", "EdgeMiddleware", "json_values", "key_matches", "route_path", "timing_headers"]

access_log = logging.getLogger("ember.access")
log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
"""A client's X-Request-Id is used when it is this plain (no spaces, quotes or control characters that could forge
access-log fields); otherwise the server makes its own."""

SLICE_BYTES = 256 * 1024
"""An answer larger than this is written in slices of it, each after the client took the one before."""

LARGE_BODY_BYTES = 1024 * 1024
"""After a request body this large, freed memory is handed back to the OS (off the event loop)."""

_UNPRINTABLE = re.compile(r"[^\x21-\x7e]")

TIMING_HEADERS = {
    "x-total-time": "milliseconds from the request's first byte to its answer's first",
    "x-tokenization-time": "milliseconds spent tokenising its inputs",
    "x-queue-time": "milliseconds it waited for its first batch",
    "x-inference-time": "milliseconds of the batches it ran in (forward and pooling)",
    "x-compute-time": "tokenisation, queue and inference together, in milliseconds",
    "x-compute-tokens": "tokens it computed (as usage counts them)",
}
"""The timings an answer from the model carries, TEI's names and meanings (whole milliseconds)."""


def timing_headers(state: dict[str, Any], start: float, now: float) -> list[tuple[bytes, bytes]]:
    """TIMING_HEADERS for a request whose engine call recorded its times in `state` (none for other requests);
    `start` and `now` are monotonic seconds."""
    if "inference_seconds" not in state:
        return []
    tokenize, queue, inference = state["tokenize_seconds"], state["queue_seconds"], state["inference_seconds"]
    values = (now - start, tokenize, queue, inference, tokenize + queue + inference)
    out = [(name.encode(), str(round(v * 1000)).encode()) for name, v in zip(TIMING_HEADERS, values, strict=False)]
    return [*out, (b"x-compute-tokens", str(state.get("tokens", 0)).encode())]


def printable(text: str) -> str:
    """`text` with spaces, control and non-ASCII characters escaped (\\xNN, \\uNNNN): one access-log field that no
    path can split or forge."""
    return _UNPRINTABLE.sub(
        lambda m: m.group().encode("unicode_escape").decode("ascii") if m.group() != " " else "\\x20", text
    )


def key_matches(authorization: str, x_api_key: str, keys: Collection[str]) -> bool:
    """Whether `Authorization: Bearer <key>` (else `x-api-key`) is one of `keys`, compared in constant time."""
    token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else x_api_key
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


class PayloadTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes (--max-request-bytes)")


class TooManyValues(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"request body holds more JSON values than this server takes in one request ({limit}, from "
            "--max-queued-tokens and --max-inputs-per-request): send its inputs in smaller requests",
        )


def _prepare(scope: Scope) -> tuple[dict[bytes, bytes], str]:
    """The request's headers and id (the client's X-Request-Id when plain, else a new one, kept in its state);
    /path/ read as /path and a POST body read as JSON whatever its content type (`curl -d` sends a form type)."""
    if len(scope["path"]) > 1 and scope["path"].endswith("/"):
        scope["path"] = scope["path"].rstrip("/") or "/"
    headers = dict(scope["headers"])
    if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope["headers"].append((b"content-type", b"application/json"))
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = request_id
    return headers, request_id


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        max_body_bytes: int,
        api_keys: Collection[str] = (),
        protected: Collection[str] = (),
        max_body_values: int | None = None,
        hold_answer: Callable[[int, str | None], Callable[[], None]] | None = None,
        tracing: Tracing | None = None,
        endpoints: Collection[str] = (),
    ) -> None:
        self.app = app
        self.endpoints = frozenset(endpoints)
        """The app's routes: metrics are labelled by route, anything else as "other"."""
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.max_body_values = max_body_values
        self.api_keys = tuple(api_keys)
        self.protected = frozenset(protected)
        self.hold_answer = hold_answer
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        headers, request_id = _prepare(scope)
        route, state = route_path(scope), scope["state"]
        status, started, body_cut, responded = 500, False, False, start
        limit = self.max_body_bytes
        declared = headers.get(b"content-length", b"0")
        length = int(declared) if declared.isdigit() else 0
        counted = _Counted(receive, limit, self.max_body_values)
        receive = _refuse(limit) if length > limit else counted

        async def watched() -> Message:
            nonlocal body_cut
            message = await receive()
            body_cut = body_cut or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, started, responded
            if message["type"] == "http.response.start":
                status, started, responded = message["status"], True, time.monotonic()
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                    *timing_headers(state, start, responded),
                ]
            if message["type"] == "http.response.body" and len(message.get("body", b"")) > SLICE_BYTES:
                await self._send_sliced(send, message, state.get("model"))
            else:
                await send(message)

        try:
            if self.api_keys and route in self.protected and not self._authorized(headers):
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
            end = time.monotonic()
            self._record(scope, status, end - start, request_id)
            if self.tracing is not None:
                self.tracing.record(scope, headers, status, start, responded, end)
            if counted.seen >= LARGE_BODY_BYTES:  # its parsed objects are gone now: give their pages back
                asyncio.get_running_loop().run_in_executor(None, release_free_memory)

    async def _send_sliced(self, send: Send, message: Message, model: str | None = None) -> None:
        """A large body in slices (uvicorn waits for the client to drain each before taking the next), counted in
        the memory plan until the last is taken; a client that stops reading is cut off by the transport's write
        timeout, which ends this too."""
        body = memoryview(message["body"])
        release = self.hold_answer(len(body), model) if self.hold_answer is not None else None
        try:
            more = message.get("more_body", False)
            for at in range(0, len(body), SLICE_BYTES):
                last = at + SLICE_BYTES >= len(body)
                await send(
                    {
                        "type": "http.response.body",
                        "body": bytes(body[at : at + SLICE_BYTES]),
                        "more_body": more or not last,
                    }
                )
        finally:
            if release is not None:
                release()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"").decode("latin-1")
        return key_matches(auth, headers.get(b"x-api-key", b"").decode("latin-1"), self.api_keys)

    def _record(self, scope: Scope, status: int, seconds: float, request_id: str) -> None:
        path = route_path(scope)
        endpoint = path if path in self.endpoints else "other"
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.latency.labels(endpoint).observe(seconds)
        state: dict[str, Any] = scope.get("state", {})
        if endpoint in ("/metrics", "/health", "/ping"):
            return  # probes and scrapes would drown the access log
        fields = {
            "client": (scope.get("client") or ("-",))[0],
            "method": printable(scope["method"]),
            "route": printable(path),
            "status": status,
            "request_id": request_id,
            "model": state.get("model"),
            "tokens": state.get("tokens", 0),
            "total_ms": round(seconds * 1000, 1),
            "tokenize_ms": round(state.get("tokenize_seconds", 0.0) * 1000, 1),
            "queue_ms": round(state.get("queue_seconds", 0.0) * 1000, 1),
            "inference_ms": round(state.get("inference_seconds", 0.0) * 1000, 1),
        }
        access_log.info(
            '%(client)s "%(method)s %(route)s" %(status)d id=%(request_id)s total=%(total_ms).1fms '
            "queue=%(queue_ms).1fms inference=%(inference_ms).1fms tokens=%(tokens)d",
            fields,
            extra=fields,
        )


def _refuse(limit: int) -> Receive:
    async def receive() -> Message:
        raise PayloadTooLarge(limit)

    return receive


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or one left open at the end of the bytes: matched from outside strings, it never fails, so one
pass strips every string in linear time."""


def json_values(body: bytes) -> int:
    """An upper bound on the JSON values in `body`: every value past the first follows a comma or opens an array or
    object, so it counts the commas, brackets and braces outside strings (a long text of commas is one value). The
    strings are stripped by one regular expression and the rest counted by bytes.count, all in C."""
    outside = _STRING.sub(b"", body)
    return outside.count(b",") + outside.count(b"[") + outside.count(b"{")


EXACT_COUNT_BYTES = 4 * 1024 * 1024
"""A body whose crude count of values passes the bound is counted exactly (json_values, ~0.5 s at worst on the event
loop) when it is at most this large; a larger one is refused on the crude count."""


class _Counted:
    """The request's body as it arrives, refused (413) once over `limit` bytes or `values` JSON values. The values are
    first counted crudely (every comma, bracket and brace, inside strings too); a body whose crude count passes the
    bound is counted exactly, once, when its last byte has arrived, if it is at most EXACT_COUNT_BYTES (so a text full
    of commas is not refused), and refused as it streams in if it is larger."""

    def __init__(self, receive: Receive, limit: int, values: int | None) -> None:
        self.receive, self.limit, self.values = receive, limit, values
        self.seen = self.crude = 0
        self.pieces: list[bytes] = []

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            body = message.get("body", b"")
            self.seen += len(body)
            if self.seen > self.limit:
                raise PayloadTooLarge(self.limit)
            if self.values is not None:
                self.pieces.append(body)  # the body is held for parsing anyway: these are references to it
                self.crude += body.count(b",") + body.count(b"[") + body.count(b"{")
                done = not message.get("more_body", False)
                over = self.crude > self.values
                if over and (
                    self.seen > EXACT_COUNT_BYTES or (done and json_values(b"".join(self.pieces)) > self.values)
                ):
                    raise TooManyValues(self.values)
                if done:
                    self.pieces = []
        return message
