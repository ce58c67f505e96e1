"""Request and response bodies, with OpenAI's and vLLM's field names.

Unknown fields are accepted and ignored, as vLLM does, so every client's extras pass.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "REMOVED_TASKS",
    "ClassifyRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ModelList",
    "PoolingRequest",
    "PoolingTask",
    "RerankRequest",
    "ScoreRequest",
    "TokenizeRequest",
    "TokenizeResponse",
]

Input = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    """Strict: `true` is not the token id 1, `"8"` is not the number 8, `"yes"` is not true (400 instead)."""


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (and /pooling)."""

    model: str | None = None
    input: Input
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] | None = Field(
        None, description="float (default, also when null), base64, or a raw body (bytes: with a metadata header)"
    )
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = Field(
        "float32", description="the type of base64 and bytes values (vLLM's)"
    )
    endianness: Literal["native", "big", "little"] = Field(
        "native", description="the byte order of base64 and bytes values; native: the server's (vLLM's)"
    )
    dimensions: int | None = Field(None, description="Matryoshka truncation (Matryoshka models only)")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="-1: max-model-len; k: keep k tokens")
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    use_activation: bool | None = Field(None, description="accepted for vLLM compatibility; same as normalize")
    prompt_name: str | None = Field(None, description="a prompt from config_sentence_transformers.json")
    embedding_type: Literal["float", "int8", "uint8", "binary", "ubinary"] = Field(
        "float",
        description="ember extension: compact codes instead of floats (as Cohere's embedding_types): int8/uint8 per "
        "value, binary/ubinary one bit per value packed in bytes; as JSON integers, or their bytes for base64/bytes",
    )


class ClassifyRequest(_Request):
    """POST /classify (vLLM's fields)."""

    model: str | None = None
    input: Input
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="-1: max-model-len; k: keep k tokens")
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    use_activation: bool | None = Field(None, description="false: raw logits in `probs`")
    user: str | None = None


PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"]
"""vLLM's pooling tasks; ember runs embed, token_embed and (sparse models) token_classify."""
REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}
"""vLLM's messages for pooling task names it no longer accepts."""


class PoolingRequest(EmbeddingRequest):
    """POST /pooling: an embedding request with vLLM's `task`."""

    task: str | None = Field(
        None,
        description="embed: a vector per input; token_embed: a vector per token; token_classify: sparse weights "
        "(SPLADE, bge-m3) (default: --pooler-config task)",
    )
    top_k: int | None = Field(None, ge=1, description="ember, token_classify: keep each input's k largest weights")
    return_tokens: bool | None = Field(None, description="token_classify: each sparse entry's token text (vLLM's)")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: Usage


class SparseEntry(BaseModel):
    token_id: int
    weight: float
    token: str | None = None


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str | None = None
    sparse_embedding: list[SparseEntry] | None = Field(
        None, description="token_classify: the input's sparse weights by token id (vLLM's bge-m3 sparse shape)"
    )


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: Usage


class TokenizeRequest(_Request):
    """POST /tokenize: vLLM's `prompt`, or TEI's `inputs` (a text or a list)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    inputs: str | list[str] | None = Field(None, description="TEI: the texts; the answer is then TEI's list")
    prompt_name: str | None = Field(None, description="TEI: a prompt of the model's put before each text")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ember"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    task: str | None = None
    permission: list[dict[str, Any]] = []


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    text: str


class RerankRequest(_Request):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's and Cohere's fields; TEI's `texts` form on /rerank)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument] | None = None
    top_n: int | None = Field(None, ge=0, description="the best n results; null or 0: all")
    return_documents: bool | None = Field(None, description="each result carries its document unless false")
    max_tokens_per_doc: int | None = Field(None, ge=0, description="cut each document to this many tokens (0: no cut)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="cut each pair to k tokens (-1: max)")
    instruction: str | None = Field(None, description="Qwen3-Reranker's task instruction")
    use_activation: bool | None = Field(None, description="false: raw logits")
    rank_fields: list[str] | None = None
    texts: list[str] | None = Field(None, description="TEI: the documents; the answer is then TEI's list")
    raw_scores: bool = Field(False, description="TEI: raw logits")
    return_text: bool = Field(False, description="TEI: each result carries its text")
    truncate: bool | None = Field(None, description="TEI: true cuts each pair to max-model-len")
    truncation_direction: Literal["right", "left", "Right", "Left"] | None = None


class ScoreRequest(_Request):
    """POST /score, /v1/score: text_1/text_2 (or queries/documents, data_1/data_2), paired 1:1, 1:N or N:N."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    instruction: str | None = None
    use_activation: bool | None = None
