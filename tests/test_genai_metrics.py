"""OpenTelemetry GenAI metrics over OTLP/HTTP (sidecar/telemetry/genai_metrics.py).

A real OTLP/HTTP receiver (an aiohttp server decoding opentelemetry-proto's
ExportMetricsServiceRequest) gets what the real exporter sends, configured by the same OTEL_*
variables as the traces. Guards: the exact token sums by gen_ai.token.type, one duration point per
request, a time-to-first-chunk point per stream only, the advised buckets, the attributes, and the
names of semantic-conventions 0.66b2.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from sidecar.telemetry.metrics import GENAI_DURATION_ADVICE, GENAI_TOKEN_ADVICE
from tests.conftest import StartSidecar
from tests.test_reconcile import MODEL, FakeVllm, chat
from tests.waiting import wait_for


class Receiver:
    def __init__(self) -> None:
        self.exports: list[ExportMetricsServiceRequest] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/metrics", self.metrics)
        self.app.router.add_post("/v1/traces", self.traces)

    async def metrics(self, request: web.Request) -> web.Response:
        self.exports.append(ExportMetricsServiceRequest.FromString(await request.read()))
        body = ExportMetricsServiceResponse().SerializeToString()
        return web.Response(body=body, content_type="application/x-protobuf")

    async def traces(self, request: web.Request) -> web.Response:
        return web.Response(body=b"", content_type="application/x-protobuf")

    def histograms(self) -> dict[str, Any]:
        """The last export's histograms by name (cumulative: it holds the totals)."""
        out: dict[str, Any] = {}
        for export in self.exports[-1:]:
            for rm in export.resource_metrics:
                for sm in rm.scope_metrics:
                    out.update({m.name: m for m in sm.metrics})
        return out


def attrs(point: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in point.attributes:
        v = kv.value
        out[kv.key] = v.int_value if v.HasField("int_value") else v.string_value
    return out


def count_of(rec: Receiver, name: str) -> int:
    m = rec.histograms().get(name)
    return sum(p.count for p in m.histogram.data_points) if m is not None else 0


async def test_token_usage_arrives_over_otlp_with_exact_sums(
    start_sidecar: StartSidecar, aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Receiver()
    collector = await aiohttp_server(rec.app)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", str(collector.make_url("")).rstrip("/"))
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "50")
    fake = FakeVllm()
    engine = await aiohttp_server(fake.app)
    run = await start_sidecar(
        {"reconcile": {"enabled": False}}, upstream_url=str(engine.make_url("")).rstrip("/")
    )
    await chat(run.url, 7, 11)
    await chat(run.url, 3, 13, stream=True)
    await chat(run.url, 5, 17, stream=True)
    await wait_for(
        lambda: count_of(rec, "gen_ai.client.operation.duration") == 3, "three requests exported"
    )
    got = rec.histograms()
    usage = got["gen_ai.client.token.usage"]
    assert usage.unit == "{token}"
    sums: dict[str, float] = {}
    for p in usage.histogram.data_points:
        a = attrs(p)
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.request.model"] == MODEL
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == engine.port
        assert list(p.explicit_bounds) == [float(b) for b in GENAI_TOKEN_ADVICE]
        sums[a["gen_ai.token.type"]] = sums.get(a["gen_ai.token.type"], 0.0) + p.sum
        assert p.count == 3
    assert sums == {"input": 15.0, "output": 41.0}
    duration = got["gen_ai.client.operation.duration"]
    assert duration.unit == "s"
    [point] = duration.histogram.data_points
    assert point.count == 3 and list(point.explicit_bounds) == list(GENAI_DURATION_ADVICE)
    first = got["gen_ai.client.operation.time_to_first_chunk"]
    assert sum(p.count for p in first.histogram.data_points) == 2  # the two streams only
