"""`ember serve`: load the model, wire engine and app, run uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import uvicorn

from ember.cli.flags import (
    add_serve_flags,
    api_keys,
    check_runner,
    max_inputs_per_request,
    otel_service_name,
    otlp_endpoint,
    warn_ignored,
)
from ember.cli.logs import setup_logging
from ember.cli.model_flags import model_configs, truncate
from ember.cli.runtime import (
    connection_limit,
    maybe_reexec_with_allocator,
    native_config,
    parse_bytes,
    prepare_process,
)
from ember.config import EngineConfig, ServerConfig
from ember.errors import ConfigError, EmberError
from ember.sizing import request_bytes

if TYPE_CHECKING:
    from ember.engine.engine import AsyncEngine

__all__ = ["add_parser", "run"]

log = logging.getLogger("ember.cli")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", allow_abbrev=False, help="serve an embedding model over HTTP (OpenAI/vLLM compatible)")
    add_serve_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, args.log_format)
    try:
        maybe_reexec_with_allocator(sys.argv[1:])
        plan = prepare_process(args.threads, args.cpu_bind)
        return _serve(args, plan.threads)
    except EmberError as e:
        log.error("%s", e)
        return 2


def _compile_kernels(enforce_eager: bool) -> tuple[bool, str]:
    """torch.compile's fused regions unless told not to, where a C++ compiler can build them; and if not, why."""
    from ember.ops.fused import can_compile

    if enforce_eager:
        return False, "--enforce-eager"
    if not can_compile():
        log.warning(
            "no C++ compiler (g++) found: torch.compile's fused kernels are off. ember's native kernels are not "
            "affected (prebuilt ones load without a compiler: `ember build-kernels` at image build); Qwen3 and "
            "other decoders run their elementwise steps eagerly, BERT-family models do not use fused kernels"
        )
        return False, "no C++ compiler"
    return True, ""


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    compile_kernels, eager_reason = _compile_kernels(args.enforce_eager)
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        max_queue_seconds=args.max_queue_seconds,
        auto_truncate=truncate(args),
        batch_wait_seconds=args.batch_wait_ms / 1000,
        shared_batch_seconds=args.shared_batch_ms / 1000,
        compile_kernels=compile_kernels,
        eager_reason=eager_reason,
        cache_bytes=parse_bytes(args.embedding_cache_size),
    )


def _server_config(
    args: argparse.Namespace, names: tuple[str, ...], path: str, budget: int, queued_tokens: int
) -> ServerConfig:
    body = parse_bytes(args.max_request_bytes) if args.max_request_bytes else request_bytes(queued_tokens)
    if not args.max_request_bytes:
        log.info(
            "request bodies up to %.1f MiB (--max-request-bytes; from %d queued tokens)", body / 2**20, queued_tokens
        )
    return ServerConfig(
        served_model_names=names,
        model_path=path,
        api_keys=api_keys(args.api_key),
        max_request_bytes=body,
        max_inputs_per_request=max_inputs_per_request(args.max_inputs_per_request),
        shutdown_grace_seconds=args.shutdown_grace,
        memory_budget_bytes=budget,
    )


def _serve(args: argparse.Namespace, threads: int) -> int:
    """The wiring, in order: model (tokenizer, weights, memory plan), engine, server configuration, app, uvicorn."""
    # torch is imported only now, after prepare_process has set the threads and the allocator
    from ember.api.app import create_app
    from ember.api.context import Served
    from ember.api.transport import guarded_protocol
    from ember.cli.frontend import frontend
    from ember.engine.cpu import set_threads

    set_threads(threads)
    check_runner(args)
    front = frontend(args)  # TLS files, CORS lists: refused before the model loads
    warn_ignored(args)
    endpoint = otlp_endpoint(args.otlp_traces_endpoint)
    tracing = None
    if endpoint is not None:  # OpenTelemetry is imported only now, and only when traces are asked for
        from ember.api.tracing import Tracing

        tracing = Tracing(endpoint, otel_service_name())
        log.info("tracing: each request's spans to %s", tracing.url)
    served = _models(args, threads)
    first = served[0]
    queued = max(m.engine.config.max_queued_tokens for m in served)
    server = _server_config(args, first.names, first.path, first.engine_memory, queued)
    more = [Served(m.engine, m.names, m.path) for m in served[1:]]
    app = create_app(first.engine, server, cors=front.cors, docs=front.docs, tracing=tracing, more=more)
    where = f"unix socket {args.uds}" if args.uds else f"{front.scheme}://{args.host}:{args.port}"
    log.info("serving %s on %s%s", ", ".join(m.names[0] for m in served), where, front.uvicorn.get("root_path", ""))
    if not server.api_keys:
        log.warning(
            "no API key: any client that reaches this port may use it (--api-key or EMBER_API_KEY requires one)"
        )
    connections = connection_limit(args.max_connections)
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        log_config=None if args.log_format == "json" else uvicorn.config.LOGGING_CONFIG,  # json: through ember's
        timeout_graceful_shutdown=math.ceil(args.shutdown_grace),
        timeout_keep_alive=args.timeout_keep_alive,
        http=guarded_protocol(connections, args.http_read_timeout, args.http_write_timeout),
        **front.uvicorn,
    )
    engines = [m.engine for m in served]

    def drain() -> None:
        for engine in engines:
            engine.drain(args.shutdown_grace)

    server_ = _Server(uvicorn_config, drain, args.shutdown_grace)
    server_.run()
    if any(e.model_busy for e in engines):  # a batch nobody will receive is still running: do not wait for it to exit
        log.info("exiting with a batch still on the model thread (its requests were answered 503)")
        logging.shutdown()
        os._exit(0)
    return 0


@dataclass(frozen=True)
class _Model:
    engine: AsyncEngine
    names: tuple[str, ...]
    path: str
    engine_memory: int


def _models(args: argparse.Namespace, threads: int) -> list[_Model]:
    """Every model asked for (the flags' model, then --models' entries), planned together in one memory plan,
    loaded, and given engines that share the model thread."""
    from ember.engine.build import build_engines, load, plan_models

    wanted = model_configs(args)
    native = native_config()
    # Planning and loading run on a thread that ends with them, taking along the pool of workers OpenMP keeps for
    # each thread that ran parallel work: only the model thread may keep one (see AsyncEngine.start). The plan
    # runs tiny products too (which float32 product this CPU takes): on the main thread, their pool would outlive
    # start-up and slow every forward (benchmarks/NOTES.md, "One OpenMP pool").
    with ThreadPoolExecutor(1, thread_name_prefix="ember-load") as loader:
        plans = loader.submit(plan_models, [config for config, _, _ in wanted], native=native).result()
        loaded = [loader.submit(load, p.config, native, planned=p).result() for p in plans]
    base = _engine_config(args)
    engines = build_engines(
        [(m, replace(base, auto_truncate=cut)) for m, (_, cut, _) in zip(loaded, wanted, strict=True)],
        tokenizer_threads=min(threads, 4),
    )
    models = [
        _Model(engine, (m.info.name, *extra), str(m.plan.path), m.memory.budget_bytes)
        for engine, m, (_, _, extra) in zip(engines, loaded, wanted, strict=True)
    ]
    seen: dict[str, int] = {}
    for i, model in enumerate(models):
        for name in model.names:
            if seen.setdefault(name, i) != i:
                raise ConfigError(f"two models are served as {name!r}: give each its own served_model_name")
    return models


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM starts the engines' drain at once (new requests 503, the grace counted from
    now) and the server keeps serving while they drain: it stops accepting connections and closes them only once
    every request it has read has its answer (or the grace is over). uvicorn alone stops at once, closing any
    connection whose request it has not read yet: its client saw the connection drop instead of a 503, and a
    Kubernetes pod still gets new connections for a few seconds after its SIGTERM. A drained SIGTERM is a clean exit
    (status 0), as orchestrators expect; a second signal, or SIGINT, stops as uvicorn does."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], grace: float) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._grace = grace
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            asyncio.get_event_loop().call_soon_threadsafe(self._on_exit)
        if sig == signal.SIGTERM and self._drain_until is None and not self.should_exit:
            self._drain_until = time.monotonic() + self._grace  # on_tick ends the serving when drained
            return
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            getattr(self, "_captured_signals", []).clear()  # uvicorn would re-raise it after draining

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and not self.should_exit:
            left = self._drain_until - time.monotonic()
            if left <= 0 or not self.server_state.tasks:  # every request read (each an ASGI task) is answered
                # uvicorn then waits for the answers still being written, within what is left of the grace
                self.config.timeout_graceful_shutdown = max(1, math.ceil(left))
                self.should_exit = True
        return await super().on_tick(counter)
