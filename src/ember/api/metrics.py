"""Prometheus metrics for one app: requests, latencies, queue, batches, tokens, memory. Every series about a model
carries vLLM's `model_name` label, so a server running several models reports each."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics"]

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKENS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class Metrics:
    """The metrics of one server, in their own registry (so tests can build many apps)."""

    def __init__(self) -> None:
        self._kernels: dict[str, Callable[[], dict[str, bool]]] = {}
        self._caches: dict[str, Callable[[], tuple[int, int, int, int] | None]] = {}
        m = ["model_name"]
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, fds
        self.requests = Counter(
            "ember_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "ember_request_duration_seconds", "End-to-end request latency", ["endpoint"], buckets=_LATENCY, registry=r
        )
        self.tokenize_time = Histogram(
            "ember_tokenization_duration_seconds",
            "Time a request spent tokenising its inputs",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_time = Histogram(
            "ember_queue_duration_seconds", "Time from admission to first batch", m, buckets=_LATENCY, registry=r
        )
        self.inference_time = Histogram(
            "ember_inference_duration_seconds",
            "Model time spent on a request's batches",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.batch_size = Histogram("ember_batch_sequences", "Sequences per batch", m, buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("ember_batch_tokens", "Tokens per batch", m, buckets=_TOKENS, registry=r)
        self.batch_time = Histogram(
            "ember_batch_duration_seconds",
            "Model time per batch (forward and pooling)",
            m,
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter("ember_prompt_tokens", "Tokens embedded", m, registry=r)
        self.queued_requests = Gauge("ember_queue_requests", "Requests queued or running", m, registry=r)
        self.queued_tokens = Gauge("ember_queue_tokens", "Tokens queued or running", m, registry=r)
        self.running_seqs = Gauge("ember_running_batch_sequences", "Sequences in the running batch", m, registry=r)
        self.running_tokens = Gauge("ember_running_batch_tokens", "Tokens in the running batch", m, registry=r)
        self.memory_budget = Gauge("ember_memory_budget_bytes", "Memory budget ember sizes itself to", registry=r)
        self.kernel_active = Gauge(
            "ember_kernel_active",
            "1 where a kernel is in use (native or torch.compile's fused)",
            ["kernel", "model_name"],
            registry=r,
        )
        self.registry.register(_CacheCollector(self._caches))

    def watch(self, gauge: Gauge, model: str, read: Callable[[], float]) -> None:
        """Make `gauge`'s series of `model` read its value from `read` at scrape time."""
        gauge.labels(model).set_function(read)

    def batch_observer(self, model: str) -> Callable[[int, int, float], None]:
        """What `model`'s engine calls after each batch with (sequences, tokens, seconds)."""
        size, tokens, time_ = (
            self.batch_size.labels(model),
            self.batch_tokens.labels(model),
            self.batch_time.labels(model),
        )

        def observe(seqs: int, n: int, seconds: float) -> None:
            size.observe(seqs)
            tokens.observe(n)
            time_.observe(seconds)

        return observe

    def watch_kernels(self, model: str, read: Callable[[], dict[str, bool]]) -> None:
        """Set ember_kernel_active{kernel=..., model_name=model} from `read` (kernel -> active) at every scrape."""
        self._kernels[model] = read

    def watch_cache(self, model: str, read: Callable[[], tuple[int, int, int, int] | None]) -> None:
        """Export `model`'s embedding cache's (hits, misses, bytes, entries) as read at scrape time (None: off)."""
        self._caches[model] = read

    def render(self) -> bytes:
        for model, read in self._kernels.items():
            for name, active in read().items():
                self.kernel_active.labels(kernel=name, model_name=model).set(1 if active else 0)
        return generate_latest(self.registry)


class _CacheCollector:
    """ember_embedding_cache_hits_total / _misses_total (counters), _bytes and _entries (gauges), per model."""

    def __init__(self, caches: dict[str, Callable[[], tuple[int, int, int, int] | None]]) -> None:
        self.caches = caches

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        families = (
            (CounterMetricFamily, "ember_embedding_cache_hits", "Windows answered from the embedding cache"),
            (CounterMetricFamily, "ember_embedding_cache_misses", "Windows the embedding cache did not hold"),
            (GaugeMetricFamily, "ember_embedding_cache_bytes", "Bytes the embedding cache holds"),
            (GaugeMetricFamily, "ember_embedding_cache_entries", "Windows the embedding cache holds"),
        )
        states: dict[str, tuple[int, int, int, int]] = {}
        for model, read in self.caches.items():
            state = read()
            if state is not None:
                states[model] = state
        if not states:
            return
        for at, (kind, name, text) in enumerate(families):
            family = kind(name, text, labels=["model_name"])
            for model, state in states.items():
                family.add_metric([model], state[at])
            yield family
