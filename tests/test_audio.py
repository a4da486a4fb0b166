"""vLLM's speech-to-text routes metered (issue 23): `/v1/audio/transcriptions` and
`/v1/audio/translations`, multipart bodies streamed through, billed per second of audio.

The answer shapes are vLLM's vllm/entrypoints/openai/speech_to_text/: `TranscriptionResponse`
(protocol.py: `usage: TranscriptionUsageAudio {type: "duration", seconds: int}`, the seconds
`int(math.ceil(duration_s))` in speech_to_text.py, "rounded up as per openAI specs"), a
translation's with no usage ("no usage in response for translation task"), verbose_json's
`duration: str(duration_s)`, and a stream's `UsageInfo` chunk (tokens) only under
`stream_include_usage`. api_router.py answers json and text alike as JSON.
"""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.billing import ledger
from sidecar.billing.budget import to_micros
from sidecar.exchange import Endpoint
from sidecar.metering.audio import FormHead, audio_seconds, boundary
from sidecar.metering.wire import open_stream, usage_from_body
from sidecar.proxy.audio import AUDIO_IN_FLIGHT
from sidecar.proxy.memory import HELD_PER_BYTE
from sidecar.proxy.routes import classify
from tests.conftest import Running, StartSidecar
from tests.simulated import (
    INPUT_PER_1M,
    OUTPUT_PER_1M,
    assert_burst_held,
    burst,
    ledger_rows,
    sse_data,
    start_simulated,
    token_cost,
)
from tests.waiting import wait_for

MODEL = "whisper-sim"
PER_SECOND = 0.01
PRICE = {"input_per_1m": INPUT_PER_1M, "output_per_1m": OUTPUT_PER_1M}
PRICES = {"models": {MODEL: {**PRICE, "audio_per_second": PER_SECOND}}}
COLUMNS = "user, model, endpoint, audio_seconds, input_tokens, output_tokens, cost_usd, status"
TRANSCRIBE, TRANSLATE = "/v1/audio/transcriptions", "/v1/audio/translations"
B = "tollbooth-test-boundary"


def wav(seconds: float, rate: int = 8000) -> bytes:
    """A silent mono 16-bit WAV of `seconds`."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return out.getvalue()


def form(fields: list[tuple[str, str]], audio: bytes | None, *, file_first: bool = False) -> bytes:
    """A multipart/form-data body (boundary B), the fields before the file unless `file_first`."""
    parts = [
        f'--{B}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields
    ]
    if audio is not None:
        head = f'--{B}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        file = (head + "Content-Type: audio/wav\r\n\r\n").encode() + audio + b"\r\n"
        parts = [file, *parts] if file_first else [*parts, file]
    return b"".join(parts) + f"--{B}--\r\n".encode()


CONTENT_TYPE = {"Content-Type": f"multipart/form-data; boundary={B}"}


# --- the request's head, read as it comes -------------------------------------------------------


def test_the_routes_are_metered() -> None:
    assert classify("POST", TRANSCRIBE) is Endpoint.AUDIO_TRANSCRIPTIONS
    assert classify("POST", TRANSLATE) is Endpoint.AUDIO_TRANSLATIONS


def test_the_boundary_is_read_from_a_form_content_type_only() -> None:
    assert boundary(f'multipart/form-data; boundary="{B}"') == B.encode()
    assert boundary("multipart/form-data; boundary=abc") == b"abc"
    assert boundary("application/json") is None
    assert boundary("multipart/form-data") is None
    assert boundary("multipart/form-data; boundary=" + "x" * 71) is None


BODY = form([("model", MODEL), ("stream", "true"), ("response_format", "json")], wav(0.5))


@pytest.mark.parametrize("cut", [1, 2, 7, 64, len(BODY)])
def test_the_fields_before_the_file_are_read_at_every_cut(cut: int) -> None:
    head = FormHead(B.encode(), 64 * 1024)
    fed = 0
    while not head.done and fed < len(BODY):
        head.feed(BODY[fed : fed + cut])
        fed += cut
    assert head.done and head.reached_file and not head.capped
    assert head.fields == {"model": MODEL, "stream": "true", "response_format": "json"}
    assert fed < len(BODY) or cut == len(BODY)  # stopped at the file, not read to its end


def test_a_model_after_the_file_is_not_read() -> None:
    head = FormHead(B.encode(), 64 * 1024)
    head.feed(form([("model", MODEL)], wav(0.5), file_first=True))
    assert head.done and head.reached_file and head.fields == {}


def test_a_head_longer_than_the_cap_stops_there_unread() -> None:
    head = FormHead(B.encode(), 1024)
    head.feed(form([("prompt", "p" * 5000), ("model", MODEL)], wav(0.1)))
    assert head.done and head.capped and "model" not in head.fields


def test_a_field_sent_twice_is_noted() -> None:
    head = FormHead(B.encode(), 1024)
    head.feed(form([("model", MODEL), ("model", "other")], wav(0.1)))
    assert head.duplicate == "model"


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=50))
def test_any_bytes_end_the_head_within_the_cap(data: bytes, cut: int) -> None:
    head = FormHead(B.encode(), 200)
    for i in range(0, len(data), cut):
        head.feed(data[i : i + cut])
    assert len(head._buf) <= 201
    assert all(len(v) <= 200 for v in head.fields.values())


# --- the answer's usage (vLLM's shapes) ----------------------------------------------------------


def _usage(route: Endpoint, body: object) -> Any:
    return usage_from_body(route, json.dumps(body).encode(), {})


def test_a_transcription_is_read_in_seconds() -> None:
    u = _usage(
        Endpoint.AUDIO_TRANSCRIPTIONS, {"text": "hi", "usage": {"type": "duration", "seconds": 3}}
    )
    assert (u.audio_seconds, u.input_tokens, u.output_tokens) == (3.0, None, None)


def test_verbose_json_is_read_from_its_duration() -> None:
    body = {"duration": "2.5", "language": "en", "text": "hi", "segments": []}
    assert _usage(Endpoint.AUDIO_TRANSLATIONS, body).audio_seconds == 2.5


def test_a_translation_json_and_a_plain_text_answer_have_no_usage() -> None:
    u = _usage(Endpoint.AUDIO_TRANSLATIONS, {"text": "hi"})
    assert (u.audio_seconds, u.unknown_reason) == (None, "no_usage")
    u = usage_from_body(Endpoint.AUDIO_TRANSCRIPTIONS, b"hello there\n", {})
    assert (u.audio_seconds, u.unknown_reason) == (None, "no_usage")


@pytest.mark.parametrize("seconds", [-1, 1e12, "nan", "inf", True, None, [], "x"])
def test_hostile_seconds_are_invalid_usage(seconds: object) -> None:
    u = _usage(Endpoint.AUDIO_TRANSCRIPTIONS, {"usage": {"type": "duration", "seconds": seconds}})
    assert (u.audio_seconds, u.unknown_reason) == (None, "invalid_usage")
    assert audio_seconds(seconds) is None


def test_a_stream_is_read_as_chat_chunks_with_its_usage_chunk() -> None:
    chunk = {
        "object": "transcription.chunk",
        "model": MODEL,
        "choices": [{"delta": {"content": "a"}}],
    }
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    wire = (
        b"".join(
            b"data: " + json.dumps(e).encode() + b"\n\n"
            for e in (chunk, chunk, {**chunk, "choices": [], "usage": usage})
        )
        + b"data: [DONE]\n\n"
    )
    meter = open_stream(Endpoint.AUDIO_TRANSCRIPTIONS)
    out = meter.feed(wire)
    tail, u = meter.finish()
    assert out + tail == wire and meter.done
    assert (u.input_tokens, u.output_tokens, u.audio_seconds) == (4, 2, None)


# --- through the sidecar, in front of the simulator, with the openai SDK -------------------------


async def _start(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, **config: Any
) -> tuple[Running, Path]:
    prices = config.pop("pricing", PRICES)
    return await start_simulated(start_sidecar, aiohttp_server, tmp_path, prices, **config)


def _rows(db: Path) -> list[tuple[Any, ...]]:
    return ledger_rows(db, COLUMNS)


def _client(run: Running, user: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=run.url + "/v1", api_key="x", default_headers={"X-Tollbooth-User": user}
    )


def _seconds(run: Running, route: str, user: str, model: str = MODEL) -> float | None:
    labels = {"model": model, "api_endpoint": route, "user_id": user}
    return run.value("llm_audio_seconds_total", **labels)


async def test_the_sdk_is_billed_exact_seconds_per_user(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    audio = ("a.wav", wav(2.5), "audio/wav")
    async with _client(run, "ann") as ann, _client(run, "bob") as bob:
        t = await ann.audio.transcriptions.create(file=audio, model=MODEL)
        with pytest.warns(DeprecationWarning):  # the SDK's overload for verbose_json
            v = await bob.audio.translations.create(
                file=audio, model=MODEL, response_format="verbose_json"
            )
        plain = await ann.audio.transcriptions.create(
            file=audio, model=MODEL, response_format="text"
        )
        with pytest.warns(DeprecationWarning):
            j = await bob.audio.translations.create(file=audio, model=MODEL)
    assert t.text and v.text and j.text
    assert t.usage is not None and t.usage.type == "duration" and t.usage.seconds == 3  # ceil(2.5)
    assert float(v.duration) == 2.5
    assert json.loads(plain)["usage"] == {"type": "duration", "seconds": 3}  # vLLM: JSON for text
    await wait_for(lambda: len(_rows(db)) == 4, "four ledger rows")
    assert _rows(db) == [
        ("ann", MODEL, TRANSCRIBE, 3.0, None, None, pytest.approx(3 * PER_SECOND), "200"),
        ("bob", MODEL, TRANSLATE, 2.5, None, None, pytest.approx(2.5 * PER_SECOND), "200"),
        ("ann", MODEL, TRANSCRIBE, 3.0, None, None, pytest.approx(3 * PER_SECOND), "200"),
        ("bob", MODEL, TRANSLATE, None, None, None, None, "200"),  # translation json: no usage
    ]
    assert _seconds(run, TRANSCRIBE, "ann") == 6.0
    assert _seconds(run, TRANSLATE, "bob") == 2.5
    cost = {"model": MODEL, "token_type": "input", "api_endpoint": TRANSCRIBE, "user_id": "ann"}
    assert run.value("llm_cost_usd_total", **cost) == pytest.approx(6 * PER_SECOND)
    unknown = {"model": MODEL, "api_endpoint": TRANSLATE, "reason": "no_usage"}
    assert run.value("llm_usage_unknown_total", **unknown) == 1


async def test_without_an_audio_price_the_cost_is_unknown_and_the_seconds_counted(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    prices = {"models": {MODEL: PRICE}}  # token prices, no audio_per_second
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, pricing=prices)
    async with _client(run, "ann") as ann:
        await ann.audio.transcriptions.create(file=("a.wav", wav(1.2), "audio/wav"), model=MODEL)
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db) == [("ann", MODEL, TRANSCRIBE, 2.0, None, None, None, "200")]
    assert _seconds(run, TRANSCRIBE, "ann") == 2.0
    assert run.value("llm_cost_unknown_total", model=MODEL, reason="no_audio_price") == 1


async def test_a_model_the_head_does_not_name_is_the_unknown_model(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """No model field, or one after the file: the request is the unknown model's (its price the
    default one, here none: cost unknown, and a budget holds nothing for it)."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    async with aiohttp.ClientSession() as s:
        for fields, first in (([], False), ([("model", MODEL)], True)):
            body = form(fields, wav(1.0), file_first=first)
            async with s.post(run.url + TRANSCRIBE, data=body, headers=CONTENT_TYPE) as r:
                assert r.status == 200
    await wait_for(lambda: len(_rows(db)) == 2, "two ledger rows")
    assert [r[1] for r in _rows(db)] == ["unknown", "unknown"]
    assert [r[3] for r in _rows(db)] == [1.0, 1.0] and [r[6] for r in _rows(db)] == [None, None]


async def test_a_model_the_head_does_not_name_is_upstream_model_name(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """vLLM serves its own model to a request naming none: priced at upstream.model_name."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, upstream={"model_name": MODEL})
    body = form([], wav(2.0))
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=CONTENT_TYPE) as r,
    ):
        assert r.status == 200
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][1:4] == (MODEL, TRANSCRIBE, 2.0)
    assert _rows(db)[0][6] == pytest.approx(2 * PER_SECOND)


async def test_under_a_budget_a_model_the_head_does_not_name_is_refused(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The answer names no model, so a request the head does not price is never priced: with
    budgets enforced it is refused before the upstream (nothing escapes the meter)."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 1.0})
    body = form([("model", MODEL)], wav(1.0), file_first=True)
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=CONTENT_TYPE) as r,
    ):
        assert r.status == 400
        assert "must come before the file" in (await r.json())["error"]["message"]
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][1] == "unknown" and _rows(db)[0][-1] == "400"


def test_a_head_not_written_as_rfc_7578_writes_it_is_not_used() -> None:
    """Padding after a delimiter: another parser may read such a head otherwise."""
    head = FormHead(B.encode(), 64 * 1024)
    body = form([("model", MODEL)], wav(0.1)).replace(f"--{B}\r\n".encode(), f"--{B} \r\n".encode())
    head.feed(body)
    assert head.done and head.malformed and head.fields == {}


async def test_a_model_sent_twice_is_refused(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, _ = await _start(start_sidecar, aiohttp_server, tmp_path)
    body = form([("model", MODEL), ("model", "cheap")], wav(0.5))
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=CONTENT_TYPE) as r,
    ):
        assert r.status == 400
        assert "sent twice" in (await r.json())["error"]["message"]


async def test_an_upload_larger_than_the_limit_is_refused_unread(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, server={"max_audio_body_bytes": 10_000}
    )
    body = form([("model", MODEL)], wav(1.0))  # 16 KB
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=CONTENT_TYPE) as r,
    ):
        assert r.status == 413
    assert _rows(db) == []


async def test_a_chunked_upload_is_streamed_and_metered(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """No Content-Length: sent on chunked, as it arrives; its hold counts the largest upload
    taken (server.max_audio_body_bytes), and a chunked one past that limit is cut off."""
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, server={"max_audio_body_bytes": 200_000}
    )
    body = form([("model", MODEL)], wav(3.0))  # 48 KB

    async def pieces(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    async with aiohttp.ClientSession() as s:
        async with s.post(run.url + TRANSCRIBE, data=pieces(body), headers=CONTENT_TYPE) as r:
            assert r.status == 200 and (await r.json())["usage"]["seconds"] == 3
        big = form([("model", MODEL)], wav(20.0))  # 320 KB, past the limit
        async with s.post(run.url + TRANSCRIBE, data=pieces(big), headers=CONTENT_TYPE) as r:
            assert r.status == 502  # the upstream got a request cut short
    await wait_for(lambda: len(_rows(db)) == 2, "two ledger rows")
    assert _rows(db)[0][3:] == (3.0, None, None, pytest.approx(3 * PER_SECOND), "200")
    assert _rows(db)[1][3] is None and _rows(db)[1][-1] == "502"


async def test_an_upload_streams_through_in_bounded_memory(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """A 4 MB upload under 1 MiB of request memory: streamed, never held (a JSON body of that
    size is refused there). What is held: the head and the one piece in flight."""
    run, db = await _start(
        start_sidecar,
        aiohttp_server,
        tmp_path,
        server={"max_buffered_request_bytes": 1 << 20, "max_buffered_request_bytes_per_key": 0},
    )
    audio = wav(250.0)  # 4 MB at 8 kHz
    async with _client(run, "ann") as ann:
        t = await ann.audio.transcriptions.create(file=("a.wav", audio, "audio/wav"), model=MODEL)
    assert t.usage is not None and t.usage.seconds == 250
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][3] == 250.0
    memory = run.sc.proxy.memory
    assert 0 < memory.peak <= AUDIO_IN_FLIGHT + HELD_PER_BYTE * (64 * 1024 + 2**17)
    await wait_for(lambda: memory.total == 0, "the reservation released")


# --- streams ----------------------------------------------------------------------------------


def _stream_body(include: bool, limit: int = 6, running: bool = False) -> bytes:
    fields = [("model", MODEL), ("stream", "true"), ("max_completion_tokens", str(limit))]
    if include:
        fields.append(("stream_include_usage", "true"))
    if running:
        fields.append(("stream_continuous_usage_stats", "true"))
    return form(fields, wav(5.0))


def usage_of(events: list[Any]) -> int:
    """Output tokens the client saw: the deltas with content."""
    return sum(1 for e in events for c in e["choices"] if c["delta"].get("content"))


async def _post_stream(run: Running, body: bytes, user: str) -> list[Any]:
    headers = {**CONTENT_TYPE, "X-Tollbooth-User": user}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=headers) as r,
    ):
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = await r.read()
    return [json.loads(x[6:]) for x in raw.split(b"\n\n") if x.startswith(b"data: {")]


async def test_a_stream_with_usage_is_billed_its_tokens_and_one_without_is_unknown(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path)
    events = await _post_stream(run, _stream_body(include=True), "ann")
    usage, out = events[-1]["usage"], usage_of(events)
    assert events[-1]["object"] == "transcription.chunk" and usage["completion_tokens"] == out
    await _post_stream(run, _stream_body(include=False), "bob")
    await wait_for(lambda: len(_rows(db)) == 2, "two ledger rows")
    cost = usage["prompt_tokens"] * INPUT_PER_1M / 1e6 + out * OUTPUT_PER_1M / 1e6
    assert _rows(db) == [
        ("ann", MODEL, TRANSCRIBE, None, usage["prompt_tokens"], out, pytest.approx(cost), "200"),
        ("bob", MODEL, TRANSCRIBE, None, None, None, None, "200"),
    ]


# --- clients that leave ---------------------------------------------------------------------------


async def test_a_client_leaving_mid_upload_consumed_nothing(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The server never had a whole request: nothing generated, nothing charged (the hold is
    released), the row a 499 with its usage unknown."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 5.0})
    body = form([("model", MODEL), ("max_completion_tokens", "8")], wav(3.0))
    host, port = run.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = [
        f"POST {TRANSCRIBE} HTTP/1.1",
        f"Host: {host}",
        f"Content-Type: multipart/form-data; boundary={B}",
        f"Content-Length: {len(body)}",
        "X-Tollbooth-User: cy",
    ]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body[: len(body) // 2])
    await writer.drain()
    await wait_for(lambda: run.sc.budgets.store.holds, "the request admitted")
    writer.close()  # leaves with half the file sent
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db) == [("cy", MODEL, TRANSCRIBE, None, None, None, 0.0, "499")]
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    assert run.sc.budgets.store.spent.get("user:cy", 0) == 0
    assert run.value("llm_budget_unmeasured_charges_total") in (None, 0)
    del reader


@pytest.mark.parametrize("running", [False, True])
async def test_a_client_leaving_mid_stream_is_billed_per_the_disconnect_rules(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path, running: bool
) -> None:
    """The generation is cancelled when the client leaves. With the form's running totals
    (`stream_continuous_usage_stats`) the tokens read last are billed; with the final usage
    chunk only, nothing was measured: the usage is unknown and the budget charges the hold."""
    run, db = await _start(start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 5.0})

    def progress(line: bytes) -> int | None:
        return 1 if (event := sse_data(line)) is not None and event["choices"] else None

    seen = await leave_mid_stream_form(run, _stream_body(True, 400, running), "cy", progress)
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    ((user, _, _, seconds, inp, out, cost, status),) = _rows(db)
    assert (user, seconds, status) == ("cy", None, "499") and seen >= 3
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")
    spent = run.sc.budgets.store.spent["user:cy"]
    if running:
        assert inp == 4 and out is not None and 1 <= out < 400
        assert cost == pytest.approx(token_cost(4, out)) and spent == to_micros(cost)
        assert run.value("llm_budget_unmeasured_charges_total") in (None, 0)
    else:
        assert (inp, out, cost) == (None, None, None)
        assert spent > 0 and run.value("llm_budget_unmeasured_charges_total") == 1


async def leave_mid_stream_form(
    run: Running, body: bytes, user: str, progress: Any, after: int = 3
) -> int:
    """POST a form as `user` and leave after `after` events that `progress` counts."""
    seen = 0
    headers = {**CONTENT_TYPE, "X-Tollbooth-User": user}
    async with aiohttp.ClientSession() as s:
        r = await s.post(run.url + TRANSCRIBE, data=body, headers=headers)
        async for line in r.content:
            seen += progress(line) or 0
            if seen >= after:
                break
        r.close()
    return seen


# --- budgets ------------------------------------------------------------------------------------


async def test_a_burst_against_a_small_budget_is_held(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Each hold: the upload (about 16 KB: 33 seconds at 500 bytes a second) at $0.01 a second,
    plus 4 output tokens: $0.338; the budget of $1 takes two or three at once."""
    limit = 1.0
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": limit}
    )
    body = form([("model", MODEL), ("max_completion_tokens", "4")], wav(1.0))

    async def one() -> int:
        headers = {**CONTENT_TYPE, "X-Tollbooth-User": "dee"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + TRANSCRIBE, data=body, headers=headers) as r,
        ):
            await r.read()
            return r.status

    statuses = await burst(one)
    await assert_burst_held(
        run, db, "audio_seconds, status", "dee", limit, statuses, lambda r: r[0] * PER_SECOND
    )


# --- the ledger -----------------------------------------------------------------------------------


def test_a_ledger_written_before_the_audio_column_gets_it(tmp_path: Path) -> None:
    """Today's schema less `audio_seconds` (the ledger as of bc59865), holding a row: opened by
    today's writer, the column is added and the old row's is NULL."""
    old = "\n".join(ln for ln in ledger.SCHEMA.splitlines() if "audio_seconds" not in ln)
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(old)
        conn.execute(
            "INSERT INTO requests (ts, request_id, model, endpoint, user, status, stream) "
            "VALUES (1.0, 'r', 'm', '/v1/chat/completions', 'u', '200', 0)"
        )
    conn = ledger.connect(path)
    try:
        assert conn.execute("SELECT audio_seconds FROM requests").fetchall() == [(None,)]
    finally:
        conn.close()
