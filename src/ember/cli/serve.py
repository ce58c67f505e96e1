"""`ember serve`: load the model, wire engine and app, run uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.cli.flags import add_serve_flags, api_keys, check_runner, parse_json_flag, warn_ignored
from ember.cli.runtime import maybe_reexec_with_allocator, parse_bytes, prepare_process
from ember.errors import EmberError

__all__ = ["add_parser", "run"]

log = logging.getLogger("ember.cli")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", allow_abbrev=False, help="serve an embedding model over HTTP (OpenAI/vLLM compatible)")
    add_serve_flags(p)
    p.set_defaults(run=run)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        maybe_reexec_with_allocator(sys.argv[1:])
        plan = prepare_process(args.threads, args.cpu_bind)
        return _serve(args, plan.threads)
    except EmberError as e:
        log.error("%s", e)
        return 2


def uvicorn_server() -> type:
    import uvicorn

    return uvicorn.Server


def compile_kernels(enforce_eager: bool) -> bool:
    """Fused kernels unless told not to, where a C++ compiler can build them."""
    from ember.ops.fused import can_compile

    if enforce_eager:
        return False
    if not can_compile():
        log.warning("no C++ compiler (g++) found: serving with eager kernels, ~1.3x slower; install g++ to fix")
        return False
    return True


def _serve(args: argparse.Namespace, threads: int) -> int:
    import uvicorn

    from ember.api.app import create_app
    from ember.config import EngineConfig, PoolerConfig, ServerConfig, check_dtype
    from ember.engine.build import Limits, build_engine, load, set_threads

    set_threads(threads)
    check_runner(args)
    warn_ignored(args)
    pooler = PoolerConfig.parse(args.pooler_config or args.override_pooler_config)
    model = args.model or args.model_tag
    quantization = args.quantization or ("int8" if args.dtype == "int8" else None)
    # Loading runs on a thread that ends with it, taking along the pool of workers OpenMP keeps for each
    # thread that ran parallel work: only the model thread may keep one (see AsyncEngine.start).
    with ThreadPoolExecutor(1, thread_name_prefix="ember-load") as loader:
        loaded = loader.submit(
            load,
            model,
            dtype=check_dtype("auto" if args.dtype == "int8" else args.dtype),
            quantization=quantization,
            max_model_len=args.max_model_len,
            pooler=pooler,
            revision=args.revision,
            download_dir=args.download_dir,
            served_name=(args.served_model_name or [None])[0],
            hf_overrides=parse_json_flag(args.hf_overrides, "--hf-overrides"),
            limits=Limits(
                batch_tokens=args.max_num_batched_tokens,
                queued_tokens=args.max_queued_tokens,
                memory_limit=parse_bytes(args.memory_limit) if args.memory_limit else None,
            ),
        ).result()
    engine_config = EngineConfig(
        max_num_batched_tokens=loaded.memory.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=loaded.memory.max_queued_tokens,
        auto_truncate=args.truncate,
        batch_wait_seconds=args.batch_wait_ms / 1000,
        compile_kernels=compile_kernels(args.enforce_eager),
    )
    engine = build_engine(loaded, engine_config, pooler, tokenizer_threads=min(threads, 4))
    names = tuple(args.served_model_name or [loaded.info.name])
    server = ServerConfig(
        served_model_names=names,
        model_path=str(loaded.path),
        api_keys=api_keys(args.api_key),
        max_request_bytes=parse_bytes(args.max_request_bytes),
        shutdown_grace_seconds=args.shutdown_grace,
        memory_budget_bytes=loaded.memory.budget_bytes,
    )
    app = create_app(engine, server)
    log.info("serving %s as %s on http://%s:%d", loaded.info.name, names[0], args.host, args.port)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(args.shutdown_grace),
    )
    _Server(config).run()
    return 0


class _Server(uvicorn_server()):  # type: ignore[misc]
    """uvicorn's server, but a drained SIGTERM is a clean exit (status 0), as orchestrators expect."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            getattr(self, "_captured_signals", []).clear()  # uvicorn would re-raise it after draining
