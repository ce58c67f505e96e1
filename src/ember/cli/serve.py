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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
from ember.cli.model_flags import model_config, truncate
from ember.cli.runtime import (
    connection_limit,
    maybe_reexec_with_allocator,
    native_config,
    parse_bytes,
    prepare_process,
)
from ember.config import EngineConfig, ServerConfig
from ember.errors import EmberError

__all__ = ["add_parser", "run"]

log = logging.getLogger("ember.cli")

_REQUEST_BYTES = ServerConfig(("",)).max_request_bytes


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
        compile_kernels=compile_kernels,
        eager_reason=eager_reason,
        cache_bytes=parse_bytes(args.embedding_cache_size),
    )


def _server_config(args: argparse.Namespace, names: tuple[str, ...], path: str, budget: int) -> ServerConfig:
    return ServerConfig(
        served_model_names=names,
        model_path=path,
        api_keys=api_keys(args.api_key),
        max_request_bytes=parse_bytes(args.max_request_bytes) if args.max_request_bytes else _REQUEST_BYTES,
        max_inputs_per_request=max_inputs_per_request(args.max_inputs_per_request),
        shutdown_grace_seconds=args.shutdown_grace,
        memory_budget_bytes=budget,
    )


def _serve(args: argparse.Namespace, threads: int) -> int:
    """The wiring, in order: model (tokenizer, weights, memory plan), engine, server configuration, app, uvicorn."""
    # torch is imported only now, after prepare_process has set the threads and the allocator
    from ember.api.app import create_app
    from ember.api.transport import guarded_protocol
    from ember.cli.frontend import frontend
    from ember.engine.build import build_engine, load
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
    config = model_config(args)
    # Loading runs on a thread that ends with it, taking along the pool of workers OpenMP keeps for each
    # thread that ran parallel work: only the model thread may keep one (see AsyncEngine.start).
    with ThreadPoolExecutor(1, thread_name_prefix="ember-load") as loader:
        loaded = loader.submit(load, config, native_config()).result()
    engine = build_engine(loaded, _engine_config(args), tokenizer_threads=min(threads, 4))
    names = (loaded.info.name, *(args.served_model_name or [])[1:])
    server = _server_config(args, names, str(loaded.plan.path), loaded.memory.budget_bytes)
    app = create_app(engine, server, cors=front.cors, docs=front.docs, tracing=tracing)
    where = f"unix socket {args.uds}" if args.uds else f"{front.scheme}://{args.host}:{args.port}"
    log.info("serving %s on %s%s", names[0], where, front.uvicorn.get("root_path", ""))
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
    server_ = _Server(uvicorn_config, on_exit=lambda: engine.drain(args.shutdown_grace))
    server_.run()
    if engine.model_busy:  # a batch nobody will receive is still running: do not wait for it to exit
        log.info("exiting with a batch still on the model thread (its requests were answered 503)")
        logging.shutdown()
        os._exit(0)
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, but SIGTERM starts the engine's drain at once (new requests 503, the grace counted from
    now), and a drained SIGTERM is a clean exit (status 0), as orchestrators expect."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            asyncio.get_event_loop().call_soon_threadsafe(self._on_exit)
        if sig == signal.SIGTERM:
            getattr(self, "_captured_signals", []).clear()  # uvicorn would re-raise it after draining
