"""The HTTP routes: embeddings, pooling, tokenize, models, health, version, info, metrics.

Handlers only translate: request body -> engine call -> response body. Inference routes sit
behind the API key; probes and /metrics stay open.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, HTTPException, Request, Response

from ember.api.encoding import bytes_response, check_metadata, encode, quantize
from ember.api.metrics import Metrics
from ember.api.responses import JSONBytes, usage
from ember.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from ember.config import ServerConfig
from ember.engine.engine import AsyncEngine, EmbedParams
from ember.engine.scheduler import BatchSpan
from ember.errors import InputError, RequestTooLargeError
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


@dataclass
class Context:
    """What the handlers need, stored on app.state.ctx by create_app."""

    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics
    created: int

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.served_model_names:
            raise HTTPException(404, f"The model `{model}` does not exist.")


def context(request: Request) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx


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
    ctx.check_model(model)
    timeout = client_timeout(request)
    state = request.state
    state.model, state.engine_started = model or ctx.model_name, time.monotonic()
    try:
        result: R = await until_disconnect(request, work(ctx.engine, timeout))
    except ClientGone:
        raise HTTPException(499, "client closed the request") from None
    tokens = sum(result.token_counts)
    state.engine_done, state.tokens, state.batches = time.monotonic(), tokens, result.batches
    state.queue_seconds, state.inference_seconds = result.queue_seconds, result.inference_seconds
    state.tokenize_seconds = result.tokenize_seconds
    ctx.metrics.tokens.inc(tokens)
    ctx.metrics.tokenize_time.observe(result.tokenize_seconds)
    ctx.metrics.queue_time.observe(result.queue_seconds)
    ctx.metrics.inference_time.observe(result.inference_seconds)
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
        "model": ctx.model_name,
        "data": data,
        "usage": usage(tokens),
    }


@inference.post("/v1/embeddings", response_model=EmbeddingResponse)
@inference.post("/embeddings", response_model=EmbeddingResponse, include_in_schema=False)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings endpoint, with vLLM's extras."""
    return await vectors_response(request, body, prefix="embd", kind="embedding", field="embedding")


@inference.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx = context(request)
    ctx.check_model(body.model)
    tok = ctx.engine.tokenizer
    ids: list[int] = await ctx.engine.run_in_tokenizer(tok.encode, body.prompt, body.add_special_tokens)
    limit = ctx.engine.config.max_queued_tokens
    if len(ids) > limit:  # the same bound as one embedding request, before the token strings and the JSON
        raise RequestTooLargeError(
            f"this prompt holds {len(ids)} tokens, more than one request may ({limit}, --max-queued-tokens as the "
            "memory plan allows)",
            "prompt",
        )
    strs = [tok.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.engine.info.max_model_len, tokens=ids, token_strs=strs)


@inference.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = context(request)
    ctx.check_model(body.model)
    text: str = await ctx.engine.run_in_tokenizer(ctx.engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)


@inference.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> dict[str, Any]:
    ctx = context(request)
    card = {
        "object": "model",
        "created": ctx.created,
        "owned_by": "ember",
        "root": ctx.config.model_path or ctx.model_name,
        "parent": None,
        "max_model_len": ctx.engine.info.max_model_len,
        "task": ctx.engine.info.task,
        "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": ctx.created}],
    }
    return {"object": "list", "data": [{"id": name, **card} for name in ctx.config.served_model_names]}


@probes.get("/health")
@probes.get("/ping")
@probes.post("/ping")
async def health(request: Request) -> Response:
    """200 while the engine can embed; 503 once it cannot (or while draining)."""
    engine = context(request).engine
    return Response(status_code=200 if engine.alive and not engine.closing else 503)


@probes.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@probes.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """What this server runs: the model, its task and dtype, and which kernels are active and why."""
    ctx = context(request)
    model = ctx.engine.info
    return {
        "version": __version__,
        "model": ctx.model_name,
        "architecture": model.architecture,
        "task": model.task,
        "dtype": model.dtype,
        "dimension": model.dimension,
        "max_model_len": model.max_model_len,
        "kernels": {k.name: {"active": k.active, "detail": k.detail} for k in ctx.engine.kernels.values()},
    }


@probes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(context(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
