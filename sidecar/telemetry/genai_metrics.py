"""OpenTelemetry GenAI client metrics over OTLP, beside the traces and the Prometheus metrics.

Owns: a MeterProvider exporting through the standard OTEL_* variables (on where `tracing.enabled`
is true, or, unset, where OTEL_EXPORTER_OTLP_METRICS_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is
set; OTEL_EXPORTER_OTLP_(METRICS_)PROTOCOL, OTEL_METRIC_EXPORT_INTERVAL),
and three histograms recorded once per metered request: `gen_ai.client.token.usage` ({token},
by gen_ai.token.type), `gen_ai.client.operation.duration` (s) and
`gen_ai.client.operation.time_to_first_chunk` (s, streams only), with the conventions' advised
bucket boundaries.
Names are those of opentelemetry-semantic-conventions 0.66b2 (pinned in pyproject; the GenAI
metrics are at Development stability there and marked as moving to the GenAI conventions
repository, so a later version may rename them: the pin keeps these names).
Never: records a count that was not measured (an unknown usage records no token point), or
changes the Prometheus metrics. Without OTLP configured nothing here exists.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as ga
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as gm
from opentelemetry.semconv.attributes import server_attributes

from .. import __version__
from ..config import Config
from ..exchange import Exchange
from .metrics import GENAI_DURATION_ADVICE, GENAI_TOKEN_ADVICE
from .tracing import exporter_from_env, resource, server


class GenAiMetrics:
    def __init__(self, config: Config, exporter: MetricExporter | None = None) -> None:
        self.provider_name = config.upstream.api
        self.address, self.port = server(config.upstream.url)
        reader = PeriodicExportingMetricReader(exporter or exporter_from_env("metric"))
        self.provider = MeterProvider(resource=resource(), metric_readers=[reader])
        meter = self.provider.get_meter("tollbooth", __version__)
        self.tokens = meter.create_histogram(
            gm.GEN_AI_CLIENT_TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=GENAI_TOKEN_ADVICE,
        )
        self.duration = meter.create_histogram(
            gm.GEN_AI_CLIENT_OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=GENAI_DURATION_ADVICE,
        )
        self.first_chunk = meter.create_histogram(
            gm.GEN_AI_CLIENT_OPERATION_TIME_TO_FIRST_CHUNK,
            unit="s",
            description="Time to receive the first chunk of a streamed response.",
            explicit_bucket_boundaries_advisory=GENAI_DURATION_ADVICE,
        )

    def attributes(self, ex: Exchange) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            ga.GEN_AI_OPERATION_NAME: ex.endpoint.operation,
            ga.GEN_AI_PROVIDER_NAME: self.provider_name,
            server_attributes.SERVER_ADDRESS: self.address,
            server_attributes.SERVER_PORT: self.port,
        }
        model = ex.info.model or (ex.model if ex.endpoint.is_tgi_native else None)
        if model:
            attrs[ga.GEN_AI_REQUEST_MODEL] = model
        return attrs

    def finish(self, ex: Exchange) -> None:
        """A sink: one point per measured quantity of the request."""
        attrs = self.attributes(ex)
        u = ex.usage
        for kind, count in (("input", u.input_tokens), ("output", u.output_tokens)):
            if count is not None and count >= 0:
                self.tokens.record(count, {**attrs, ga.GEN_AI_TOKEN_TYPE: kind})
        if ex.duration_s is not None:
            self.duration.record(ex.duration_s, attrs)
        if ex.ttft_s is not None:
            self.first_chunk.record(ex.ttft_s, attrs)

    def shutdown(self) -> None:
        self.provider.shutdown()
