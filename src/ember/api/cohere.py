"""Cohere's embed API, `POST /v2/embed`, as vLLM serves it: texts in, `embeddings` keyed by type out.

`input_type` picks one of the model's prompts (config_sentence_transformers.json): the prompt of that name, else
for Cohere's four types the usual one (`search_query` -> `query`, `search_document` -> `document` or `passage`),
else none (the text as it is: a model with only a query prompt embeds documents bare). Any other value is a 400.
The text parts of one `inputs` item are joined with spaces.

Types: `float`; `base64` (little-endian float32); `binary`/`ubinary` (one bit per value, `v >= 0`, packed
most-significant bit first; `binary` = `ubinary` - 128, as vLLM and Cohere); `int8`/`uint8`: each vector scaled so
its largest |value| is 127, then rounded (`uint8` = `int8` + 128), as ember.api.encoding.quantize says. Decode
with `np.asarray(codes, np.float32)` (minus 128 for uint8) and normalise before dot products.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember.api.encoding import quantize
from ember.api.responses import JSONBytes
from ember.api.routes import check_count, context, engine_call
from ember.engine.engine import EmbedParams
from ember.errors import InputError

__all__ = ["CohereEmbedRequest", "cohere", "typed_embeddings"]

cohere = APIRouter()

EmbeddingType = Literal["float", "base64", "binary", "ubinary", "int8", "uint8"]

ALIASES = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
"""Cohere's input types and the prompt names each may be found under, in order."""


class _Content(BaseModel):
    type: Literal["text", "image_url"]
    text: str | None = None

    @model_validator(mode="after")
    def _text_given(self) -> _Content:
        if self.type == "text" and self.text is None:
            raise ValueError("content of type 'text' needs text")
        return self


class _Input(BaseModel):
    content: list[_Content]


class CohereEmbedRequest(BaseModel):
    """POST /v2/embed."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[_Input] | None = None
    input_type: str | None = None
    embedding_types: list[EmbeddingType] | None = Field(None, description="default: float")
    output_dimension: int | None = Field(None, description="Matryoshka truncation, as `dimensions`")
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(None, ge=1)


def _texts(body: CohereEmbedRequest) -> list[str]:
    given = [field for field in (body.texts, body.images, body.inputs) if field is not None]
    if len(given) != 1 or not given[0]:
        raise InputError("Exactly one of texts, images, or inputs must be provided, and it must be non-empty", "texts")
    if body.images is not None or any(c.type != "text" for i in body.inputs or [] for c in i.content):
        raise InputError("images are not supported: this server embeds text", "images")
    if body.texts is not None:
        return body.texts
    return [" ".join(c.text or "" for c in item.content) for item in body.inputs or []]


def _prompt(input_type: str | None, prompts: dict[str, str]) -> dict[str, Any]:
    """EmbedParams' prompt fields for `input_type`: the model's default, a prompt of its own, or none at all."""
    if input_type is None:
        return {}
    if input_type in prompts:
        return {"prompt_name": input_type}
    if input_type in ALIASES:
        name = next((name for name in ALIASES[input_type] if name in prompts), None)
        return {"prompt_name": name} if name else {"prompt": ""}
    supported = ", ".join(sorted({*ALIASES, *prompts}))
    raise InputError(f"Unsupported input_type {input_type!r}. Supported values: {supported}", "input_type")


def _truncation(body: CohereEmbedRequest) -> tuple[int | None, Literal["left", "right"] | None]:
    """(truncate_prompt_tokens, truncation_side): NONE refuses what is too long; START drops the start."""
    if body.truncate == "NONE":
        return None, None
    return (body.max_tokens or -1), ("left" if body.truncate == "START" else "right")


def typed_embeddings(vectors: np.ndarray, types: list[str]) -> dict[str, Any]:
    """The vectors in each requested type (see ember.api.encoding.quantize for the compact ones)."""
    vectors = np.asarray(vectors, np.float32)
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(types):
        if kind == "float":
            out[kind] = vectors
        elif kind == "base64":
            out[kind] = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            out[kind] = quantize(vectors, kind, "embedding_types")
    return out


@cohere.post("/v2/embed")
async def embed(body: CohereEmbedRequest, request: Request) -> Response:
    """Cohere's v2 embed: `embeddings` by type, `texts` echoed, tokens in `meta`."""
    texts = _texts(body)
    check_count(request, len(texts), "texts" if body.texts is not None else "inputs")
    truncate, side = _truncation(body)
    prompt = _prompt(body.input_type, context(request).served(body.model).engine.info.prompts)
    params = EmbedParams(
        dimensions=body.output_dimension, truncate_prompt_tokens=truncate, truncation_side=side, **prompt
    )
    _, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(texts, params, timeout=timeout)
    )
    if body.truncate == "NONE" and body.max_tokens is not None:
        longest = max(result.token_counts)
        if longest > body.max_tokens:
            raise InputError(
                f"Input of {longest} tokens exceeds max_tokens={body.max_tokens} with truncate=NONE. "
                "Set truncate to END or START to allow truncation.",
                "max_tokens",
            )
    return JSONBytes(
        {
            "id": f"embd-{request.state.request_id}",
            "embeddings": typed_embeddings(np.asarray(result.vectors), list(body.embedding_types or ["float"])),
            "texts": texts,
            "meta": {
                "api_version": {"version": "2"},
                "billed_units": {"input_tokens": tokens, "image_tokens": 0},
                "tokens": {"input_tokens": tokens, "output_tokens": 0},
            },
            "response_type": "embeddings_by_type",
        }
    )
