"""Sparse (lexical) weights: TEI's `POST /embed_sparse`, and the entries /pooling's token_classify answers with.

An input's sparse weights are a SPLADE model's non-zero vocabulary weights, or bge-m3's sparse head merged as
FlagEmbedding merges it (each distinct token's largest weight; special tokens and zeros left out).
/embed_sparse gives `[{"index": token id, "value": weight}]` per input in ascending index order (TEI's shape).
`truncate` true cuts over-long inputs to max-model-len (`truncation_direction` right or left); unset, the server's
--auto-truncate decides. `top_k` (an ember extension) keeps each input's k largest weights, still by index.
A SPLADE model's weights also come dense (one value per vocabulary entry) from /v1/embeddings, as vLLM serves it.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ember.api.responses import JSONBytes
from ember.api.routes import check_count, context, engine_call
from ember.engine.engine import EmbedParams
from ember.engine.lexical import lexical, sparse_output
from ember.tokenizer import Tokenizer

__all__ = ["EmbedSparseRequest", "sparse", "token_entries", "top_lexical"]

sparse = APIRouter()


class EmbedSparseRequest(BaseModel):
    """POST /embed_sparse (TEI)."""

    model_config = ConfigDict(extra="allow", strict=True)

    inputs: str | list[str]
    truncate: bool | None = None
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = None
    top_k: int | None = Field(None, ge=1, description="ember: keep the k largest weights of each input")
    model: str | None = None


def top_lexical(answer: Any, tokenizer: Tokenizer, top_k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """An input's sparse weights (ember.engine.lexical.lexical, special tokens left out): (token ids ascending,
    weights), the top_k largest when given."""
    ids, weights = lexical(answer, tokenizer.special_ids)
    if top_k is not None and len(ids) > top_k:
        keep = np.sort(np.argsort(-weights, kind="stable")[:top_k])
        ids, weights = ids[keep], weights[keep]
    return ids, weights


def token_entries(
    ids: np.ndarray, weights: np.ndarray, tokenizer: Tokenizer, with_tokens: bool
) -> list[dict[str, Any]]:
    """vLLM's sparse entries (its bge-m3 sparse plugin's shape): `{token_id, weight, token}`, the token's text
    only when asked for."""
    return [
        {"token_id": int(i), "weight": float(w), "token": tokenizer.token_text(int(i)) if with_tokens else None}
        for i, w in zip(ids, weights, strict=True)
    ]


@sparse.post("/embed_sparse")
async def embed_sparse(body: EmbedSparseRequest, request: Request) -> Response:
    """Sparse weights per input, non-zero ones only, as TEI's `{index, value}` pairs."""
    served = context(request).served(body.model)
    engine = served.engine
    output = sparse_output(engine.info)
    if output is None:
        raise HTTPException(
            424,
            f"model {served.name!r} ({engine.info.architecture}) gives dense embeddings: /embed_sparse needs "
            "a sparse model (SPLADE, or bge-m3 with its sparse head)",
        )
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise HTTPException(400, "`inputs` cannot be empty")
    check_count(request, len(texts), "inputs")
    side: Literal["left", "right"] = "left" if body.truncation_direction.lower() == "left" else "right"
    params = EmbedParams(
        truncate_prompt_tokens=-1 if body.truncate else None,
        truncation_side=side,
        prompt_name=body.prompt_name,
        output=output,
    )
    _, result, _ = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(texts, params, timeout=timeout)
    )
    pairs = (top_lexical(v, engine.tokenizer, body.top_k) for v in result.vectors)
    return JSONBytes([[{"index": int(i), "value": float(w)} for i, w in zip(*p, strict=True)] for p in pairs])
