"""Sizing ember to its container: how many threads, and how many tokens fit in memory (pure: it reads nothing).

The inputs are what `resources` detected and what the operator asked for; the outputs are
the numbers ember runs with and the reasons it gives for them at startup and in `ember doctor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.errors import ConfigError
from ember.resources import CpuBudget, MemoryBudget, parse_cpu_list

__all__ = [
    "OUTPUT_VALUE_BYTES",
    "MemoryPlan",
    "SharedMemory",
    "ThreadPlan",
    "activation_bytes_per_token",
    "flops_per_token",
    "plan_memory",
    "plan_threads",
    "request_bytes",
]

GIB = 1024**3
RUNTIME_BYTES = 450 * 1024**2
"""Python, torch, tokenizers and the server before any weight is loaded (measured: ~400 MB)."""
SAFETY = 0.9
"""Fraction of the available memory ember plans to use; the rest is headroom for the allocator."""
QUEUED_TOKEN_BYTES = 64
"""Memory a queued token costs (a Python int in a list, its share of the request text)."""
REQUEST_BYTES_PER_TOKEN = 32
"""Body bytes allowed per token the queue holds: ~4-8 bytes make a token of text or a token id in a list, so this
leaves room for texts cut by --truncate and for JSON around them."""
REQUEST_BYTES_RANGE = (1024**2, 64 * 1024**2)
"""The least and most a request body may be by default, whatever the queue holds."""
OUTPUT_VALUE_BYTES = 16
"""Memory one value of an answer costs until it is sent: 4 bytes in its float32 vector and up to ~12 in the JSON
body (orjson writes a float32 in at most 9 significant digits, a sign, a point, an exponent and a comma)."""


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    reason: str
    bind: tuple[int, ...] | None = None
    warnings: tuple[str, ...] = ()


def plan_threads(
    cpu: CpuBudget,
    requested: int | None = None,
    omp_env: str | None = None,
    bind: str | None = None,
    label: str = "--threads",
    bind_label: str = "--cpu-bind",
) -> ThreadPlan:
    """Threads from --threads, else an explicit OMP_NUM_THREADS, else the usable CPUs; `label` and `bind_label`
    name where the thread count and the CPU list came from, for errors."""
    warnings: list[str] = []
    allowed = set(cpu.cpus or range(cpu.affinity))
    cpus = _bind_list(bind, bind_label, allowed)
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"{label} must be at least 1, got {requested}")
        threads, reason = requested, f"{label}={requested}"
    elif omp_env:
        try:
            threads = int(omp_env)
        except ValueError:
            raise ConfigError(f"OMP_NUM_THREADS={omp_env!r} is not a number") from None
        reason = f"OMP_NUM_THREADS={threads}"
    elif cpus:
        threads, reason = len(cpus), f"one thread per bound CPU ({len(cpus)})"
    else:
        threads, reason = cpu.usable, f"usable CPUs: {cpu.source}"
    if threads > cpu.usable:
        warnings.append(
            f"{reason} is above the {cpu.usable} CPU(s) this process may use ({cpu.source}): "
            "threads will be throttled by the CPU quota; use at most that many"
        )
    if bind == "auto":
        cpus = tuple(sorted(allowed)[:threads])
    return ThreadPlan(threads, reason, cpus or None, tuple(warnings))


def _bind_list(bind: str | None, label: str, allowed: set[int]) -> tuple[int, ...]:
    if bind in (None, "", "auto", "nobind"):
        return ()
    try:
        cpus = parse_cpu_list(bind.split("|")[0])
    except ValueError as e:
        raise ConfigError(f"{label} {bind!r}: {e}") from None
    if not cpus <= allowed:
        raise ConfigError(f"{label} {bind!r} names CPUs outside this process's affinity {sorted(allowed)}")
    return tuple(sorted(cpus))


def activation_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """Peak activation memory per batched token (the residual stream, q/k/v, attention output, norms)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    qkv = (heads + 2 * kv) * head_dim
    # residual + normed input + attention output + projection: ~6 hidden-wide tensors live at once,
    # q/k/v twice (projection and rotated copy), and float32 copies inside the norms.
    return dtype_bytes * (6 * hidden + 2 * qkv + heads * head_dim) + 2 * 4 * hidden


@dataclass(frozen=True)
class SharedMemory:
    """A model's neighbours in one server: they share its memory budget and its one model thread."""

    others_bytes: int = 0
    """The other models' weights and fixed buffers."""
    batch_bytes: int = 0
    """The activations of the largest batch any of them runs (one batch runs at a time)."""
    share: float = 1.0
    """This model's share of the memory left for queued work and answers."""


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    weights_bytes: int
    per_token_bytes: int
    fixed_bytes: int
    max_batch_tokens: int
    max_queued_tokens: int
    source: str
    max_queued_vectors: int | None = None
    """Most answer vectors held at once (queued inputs, tokens of token_embed requests); None: unbounded."""
    others_bytes: int = 0
    """What the other models of the server hold (weights and fixed buffers)."""

    def describe(self) -> str:
        vectors = f", answers of up to {self.max_queued_vectors} vectors" if self.max_queued_vectors else ""
        others = f", other models {self.others_bytes / GIB:.2f} GiB" if self.others_bytes else ""
        return (
            f"memory budget {self.budget_bytes / GIB:.2f} GiB ({self.source}): "
            f"weights {self.weights_bytes / GIB:.2f} GiB{others}, "
            f"runtime {RUNTIME_BYTES / GIB:.2f} GiB, {self.per_token_bytes / 1024:.0f} KiB per batched token "
            f"-> batches of up to {self.max_batch_tokens} tokens, {self.max_queued_tokens} tokens queued{vectors}"
        )


def plan_memory(
    memory: MemoryBudget,
    *,
    weights_bytes: int,
    per_token_bytes: int,
    fixed_bytes: int,
    max_model_len: int,
    batch_tokens: int,
    queued_tokens: int,
    limit_override: int | None = None,
    dtype_bytes: int = 2,
    dimension: int = 0,
    int8_weights_bytes: int | None = None,
    shared: SharedMemory | None = None,
) -> MemoryPlan:
    """Fit the batch and queue token budgets into the memory limit, or refuse with what would fit. With the
    model's output `dimension`, half of what is left for the queue holds answers: the most vectors queued requests
    may ask for (each dimension x OUTPUT_VALUE_BYTES), so a queue of one-token inputs cannot outgrow memory.
    `int8_weights_bytes`: what the weights would take with --quantization int8, named in the refusal if it fits.
    `shared`: the other models one server runs beside this one (their weights held, the largest of their batches,
    this model's share of the queue memory)."""
    shared = shared or SharedMemory()
    available = limit_override or memory.available_bytes
    parts = memory.source.split("; ")
    source = "--memory-limit" if limit_override else parts[0] if memory.limit_bytes else parts[-1]
    budget = int(available * SAFETY)
    left = budget - RUNTIME_BYTES - weights_bytes - fixed_bytes - shared.others_bytes
    need_one = per_token_bytes * max_model_len
    if left < need_one:
        need = RUNTIME_BYTES + weights_bytes + fixed_bytes + need_one + shared.others_bytes
        hints = ["--dtype bfloat16 (half the memory of float32)"] if dtype_bytes == 4 else []
        if int8_weights_bytes is not None and left + weights_bytes - int8_weights_bytes >= need_one:
            hints.insert(0, f"--quantization int8 (weights {int8_weights_bytes / GIB:.2f} GiB; it fits)")
        hints += ["a smaller --max-model-len with chunked processing", "a smaller model"]
        raise ConfigError(
            f"the model does not fit: it needs about {need / GIB:.2f} GiB (weights {weights_bytes / GIB:.2f} GiB, "
            f"one {max_model_len}-token input {need_one / GIB:.2f} GiB, runtime {RUNTIME_BYTES / GIB:.2f} GiB"
            + (f", the other models {shared.others_bytes / GIB:.2f} GiB" if shared.others_bytes else "")
            + ") "
            f"but {budget / GIB:.2f} GiB is available ({source}, {SAFETY:.0%} of it). Try " + ", or ".join(hints)
        )
    batch = max(1, min(batch_tokens, left // per_token_bytes))
    # A window longer than the batch budget runs alone, so the peak is the larger of the two.
    # one batch runs at a time, whichever model's: the queues share what the largest batch leaves
    left_for_queue = int((left - max(max(batch, max_model_len) * per_token_bytes, shared.batch_bytes)) * shared.share)
    vectors = None
    if dimension:
        vectors = max(1, left_for_queue // 2 // (dimension * OUTPUT_VALUE_BYTES))
        left_for_queue -= vectors * dimension * OUTPUT_VALUE_BYTES
    queue = max(max_model_len, min(queued_tokens, left_for_queue // QUEUED_TOKEN_BYTES))
    return MemoryPlan(
        budget, weights_bytes, per_token_bytes, fixed_bytes, batch, queue, source, vectors, shared.others_bytes
    )


def flops_per_token(config: dict[str, Any], seq_len: float, causal: bool) -> float:
    """Forward FLOPs per token: 2 x the layers' matrix weights, plus attention over `seq_len`."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config.get("intermediate_size", 4 * hidden)
    mlp = (3 if config.get("model_type") in ("qwen3", "qwen2", "llama") else 2) * hidden * inter
    attn_weights = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    context = seq_len / 2 if causal else seq_len
    attention = 2 * 2 * context * heads * head_dim  # QK^T and AV
    return layers * (2 * (mlp + attn_weights) + attention)


def request_bytes(max_queued_tokens: int) -> int:
    """The largest request body a server takes by default: REQUEST_BYTES_PER_TOKEN bytes for each token its queue
    holds (the largest queue of its models), within REQUEST_BYTES_RANGE. A body parses into several times its size
    in objects, so a small pod takes smaller bodies."""
    low, high = REQUEST_BYTES_RANGE
    return min(high, max(low, max_queued_tokens * REQUEST_BYTES_PER_TOKEN))
