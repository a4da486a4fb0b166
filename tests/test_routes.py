"""No way around metering: every route that generates is metered, gated or refused.

Each test attacks one hole of issue 10 the way a client would: the real openai SDK, aiohttp's
client, and raw sockets for request targets that client libraries normalise before sending.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from sidecar.proxy import routes
from sidecar.proxy.routes import AmbiguousPath
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.rawhttp import raw_request

PRICING = {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0}}}
MSGS = [{"role": "user", "content": "one two three four five"}]  # 5 prompt tokens at the fake
CHAT = "/v1/chat/completions"


def tokens(run: Running, direction: str, endpoint: str = CHAT, user: str = "anonymous") -> Any:
    return run.value(
        "llm_tokens_total", model=MODEL, token_type=direction, api_endpoint=endpoint, user_id=user
    )


def unmetered(run: Running, endpoint_class: str) -> Any:
    return run.value("llm_unmetered_requests_total", endpoint_class=endpoint_class)


# --- paths ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
        "/v1//chat/completions",
        "//v1/chat/completions",
        "/v1/%2e/chat/completions",
        "/v1/%2E%2E/v1/chat/completions",
        "/v1/chat/completions/.?x=1",
    ],
)
async def test_dot_segments_and_encodings_are_metered_and_forwarded_as_classified(
    start_sidecar: StartSidecar, target: str
) -> None:
    run = await start_sidecar()
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 3}).encode()
    resp = await raw_request(run.url, target, body)
    assert resp.status == 200, resp.text()
    assert run.upstream is not None
    assert run.upstream.seen[-1]["path"] == CHAT  # the path that was classified, nothing else
    assert (tokens(run, "input"), tokens(run, "output")) == (5, 3)


@pytest.mark.parametrize("base", ["/v1/%2e/", "//v1/", "/x/%2E%2E/v1/"])
async def test_sdk_with_a_dotted_base_url_is_metered(
    start_sidecar: StartSidecar, base: str
) -> None:
    run = await start_sidecar()
    async with openai.AsyncOpenAI(base_url=run.url + base, api_key="k", max_retries=0) as client:
        resp = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4)
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert tokens(run, "output", user="key-" + _key_hash("k")) == 4


@pytest.mark.parametrize(
    "target", ["/v1/chat%2Fcompletions", "/v1%2Fchat%2Fcompletions", "/v1/%5c../chat/completions"]
)
async def test_an_encoded_slash_is_refused_before_the_upstream(
    start_sidecar: StartSidecar, target: str
) -> None:
    run = await start_sidecar()
    body = json.dumps({"model": MODEL, "messages": MSGS}).encode()
    resp = await raw_request(run.url, target, body)
    assert resp.status == 400
    assert json.loads(resp.body)["error"]["type"] == "ambiguous_path"
    assert run.upstream is not None and run.upstream.seen == []


# --- stream flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["true", "1", "yes", "On", "T", 1, 1.0])
async def test_string_and_integer_stream_is_metered(
    start_sidecar: StartSidecar, oai: Any, flag: object
) -> None:
    run = await start_sidecar()
    client = oai(run, "sk-flag")
    stream = await client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, stream=True, extra_body={"stream": flag}
    )
    chunks = [c async for c in stream]
    assert len(chunks) == 3 and all(c.usage is None for c in chunks)  # what the client asked for
    assert run.upstream is not None
    assert json.loads(run.upstream.seen[-1]["body"])["stream"] == flag  # the client's own bytes
    user = "key-" + _key_hash("sk-flag")
    assert (tokens(run, "input", user=user), tokens(run, "output", user=user)) == (5, 6)


async def test_integer_stream_over_a_raw_socket(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    body = b'{"model": "%s", "prompt": "a b c", "max_tokens": 4, "stream": 1}' % MODEL.encode()
    resp = await raw_request(run.url, "/v1/completions", body)
    assert resp.status == 200 and b'"usage"' not in resp.body
    assert tokens(run, "input", "/v1/completions") == 3
    assert tokens(run, "output", "/v1/completions") == 4


# --- /invocations and /vertex ---------------------------------------------------------------------


async def test_invocations_is_metered_by_the_body_shape(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with openai.AsyncOpenAI(base_url=run.url, api_key="k", max_retries=0) as client:
        chat = await client.post(
            "/invocations",
            body={"model": MODEL, "messages": MSGS, "max_tokens": 3},
            cast_to=ChatCompletion,
        )
        completion = await client.post(
            "/invocations",
            body={"model": MODEL, "prompt": "a b", "max_tokens": 2},
            cast_to=Completion,
        )
        stream = await client.post(
            "/invocations",
            body={"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": "true"},
            cast_to=ChatCompletionChunk,
            stream=True,
            stream_cls=openai.AsyncStream[ChatCompletionChunk],
        )
        chunks = [c async for c in stream]
    assert chat.usage is not None and completion.usage is not None
    assert all(c.choices and c.usage is None for c in chunks)  # usage asked for us, cut out
    user = "key-" + _key_hash("k")
    assert tokens(run, "input", user=user) == 5 + 5
    assert tokens(run, "output", user=user) == 3 + 4
    assert tokens(run, "output", "/v1/completions", user=user) == 2
    assert run.upstream is not None and {s["path"] for s in run.upstream.seen} == {"/invocations"}


async def test_invocations_with_no_generation_shape_is_unmetered(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar()
    resp = await raw_request(run.url, "/invocations", b'{"query": "q", "documents": ["a"]}')
    assert resp.status == 403
    assert unmetered(run, "/invocations") == 1


async def test_vertex_is_metered_and_its_prompt_counted(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"upstream": {"api": "tgi"}, "pricing": PRICING})
    body = {
        "instances": [
            {"inputs": "one two three", "parameters": {"max_new_tokens": 3}},
            {"messages": [{"role": "user", "content": "four five"}], "max_tokens": 3},
        ]
    }
    async with aiohttp.ClientSession() as s, s.post(run.url + "/vertex", json=body) as r:
        assert r.status == 200
        assert len((await r.json())["predictions"]) == 2
    model = "fake/tgi-model"  # from the upstream's /info
    key = {"model": model, "api_endpoint": "/vertex"}
    for _ in range(100):  # the prompt is counted after the answer went out
        if run.value("llm_requests_total", status_code="200", **key):
            break
        await aiohttp_sleep()
    assert run.value("llm_requests_total", status_code="200", **key) == 1
    # /vertex reports no counts: the prompts are counted exactly by the server's tokenizers
    assert run.upstream is not None
    assert [t["path"] for t in run.upstream.tokenized] == ["/tokenize", "/chat_tokenize"]
    assert run.value("llm_tokens_total", token_type="input", user_id="anonymous", **key) == 3 + 2
    assert run.value("llm_usage_unknown_total", reason="no_usage", **key) == 1


# --- routes that are not metered ------------------------------------------------------------------


@pytest.mark.parametrize(
    "target,cls", [("/inference/v1/generate", "/inference/v1/generate"), ("/x/gen", "other")]
)
async def test_an_unmetered_post_is_refused_by_default(
    start_sidecar: StartSidecar, target: str, cls: str
) -> None:
    run = await start_sidecar()
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 5}).encode()
    resp = await raw_request(run.url, target, body)
    assert resp.status == 403
    assert json.loads(resp.body)["error"]["type"] == "route_not_metered"
    assert run.upstream is not None and run.upstream.seen == []
    assert unmetered(run, cls) == 1
    status = {"model": "unknown", "api_endpoint": "other", "status_code": "403"}
    assert run.value("llm_requests_total", **status) == 1


async def test_a_forwarded_unmetered_post_is_counted_and_gated(
    start_sidecar: StartSidecar,
) -> None:
    # An unmetered request's cost is unknown: with a default price its budget hold is the
    # default output limit at that price, and, unmeasured, it is charged that hold.
    pricing = {**PRICING, "default": {"input_per_1m": 1.0, "output_per_1m": 2.0}}
    run = await start_sidecar(
        {
            "metering": {"unknown_routes": "forward"},
            "pricing": pricing,
            "budgets": {"user_daily_usd": 0.01, "default_max_output_tokens": 4096},
        }
    )  # one hold is 4096 x $2/M = $0.0082: the second does not fit
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 5}
    async with aiohttp.ClientSession() as s:
        async with s.post(run.url + "/echo", json=body, headers=_as("bob")) as r:
            assert r.status == 200  # served, its usage unknown
        async with s.post(run.url + "/echo", json=body, headers=_as("bob")) as r:
            assert r.status == 429  # the budget gate applies to unmetered routes too
            assert (await r.json())["error"]["type"] == "budget_exceeded"
        async with s.post(run.url + CHAT, json=body, headers=_as("alice")) as r:
            assert r.status == 200
    assert unmetered(run, "other") == 2
    assert run.upstream is not None
    assert [x["path"] for x in run.upstream.seen] == ["/echo", CHAT]
    other = {"model": "unknown", "api_endpoint": "other"}
    assert run.value("llm_requests_total", status_code="200", **other) == 1
    assert run.value("llm_usage_unknown_total", reason="unmetered_route", **other) == 1


async def test_free_routes_are_forwarded_uncounted(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/tokenize/", json={"model": MODEL, "prompt": "a b c"}) as r,
    ):
        assert r.status == 200 and (await r.json())["count"] == 3
    assert unmetered(run, "other") is None


# --- bodies that must not be corrupted (issue 13) -------------------------------------------------


async def test_injection_keeps_numbers_the_client_wrote(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"metering": {"continuous_usage": False}})
    raw = (
        b'{"model": "m", "prompt": "a", "stream": true, "logit_bias": {"1": 1e999},\n'
        b' "stream_options": {"include_usage": false}}'
    )
    resp = await raw_request(run.url, "/v1/completions", raw)
    assert resp.status == 200
    assert run.upstream is not None
    assert run.upstream.seen[-1]["body"] == raw.replace(b"false", b"true")  # not `Infinity`


async def test_a_utf16_body_is_forwarded_untouched(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar()
    raw = json.dumps({"model": MODEL, "prompt": "caf\u00e9 b", "stream": True}).encode("utf-16")
    resp = await raw_request(run.url, "/v1/completions", raw)
    assert resp.status == 200
    assert run.upstream is not None and run.upstream.seen[-1]["body"] == raw
    key = {"model": MODEL, "api_endpoint": "/v1/completions"}
    assert run.value("llm_usage_unknown_total", reason="body_not_utf8", **key) == 1


@pytest.mark.parametrize(
    "options",
    [
        None,
        {"include_usage": False},
        {"include_usage": True},
        {"include_usage": False, "continuous_usage_stats": True},
        {"continuous_usage_stats": True},
    ],
)
async def test_the_client_receives_exactly_what_it_asked_for(
    start_sidecar: StartSidecar, options: dict | None
) -> None:
    """Byte for byte what the server sends for the client's own body, although the sidecar asked
    it for usage and for running totals on every chunk."""
    run = await start_sidecar()
    assert run.upstream is not None
    body: dict[str, Any] = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "stream": True}
    if options is not None:
        body["stream_options"] = options
    raw = json.dumps(body).encode()
    upstream_url = run.sc.config.upstream.url
    direct = await raw_request(upstream_url, CHAT, raw)
    via = await raw_request(run.url, CHAT, raw)
    asked = json.loads(run.upstream.seen[-1]["body"])["stream_options"]
    assert asked == {"include_usage": True, "continuous_usage_stats": True}
    assert via.status == direct.status == 200
    assert via.body == direct.body
    assert (tokens(run, "input"), tokens(run, "output")) == (5, 6)


async def test_responses_body_with_null_error_is_a_success(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    run = await start_sidecar()
    resp = await oai(run).responses.create(model=MODEL, input="a b c")
    assert resp.error is None
    key = {"model": MODEL, "api_endpoint": "/v1/responses"}
    assert run.value("llm_requests_total", status_code="200", **key) == 1
    assert run.value("llm_requests_total", status_code="stream_error", **key) is None
    assert tokens(run, "input", "/v1/responses", "key-" + _key_hash("k")) == 3


# --- helpers --------------------------------------------------------------------------------------


def _key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _as(user: str) -> dict[str, str]:
    return {"X-Tollbooth-User": user}


async def aiohttp_sleep() -> None:
    await asyncio.sleep(0.02)


PATH_PIECES = ["/", ".", "%", "%2f", "%41", "a", "\\", " ", "\x00", "\x7f", "é", "-", "~"]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(PATH_PIECES)).map("".join))
def test_a_plain_path_is_left_as_normalisation_leaves_it(tail: str) -> None:
    """The fast path (a path already normal) agrees with the normalisation, raising or not."""
    raw = "/" + tail
    try:
        expected: str | type[Exception] = routes._normalised(raw)
    except AmbiguousPath:
        expected = AmbiguousPath
    try:
        got: str | type[Exception] = routes.routing_path(raw)
    except AmbiguousPath:
        got = AmbiguousPath
    assert got == expected, raw
    if routes._PLAIN_PATH.fullmatch(raw):
        assert got == raw
