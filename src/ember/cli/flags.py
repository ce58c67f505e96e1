"""vLLM-compatible flags for `ember serve`: the ones ember honours and the ones it ignores.

Teams switching from `vllm serve MODEL --runner pooling` keep their command line; flags
that only mean something on a GPU are accepted with a one-line warning saying so.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from ember.cli.frontend import add_frontend_flags
from ember.config import DEFAULT_BATCH_TOKENS, parse_json_object
from ember.errors import ConfigError

__all__ = [
    "IGNORED_FLAGS",
    "add_serve_flags",
    "api_keys",
    "check_runner",
    "max_inputs_per_request",
    "otel_service_name",
    "otlp_endpoint",
    "parse_json_flag",
    "parse_size",
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
    "--enable-prefix-caching", "--disable-log-requests", "--enable-log-requests",
    "--disable-log-stats", "--disable-uvicorn-access-log", "--trust-remote-code", "--enable-chunked-prefill",
    "--disable-frontend-multiprocessing",
}  # fmt: skip


def parse_size(value: str) -> int:
    """A count with vLLM's suffixes: k/m/g are powers of 1000, K/M/G powers of 1024 (`8k` = 8000, `8K` = 8192)."""
    text = value.strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a count (e.g. 8192, 8k, 8K)") from None


def parse_json_flag(raw: str | None, flag: str) -> dict[str, Any] | None:
    return None if raw is None else parse_json_object(raw, flag)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, help="model: local directory or hub id")
    p.add_argument("--model", default=None, help="same as the positional model (vLLM)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    p.add_argument("--download-dir", default=None, help="Hugging Face cache directory for hub downloads")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="an accepted key (Authorization: Bearer or x-api-key); repeat the flag for several",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use; first is reported")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 (float16/half run as bfloat16) or int8")
    p.add_argument(
        "--quantization", "-q", default=None, choices=["int8"], help="int8 weights, dynamic int8 activations"
    )
    p.add_argument("--max-model-len", type=parse_size, default=None, help="longest input in tokens")
    _add_limit_flags(p)
    p.add_argument("--pooler-config", default=None, help="vLLM PoolerConfig JSON")
    p.add_argument("--truncate", action="store_true", help="truncate over-long inputs instead of refusing them")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never torch.compile the fused elementwise regions (by default they are built in the background after "
        "start-up); ember's native kernels are governed by EMBER_NATIVE_* instead",
    )
    p.add_argument("--override-pooler-config", default=None, help="older name of --pooler-config")
    p.add_argument("--hf-overrides", default=None, help='JSON merged into config.json, e.g. {"is_matryoshka": true}')
    p.add_argument("--runner", default="auto", choices=["auto", "pooling", "generate", "draft"])
    p.add_argument(
        "--convert", default="auto", choices=["auto", "none", "embed", "score", "classify", "reward"],
        help="accepted for vLLM compatibility: the checkpoint decides embed (a vector per input) or score (pairs)",
    )  # fmt: skip
    p.add_argument("--task", default=None, help="deprecated vLLM flag; embed, embedding, score and rerank accepted")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="compute threads (default: EMBER_THREADS, OMP_NUM_THREADS, else usable CPUs)",
    )
    p.add_argument("--cpu-bind", default=None, help="auto, nobind or a CPU list like 0-3 (VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument(
        "--memory-limit", default=None, help="memory to plan for, e.g. 4Gi (default: cgroup limit, else MemAvailable)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_frontend_flags(p)
    for flag in IGNORED_FLAGS:
        if flag in _IGNORED_SWITCHES:
            p.add_argument(flag, action="count", default=0, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, default=None, help=argparse.SUPPRESS)


def max_inputs_per_request(flag: int | None) -> int:
    """--max-inputs-per-request, else EMBER_MAX_INPUTS_PER_REQUEST, else 2048."""
    return flag if flag is not None else _env_int("EMBER_MAX_INPUTS_PER_REQUEST", 2048)


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
    """Batching, queueing and per-request limits."""
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per batch")
    p.add_argument(
        "--max-num-batched-tokens", type=parse_size, default=DEFAULT_BATCH_TOKENS, help="token budget of one batch"
    )
    p.add_argument(
        "--batch-wait-ms", type=float, default=25.0, help="most a batch waits for more requests to join it (0: never)"
    )
    p.add_argument("--max-queued-requests", type=int, default=1024, help="requests queued before 429")
    p.add_argument("--max-queued-tokens", type=parse_size, default=1_000_000, help="tokens queued before 429")
    p.add_argument(
        "--max-queue-seconds", type=float, default=10.0,
        help="429 for a request whose estimated wait before it starts is longer (default 10)",
    )  # fmt: skip
    p.add_argument("--max-request-bytes", default="8M", help="largest request body before 413 (e.g. 8M, 20MB)")
    p.add_argument(
        "--max-inputs-per-request",
        type=int,
        default=None,
        help="most inputs (texts, documents, pairs) in one request before 400 (default: "
        "EMBER_MAX_INPUTS_PER_REQUEST, else 2048)",
    )
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds SIGTERM waits for in-flight work")
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections before new ones are closed at once (default: 2048, or fewer if file descriptors are)",
    )
    p.add_argument(
        "--http-read-timeout",
        type=float,
        default=30.0,
        help="seconds a request may take to arrive whole (headers and body), from its first byte, before its "
        "connection is closed",
    )
    p.add_argument(
        "--embedding-cache-size",
        default="64M",
        help="bytes of pooled outputs kept by exact token ids, so repeated inputs skip the model (taken from the "
        "answers' memory budget; 0: off)",
    )
    p.add_argument(
        "--http-write-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take none of its answer before its connection is closed (its answer freed)",
    )
    p.add_argument(
        "--timeout-keep-alive", type=float, default=5.0, help="seconds an idle keep-alive connection is kept (uvicorn)"
    )


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
        raise ConfigError("--api-key '' is empty: it would accept requests without a key; give a non-empty key, or "
                          "leave --api-key out to serve without one")  # fmt: skip
    if flag_keys:
        return tuple(flag_keys)
    keys: list[str] = []
    for var in ("EMBER_API_KEY", "VLLM_API_KEY"):
        keys += [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))
