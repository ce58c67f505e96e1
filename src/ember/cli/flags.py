"""vLLM-compatible flags for `ember serve`: the ones ember honours and the ones it ignores.

Teams switching from `vllm serve MODEL --runner pooling` keep their command line; flags
that only mean something on a GPU are accepted with a one-line warning saying so.
"""

from __future__ import annotations

import argparse
import logging
import os

from ember.cli.fields import add_field_flag, field_default
from ember.cli.frontend import add_frontend_flags
from ember.cli.model_flags import add_model_flags, add_models_flag, add_process_flags
from ember.config import SERVED_CACHE_SIZE, EngineConfig, HttpConfig, ServerConfig
from ember.errors import ConfigError

__all__ = [
    "IGNORED_FLAGS",
    "add_serve_flags",
    "api_keys",
    "check_runner",
    "max_inputs_per_request",
    "otel_service_name",
    "otlp_endpoint",
    "warn_ignored",
]

log = logging.getLogger("ember.cli")

IGNORED_FLAGS: dict[str, str] = {
    "--gpu-memory-utilization": "ember sizes its memory from the container limit (see --memory-limit)",
    "--swap-space": "ember keeps no KV cache",
    "--kv-cache-dtype": "ember keeps no KV cache",
    "--block-size": "ember keeps no KV cache",
    "--enable-prefix-caching": "ember keeps no KV cache; a prefix shared within a batch is always computed once",
    "--pipeline-parallel-size": "ember runs one process on CPU",
    "--distributed-executor-backend": "ember runs one process on CPU",
    "--device": "ember runs on CPU",
    "--enable-chunked-prefill": "ember packs batches by token budget already",
    "--disable-log-requests": "ember logs one access line per request, never input text",
    "--enable-log-requests": "ember logs one access line per request, never input text",
    "--disable-log-stats": "statistics are in /metrics",
    "--disable-uvicorn-access-log": "ember writes its own access log",
    "--max-log-len": "ember never logs input text",
    "--seed": "embedding is deterministic",
    "--trust-remote-code": "ember runs its own model code; remote code is never executed",
    "--tokenizer-mode": "ember always uses the fast tokenizer (tokenizer.json)",
    "--load-format": "ember reads safetensors or pytorch_model.bin as found",
    "--disable-frontend-multiprocessing": "ember runs one process",
    "--uvicorn-log-level": "use --log-level",
}
_IGNORED_SWITCHES = {
    "--enable-prefix-caching",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-log-stats",
    "--disable-uvicorn-access-log",
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--disable-frontend-multiprocessing",
}


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_models_flag(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an accepted key (Authorization: Bearer or x-api-key); repeat the flag for several",
    )
    _add_limit_flags(p)
    add_process_flags(p)
    p.add_argument("--runner", default="auto", choices=["auto", "pooling", "generate", "draft"])
    p.add_argument(
        "--convert",
        default="auto",
        choices=["auto", "none", "embed", "score", "classify", "reward"],
        help="accepted for vLLM compatibility: the checkpoint decides embed (a vector per input) or score (pairs)",
    )
    p.add_argument("--task", default=None, help="deprecated vLLM flag; embed, embedding, score and rerank accepted")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    add_frontend_flags(p)
    for flag in IGNORED_FLAGS:
        if flag in _IGNORED_SWITCHES:
            p.add_argument(flag, action="count", default=0, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, default=None, help=argparse.SUPPRESS)


def max_inputs_per_request(flag: int | None) -> int:
    """--max-inputs-per-request, else EMBER_MAX_INPUTS_PER_REQUEST, else ServerConfig's default."""
    default = field_default(ServerConfig, "max_inputs_per_request")
    return flag if flag is not None else _env_int("EMBER_MAX_INPUTS_PER_REQUEST", default)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < 1:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Batching, queueing and per-request limits: defaults and help from EngineConfig and ServerConfig."""
    engine = {
        "--max-num-seqs": "max_num_seqs",
        "--max-queued-requests": "max_queued_requests",
        "--max-queue-seconds": "max_queue_seconds",
    }
    for flag, name in engine.items():
        value = field_default(EngineConfig, name)
        add_field_flag(p, flag, EngineConfig, name, type=type(value), default=value)
    wait_ms = 1000 * field_default(EngineConfig, "batch_wait_seconds")
    add_field_flag(
        p, "--batch-wait-ms", EngineConfig, "batch_wait_seconds", type=float, default=wait_ms, shown=f"{wait_ms:g} ms"
    )
    cache = SERVED_CACHE_SIZE
    add_field_flag(p, "--embedding-cache-size", EngineConfig, "cache_bytes", default=cache, shown=cache)
    shared_ms = 1000 * field_default(EngineConfig, "shared_batch_seconds")
    shown = f"{shared_ms:g} ms"
    add_field_flag(
        p, "--shared-batch-ms", EngineConfig, "shared_batch_seconds", type=float, default=shared_ms, shown=shown
    )
    add_field_flag(p, "--max-request-bytes", ServerConfig, "max_request_bytes", shown="from the memory plan")
    add_field_flag(
        p,
        "--max-inputs-per-request",
        ServerConfig,
        "max_inputs_per_request",
        type=int,
        shown=f"EMBER_MAX_INPUTS_PER_REQUEST, else {field_default(ServerConfig, 'max_inputs_per_request')}",
    )
    grace = field_default(ServerConfig, "shutdown_grace_seconds")
    add_field_flag(p, "--shutdown-grace", ServerConfig, "shutdown_grace_seconds", type=float, default=grace)
    http = {
        "--max-connections": "max_connections",
        "--http-read-timeout": "read_timeout",
        "--http-write-timeout": "write_timeout",
        "--timeout-keep-alive": "keep_alive",
    }
    for flag, name in http.items():
        value = field_default(HttpConfig, name)
        given = None if flag == "--max-connections" else value  # None: sized to the open-file limit
        add_field_flag(p, flag, HttpConfig, name, type=type(value), default=given)


def warn_ignored(args: argparse.Namespace) -> None:
    for flag, why in IGNORED_FLAGS.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            log.warning("%s is accepted for vLLM compatibility and ignored: %s", flag, why)


def check_runner(args: argparse.Namespace) -> None:
    """Refuse anything but a pooling runner (embed or score: the checkpoint decides), saying why; and a command
    line whose model may have been read as a served name (the default model would be served under it)."""
    names = args.served_model_name or []
    if args.model is None and args.model_tag is None and len(names) > 1:
        raise ConfigError(
            f"no model given, and --served-model-name took {len(names)} values ({', '.join(names)}): if the last is "
            "the model, put the model first (ember serve MODEL --served-model-name NAME) or use --model"
        )
    task = (args.task or "").lower()
    if args.runner in ("generate", "draft") or task in ("generate", "transcription", "draft"):
        raise ConfigError(
            "ember serves embedding and score models only (vLLM's --runner pooling); text generation is not supported"
        )
    if args.convert in ("classify", "reward") or task in ("classify", "reward"):
        raise ConfigError(f"ember does not serve {args.convert if args.convert != 'auto' else task} models yet")
    if args.tensor_parallel_size != 1:
        raise ConfigError("--tensor-parallel-size must be 1: ember runs one process on CPU")


def otlp_endpoint(flag: str | None) -> str | None:
    """--otlp-traces-endpoint, else OpenTelemetry's own OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else none (no tracing)."""
    return flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or None


def otel_service_name() -> str:
    """OTEL_SERVICE_NAME, else "ember": the service the traces are filed under."""
    return os.environ.get("OTEL_SERVICE_NAME", "").strip() or "ember"


def api_keys(flag_keys: list[str]) -> tuple[str, ...]:
    """Keys from --api-key, else VLLM_API_KEY / EMBER_API_KEY (comma-separated allowed). An empty --api-key is
    refused: it reads as "require a key" but would let every request in."""
    if any(not k.strip() for k in flag_keys):
        raise ConfigError(
            "--api-key '' is empty: it would accept requests without a key; give a non-empty key, or "
            "leave --api-key out to serve without one"
        )
    if flag_keys:
        return tuple(flag_keys)
    keys: list[str] = []
    for var in ("EMBER_API_KEY", "VLLM_API_KEY"):
        keys += [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))
