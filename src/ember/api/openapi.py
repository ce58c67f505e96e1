"""The OpenAPI document as the server really answers: 400 (never FastAPI's 422) with the OpenAI error body, the
other error statuses each route can give, empty bodies for /health and /ping, text for /metrics, and the request
types /invocations takes; the API key as a security scheme on the routes that take it (so /docs' "Authorize" sends
it), and each route under a tag of what it is for."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ember.api.errors import TEI_PATHS
from ember.api.schemas import EmbeddingRequest, RerankRequest, ScoreRequest

__all__ = ["install_openapi"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}
_TEI_ERROR = {
    "type": "object",
    "required": ["error", "error_type"],
    "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}},
}
_TEI_ERRORS = {
    "422": "TEI: invalid input",
    "424": "TEI: this model cannot answer the route",
}
TEI_FORMS = ("/rerank", "/v1/rerank", "/v2/rerank", "/tokenize")
"""Routes that answer in TEI's shape when asked in TEI's form."""
_INFERENCE_ERRORS = {
    "400": "Invalid request (field, value, length, or not JSON)",
    "401": "Missing or wrong API key",
    "404": "`model` is not a served name",
    "413": "Body or request larger than the server takes",
    "429": "Overloaded: retry after `Retry-After` seconds",
    "499": "The client closed the request",
    "503": "Draining, or the engine has stopped",
}
_EMPTY = {"200": {"description": "The engine can embed"}, "503": {"description": "Draining or stopped"}}
_SECURITY = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer <key>` (--api-key)"},
    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "`x-api-key: <key>`"},
}
TAGS = {
    "embeddings": (
        "Vectors for texts: OpenAI's, vLLM's, Cohere's and the sparse routes",
        ("/v1/embeddings", "/embeddings", "/pooling", "/v2/embed", "/embed_sparse"),
    ),
    "rerank and score": (
        "Relevance of documents to a query: Jina/Cohere rerank and vLLM's score",
        ("/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"),
    ),
    "classification": ("A sequence classifier's labels: vLLM's /classify", ("/classify", "/v1/classify")),
    "TEI": (
        "Text Embeddings Inference's native routes",
        ("/", "/embed", "/embed_all", "/predict", "/similarity", "/decode"),
    ),
    "tokens": ("The model's tokenizer", ("/tokenize", "/detokenize")),
    "models": ("What this server serves", ("/v1/models", "/info", "/version")),
    "SageMaker": ("Amazon SageMaker's single route, for every kind of request", ("/invocations",)),
    "operations": ("Probes and metrics (never behind the API key)", ("/health", "/ping", "/metrics")),
}
"""The tags the document groups routes under: a description, and their paths."""
_TAG_OF = {path: tag for tag, (_, paths) in TAGS.items() for path in paths}


def _error(description: str, tei: bool = False) -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    either = {"anyOf": [ref, {"$ref": "#/components/schemas/TeiErrorResponse"}]}
    return {"description": description, "content": {"application/json": {"schema": either if tei else ref}}}


def _fix(schema: dict[str, Any]) -> None:
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = _ERROR
    schema["components"]["schemas"]["TeiErrorResponse"] = _TEI_ERROR
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    schema["components"]["securitySchemes"] = _SECURITY
    schema["tags"] = [{"name": tag, "description": text} for tag, (text, _) in TAGS.items()]
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            op["tags"] = [_TAG_OF.get(path, "operations")]
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in ("/health", "/ping"):
                op["responses"] = dict(_EMPTY)
            elif path == "/metrics":
                op["responses"] = {"200": {"description": "Prometheus text", "content": {"text/plain": {}}}}
            elif method == "post":
                if path in ("/v1/embeddings", "/pooling", "/invocations"):  # encoding_format bytes / bytes_only
                    content = responses.setdefault("200", {"description": "OK"}).setdefault("content", {})
                    content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
                tei = path in TEI_PATHS or path in TEI_FORMS
                errors = _INFERENCE_ERRORS | (_TEI_ERRORS if tei else {})
                responses.update({status: _error(text, tei) for status, text in errors.items()})
                if path == "/tokenize":  # TEI's form answers with a list of token lists
                    ok = responses["200"]["content"]["application/json"]
                    ok["schema"] = {"anyOf": [ok["schema"], {"type": "array"}]}
            elif path == "/v1/models":
                responses["401"] = _error(_INFERENCE_ERRORS["401"])
            if "401" in responses:  # the routes the key guards: either header satisfies it
                op["security"] = [{"bearer": []}, {"apiKey": []}]
    invocations = schema["paths"].get("/invocations", {}).get("post")
    if invocations is not None:
        refs = [
            {"$ref": f"#/components/schemas/{kind.__name__}"}
            for kind in (EmbeddingRequest, RerankRequest, ScoreRequest)
        ]
        invocations["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"oneOf": refs}}}}


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _fix(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
