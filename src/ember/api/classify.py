"""vLLM's `POST /classify` (also `/v1/classify`): a sequence classifier's label and probabilities per input.

Each input is classified alone (its own tokens, never chunked: longer than max-model-len is a 400 unless
`truncate_prompt_tokens` cuts it). `probs` are the logits through the checkpoint's activation (config.json's
problem_type: softmax for single-label, sigmoid for multi-label or a single logit, none for regression), raw logits
with `use_activation: false`; `label` is id2label's name of the largest. Any `*ForSequenceClassification` checkpoint
ember serves answers it; an embedding model gets a 400.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response

from ember.api.context import Context
from ember.api.responses import JSONBytes
from ember.api.routes import check_count, engine_call, envelope, input_count
from ember.api.schemas import ClassifyRequest, PoolingRequest
from ember.engine.engine import EmbedParams
from ember.engine.pairs import activate
from ember.types import HeadSpec

__all__ = ["class_probabilities", "classify", "classify_params", "probabilities"]

classify = APIRouter()


def classify_params(
    truncate_prompt_tokens: int | None = None,
    side: Literal["left", "right"] | None = None,
    add_special_tokens: bool = True,
) -> EmbedParams:
    """The engine's options for classifying texts: each input's logits as they are."""
    return EmbedParams(
        output="classify",
        normalize=False,
        truncate_prompt_tokens=truncate_prompt_tokens,
        truncation_side=side,
        add_special_tokens=add_special_tokens,
        prompt="",
    )


def probabilities(logits: np.ndarray, head: HeadSpec, use_activation: bool | None = True) -> np.ndarray:
    """A classifier's logits through its activation for /classify (as they are when use_activation is false)."""
    return activate(logits, head.classify_activation if use_activation is not False else "identity")


async def class_probabilities(
    request: Request, body: ClassifyRequest | PoolingRequest
) -> tuple[Context, list[np.ndarray], int, HeadSpec]:
    """Classify a request's inputs: the context, each input's probabilities (its logits with `use_activation:
    false`), the tokens and the model's head."""
    check_count(request, input_count(body.input), "input")
    params = classify_params(body.truncate_prompt_tokens, body.truncation_side, body.add_special_tokens)
    ctx, result, tokens = await engine_call(
        request, body.model, lambda engine, timeout: engine.embed(body.input, params, timeout=timeout)
    )
    head = ctx.served(body.model).engine.info.head
    return ctx, [probabilities(v, head, body.use_activation) for v in result.vectors], tokens, head


@classify.post("/classify")
@classify.post("/v1/classify")
async def create_classify(body: ClassifyRequest, request: Request) -> Response:
    """Per input: `label` (the most probable), `probs` (one per label, in id order) and `num_classes`."""
    ctx, rows, tokens, head = await class_probabilities(request, body)
    data: list[dict[str, Any]] = []
    for i, probs in enumerate(rows):
        label = head.labels[int(np.argmax(probs))] if head.labels else None
        data.append({"index": i, "label": label, "probs": probs.tolist(), "num_classes": len(probs)})
    return JSONBytes(envelope(ctx, request, "classify", data, tokens))
