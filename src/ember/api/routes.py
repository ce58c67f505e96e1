"""The HTTP routes: embeddings, models, health, version, info, metrics; the helpers every inference route shares.

Handlers only translate: request body -> engine call -> response body. Inference routes sit
behind the API key; probes and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, HTTPException, Request, Response

from ember.api.context import Context, Served, context
from ember.api.encoding import bytes_response, check_metadata, encode, quantize
from ember.api.responses import JSONBytes, usage
from ember.api.schemas import (
    EmbeddingRequest,
    EmbeddingResponse,
    ModelList,
)
from ember.engine.engine import AsyncEngine, EmbedParams
from ember.engine.scheduler import BatchSpan
from ember.errors import InputError
from ember.types import Output
from ember.version import __version__

__all__ = [
    "Context",
    "check_count",
    "context",
    "embed_params",
    "engine_call",
    "envelope",
    "inference",
    "input_count",
    "probes",
    "vectors_response",
]


inference = APIRouter()
probes = APIRouter()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (and so dropping its queued batches) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone()
    return task.result()


def check_count(request: Request, count: int, param: str) -> None:
    """400 for a request with more inputs than --max-inputs-per-request, before any of them is tokenised."""
    limit = context(request).config.max_inputs_per_request
    if count > limit:
        raise InputError(
            f"{param} list length {count} exceeds the maximum allowed count of {limit}. To increase this limit, "
            "set --max-inputs-per-request (EMBER_MAX_INPUTS_PER_REQUEST).",
            param,
        )


def client_timeout(request: Request) -> float | None:
    """The client's own limit from `X-Request-Timeout` (seconds): a request that would wait longer is refused at
    once with 429 instead of being computed for a client that has gone."""
    raw = request.headers.get("x-request-timeout")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise InputError(f"X-Request-Timeout must be a positive number of seconds, got {raw!r}", "X-Request-Timeout")
    return value


def input_count(inputs: Any) -> int:
    """How many inputs `input` holds: a string or one list of token ids is one."""
    if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int):
        return len(inputs)
    return 1


def embed_params(body: EmbeddingRequest, output: Output = "embed") -> EmbedParams:
    """The engine's options for an embedding (or pooling) request."""
    normalize = body.normalize if body.normalize is not None else body.use_activation
    return EmbedParams(
        output=output,
        dimensions=body.dimensions,
        normalize=normalize,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side,
        add_special_tokens=body.add_special_tokens,
        prompt_name=body.prompt_name,
    )


class Outcome(Protocol):
    """What an engine call reports beside its answer (EmbedResult, ScoreResult)."""

    @property
    def token_counts(self) -> list[int]: ...

    @property
    def queue_seconds(self) -> float: ...

    @property
    def inference_seconds(self) -> float: ...

    @property
    def tokenize_seconds(self) -> float: ...

    @property
    def batches(self) -> tuple[BatchSpan, ...]: ...


R = TypeVar("R", bound=Outcome)


async def engine_call(
    request: Request, model: str | None, work: Callable[[AsyncEngine, float | None], Coroutine[Any, Any, R]]
) -> tuple[Context, R, int]:
    """Check `model`, run `work` on the engine (dropped if the client goes away: 499), and record its tokens and
    times (for the access log, the timing headers, traces and /metrics: EdgeMiddleware reads them from the request's
    state); returns the context, the result and its tokens."""
    ctx = context(request)
    served = ctx.served(model)
    timeout = client_timeout(request)
    state = request.state
    state.model, state.engine_started = served.name, time.monotonic()
    try:
        result: R = await until_disconnect(request, work(served.engine, timeout))
    except ClientGone:
        raise HTTPException(499, "client closed the request") from None
    tokens = sum(result.token_counts)
    state.engine_done, state.tokens, state.batches = time.monotonic(), tokens, result.batches
    state.queue_seconds, state.inference_seconds = result.queue_seconds, result.inference_seconds
    state.tokenize_seconds = result.tokenize_seconds
    m, name = ctx.metrics, served.name
    m.tokens.labels(name).inc(tokens)
    m.tokenize_time.labels(name).observe(result.tokenize_seconds)
    m.queue_time.labels(name).observe(result.queue_seconds)
    m.inference_time.labels(name).observe(result.inference_seconds)
    return ctx, result, tokens


async def vectors_response(
    request: Request, body: EmbeddingRequest, *, prefix: str, kind: str, field: str, output: Output = "embed"
) -> Response:
    """Embed, then answer with one `{"index", "object": kind, field: vector}` per input, in input order
    (token_embed: each input's (tokens, D) vectors as nested lists, or their bytes row by row)."""
    check_count(request, input_count(body.input), "input")
    if body.encoding_format == "bytes":
        check_metadata(input_count(body.input))
    params = embed_params(body, output)
    compact = body.embedding_type != "float"
    if compact and body.embed_dtype != "float32":
        raise InputError(
            f"embed_dtype applies to float vectors; embedding_type {body.embedding_type!r} is sent as "
            "its own bytes (leave embed_dtype unset)",
            "embed_dtype",
        )
    ctx, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(body.input, params, timeout=timeout)
    )
    answer = envelope(ctx, request, prefix, [], tokens)
    fmt, dtype, order = body.encoding_format, body.embed_dtype, body.endianness
    vectors = (
        [quantize(v, body.embedding_type, "embedding_type") for v in result.vectors] if compact else result.vectors
    )
    if fmt in ("bytes", "bytes_only"):
        return bytes_response(list(vectors), answer, fmt, dtype, order)
    answer["data"] = [{"index": i, "object": kind, field: encode(v, fmt, dtype, order)} for i, v in enumerate(vectors)]
    return JSONBytes(answer)


def envelope(ctx: Context, request: Request, prefix: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The list answer around `data` (OpenAI's and vLLM's): id, object, created, model, usage."""
    return {
        "id": f"{prefix}-{request.state.request_id}",
        "object": "list",
        "created": int(time.time()),
        "model": getattr(request.state, "model", None) or ctx.model_name,
        "data": data,
        "usage": usage(tokens),
    }


@inference.post("/v1/embeddings", response_model=EmbeddingResponse)
@inference.post("/embeddings", response_model=EmbeddingResponse, include_in_schema=False)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings endpoint, with vLLM's extras."""
    return await vectors_response(request, body, prefix="embd", kind="embedding", field="embedding")


@inference.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> dict[str, Any]:
    """Every name of every model, each with its task."""
    ctx = context(request)
    data = []
    for served in ctx.models:
        info = served.engine.info
        for name in served.names:
            card = {"id": name, "object": "model", "created": ctx.created, "owned_by": "ember"}
            card |= {"root": served.path or served.name, "parent": None, "max_model_len": info.max_model_len}
            data.append(card | {"task": info.task, "permission": [_permission(ctx.created)]})
    return {"object": "list", "data": data}


def _permission(created: int) -> dict[str, Any]:
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created}


@probes.get("/health")
@probes.get("/ping")
@probes.post("/ping")
async def health(request: Request) -> Response:
    """200 while every model's engine can run; 503 once one cannot (or while draining)."""
    ready = all(e.alive and not e.closing for e in context(request).engines)
    return Response(status_code=200 if ready else 503)


@probes.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@probes.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """What this server runs: each model, its task and dtype, and which kernels are active and why (the first
    model's fields at the top level, as a single-model server reports them)."""
    ctx = context(request)
    models = [_card(served) for served in ctx.models]
    return {"version": __version__, **models[0], **_tei_info(ctx, ctx.models[0]), "models": models}


_TEI_POOLING = {"CLS": "cls", "MEAN": "mean", "LAST": "last_token", "SPLADE": "splade"}


def _tei_info(ctx: Context, served: Served) -> dict[str, Any]:
    """TEI's /info fields for the first model (its clients read model_type and the limits)."""
    info, config = served.engine.info, served.engine.config
    head = info.head
    if head.task == "score":
        labels: dict[str, Any] = {
            "id2label": {str(i): n for i, n in enumerate(head.labels)},
            "label2id": {n: i for i, n in enumerate(head.labels)},
        }
        model_type: dict[str, Any] = {"reranker" if head.num_labels == 1 else "classifier": labels}
    else:
        model_type = {"embedding": {"pooling": _TEI_POOLING.get(info.pooling.method, info.pooling.method.lower())}}
    return {
        "model_id": served.path or served.name,
        "model_sha": None,
        "model_dtype": info.dtype,
        "served_model_name": served.name,
        "model_type": model_type,
        "max_concurrent_requests": config.max_num_seqs,
        "max_input_length": info.max_model_len,
        "max_batch_tokens": config.max_num_batched_tokens,
        "max_batch_requests": config.max_num_seqs,
        "max_client_batch_size": ctx.config.max_inputs_per_request,
        "auto_truncate": served.engine.preprocessor.auto_truncate,
        "tokenization_workers": 1,
        "sha": None,
        "docker_label": None,
    }


def _card(served: Served) -> dict[str, Any]:
    model, engine = served.engine.info, served.engine
    return {
        "model": served.name,
        "architecture": model.architecture,
        "task": model.task,
        "outputs": list(model.head.outputs),
        "dtype": model.dtype,
        "dimension": model.dimension,
        "max_model_len": model.max_model_len,
        "kernels": {k.name: {"active": k.active, "detail": k.detail} for k in engine.kernels.values()},
    }


@probes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(context(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
