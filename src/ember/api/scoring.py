"""The scoring routes: vLLM's /rerank (also /v1 and Cohere's /v2) and /score, on the engine's score().

Handlers only translate: request body -> (query, document) pairs -> engine.score -> vLLM's response shapes,
with Cohere's `meta` beside them (LiteLLM reads its billed tokens).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from ember.api.responses import JSONBytes, usage
from ember.api.routes import check_count, engine_call
from ember.api.schemas import RerankDocument, RerankRequest, ScoreRequest
from ember.api.tei import tei_rerank
from ember.engine.engine import ScoreParams
from ember.engine.results import ranked
from ember.errors import InputError

__all__ = ["scoring"]

scoring = APIRouter()


def _text(doc: str | RerankDocument) -> str:
    return doc if isinstance(doc, str) else doc.text


@scoring.post("/rerank")
@scoring.post("/v1/rerank")
@scoring.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    """Documents ranked by relevance to the query, best first (vLLM's response, with Cohere's `meta`; TEI's list
    for a body in TEI's form, `texts` in place of `documents`)."""
    if body.texts is not None and body.documents is None:
        request.state.tei = True
        return await tei_rerank(body, request)
    if not body.documents:
        raise InputError("At least one text_pair element must be given ('documents' is empty)", "documents")
    check_count(request, len(body.documents), "documents")
    texts = [_text(d) for d in body.documents]
    params = ScoreParams(body.truncate_prompt_tokens, body.max_tokens_per_doc, body.use_activation, body.instruction)
    pairs = [(body.query, t) for t in texts]
    _, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.score(pairs, params, timeout=timeout)
    )
    order = ranked(result.scores, body.top_n)
    results = [
        {"index": i, "relevance_score": result.scores[i]}
        | ({} if body.return_documents is False else {"document": {"text": texts[i]}})
        for i in order
    ]
    return JSONBytes(
        {
            "id": f"rerank-{request.state.request_id}",
            "model": request.state.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"total_tokens": tokens, "search_units": 1}},
        }
    )


def _pairs(body: ScoreRequest) -> list[tuple[str, str]]:
    """vLLM's pairing: one with one, one with each of N, or N with N in order (its checks, in its order)."""
    firsts = next((x for x in (body.text_1, body.queries, body.data_1) if x is not None), None)
    seconds = next((x for x in (body.text_2, body.documents, body.items, body.data_2) if x is not None), None)
    if firsts is None or seconds is None:
        raise InputError("'text_1' and 'text_2' (or 'queries' and 'documents' or 'items') are required", "text_1")
    a = [firsts] if isinstance(firsts, str) else firsts
    b = [seconds] if isinstance(seconds, str) else seconds
    if len(a) > 1 and len(a) != len(b):
        raise InputError(
            f"Input lengths must be either 1:1, 1:N or N:N (text_1 has {len(a)} items and text_2 {len(b)})", "text_2"
        )
    if not a:
        raise InputError("At least one text element must be given", "text_1")
    if not b:
        raise InputError("At least one text_pair element must be given", "text_2")
    if len(a) == 1:
        return [(a[0], t) for t in b]
    return list(zip(a, b, strict=True))


@scoring.post("/score")
@scoring.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    """A score per pair, in order (vLLM's /score)."""
    params = ScoreParams(body.truncate_prompt_tokens, None, body.use_activation, body.instruction)
    pairs = _pairs(body)
    check_count(request, len(pairs), "text_2")
    _, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.score(pairs, params, timeout=timeout)
    )
    return JSONBytes(
        {
            "id": f"score-{request.state.request_id}",
            "object": "list",
            "created": int(time.time()),
            "model": request.state.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)],
            "usage": usage(tokens),
        }
    )
