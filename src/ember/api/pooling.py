"""vLLM's `POST /pooling`: per input, its pooled vector (task embed), a vector per token (token_embed), or its
sparse weights (token_classify: bge-m3's sparse head, or a SPLADE model's vocabulary weights)."""

from __future__ import annotations

from typing import Any, get_args

from fastapi import APIRouter, Request, Response

from ember.api.classify import class_probabilities
from ember.api.responses import JSONBytes
from ember.api.routes import (
    check_count,
    context,
    embed_params,
    engine_call,
    envelope,
    input_count,
    vectors_response,
)
from ember.api.schemas import REMOVED_TASKS, PoolingRequest, PoolingResponse, PoolingTask
from ember.api.sparse import token_entries, top_lexical
from ember.engine.lexical import TokenWeights, sparse_output
from ember.errors import InputError
from ember.types import ModelInfo, Output

__all__ = ["pooling", "pooling_tasks"]

pooling = APIRouter()


def pooling_tasks(info: ModelInfo) -> tuple[str, ...]:
    """The pooling tasks a model runs, as its head declares them (a score model's: classify; it answers /score and
    /rerank too)."""
    return info.head.outputs


@pooling.post("/pooling", response_model=PoolingResponse)
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    """`task` (vLLM's) defaults to --pooler-config's task, else embed. A task the model cannot do is refused with
    vLLM's message."""
    engine = context(request).served(body.model).engine
    supported = pooling_tasks(engine.info)
    task = body.task or engine.preprocessor.pooler.task or (supported or ("embed",))[0]
    if task in REMOVED_TASKS:
        raise InputError(REMOVED_TASKS[task], "task")
    if task not in get_args(PoolingTask):
        allowed = ", ".join(repr(t) for t in get_args(PoolingTask))
        raise InputError(f"invalid value for 'task': Input should be one of {allowed}, got {task!r}", "task")
    if task not in supported:
        raise InputError(f"Unsupported task: {task!r} Supported tasks: {supported}", "task")
    if task == "token_classify":
        return await _sparse_weights(request, body)
    for field in ("top_k", "return_tokens"):
        if getattr(body, field) is not None:
            raise InputError(f"{field} applies to task token_classify (sparse weights), not {task}", field)
    if task == "classify":
        return await _class_probabilities(request, body)
    output: Output = "token_embed" if task == "token_embed" else "embed"
    return await vectors_response(request, body, prefix="pool", kind="pooling", field="data", output=output)


async def _class_probabilities(request: Request, body: PoolingRequest) -> Response:
    """classify: per input, its probabilities (logits with `use_activation: false`) as `data`, as vLLM answers."""
    ctx, rows, tokens, _ = await class_probabilities(request, body)
    data = [{"index": i, "object": "pooling", "data": probs.tolist()} for i, probs in enumerate(rows)]
    return JSONBytes(envelope(ctx, request, "pool", data, tokens))


async def _sparse_weights(request: Request, body: PoolingRequest) -> Response:
    """token_classify: per input, `sparse_embedding` (each distinct token's weight, ascending token id, the top_k
    largest when asked), and for bge-m3 vLLM's `data`: its sparse head's weight per token, without the first and
    last token. A SPLADE model has no weight per token, so its items carry `sparse_embedding` only."""
    defaults = {
        "encoding_format": (None, "float"),
        "embedding_type": ("float",),
        "embed_dtype": ("float32",),
        "endianness": ("native",),
    }
    for field, unset in defaults.items():
        if getattr(body, field) not in unset:
            raise InputError(f"token_classify answers with JSON numbers: leave {field} unset", field)
    check_count(request, input_count(body.input), "input")
    engine = context(request).served(body.model).engine
    params = embed_params(body, sparse_output(engine.info) or "token_classify")
    ctx, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(body.input, params, timeout=timeout)
    )
    tokenizer, data = engine.tokenizer, []
    for i, answer in enumerate(result.vectors):
        item: dict[str, Any] = {"index": i, "object": "pooling"}
        if isinstance(answer, TokenWeights):
            item["data"] = answer.weights.tolist()
        ids, weights = top_lexical(answer, tokenizer, body.top_k)
        item["sparse_embedding"] = token_entries(ids, weights, tokenizer, bool(body.return_tokens))
        data.append(item)
    return JSONBytes(envelope(ctx, request, "pool", data, tokens))
