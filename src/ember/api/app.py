"""Building the FastAPI app around an engine: routes, error mapping, middleware, lifespan."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware.cors import CORSMiddleware

from ember.api.classify import classify
from ember.api.cohere import cohere
from ember.api.context import Context, Served
from ember.api.errors import install_error_handlers
from ember.api.invocations import invocations
from ember.api.metrics import Metrics
from ember.api.middleware import EdgeMiddleware
from ember.api.openapi import install_openapi
from ember.api.pooling import pooling
from ember.api.routes import inference, probes
from ember.api.scoring import scoring
from ember.api.sparse import sparse
from ember.api.tei import tei
from ember.api.tokens import tokens
from ember.config import ServerConfig
from ember.engine.engine import AsyncEngine
from ember.version import __version__

if TYPE_CHECKING:
    from ember.api.tracing import Tracing

__all__ = ["create_app", "max_body_values"]


def max_body_values(engine: AsyncEngine, config: ServerConfig) -> int:
    """The most JSON values a request body may hold: a token id each for as many tokens as the queue takes, and a
    few per input (brackets, an object's fields) for as many inputs as a request may carry. No admissible request
    holds more, so a body past it is refused as it arrives, before it is parsed."""
    return engine.config.max_queued_tokens + 8 * config.max_inputs_per_request + 4096


def _watch(metrics: Metrics, served: Served, config: ServerConfig) -> None:
    """A model's engine gauges read at scrape time, its batches observed as they end."""
    engine, name = served.engine, served.name
    metrics.watch(metrics.queued_requests, name, lambda: engine.queued_requests)
    metrics.watch(metrics.queued_tokens, name, lambda: engine.queued_tokens)
    metrics.watch(metrics.running_seqs, name, lambda: engine.running_seqs)
    metrics.watch(metrics.running_tokens, name, lambda: engine.running_tokens)
    metrics.memory_budget.set(config.memory_budget_bytes)
    metrics.watch_kernels(name, lambda: {k.name: k.active for k in engine.kernels.values()})
    cache = engine.cache
    metrics.watch_cache(name, lambda: None if cache is None else (cache.hits, cache.misses, cache.bytes, len(cache)))
    engine.observer = metrics.batch_observer(name)


def _lifespan(
    models: tuple[Served, ...], config: ServerConfig, tracing: Tracing | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Starting the app starts every model's engine; stopping it drains them together, then flushes the traces."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            for served in models:
                await served.engine.start()
            yield
        finally:  # a failed start stops the engines started before it
            await asyncio.gather(*(m.engine.stop(config.shutdown_grace_seconds) for m in models))
            if tracing is not None:
                tracing.shutdown()

    return lifespan


def create_app(
    engine: AsyncEngine,
    config: ServerConfig,
    metrics: Metrics | None = None,
    *,
    cors: dict[str, Any] | None = None,
    docs: bool = True,
    tracing: Tracing | None = None,
    more: Sequence[Served] = (),
) -> FastAPI:
    """The HTTP app; starting it starts the engines, stopping it drains them. `engine` runs the model named by
    config.served_model_names (the one requests without `model` get); `more`: further models, routed by the names
    requests send. `cors`: Starlette CORSMiddleware's settings (None: no cross-origin answers); `docs`: serve /docs,
    /redoc and /openapi.json; `tracing`: each request's spans to an OTLP collector (flushed when the app stops)."""
    metrics = metrics or Metrics()
    models = (Served(engine, config.served_model_names, config.model_path), *more)

    # /docs and /redoc with their assets served from the package (no CDN, air-gap safe); none at all when turned off
    pages: dict[str, Any] = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = (FastAPIOffline if docs else FastAPI)(
        title="ember",
        version=__version__,
        description="CPU-native, OpenAI- and vLLM-compatible embedding and rerank server",
        lifespan=_lifespan(models, config, tracing),
        redirect_slashes=False,  # the edge serves /path/ as /path: a redirect would echo the client's Host header
        **pages,
    )
    app.state.ctx = Context(models, config, metrics, created=int(time.time()))
    for served in models:
        _watch(metrics, served, config)
    install_error_handlers(app)
    install_openapi(app)
    # the API key guards these routes
    guarded = (inference, tokens, pooling, classify, scoring, cohere, invocations, sparse, tei)
    for router in (*guarded, probes):
        app.include_router(router)
    protected = {route.path for router in guarded for route in router.routes}  # type: ignore[attr-defined]
    own = {getattr(route, "path", None) for route in app.routes}  # /docs, /openapi.json, when served
    endpoints = protected | {route.path for route in probes.routes} | {p for p in own if p}  # type: ignore[attr-defined]
    app.add_middleware(
        EdgeMiddleware,
        metrics=metrics,
        max_body_bytes=config.max_request_bytes,
        api_keys=config.api_keys,
        protected=protected,
        max_body_values=max(max_body_values(m.engine, config) for m in models),
        hold_answer=lambda nbytes, model: app.state.ctx.served(model).engine.hold_answer(nbytes),
        tracing=tracing,
        endpoints=endpoints,
    )
    if cors is not None:  # outermost: a preflight carries no API key and is answered before the key is checked
        app.add_middleware(CORSMiddleware, **cors)
    return app
