"""Prometheus metrics for one app: requests, latencies, queue, batches, tokens, memory."""

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
        self._kernels: Callable[[], dict[str, bool]] = dict
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
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_time = Histogram(
            "ember_queue_duration_seconds", "Time from admission to first batch", buckets=_LATENCY, registry=r
        )
        self.inference_time = Histogram(
            "ember_inference_duration_seconds", "Model time spent on a request's batches", buckets=_LATENCY, registry=r
        )
        self.batch_size = Histogram("ember_batch_sequences", "Sequences per batch", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("ember_batch_tokens", "Tokens per batch", buckets=_TOKENS, registry=r)
        self.batch_time = Histogram(
            "ember_batch_duration_seconds", "Model time per batch (forward and pooling)", buckets=_LATENCY, registry=r
        )
        self.tokens = Counter("ember_prompt_tokens", "Tokens embedded", registry=r)
        self.queued_requests = Gauge("ember_queue_requests", "Requests queued or running", registry=r)
        self.queued_tokens = Gauge("ember_queue_tokens", "Tokens queued or running", registry=r)
        self.running_seqs = Gauge("ember_running_batch_sequences", "Sequences in the running batch", registry=r)
        self.running_tokens = Gauge("ember_running_batch_tokens", "Tokens in the running batch", registry=r)
        self.memory_budget = Gauge("ember_memory_budget_bytes", "Memory budget ember sizes itself to", registry=r)
        self.kernel_active = Gauge(
            "ember_kernel_active",
            "1 where a kernel is in use (native or torch.compile's fused)",
            ["kernel"],
            registry=r,
        )

    def watch(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Make `gauge` read its value from `read` at scrape time."""
        gauge.set_function(read)

    def observe_batch(self, seqs: int, tokens: int, seconds: float) -> None:
        self.batch_size.observe(seqs)
        self.batch_tokens.observe(tokens)
        self.batch_time.observe(seconds)

    def watch_kernels(self, read: Callable[[], dict[str, bool]]) -> None:
        """Set ember_kernel_active{kernel=...} from `read` (kernel name -> active) at every scrape."""
        self._kernels = read

    def watch_cache(self, read: Callable[[], tuple[int, int, int, int] | None]) -> None:
        """Export the embedding cache's (hits, misses, bytes, entries) as read at scrape time (None: it is off)."""
        self.registry.register(_CacheCollector(read))

    def render(self) -> bytes:
        for name, active in self._kernels().items():
            self.kernel_active.labels(kernel=name).set(1 if active else 0)
        return generate_latest(self.registry)


class _CacheCollector:
    """ember_embedding_cache_hits_total / _misses_total (counters), _bytes and _entries (gauges)."""

    def __init__(self, read: Callable[[], tuple[int, int, int, int] | None]) -> None:
        self.read = read

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        state = self.read()
        if state is None:
            return
        hits, misses, size, entries = state
        yield CounterMetricFamily("ember_embedding_cache_hits", "Windows answered from the embedding cache", hits)
        yield CounterMetricFamily("ember_embedding_cache_misses", "Windows the embedding cache did not hold", misses)
        yield GaugeMetricFamily("ember_embedding_cache_bytes", "Bytes the embedding cache holds", size)
        yield GaugeMetricFamily("ember_embedding_cache_entries", "Windows the embedding cache holds", entries)
