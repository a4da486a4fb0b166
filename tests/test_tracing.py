"""Traces: a real OTLP/HTTP receiver in the test gets the spans, with GenAI attributes."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.conftest import StartSidecar
from tests.fakes import MODEL

PROMPT = "the secret prompt text"


@pytest.fixture
async def otlp(aiohttp_server: Any) -> tuple[list[Any], str]:
    spans: list[Any] = []

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    server = await aiohttp_server(app)
    return spans, str(server.make_url("/v1/traces"))


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            list(x.string_value for x in v.array_value.values)
            if kind == "array_value"
            else getattr(v, kind)
        )
    return out


async def flush(run: Any) -> None:
    await asyncio.to_thread(run.sc.tracing.provider.force_flush)


async def test_span_has_genai_attributes_and_continues_client_trace(
    start_sidecar: StartSidecar, otlp: tuple[list[Any], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spans, endpoint = otlp
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    run = await start_sidecar(
        {"pricing": {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 1.0}}}}
    )
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "temperature": 0.3,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json=body,
            headers={
                "traceparent": f"00-{client_trace}-{client_span}-01",
                "X-Tollbooth-User": "ann",
            },
        ) as r,
    ):
        await r.read()
    await flush(run)
    assert len(spans) == 1
    span = spans[0]
    assert span.name == f"chat {MODEL}"
    assert span.kind == Span.SPAN_KIND_CLIENT
    assert span.trace_id.hex() == client_trace
    assert span.parent_span_id.hex() == client_span
    a = attrs(span)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.3)
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.response.id"] == "cmpl-fake"
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.usage.input_tokens"] == 4 and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.time_to_first_chunk"] > 0
    assert a["server.address"] == "127.0.0.1" and a["server.port"] > 0
    assert a["tollbooth.cost_usd"] == pytest.approx(10 / 1e6)
    assert a["tollbooth.user_id"] == "ann"
    assert "gen_ai.usage.cache_read.input_tokens" not in a  # not measured: left off
    assert "tollbooth.queue_wait_s" not in a  # no admission queue: nothing measured
    assert "error.type" not in a
    assert not any(PROMPT in str(v) or "tok tok" in str(v) for v in a.values())
    # the upstream joined the sidecar's span
    upstream_tp = run.upstream.seen[-1]["headers"]["traceparent"]
    assert upstream_tp == f"00-{client_trace}-{span.span_id.hex()}-01"


async def test_failed_request_has_error_type_and_exemplars(
    start_sidecar: StartSidecar, otlp: tuple[list[Any], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spans, endpoint = otlp
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    run = await start_sidecar(
        {"pricing": {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 1.0}}}}
    )
    async with aiohttp.ClientSession() as s:
        for mode in ("error-midstream", ""):
            async with s.post(
                run.url + "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": True,
                },
                headers={"X-Fake": mode},
            ) as r:
                await r.read()
        async with s.get(
            run.admin_url + "/metrics", headers={"Accept": "application/openmetrics-text"}
        ) as r:
            text = await r.text()
    await flush(run)
    failed = next(attrs(sp) for sp in spans if "error.type" in attrs(sp))
    assert failed["error.type"] == "InternalServerError"
    trace_ids = {sp.trace_id.hex() for sp in spans}
    exemplar_lines = [
        ln
        for ln in text.splitlines()
        if ln.startswith("llm_request_cost_usd_bucket") and "# {trace_id=" in ln
    ]
    assert exemplar_lines
    assert any(t in exemplar_lines[0] for t in trace_ids)


@pytest.mark.parametrize(
    ("variable", "stages"),
    [
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ["tracing"]),
        ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", ["genai_metrics"]),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ["tracing", "genai_metrics"]),
    ],
)
async def test_each_signal_is_exported_where_its_endpoint_is_set(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch, variable: str, stages: list[str]
) -> None:
    """A traces endpoint alone exports no metrics: they would go to the default localhost:4318,
    which nobody named (the compose stack's GenAI metrics went there, not to its collector)."""
    for name in ("TRACES_", "METRICS_", ""):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{name}ENDPOINT", raising=False)
    monkeypatch.setenv(variable, "http://127.0.0.1:9")  # nothing is exported in this test
    run = await start_sidecar()
    assert [s for s in run.sc.meter.stages if s in ("tracing", "genai_metrics")] == stages
    assert (run.sc.tracing is not None) == ("tracing" in stages)


async def test_no_endpoint_means_no_tracing(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    run = await start_sidecar()
    assert run.sc.tracing is None
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x"},
            headers={"traceparent": tp},
        ) as r,
    ):
        await r.read()
    assert run.upstream.seen[-1]["headers"]["traceparent"] == tp  # passed through untouched
