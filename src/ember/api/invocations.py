"""SageMaker's `POST /invocations`: one route for every task, the body's fields picking the endpoint, as vLLM's.

An embedding model answers `input` as /v1/embeddings (vLLM tries its embedding request first, so a /pooling body
is embedded too), and `query` + `documents` or `text_1`/`queries`/`data_1` pairs as /rerank and /score (cosine);
a score model answers the last two. Anything else is a 400 naming the request types this model takes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ember.api.routes import context, embeddings
from ember.api.schemas import EmbeddingRequest, RerankRequest, ScoreRequest
from ember.api.scoring import rerank, score
from ember.errors import InputError

__all__ = ["invocations"]

invocations = APIRouter()

Handler = Callable[[Any, Request], Awaitable[Response]]

_SHAPES: list[tuple[type[BaseModel], tuple[str, ...], Handler, bool]] = [
    (EmbeddingRequest, ("input",), embeddings, False),
    (RerankRequest, ("query", "documents"), rerank, True),
    (ScoreRequest, ("text_1", "queries", "data_1"), score, True),
]
"""(request type, the fields that mark it, its handler, whether a score model takes it), tried in vLLM's order."""


@invocations.post("/invocations")
async def invoke(request: Request) -> Response:
    """The endpoint whose request the body is: embeddings, rerank or score (see the module's docstring)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested past Python's limit
        raise InputError(f"JSON decode error: {e}") from None
    model = body.get("model") if isinstance(body, dict) else None
    served = context(request).served(model if isinstance(model, str) else None)
    scores = served.engine.info.task == "score"
    shapes = [(kind, marks, handler) for kind, marks, handler, for_score in _SHAPES if for_score or not scores]
    if isinstance(body, dict):
        for kind, marks, handler in shapes:
            if all(m in body for m in marks) if kind is RerankRequest else any(m in body for m in marks):
                try:
                    parsed = kind.model_validate(body)
                except ValidationError as e:
                    raise RequestValidationError(e.errors(include_url=False)) from None
                return await handler(parsed, request)
    names = [kind.__name__ for kind, _, _ in shapes]
    raise InputError(f"Cannot find suitable handler for request. Expected one of: {names}")
