"""Access log lines, trace correlation, sampling, and the audit capture of expensive requests."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sidecar.text import digest
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL

API_KEY = "sk-very-secret-key-1234"
PROMPT = "my confidential prompt about project falcon"
# $0.10 exactly for a 5-token prompt: 0.02 USD per input token
AT_LIMIT = {"models": {MODEL: {"input_per_1m": 20000.0, "output_per_1m": 0.0}}}


async def post(
    run: Running,
    *,
    stream: bool = False,
    content: str = PROMPT,
    mode: str = "",
    max_tokens: int = 4,
) -> aiohttp.ClientResponse:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Fake": mode, "Cookie": "session=abc"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        await r.read()
        return r


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


async def test_access_log_fields_and_trace_ids(
    start_sidecar: StartSidecar,
    tmp_path: Path,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    log_file = tmp_path / "access.log"
    run = await start_sidecar(
        {
            "logging": {"access_log": str(log_file)},
            "pricing": {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 1.0}}},
        },
        wire_kwargs={"span_exporter": exporter},
    )
    caplog.set_level(logging.DEBUG)
    await post(run)
    await post(run, stream=True)
    await post(run, mode="status-400")
    run.sc.tracing.provider.force_flush()
    _flush_access(run)
    got = lines(log_file)
    assert [g["status"] for g in got] == ["200", "200", "400"]
    spans = {s.context.span_id: s for s in exporter.get_finished_spans()}
    for line in got:
        span = spans[int(line["span_id"], 16)]
        assert line["trace_id"] == f"{span.context.trace_id:032x}"
        assert (
            line["user"] == "key-" + __import__("hashlib").sha256(API_KEY.encode()).hexdigest()[:12]
        )
    plain, streamed = got[0], got[1]
    assert plain["stream"] is False and streamed["stream"] is True
    assert plain["input_tokens"] == 6 and plain["output_tokens"] == 4
    assert plain["cost_usd"] == pytest.approx(10 / 1e6)
    assert streamed["ttft_s"] is not None and plain["ttft_s"] is None
    assert plain["bytes_in"] > 0 and plain["bytes_out"] > 0
    assert plain["upstream"].startswith("http://127.0.0.1:")
    assert got[2]["level"] == "warning"
    everything = log_file.read_text() + caplog.text
    assert API_KEY not in everything and "falcon" not in everything and "tok tok" not in everything


def _flush_access(run: Running) -> None:
    """Stop the access log's writer thread, which drains its queue to the file."""
    run.sc.access_log.stop()


async def test_sampling_keeps_errors(start_sidecar: StartSidecar, tmp_path: Path) -> None:
    log_file = tmp_path / "access.log"
    run = await start_sidecar({"logging": {"access_log": str(log_file), "sample_success": 0.0}})
    for _ in range(3):
        await post(run)
    await post(run, mode="status-400")
    await post(run, stream=True, mode="error-midstream")
    _flush_access(run)
    assert [g["status"] for g in lines(log_file)] == ["400", "stream_error"]


async def test_other_log_lines_carry_request_ids(
    start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    from sidecar.telemetry.logs import JsonFormatter

    run = await start_sidecar(upstream_url="http://127.0.0.1:9")  # the upstream is down
    caplog.set_level(logging.WARNING, logger="tollbooth.proxy")
    await post(run)
    record = next(r for r in caplog.records if "upstream" in r.getMessage())
    # the formatter, called inside the request, adds the request context
    from sidecar.telemetry.logs import REQUEST_CONTEXT

    token = REQUEST_CONTEXT.set({"request_id": "abc", "trace_id": "t" * 32})
    try:
        formatted = json.loads(JsonFormatter().format(record))
    finally:
        REQUEST_CONTEXT.reset(token)
    assert formatted["request_id"] == "abc" and formatted["level"] == "warning"


async def test_queued_handler_captures_context_in_the_request_task() -> None:
    import queue as q

    from sidecar.telemetry.logs import REQUEST_CONTEXT, ContextQueueHandler

    buf: q.SimpleQueue[logging.LogRecord] = q.SimpleQueue()
    h = ContextQueueHandler(buf)
    token = REQUEST_CONTEXT.set({"request_id": "r1", "trace_id": "a" * 32, "span_id": "b" * 16})
    try:
        h.emit(logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %s", ("y",), None))
    finally:
        REQUEST_CONTEXT.reset(token)
    rec = buf.get_nowait()
    assert (rec.request_id, rec.trace_id, rec.getMessage()) == ("r1", "a" * 32, "boom y")


async def test_audit_fires_above_the_limit_not_at_it(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar({"pricing": AT_LIMIT})
    await post(run, content="one two three four five")  # 5 tokens: exactly $0.10, not audited
    await post(run, content="one two three four five six")  # 6 tokens: $0.12
    run.sc.audit.stop()
    records = lines(tmp_path / "audit.jsonl")
    assert len(records) == 1
    r = records[0]
    assert r["reasons"] == ["input_cost", "total_cost"]
    assert r["input_cost_usd"] == pytest.approx(0.12)
    assert r["limits"] == {"input_cost_usd": 0.1, "total_cost_usd": 0.1}
    assert r["request"]["max_tokens"] == 4 and r["prompt"]["messages"] == 1
    assert r["prompt"]["tokens"] == 6 and r["finish_reasons"] == ["length"]
    assert r["request_headers"]["Authorization"].startswith("[redacted] key-")
    assert r["request_headers"]["Cookie"] == "[redacted]"
    assert "text" not in r and "falcon" not in json.dumps(r) and API_KEY not in json.dumps(r)
    assert run.value("llm_audit_captures_total", model=MODEL, reason="input_cost,total_cost") == 1


async def test_text_capture_only_when_enabled_and_truncated(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar(
        {"pricing": AT_LIMIT, "audit": {"capture_text": True, "max_text_chars": 20}}
    )
    await post(run, stream=True, max_tokens=8)
    await post(run, stream=False, max_tokens=8)
    run.sc.audit.stop()
    records = lines(tmp_path / "audit.jsonl")
    assert len(records) == 2
    for r in records:
        assert r["text"]["prompt"] == ("user: " + PROMPT)[:20]
        assert r["text"]["completion"] == "tok tok tok tok tok tok tok tok"[:20]


async def test_audit_to_ledger_and_cli(start_sidecar: StartSidecar, tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {"pricing": AT_LIMIT, "ledger": {"path": str(db)}, "audit": {"sink": "ledger"}}
    )
    await post(run, content="one two three four five six")
    run.sc.ledger.close()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.core.cli",
            "audit",
            "--ledger",
            str(db),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (rec,) = json.loads(out.stdout)
    assert rec["reasons"] == ["input_cost", "total_cost"]
    table = subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", "audit", "--ledger", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "input_cost,total_cost" in table and rec["request_id"] in table


def test_rotation_is_bounded(tmp_path: Path) -> None:
    from sidecar.billing.audit import Audit, read_records
    from sidecar.config import AuditConfig, PricingConfig
    from sidecar.exchange import Cost, Endpoint, Exchange, RequestInfo, Usage
    from sidecar.metering.pricing import PriceBook
    from sidecar.telemetry.metrics import Metrics
    from sidecar.telemetry.thresholds import DEFAULT

    path = tmp_path / "a.jsonl"
    audit = Audit(
        AuditConfig(path=str(path), max_bytes=3000, backups=2),
        DEFAULT,
        PriceBook(PricingConfig()),
        Metrics(),
    )
    audit.start()
    info = RequestInfo(endpoint=Endpoint.CHAT, body=b"{}", parsed=True)
    for i in range(200):
        ex = Exchange(f"r{i:03d}", Endpoint.CHAT, info, "u", "u", MODEL, started_at=1e9 + i)
        ex.usage, ex.cost = Usage(input_tokens=10**6, output_tokens=1), Cost(1.0, 0.5)
        audit.check(ex)
    audit.stop()
    files = sorted(tmp_path.glob("a.jsonl*"))
    assert [f.name for f in files] == ["a.jsonl", "a.jsonl.1", "a.jsonl.2"]
    assert all(f.stat().st_size <= 3000 for f in files)
    kept = read_records(0, path=str(path))
    assert [r["time"] for r in kept] == sorted(r["time"] for r in kept)
    assert kept[-1]["request_id"] == "r199" and len(kept) < 200


async def test_refused_requests_are_not_unmeasured_in_the_log_either(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    """A 4xx/5xx without usage consumed nothing: the access log agrees with the metric."""
    log_file = tmp_path / "access.log"
    run = await start_sidecar(
        {"logging": {"access_log": str(log_file)}, "metering": {"continuous_usage": False}}
    )
    await post(run, mode="status-400")
    await post(run, stream=True, mode="nousage")  # a 200 whose usage is really unknown
    _flush_access(run)
    refused, unmeasured = lines(log_file)
    assert refused["status"] == "400" and refused["usage_unknown"] is None
    assert unmeasured["status"] == "200" and unmeasured["usage_unknown"] == "stream_without_usage"
    ep = "/v1/chat/completions"
    assert (
        run.value("llm_usage_unknown_total", model=MODEL, api_endpoint=ep, reason="error_response")
        is None
    )
    assert (
        run.value(
            "llm_usage_unknown_total", model=MODEL, api_endpoint=ep, reason="stream_without_usage"
        )
        == 1
    )


async def test_audit_records_only_allow_listed_header_values(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    secrets = {
        "X-Auth-Token": "tok-secret-1",
        "Api-Key": "api-secret-2",
        "X-Goog-Api-Key": "goog-secret-3",
        "OpenAI-Api-Key": "oai-secret-4",
        "Authorization": f"Bearer {API_KEY}",
    }
    run = await start_sidecar({"pricing": AT_LIMIT})
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "one two three four five six"}],
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json=body,
            headers={**secrets, "User-Agent": "audit-test/1.0", "X-Request-Id": "req-42"},
        ) as r,
    ):
        assert r.status == 200
    run.sc.audit.stop()
    text = (tmp_path / "audit.jsonl").read_text()
    for value in secrets.values():
        assert value.split()[-1] not in text
    (record,) = lines(tmp_path / "audit.jsonl")
    headers = {k.lower(): v for k, v in record["request_headers"].items()}
    for name in ("x-auth-token", "api-key", "x-goog-api-key", "openai-api-key"):
        assert headers[name] == "[redacted]"
    assert headers["authorization"].startswith("[redacted] key-")
    assert headers["user-agent"] == "audit-test/1.0" and headers["x-request-id"] == "req-42"


async def test_user_id_lengths_are_what_the_docs_say(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    """docs/metrics.md: the label is cut to 64 characters, the logged and billed id to 128."""
    log_file = tmp_path / "access.log"
    run = await start_sidecar({"logging": {"access_log": str(log_file)}})
    user = "u" * 100 + "!" + "v" * 99  # 200 characters, one of them not allowed
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Tollbooth-User": user},
        ) as r,
    ):
        assert r.status == 200
    _flush_access(run)
    (line,) = lines(log_file)
    # longer than 128: its first 111 characters and a digest of the whole (docs/metrics.md)
    assert line["user"] == "u" * 100 + "_" + "v" * 10 + "_" + digest(user)
    ep = "/v1/chat/completions"
    assert (
        run.value(
            "llm_tokens_total", model=MODEL, token_type="input", api_endpoint=ep, user_id="u" * 64
        )
        == 1
    )
    docs = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    assert "cut to 128 characters; the `user_id` label cuts it to 64" in " ".join(docs.split())


@pytest.mark.parametrize("failed", [False, True])
def test_batched_access_lines_are_the_lines_logging_wrote(failed: bool) -> None:
    """The access log left `logging` for a batching writer; its lines did not change."""
    from sidecar.exchange import Cost, Endpoint, Exchange, RequestInfo, Usage
    from sidecar.telemetry.accesslog import fields, render_json, render_text, snapshot
    from sidecar.telemetry.logs import JsonFormatter, TextFormatter

    info = RequestInfo(endpoint=Endpoint.CHAT, body=b"{}", parsed=True, stream=True)
    ex = Exchange("r1", Endpoint.CHAT, info, "u", "u", MODEL, status=200, bytes_out=12)
    ex.usage, ex.cost, ex.error = Usage(input_tokens=3), Cost(1e-05, 0.0), "x" if failed else None
    ex.upstream_start, ex.first_token_at, ex.duration_s = 1.0, 1.25, 2.0000004
    rec = logging.LogRecord(
        "tollbooth.access", logging.WARNING if failed else logging.INFO, "", 0, "request", (), None
    )
    rec.created, rec.access, rec.request_id = 1.7e9 + 0.123, fields(ex), "r1"
    record = (rec.created, failed, snapshot(ex))
    old, new = JsonFormatter().format(rec), render_json(record)
    assert list(json.loads(new).items()) == list(json.loads(old).items())
    assert render_text(record) == TextFormatter().format(rec)


def test_batch_writer_is_bounded_counts_what_it_loses_and_drains_on_stop() -> None:
    from sidecar.telemetry.logs import BatchWriter

    written: list[str] = []
    dropped, errors = [], []

    def render(n: int) -> str:
        return f"line {10 // (n - 3)}"  # record 3 cannot be rendered

    writer = BatchWriter(
        "test",
        render,
        written.extend,
        interval_s=60,
        max_pending=5,
        on_drop=lambda: dropped.append(1),
        on_error=lambda: errors.append(1),
    )
    for i in range(8):
        writer.put(i)  # 0, 1, 2 make room for 5, 6, 7
    writer.start()
    writer.stop()  # long before the interval: stopping writes what waits
    assert written == ["line 10", "line 5", "line 3", "line 2"]
    assert (len(dropped), len(errors)) == (3, 1)


@pytest.mark.parametrize("case", range(4))
def test_a_json_access_line_is_its_head_then_fields_of(case: int) -> None:
    """`line_of` makes the line's dict in one step; it equals the head merged with `fields_of`,
    key order and encoded bytes included."""
    from sidecar.exchange import Cost, Endpoint, Exchange, RequestInfo, Usage
    from sidecar.telemetry.accesslog import LOGGER, fields_of, line_of, render_json, snapshot
    from sidecar.telemetry.logs import iso_time, json_line

    endpoint = [Endpoint.CHAT, Endpoint.TGI_GENERATE, Endpoint.OTHER, Endpoint.RERANK_V2][case]
    info = RequestInfo(endpoint=endpoint, body=b"{}", parsed=True, stream=case % 2 == 1)
    ex = Exchange(f"r{case}", endpoint, info, "ü", "ü" * 3, MODEL, status=[200, 502, 0, 499][case])
    ex.usage = [
        Usage(input_tokens=3, output_tokens=5, reasoning_tokens=2),
        Usage(),
        Usage(unknown_reason="no_usage", audio_seconds=1.5),
        Usage(cached_input_tokens=1),
    ][case]
    ex.cost = Cost(1e-05, 3e-7) if case == 0 else None
    ex.error = None if case == 0 else "upstream"
    ex.queue_s, ex.upstream_start, ex.first_token_at = 0.0012345678, 1.0, 1.25 + case
    ex.duration_s, ex.trace_id, ex.team = 2.0000004 * case, "ab" * 16, "t" if case else None
    for failed in (False, True):
        record = (1.7e9 + 0.123 * case, failed, snapshot(ex))
        head = {"time": iso_time(record[0]), "level": "warning" if failed else "info"}
        want = {**head, "logger": LOGGER, "message": "request", **fields_of(record[2])}
        assert list(line_of(record).items()) == list(want.items())
        assert render_json(record) == json_line(want)
