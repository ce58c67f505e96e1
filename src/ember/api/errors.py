"""Translating errors into OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}.

Every failure leaves the server through here, so clients always see the same shape,
and validation failures are 400 (never FastAPI's default 422). TEI's routes (ember.api.tei, and /rerank and
/tokenize asked in TEI's form) answer in TEI's: {"error": message, "error_type": kind}, invalid input 422.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.types import Scope

from ember.api.responses import JSONBytes
from ember.errors import EmberError, OverloadedError

__all__ = ["TEI_PATHS", "error_response", "install_error_handlers", "route_path"]

log = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    499: "ClientClosedRequest",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def route_path(scope: Scope) -> str:
    """The path the routes match: behind --root-path, uvicorn's scope["path"] carries the prefix (as the router sees
    it, stripped here too), so the key check and the metrics see /v1/embeddings, never /prefix/v1/embeddings."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


TEI_PATHS = frozenset({"/", "/embed", "/embed_all", "/embed_sparse", "/predict", "/similarity", "/decode"})
"""The routes only TEI has (the `tei` and `sparse` routers' paths, which a test checks): their errors take TEI's
shape and statuses."""
_TEI_TYPES = {400: "Empty", 413: "Validation", 422: "Validation", 424: "Backend", 429: "Overloaded", 503: "Unhealthy"}


def _tei(request: Request) -> bool:
    """Whether the request went to a TEI route, or asked /rerank or /tokenize in TEI's form."""
    return route_path(request.scope) in TEI_PATHS or bool(getattr(request.state, "tei", False))


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    *,
    tei: bool = False,
) -> JSONBytes:
    """The OpenAI/vLLM error body for `status` (TEI's with `tei`)."""
    if tei:
        tei_kind = _TEI_TYPES.get(status) or HTTPStatus(status).phrase
        return JSONBytes({"error": message, "error_type": tei_kind}, status_code=status, headers=headers)
    kind = _TYPES.get(status) or HTTPStatus(status).phrase
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONBytes(body, status_code=status, headers=headers)


async def _ember_error(request: Request, exc: Exception) -> JSONBytes:
    assert isinstance(exc, EmberError)
    status = exc.status
    if status == 500:
        log.error("request %s failed: %s", request.url.path, exc)
    headers = {"Retry-After": str(int(exc.retry_after))} if isinstance(exc, OverloadedError) else None
    tei = _tei(request)
    if tei and status == 400:  # TEI's clients read invalid input as 422
        status = 422
    return error_response(status, str(exc), getattr(exc, "param", None), headers, tei=tei)


async def _validation_error(request: Request, exc: Exception) -> JSONBytes:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if _tei(request):
        return error_response(422, _described(errors[0]) if errors else "invalid request", tei=True)
    if not errors:
        return error_response(400, "invalid request")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"request body is not valid JSON: {first.get('msg')}")
    field = loc[0] if loc else None
    where = ".".join(loc) or "body"
    got = f", got {first['input']!r}" if first.get("type") in ("literal_error", "enum") and "input" in first else ""
    return error_response(400, f"invalid value for '{where}': {first.get('msg')}{got}", field)


def _described(error: Any) -> str:
    where = ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"
    return f"invalid value for '{where}': {error.get('msg')}"


async def _http_error(request: Request, exc: Exception) -> JSONBytes:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None), tei=_tei(request))


async def _unexpected(request: Request, exc: Exception) -> JSONBytes:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(EmberError, _ember_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
