"""OpenTelemetry traces of requests, exported over OTLP/HTTP (--otlp-traces-endpoint).

Each request becomes a server span (`POST /v1/embeddings`, the client's W3C `traceparent` as its parent) with a child
per stage: `tokenize`, `queue` (admitted to its first batch), one `forward` per batch it ran in (with the batch's
sequences and tokens: a batch shared by several requests appears in each of their traces) and `serialize` (the answer
built and its first byte sent). The spans are made when the request ends, from the times the engine and the edge
recorded anyway, and exported in batches on the SDK's thread: the request path does no tracing work while it runs.

The SDK and exporter are an optional extra (`pip install 'ember[otel]'`), imported only when tracing is on.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from starlette.types import Scope

from ember.errors import ConfigError

__all__ = ["Tracing", "traces_url"]


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector: `http://collector:4318` -> `http://collector:4318/v1/traces` (a URL
    with a path is taken as it is). gRPC is not spoken: its exporter would pull grpcio into the image."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.scheme not in ("http", "https"):
        raise ConfigError(
            f"--otlp-traces-endpoint {endpoint!r}: ember exports OTLP over HTTP (protobuf); give the collector's "
            "OTLP/HTTP receiver, e.g. http://otel-collector:4318"
        )
    if not parts.netloc:
        raise ConfigError(f"--otlp-traces-endpoint {endpoint!r} names no host")
    path = parts.path if parts.path not in ("", "/") else "/v1/traces"
    return f"{parts.scheme}://{parts.netloc}{path}"


class Tracing:
    """Spans of each request, to an OTLP/HTTP collector."""

    def __init__(self, endpoint: str, service_name: str = "ember", export_delay_ms: int = 1000) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ConfigError(
                "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: pip install 'ember[otel]'"
            ) from None
        from ember.version import __version__

        self.url = traces_url(endpoint)
        resource = Resource.create({"service.name": service_name, "service.version": __version__})
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=self.url, timeout=10)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_ms))
        self.tracer = self.provider.get_tracer("ember", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def record(
        self, scope: Scope, headers: dict[bytes, bytes], status: int, start: float, responded: float, end: float
    ) -> None:
        """The spans of one request that has ended: `start`, `responded` (its answer's first byte) and `end` are
        monotonic seconds; the stages' times are in scope["state"] (api.routes.engine_call)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        carrier = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items() if k in (b"traceparent", b"tracestate")
        }
        state: dict[str, Any] = scope.get("state", {})
        route = scope["path"]
        root = self.tracer.start_span(
            f"{scope['method']} {route}",
            context=self.propagator.extract(carrier),
            kind=SpanKind.SERVER,
            start_time=ns(start),
            attributes={
                "http.request.method": scope["method"],
                "http.route": route,
                "url.path": scope["path"],
                "http.response.status_code": status,
                "ember.request_id": str(state.get("request_id", "")),
            },
        )
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR))
        if "inference_seconds" in state:
            root.set_attributes({"ember.model": str(state.get("model")), "ember.tokens": int(state.get("tokens", 0))})
            self._stages(trace.set_span_in_context(root), state, responded, ns)
        root.end(end_time=ns(end))

    def _stages(self, parent: Any, state: dict[str, Any], responded: float, ns: Any) -> None:
        began, done = state["engine_started"], state["engine_done"]
        tokenized = began + state["tokenize_seconds"]
        batches = state.get("batches", ())
        first = batches[0].start if batches else tokenized
        stages: list[tuple[str, float, float, dict[str, Any]]] = [
            ("tokenize", began, tokenized, {}),
            ("queue", tokenized, max(tokenized, first), {}),
            *(
                ("forward", b.start, b.end, {"ember.batch.sequences": b.sequences, "ember.batch.tokens": b.tokens})
                for b in batches
            ),
            ("serialize", done, max(done, responded), {}),
        ]
        for name, t0, t1, attributes in stages:
            span = self.tracer.start_span(name, context=parent, start_time=ns(t0), attributes=attributes)
            span.end(end_time=ns(t1))

    def shutdown(self) -> None:
        """Export what is still buffered (at most a few seconds), then stop."""
        self.provider.shutdown()
