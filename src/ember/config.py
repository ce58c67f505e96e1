"""Frozen, documented configuration records, validated where they are built.

Field names follow vLLM's (`--pooler-config`, `--max-model-len`, ...) so users keep theirs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, cast, get_args

from ember.errors import ConfigError
from ember.types import PoolingType

__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "DEFAULT_QUEUED_TOKENS",
    "ONEDNN_KERNEL_CACHE",
    "RAY_BATCH_SIZE",
    "REMOTE_BATCH_SIZE",
    "SERVED_CACHE_SIZE",
    "DType",
    "EngineConfig",
    "HttpConfig",
    "ModelConfig",
    "NativeConfig",
    "PoolerConfig",
    "ServerConfig",
    "check_dtype",
    "parse_json_object",
]

ONEDNN_KERNEL_CACHE = 384
"""oneDNN primitives kept (ONEDNN_PRIMITIVE_CACHE_CAPACITY, set where the process starts, before torch's first matmul,
unless the operator set it): one per GEMM shape and row count, each milliseconds to build (benchmarks/NOTES.md). Batches
run at rounded token counts (runner.padded_tokens), so a model meets at most ~80 row counts per GEMM up to the
2,048-token slice: 384 holds them for 4 GEMM shapes with room to spare. Unbounded (oneDNN's default 1,024) with
unrounded batches, a server grew by ~600 MB; bounded to 32, most batches rebuilt their kernels (benchmarks/NOTES.md)."""

DEFAULT_BATCH_TOKENS = 2048
"""Token budget of one packed batch unless the operator sets one (--max-num-batched-tokens): the token slice
the models run their per-token work in, so a full batch keeps its GEMMs in cache; the memory plan lowers it
where memory is short."""

DEFAULT_QUEUED_TOKENS = 1_000_000
"""Tokens queued (waiting or running) before new requests get 429, unless the memory plan lowers it."""

REMOTE_BATCH_SIZE = 32
"""Texts per request when `ember embed --url` embeds on running servers (--batch-size)."""

RAY_BATCH_SIZE = 256
"""Texts per Ray Data batch for `ember embed --ray` (--batch-size)."""

DType = Literal["auto", "float32", "bfloat16"]
_POOLING_NAMES = {"CLS", "MEAN", "LAST"}
# vLLM pooler fields that only matter for other tasks (reward, classify); accepted and ignored.
_IGNORED_POOLER_FIELDS = {"activation", "softmax", "step_tag_id", "returned_token_ids", "use_activation"}


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `--pooler-config` JSON for embedding models."""

    pooling_type: PoolingType | None = None
    """CLS, MEAN or LAST; None (or "auto" in JSON) detects it from the checkpoint."""
    normalize: bool | None = None
    """L2-normalise the pooled vector; None follows the checkpoint."""
    dimensions: int | None = None
    """Default Matryoshka truncation when a request does not ask for `dimensions`."""
    enable_chunked_processing: bool = False
    """Embed inputs longer than max-model-len as windows and merge them (token-weighted mean)."""
    max_embed_len: int | None = None
    """With chunked processing, the longest input accepted, in tokens (None: no limit)."""
    chunk_overlap: int = 0
    """ember extension: tokens each window shares with the previous one (at most half a window)."""
    task: Literal["embed", "token_embed", "token_classify"] | None = None
    """What /pooling answers when a request names no task: embed (a vector per input, the default), token_embed
    (a vector per token) or token_classify (sparse weights, for models that have them)."""

    @classmethod
    def parse(cls, raw: str | dict[str, Any] | None, flag: str = "--pooler-config") -> PoolerConfig:
        """Build from the flag's JSON text or a dict; every error names the flag."""
        if raw is None or raw == "":
            return cls()
        data = parse_json_object(raw, flag) if isinstance(raw, str) else raw
        if not isinstance(data, dict):
            raise ConfigError(f"{flag} must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - _IGNORED_POOLER_FIELDS
        if unknown:
            raise ConfigError(f"{flag}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**_validated(kwargs, flag))


def _validated(kw: dict[str, Any], flag: str) -> dict[str, Any]:
    pooling = kw.get("pooling_type")
    if isinstance(pooling, str):
        pooling = pooling.upper()
        if pooling == "AUTO":
            pooling = None
        elif pooling == "LASTTOKEN":
            pooling = "LAST"
        elif pooling not in _POOLING_NAMES:
            raise ConfigError(
                f"{flag}: pooling_type {kw['pooling_type']!r} is not supported; "
                f"choose one of {sorted(_POOLING_NAMES)} or 'auto'"
            )
        kw["pooling_type"] = cast(PoolingType, pooling)
    elif pooling is not None:
        raise ConfigError(f"{flag}: pooling_type must be a string, got {pooling!r}")
    for name in ("normalize", "enable_chunked_processing"):
        if name in kw and kw[name] is not None and not isinstance(kw[name], bool):
            raise ConfigError(f"{flag}: {name} must be true or false, got {kw[name]!r}")
    if kw.get("task") not in (None, "embed", "token_embed", "token_classify"):
        raise ConfigError(
            f"{flag}: task {kw['task']!r} is not one ember runs; choose embed, token_embed or token_classify"
        )
    overlap = kw.get("chunk_overlap", 0)
    if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 0:
        raise ConfigError(f"{flag}: chunk_overlap must be a non-negative integer, got {overlap!r}")
    for name in ("dimensions", "max_embed_len"):
        value = kw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{flag}: {name} must be a positive integer, got {value!r}")
    return kw


def parse_json_object(raw: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object (--pooler-config, --hf-overrides); errors name the flag."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {raw!r}")
    return data


def check_dtype(value: str, flag: str = "--dtype") -> DType:
    """Validate a dtype name (accepting torch's aliases) and return its canonical form."""
    aliases = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "float16": "bfloat16", "half": "bfloat16"}
    name = aliases.get(value, value)
    if name not in get_args(DType):
        raise ConfigError(f"{flag} {value!r} is not supported on CPU; choose auto, float32 or bfloat16")
    return cast(DType, name)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how (vLLM's flag names), before it is fitted into memory."""

    model: str | None = None
    """A local directory or a hub id; None: the bundled sentence-transformers/all-MiniLM-L6-v2."""
    served_name: str | None = None
    """The name the model is reported as (the first --served-model-name); None: `model`."""
    revision: str | None = None
    """The hub revision to load: a branch, tag or commit."""
    download_dir: str | None = None
    """The Hugging Face cache directory for hub downloads."""
    dtype: DType = "auto"
    """auto (bfloat16 where the CPU has bf16 matrix instructions, else float32), float32 or bfloat16 (float16 and
    half run as bfloat16); int8 is --quantization int8 in the auto dtype."""
    quantization: Literal["int8"] | None = None
    """int8: weights at one byte and per-token int8 activations in the linear layers."""
    calibration: str | None = None
    """With int8: a text file, one text per line, that the weights are rounded against (GPTQ); none: plain rounding;
    None: ember's bundled English sentences. Done once per model and calibration, then read from the cache."""
    max_model_len: int | None = None
    """Longest input in tokens; None: the model's positions, capped by sentence-transformers' max_seq_length."""
    hf_overrides: dict[str, Any] | None = None
    """JSON merged into config.json before anything reads it, e.g. {"is_matryoshka": true}."""
    pooler: PoolerConfig = PoolerConfig()
    """vLLM's PoolerConfig JSON: pooling_type, normalize, dimensions, enable_chunked_processing, max_embed_len,
    chunk_overlap, task."""
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Token budget of one batch; the memory plan may lower it."""
    max_queued_tokens: int = DEFAULT_QUEUED_TOKENS
    """Tokens queued before 429; the memory plan may lower it."""
    memory_limit: int | None = None
    """Bytes to plan for, e.g. 4Gi, instead of the detected cgroup limit or available memory."""

    def __post_init__(self) -> None:
        if self.quantization not in (None, "int8"):
            raise ConfigError(f"--quantization {self.quantization!r} is not supported; ember offers int8")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be positive, got {self.max_model_len}")


SERVED_CACHE_SIZE = "64M"
"""The embedding cache `ember serve` keeps by default (--embedding-cache-size)."""


@dataclass(frozen=True)
class EngineConfig:
    """Batching and backpressure limits of the async engine (vLLM's flag names where they exist)."""

    max_num_batched_tokens: int = DEFAULT_BATCH_TOKENS
    """Token budget of one packed batch (--max-num-batched-tokens)."""
    max_num_seqs: int = 256
    """Most sequences in one batch (--max-num-seqs)."""
    max_queued_requests: int = 1024
    """Requests waiting or running before new ones get 429 (--max-queued-requests)."""
    max_queued_tokens: int = DEFAULT_QUEUED_TOKENS
    """Tokens waiting or running before new requests get 429 (--max-queued-tokens)."""
    seconds_per_token: float = 0.002
    """Scheduling cost estimate: a request's deadline is arrival + tokens x this, earliest first."""
    max_queued_vectors: int | None = None
    """Most answer vectors held by admitted requests (an input each; a token each for token_embed; see
    ember.engine.results.answer_vectors), as the memory plan allows; past it, 429 (413 for one request larger than
    all of it). None: unbounded (offline use)."""
    max_queue_seconds: float = 10.0
    """Admission by time (--max-queue-seconds): a request whose estimated wait before it starts (the running batch
    and the queued work due before it, earliest deadline first, at the measured cost per token) exceeds this gets
    429 with a Retry-After of the excess, unless the queue is empty. A client's own X-Request-Timeout bounds its
    wait plus its own work. Overload then gets prompt 429s rather than answers computed for clients that have given
    up; 10 s stays well inside the usual 30-600 s client timeouts, and a bulk client told to retry finds room when the
    work ahead has shrunk to the bound, so the model never idles between its requests."""
    batch_wait_seconds: float = 0.025
    """Before starting a batch that is not full (or a long window alone), wait up to this long for more
    requests to join it (--batch-wait-ms): a forward on CPU has a large fixed cost (streaming the weights),
    so two queries run together cost little more than one, and closed-loop clients stop alternating.
    The engine ends the wait early once the requests it expects have arrived (see AsyncEngine._gather), so
    the bound matters only for a straggler: long enough that late queries join their batch instead of waiting a
    whole forward for the next (benchmarks/NOTES.md)."""
    auto_truncate: bool = False
    """Truncate inputs longer than max-model-len instead of refusing them (--truncate), when not chunking."""
    compile_kernels: bool = False
    """After warm-up, compile the fused elementwise regions (torch.compile) on a background thread while
    serving eagerly, then switch to them (on by default in `ember serve`; off with --enforce-eager). ember's
    native kernels are not governed by this: see NativeConfig."""
    eager_reason: str = "--enforce-eager"
    """Why the fused regions are off when compile_kernels is False (shown by /info and the start-up log)."""
    shared_batch_seconds: float = 0.05
    """With several models on the one model thread (`--models`, --shared-batch-ms), each batch is cut to about this much
    of its model's measured time (at least 128 tokens), so a request to another model waits about this long for the
    batch running when it arrives rather than a whole token budget's worth (a full rerank batch of a MiniLM-sized
    cross-encoder takes most of a second on 2 cores). Shorter cuts favour the other models' latency, longer ones the
    busy model's throughput (benchmarks/stack.py). Batches are cut only while another model is active (asked for the
    thread in the last 5 s); a single model's never are."""
    cache_bytes: int = 0
    """0 (off) for in-process use; `ember serve` keeps SERVED_CACHE_SIZE unless told otherwise. The embedding cache
    (--embedding-cache-size): the pooled output of every window computed, kept by its exact token ids up to this many
    bytes (least recently used out first), so a repeated input is answered without the model; taken from the memory
    plan's answer budget (at most a quarter of it). 0: off."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and value <= 0 and f.name not in ("batch_wait_seconds", "cache_bytes"):
                raise ConfigError(f"--{f.name.replace('_', '-')} must be positive, got {value}")


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP connections' limits (uvicorn and ember.api.transport)."""

    max_connections: int = 2048
    """Open connections before new ones are closed at once (fewer if the process may not open that many files)."""
    read_timeout: float = 30.0
    """Seconds a request may take to arrive whole (headers and body), from its first byte, before its connection is
    closed."""
    write_timeout: float = 60.0
    """Seconds a client may take none of its answer before its connection is closed (its answer freed)."""
    keep_alive: float = 5.0
    """Seconds an idle keep-alive connection is kept (uvicorn)."""


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP edge needs to know: names, keys and limits."""

    served_model_names: tuple[str, ...]
    """Names clients may send as `model`; the first is the one reported (--served-model-name)."""
    model_path: str = ""
    """The checkpoint the model was loaded from, reported as `root` by /v1/models."""
    api_keys: tuple[str, ...] = ()
    """Accepted bearer tokens (--api-key, VLLM_API_KEY, EMBER_API_KEY); empty = no auth."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Largest request body accepted before 413 (--max-request-bytes). `ember serve` sizes it to the memory plan
    unless given: 32 bytes per token the queue holds, between 1 MiB and 64 MiB (ember.sizing.request_bytes)."""
    max_inputs_per_request: int = 2048
    """Most inputs one request may carry (texts of /v1/embeddings, /pooling and /v2/embed, documents of /rerank,
    pairs of /score), checked before any tokenising: 400 past it (--max-inputs-per-request,
    EMBER_MAX_INPUTS_PER_REQUEST). 2,048 is OpenAI's own cap, which OpenAI-written clients already respect."""
    shutdown_grace_seconds: float = 30.0
    """How long SIGTERM waits for in-flight requests (--shutdown-grace)."""
    memory_budget_bytes: int = 0
    """The memory ember sized itself to, exported in /metrics."""

    def __post_init__(self) -> None:
        if self.max_inputs_per_request < 1:
            raise ConfigError(f"--max-inputs-per-request must be positive, got {self.max_inputs_per_request}")


@dataclass(frozen=True)
class NativeConfig:
    """ember's native C++ kernels (ember.ops.native): which may be built and loaded, and where they are cached.

    Each runs only where the CPU (as capped by EMBER_MAX_ISA) has what it needs; these switches only turn them
    off (EMBER_NATIVE_ATTENTION, EMBER_NATIVE_INT8, EMBER_NATIVE_ELEMENTWISE, EMBER_NATIVE_LINEAR,
    EMBER_NATIVE_LINEAR_F32, EMBER_NATIVE_LINEAR_BF16 = 0, read by the CLI)."""

    attention: bool = True
    """Flash attention over packed sequences: float32 (AVX2 + FMA up), bf16 (AMX, else AVX-512 BF16)."""
    int8_gemm: bool = True
    """The int8 layers' matrix product with SwiGLU in its epilogue (AMX, else AVX-512 VNNI)."""
    elementwise: bool = True
    """SwiGLU and Qwen3's q/k norm + rotary, bf16 (AVX-512 BF16)."""
    linear: bool = True
    """float32 models of bf16 checkpoints keep their linear layers' weights bf16 (half the memory) and run them on
    ember's bf16-weight product (AVX-512); off: widened to float32 at load, on oneMKL."""
    linear_f32: bool = True
    """float32 linear layers on AMD CPUs without AVX-512 (Zen 2, Zen 3) run short batches on ember's float32 product,
    which overlaps streaming the weights with computing them (AVX2); off: oneDNN's packed matmul."""
    linear_bf16: bool = True
    """bf16 linear layers run a query's few rows on ember's bf16 product, which streams the weights faster than
    oneDNN's packed matmul (AVX-512 BF16, AMD; at every height, for models whose linear weights outgrow the caches);
    off: oneDNN's."""
    cache_dir: str | None = None
    """Where built libraries are kept (EMBER_CACHE_DIR); None: ~/.cache/ember."""
    compiler: str | None = None
    """The C++ compiler to build them with (CXX); None: g++, else c++, else clang++ on PATH."""

    def enabled(self, kernel: str) -> bool:
        return bool(getattr(self, kernel))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NativeConfig:
        """The operator's settings in `env` (os.environ, passed by an edge: the CLI, the offline and Ray APIs):
        EMBER_NATIVE_* (0/false/no/off turns a kernel off), EMBER_CACHE_DIR (else $XDG_CACHE_HOME/ember, else
        ~/.cache/ember, where prebuilt kernels of an image are found too) and CXX."""
        off = ("0", "false", "no", "off")
        xdg = env.get("XDG_CACHE_HOME")
        return cls(
            **{
                kernel: env.get(cls.switch(kernel), "1").strip().lower() not in off
                for kernel in ("attention", "int8_gemm", "elementwise", "linear", "linear_f32", "linear_bf16")
            },
            cache_dir=env.get("EMBER_CACHE_DIR") or (f"{xdg}/ember" if xdg else None),
            compiler=env.get("CXX") or None,
        )

    @staticmethod
    def switch(kernel: str) -> str:
        """The environment variable that turns `kernel` off."""
        return {"int8_gemm": "EMBER_NATIVE_INT8"}.get(kernel, f"EMBER_NATIVE_{kernel.upper()}")
