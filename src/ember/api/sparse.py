"""TEI's sparse embedding endpoint, `POST /embed_sparse`, for SPLADE models: per input, the non-zero vocabulary
weights as `[{"index": token id, "value": weight}]` in ascending index order (TEI's shape).

`truncate` true cuts over-long inputs to max-model-len (`truncation_direction` right or left); unset, the server's
--auto-truncate decides. `top_k` (an ember extension) keeps each input's k largest weights, still by index.
The same weights come dense (one value per vocabulary entry) from /v1/embeddings, as vLLM serves SPLADE.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ember.api.responses import JSONBytes
from ember.api.routes import check_count, context, engine_call, require_api_key
from ember.engine.engine import EmbedParams
from ember.errors import InputError

__all__ = ["EmbedSparseRequest", "sparse", "sparse_pairs"]

sparse = APIRouter(dependencies=[Depends(require_api_key)])


class EmbedSparseRequest(BaseModel):
    """POST /embed_sparse (TEI)."""

    model_config = ConfigDict(extra="allow", strict=True)

    inputs: str | list[str]
    truncate: bool | None = None
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = None
    top_k: int | None = Field(None, ge=1, description="ember: keep the k largest weights of each input")
    model: str | None = None


def sparse_pairs(weights: np.ndarray, top_k: int | None = None) -> list[dict[str, Any]]:
    """The non-zero entries of a (vocabulary,) weight vector as {index, value}, by index; the top_k largest."""
    index = np.flatnonzero(weights)
    if top_k is not None and len(index) > top_k:
        index = np.sort(index[np.argsort(-weights[index], kind="stable")[:top_k]])
    return [{"index": int(i), "value": float(weights[i])} for i in index]


@sparse.post("/embed_sparse")
async def embed_sparse(body: EmbedSparseRequest, request: Request) -> Response:
    """A SPLADE model's vocabulary weights per input, non-zero ones only."""
    info = context(request).engine.info
    if info.splade_strategy is None:
        raise InputError(f"this model ({info.architecture}) gives dense embeddings: /embed_sparse needs a sparse "
                         "model (SPLADE); use /v1/embeddings", "inputs")  # fmt: skip
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise InputError("`inputs` cannot be empty", "inputs")
    check_count(request, len(texts), "inputs")
    side: Literal["left", "right"] = "left" if body.truncation_direction.lower() == "left" else "right"
    params = EmbedParams(truncate_prompt_tokens=-1 if body.truncate else None, truncation_side=side,
                         prompt_name=body.prompt_name)  # fmt: skip
    _, result, _ = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(texts, params, timeout=timeout)
    )
    return JSONBytes([sparse_pairs(np.asarray(v), body.top_k) for v in result.vectors])
