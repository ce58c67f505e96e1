"""Text Embeddings Inference's native API, so TEI's clients (huggingface_hub's InferenceClient, LangChain's
HuggingFaceEndpointEmbeddings, Haystack's TEI embedders and ranker, LlamaIndex's TextEmbeddingsInference) switch to
ember by URL alone.

`POST /embed` (a list of vectors), `/embed_all` (a vector per token), `/predict` (a classifier's labels and scores,
for texts or text pairs), `/similarity` (cosines to a source sentence), `/decode`, and `POST /`, which answers as
TEI's does for the model it serves (/predict for a classifier, TEI's /rerank for a one-label scorer, /embed_sparse
for a sparse model, else /embed). `/rerank` and `/tokenize` answer in TEI's shape when asked in it (`texts`,
`inputs`): see ember.api.scoring and ember.api.tokens. `/embed_sparse` is in ember.api.sparse.

Errors on these routes have TEI's body, `{"error": message, "error_type": kind}`, and its statuses: 422 for
invalid input, 400 for an empty one, 424 for a model that cannot answer the route, 429 when overloaded
(ember.api.errors). `truncate: true` cuts to max-model-len; unset or false, the server's own rule applies (split
into windows when chunked processing is on, else cut with --auto-truncate, else refused).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ember.api.classify import classify_params, probabilities
from ember.api.context import Served
from ember.api.responses import JSONBytes
from ember.api.routes import check_count, context, engine_call, input_count
from ember.api.schemas import RerankRequest
from ember.api.sparse import EmbedSparseRequest, embed_sparse
from ember.engine.engine import EmbedParams
from ember.engine.pairs import ScoreParams
from ember.engine.results import ranked
from ember.errors import InputError
from ember.types import HeadSpec

__all__ = ["TeiEmbedRequest", "tei", "tei_rerank", "truncation"]

tei = APIRouter()

Direction = Literal["right", "left", "Right", "Left"]


class _TeiRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="ember: which served model answers (default: the first)")


class TeiEmbedRequest(_TeiRequest):
    """POST /embed (and /embed_all, without normalize and dimensions)."""

    inputs: str | list[str] | list[int] | list[list[int]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    normalize: bool = True
    dimensions: int | None = Field(None, description="Matryoshka truncation")


class TeiPredictRequest(_TeiRequest):
    """POST /predict: a text, a pair ([a, b]), or a list of texts and pairs ([[a], [a, b]])."""

    inputs: str | list[str] | list[list[str]]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False


class _Sentences(BaseModel):
    model_config = ConfigDict(strict=True)
    source_sentence: str
    sentences: list[str]


class _SimilarityParameters(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class TeiSimilarityRequest(_TeiRequest):
    """POST /similarity."""

    inputs: _Sentences
    parameters: _SimilarityParameters | None = None


class TeiDecodeRequest(_TeiRequest):
    """POST /decode."""

    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


def truncation(truncate: bool | None, direction: str) -> tuple[int | None, Literal["left", "right"]]:
    """(truncate_prompt_tokens, truncation side) for TEI's `truncate` and `truncation_direction`."""
    return (-1 if truncate else None), ("left" if direction.lower() == "left" else "right")


def _empty(what: str) -> HTTPException:
    return HTTPException(400, f"`{what}` cannot be empty")


def _wrong_model(served: Served, needs: str) -> HTTPException:
    info = served.engine.info
    return HTTPException(424, f"Model is not {needs} ({served.name!r} is {info.architecture}, task {info.task})")


def _texts(inputs: Any) -> Any:
    if inputs == [] or inputs == "":
        raise _empty("inputs")
    return inputs


@tei.post("/embed")
async def embed(body: TeiEmbedRequest, request: Request) -> Response:
    """TEI's /embed: one vector per input, always as a list."""
    served = context(request).served(body.model)
    if served.engine.info.task != "embed":
        raise _wrong_model(served, "an embedding model")
    inputs = _texts(body.inputs)
    check_count(request, input_count(inputs), "inputs")
    if body.dimensions is not None and body.dimensions < 1:
        raise InputError("`dimensions` should be positive", "dimensions")
    cut, side = truncation(body.truncate, body.truncation_direction)
    params = EmbedParams(
        dimensions=body.dimensions,
        normalize=body.normalize,
        truncate_prompt_tokens=cut,
        truncation_side=side,
        prompt_name=body.prompt_name,
    )
    _, result, _ = await engine_call(request, body.model, lambda e, timeout: e.embed(inputs, params, timeout=timeout))
    return JSONBytes(result.vectors)


@tei.post("/embed_all")
async def embed_all(body: TeiEmbedRequest, request: Request) -> Response:
    """TEI's /embed_all: every token's vector (the last hidden states, not normalised) per input."""
    served = context(request).served(body.model)
    if "token_embed" not in served.engine.info.head.outputs:
        raise _wrong_model(served, "an embedding model with a vector per token")
    inputs = _texts(body.inputs)
    check_count(request, input_count(inputs), "inputs")
    cut, side = truncation(body.truncate, body.truncation_direction)
    params = EmbedParams(
        output="token_embed",
        normalize=False,
        truncate_prompt_tokens=cut,
        truncation_side=side,
        prompt_name=body.prompt_name,
    )
    _, result, _ = await engine_call(request, body.model, lambda e, timeout: e.embed(inputs, params, timeout=timeout))
    return JSONBytes(result.vectors)


def _predict_items(inputs: str | list[str] | list[list[str]]) -> tuple[list[str | tuple[str, str]], bool]:
    """TEI's reading of /predict's inputs: (the texts and pairs, whether it was a batch)."""
    if isinstance(inputs, str):
        return [inputs], False
    if not inputs:
        raise InputError("`inputs` must hold a text, a pair of texts, or a list of them", "inputs")
    if isinstance(inputs[0], str):  # ["a"] is one text, ["a", "b"] one pair
        return [_one(inputs)], False
    return [_one(x) for x in inputs], True


def _one(item: list[str]) -> str | tuple[str, str]:
    if len(item) == 1:
        return item[0]
    if len(item) == 2:
        return (item[0], item[1])
    raise InputError(f"each input is a text or a pair of texts, got a list of {len(item)}", "inputs")


@tei.post("/predict")
async def predict(body: TeiPredictRequest, request: Request) -> Response:
    """A classifier's score per label, best first, for each text or pair (probabilities unless raw_scores)."""
    served = context(request).served(body.model)
    if served.engine.info.task != "score":
        raise _wrong_model(served, "a classifier model")
    items, batch = _predict_items(body.inputs)
    if any(x == "" or x == ("", "") for x in items):
        raise _empty("inputs")
    check_count(request, len(items), "inputs")
    cut, side = truncation(body.truncate, body.truncation_direction)
    singles = [i for i, x in enumerate(items) if isinstance(x, str)]
    pairs = [i for i, x in enumerate(items) if not isinstance(x, str)]
    logits: dict[int, np.ndarray] = {}
    tokens = 0
    if singles:
        params = classify_params(cut, side)
        texts = [items[i] for i in singles]
        _, result, n = await engine_call(request, body.model, lambda e, t: e.embed(texts, params, timeout=t))
        logits |= dict(zip(singles, result.vectors, strict=True))
        tokens += n
    if pairs:
        score = ScoreParams(truncate_prompt_tokens=cut, use_activation=False)
        both = [items[i] for i in pairs]
        _, scored, n = await engine_call(request, body.model, lambda e, t: e.score(both, score, timeout=t))  # type: ignore[arg-type]
        logits |= dict(zip(pairs, scored.logits, strict=True))
        tokens += n
    request.state.tokens = tokens
    head = served.engine.info.head
    answers = []
    for i in range(len(items)):
        scores = probabilities(logits[i], head, not body.raw_scores)
        order = np.argsort(-scores, kind="stable")
        answers.append([{"score": float(scores[j]), "label": head.labels[j]} for j in order])
    return JSONBytes(answers if batch else answers[0])


async def tei_rerank(body: RerankRequest, request: Request) -> Response:
    """TEI's /rerank: `[{index, score, text?}]`, best first, for `query` against each of `texts`."""
    texts = body.texts or []
    if not texts:
        raise _empty("texts")
    check_count(request, len(texts), "texts")
    cut, _ = truncation(body.truncate, body.truncation_direction or "right")
    params = ScoreParams(truncate_prompt_tokens=cut, use_activation=not body.raw_scores)
    pairs = [(body.query, t) for t in texts]
    _, result, _ = await engine_call(request, body.model, lambda e, t: e.score(pairs, params, timeout=t))
    order = ranked(result.scores)
    return JSONBytes(
        [{"index": i, "score": result.scores[i]} | ({"text": texts[i]} if body.return_text else {}) for i in order]
    )


@tei.post("/similarity")
async def similarity(body: TeiSimilarityRequest, request: Request) -> Response:
    """The cosine of each sentence's embedding to the source sentence's, in input order."""
    served = context(request).served(body.model)
    if served.engine.info.task != "embed":
        raise _wrong_model(served, "an embedding model")
    sentences = body.inputs.sentences
    if not sentences:
        raise _empty("inputs.sentences")
    check_count(request, len(sentences) + 1, "inputs.sentences")
    extra = body.parameters or _SimilarityParameters()
    cut, side = truncation(extra.truncate, extra.truncation_direction)
    params = EmbedParams(
        normalize=True, truncate_prompt_tokens=cut, truncation_side=side, prompt_name=extra.prompt_name
    )
    texts = [body.inputs.source_sentence, *sentences]
    _, result, _ = await engine_call(request, body.model, lambda e, t: e.embed(texts, params, timeout=t))
    source, *rest = result.vectors
    return JSONBytes([float(source @ v) for v in rest])


@tei.post("/decode")
async def decode(body: TeiDecodeRequest, request: Request) -> Response:
    """Each list of token ids back to text (one string for one list)."""
    engine = context(request).served(body.model).engine
    rows: list[list[int]] = [body.ids] if not body.ids or isinstance(body.ids[0], int) else body.ids  # type: ignore[list-item]
    if not rows or any(not r for r in rows):
        raise _empty("ids")
    check_count(request, len(rows), "ids")
    tok = engine.tokenizer
    texts = [await engine.run_in_tokenizer(tok.decode, r, body.skip_special_tokens) for r in rows]
    return JSONBytes(texts)


Handler = Callable[[Any, Request], Awaitable[Response]]


def _root_route(head: HeadSpec) -> tuple[type[BaseModel], Handler]:
    """The body and handler of the route TEI's `POST /` answers for a model with this head."""
    if head.task == "score":
        return (RerankRequest, tei_rerank) if head.num_labels == 1 else (TeiPredictRequest, predict)
    if head.vocabulary:
        return EmbedSparseRequest, embed_sparse
    return TeiEmbedRequest, embed


@tei.post("/")
async def root(request: Request) -> Response:
    """TEI's `POST /`: the body of the route this model answers (see the module's docstring)."""
    try:
        raw = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        raise InputError(f"JSON decode error: {e}") from None
    model = raw.get("model") if isinstance(raw, dict) else None
    head = context(request).served(model if isinstance(model, str) else None).engine.info.head
    kind, handler = _root_route(head)
    try:
        body = kind.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
    return await handler(body, request)
