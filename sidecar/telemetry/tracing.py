"""OTLP traces: one CLIENT span per proxied request, following the OpenTelemetry GenAI conventions.

Owns: the tracer provider (exported through the standard OTEL_* variables, batched), continuing a
client's `traceparent`, the `traceparent` sent upstream, span attributes from what was measured,
and counting spans dropped by a full export queue.
Never: records prompt or completion text, or an attribute that was not measured. With no OTLP
endpoint configured no provider exists, and a request pays for nothing here.
Attribute names come from opentelemetry-semantic-conventions 0.66b2 (pinned in pyproject).
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Literal
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as ga
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import __version__
from ..config import Config
from ..exchange import Exchange
from .metrics import Metrics

log = logging.getLogger("tollbooth.tracing")
PROPAGATOR = TraceContextTextMapPropagator()


def enabled(config: Config, signal: Literal["trace", "metric"] = "trace") -> bool:
    """Whether to export `signal` over OTLP: `tracing.enabled` where set, else whether an
    endpoint for it is set (OTEL_EXPORTER_OTLP_ENDPOINT, or the signal's own variable). A
    traces endpoint alone turns on no metrics: they would go to the default localhost:4318."""
    if config.tracing.enabled is not None:
        return config.tracing.enabled
    own = f"OTEL_EXPORTER_OTLP_{signal.upper()}S_ENDPOINT"
    return any(os.environ.get(v) for v in (own, "OTEL_EXPORTER_OTLP_ENDPOINT"))


def exporter_from_env(signal: Literal["trace", "metric"]) -> Any:
    """The OTLP exporter of spans (`trace`) or metrics over gRPC or HTTP/protobuf, as
    OTEL_EXPORTER_OTLP_(TRACES_|METRICS_)PROTOCOL says."""
    protocol = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}S_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    wire = "grpc" if protocol == "grpc" else "http"
    module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{wire}.{signal}_exporter")
    return getattr(module, "OTLPSpanExporter" if signal == "trace" else "OTLPMetricExporter")()


def server(url: str) -> tuple[str, int]:
    """server.address and server.port of the upstream at `url` (its scheme's port by default)."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def resource() -> Resource:
    """This service, for the traces and the GenAI metrics (OTEL_SERVICE_NAME may rename it)."""
    name = os.environ.get("OTEL_SERVICE_NAME", "tollbooth")
    return Resource.create({"service.name": name, "service.version": __version__})


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor that counts the spans it drops when its queue is full."""

    def __init__(self, exporter: SpanExporter, metrics: Metrics, **kw: Any) -> None:
        super().__init__(exporter, **kw)
        self._dropped = metrics.spans_dropped
        inner = getattr(self, "_batch_processor", None)
        self._queue = getattr(inner, "_queue", None)
        self._max = getattr(inner, "_max_queue_size", None)

    def on_end(self, span: ReadableSpan) -> None:
        if self._queue is not None and self._max is not None and len(self._queue) >= self._max:
            self._dropped.inc()
        super().on_end(span)


class Tracing:
    def __init__(self, config: Config, metrics: Metrics, exporter: SpanExporter | None = None):
        self.config = config
        self.provider = TracerProvider(resource=resource())  # sampler from OTEL_TRACES_SAMPLER
        self.provider.add_span_processor(
            CountingBatchSpanProcessor(exporter or exporter_from_env("trace"), metrics)
        )
        self.tracer = self.provider.get_tracer("tollbooth", __version__)
        self.server_address, self.server_port = server(config.upstream.url)
        self.spans: dict[int, trace.Span] = {}

    # --- hooks

    def start(self, ex: Exchange) -> None:
        """At request start: open the span (continuing the client's trace), fix upstream headers."""
        parent = PROPAGATOR.extract(ex.request_headers)
        name = f"{ex.endpoint.operation} {ex.info.model or ex.model}"
        span = self.tracer.start_span(name, kind=SpanKind.CLIENT, context=parent)
        self.spans[id(ex)] = span
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        ex.trace_headers = carrier
        sc = span.get_span_context()
        if sc.is_valid:
            ex.trace_id, ex.span_id = f"{sc.trace_id:032x}", f"{sc.span_id:016x}"
            ex.trace_sampled = sc.trace_flags.sampled

    def finish(self, ex: Exchange) -> None:
        """A sink: set what was measured, then end the span."""
        span = self.spans.pop(id(ex), None)
        if span is None:
            return
        if span.is_recording():
            span.set_attributes(
                attributes(ex, self.config.upstream.api, self.server_address, self.server_port)
            )
            if ex.failed:
                span.set_status(Status(StatusCode.ERROR, ex.error or ex.status_label))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()


def attributes(ex: Exchange, provider: str, address: str, port: int) -> dict[str, Any]:
    info, u = ex.info, ex.usage
    attrs: dict[str, Any] = {
        ga.GEN_AI_OPERATION_NAME: ex.endpoint.operation,
        ga.GEN_AI_PROVIDER_NAME: provider,
        ga.GEN_AI_REQUEST_STREAM: info.stream,
        server_attributes.SERVER_ADDRESS: address,
        server_attributes.SERVER_PORT: port,
        "tollbooth.user_id": ex.user_id,
    }
    optional = {
        ga.GEN_AI_REQUEST_MODEL: info.model or (ex.model if ex.endpoint.is_tgi_native else None),
        ga.GEN_AI_RESPONSE_MODEL: u.model,
        ga.GEN_AI_REQUEST_MAX_TOKENS: info.max_tokens,
        ga.GEN_AI_REQUEST_TEMPERATURE: info.temperature,
        ga.GEN_AI_RESPONSE_ID: u.response_id,
        ga.GEN_AI_RESPONSE_FINISH_REASONS: list(u.finish_reasons) or None,
        ga.GEN_AI_USAGE_INPUT_TOKENS: u.input_tokens,
        ga.GEN_AI_USAGE_OUTPUT_TOKENS: u.output_tokens,
        ga.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: u.cached_input_tokens,
        "tollbooth.usage.reasoning_tokens": u.reasoning_tokens,
        ga.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: ex.ttft_s,
        "tollbooth.cost_usd": ex.cost.total_usd if ex.cost is not None else None,
        "tollbooth.queue_wait_s": ex.queue_s,
        "tollbooth.device_seconds": ex.device_seconds,
        error_attributes.ERROR_TYPE: (ex.error or ex.status_label) if ex.failed else None,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs
