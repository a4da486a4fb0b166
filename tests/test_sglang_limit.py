"""SGLang's own default max_new_tokens: what a /generate prompt that sets none is held at.

SGLang runs such a prompt to 128 tokens (srt/sampling/sampling_params.py), unless the server was
started with --preferred-sampling-params, whose max_new_tokens then applies
(tokenizer_manager.py `_create_tokenized_object`: `{**self.preferred_sampling_params,
**obj.sampling_params}`); GET /model_info (/get_model_info, its older name) states the flag's
JSON text as `preferred_sampling_params` (http_server.py `model_info`). The hold read 128 on
every server: an unmeasured request on a server defaulting to 1,000 was charged 128 tokens of
output (h-rev8 finding 3). The fake here answers /generate without counts, so every request is
unmeasured and charged its hold, which each case reads.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from sidecar.metering.sglang import stated_default
from tests import simulated as sim
from tests.conftest import Running, StartSidecar
from tests.waiting import wait_for

SIM_MODEL = "sim-llama-3-8b"
PROMPT = "abcd"  # the hold's prompt: ceil(4 / 4) = 1 token


def info(preferred: Any) -> dict[str, Any]:
    """/model_info as SGLang answers it, `preferred_sampling_params` as given."""
    return {
        "model_path": "/models/llama",
        "is_generation": True,
        "preferred_sampling_params": preferred,
    }


@pytest.mark.parametrize(
    ("answer", "default"),
    [
        (info(None), 128),  # no --preferred-sampling-params
        (info(""), 128),  # an empty flag is none (`if server_args.preferred_sampling_params`)
        (info('{"temperature": 0.7}'), 128),
        (info('{"max_new_tokens": 1000}'), 1000),
        (info({"max_new_tokens": 1000}), 1000),  # a router's own answer: a JSON object
        (info('{"max_new_tokens": null}'), 0),  # no limit: runs to the context's end
        (info('{"max_new_tokens": 0}'), 0),
        (info('{"max_new_tokens": -5}'), 0),  # read as a body's: no limit of its own
        (info('{"max_new_tokens": 1e40}'), None),
        (info('{"max_new_tokens": 1000.0}'), None),
        (info('{"max_new_tokens": "1000"}'), None),
        (info('{"max_new_tokens": true}'), None),
        (info('{"max_new_tokens": 1000'), None),  # no JSON
        (info("[1000]"), None),
        (info(1000), None),
        (info(0), None),
        (info(False), None),
        (info([]), None),
        (info({}), 128),
        ({"model_path": "/models/llama"}, 128),  # an SGLang from before the flag
        ({"preferred_sampling_params": None}, None),  # no SGLang answer
        ([], None),
    ],
)
def test_the_stated_default_is_read_as_sglang_reads_its_flag(answer: Any, default: int) -> None:
    assert stated_default(json.dumps(answer).encode()) == default


def test_an_answer_that_is_no_json_states_nothing() -> None:
    assert stated_default(b"\xff\xfe") is None
    assert stated_default(b"<html>") is None
    assert stated_default(b"[" * 100_000 + b"]" * 100_000) is None  # too deep for the parser
    deep = json.dumps(info("[" * 100_000 + "]" * 100_000)).encode()
    assert stated_default(deep) is None
    assert stated_default(json.dumps(info(10**40)).encode()) is None  # a string: no JSON object
    huge = json.dumps(info(json.dumps({"max_new_tokens": 10**40}))).encode()
    assert stated_default(huge) == 10**40  # held at the budget's largest (and refused there)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(value=_JSON, as_text=st.booleans(), extra=st.dictionaries(st.text(max_size=8), _JSON))
def test_whatever_the_server_states_is_a_count_or_unknown(
    value: Any, as_text: bool, extra: dict[str, Any]
) -> None:
    """Never an exception and never a fraction; a positive default only from a JSON integer."""
    preferred: Any = {**extra, "max_new_tokens": value}
    if as_text:
        preferred = json.dumps(preferred, allow_nan=True)
    read = stated_default(json.dumps(info(preferred), allow_nan=True).encode())
    assert read is None or (type(read) is int and read >= 0)
    if read:
        assert read == value and type(value) is int


class FakeSGLang:
    """/generate answered without counts (its usage unknown: charged the hold), and
    /model_info or /get_model_info answered as set."""

    def __init__(self, answer: Any, path: str = "/get_model_info", status: int = 200):
        self.answer, self.path, self.status = answer, path, status
        self.asked: list[str] = []
        self.generated = 0
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)
        self.app.router.add_get(path, self.model_info)

    async def generate(self, request: web.Request) -> web.Response:
        await request.read()
        self.generated += 1
        return web.json_response({"text": " x", "meta_info": {"id": "r"}})

    async def model_info(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        return web.Response(status=self.status, text=json.dumps(self.answer))


async def sidecar(
    start_sidecar: StartSidecar, aiohttp_server: Any, fake: FakeSGLang, **config: Any
) -> Running:
    config = {
        "pricing": sim.prices(SIM_MODEL),
        "budgets": {"user_daily_usd": 50.0},
        "upstream": {"api": "sglang", "model_name": SIM_MODEL},
        **config,
    }
    up = await aiohttp_server(fake.app)
    return await start_sidecar(config, upstream_url=str(up.make_url("")).rstrip("/"))


async def charged(run: Running, body: dict[str, Any]) -> tuple[int, float]:
    """The status of one /generate and what its user was charged (USD)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json=body, headers={"X-Tollbooth-User": "sg"}) as r,
    ):
        status = r.status
        await r.read()
    store = run.sc.budgets.store
    if status == 200:
        await wait_for(lambda: "user:sg" in store.spent, "the charge")  # type: ignore[attr-defined]
    await wait_for(lambda: not store.holds, "the hold settled")  # type: ignore[attr-defined]
    return status, store.spent.get("user:sg", 0) / 1e6  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("preferred", "output"),
    [
        (json.dumps({"max_new_tokens": 1000}), 1000),  # before: 128
        (None, 128),
        (json.dumps({"temperature": 0.5}), 128),
        (json.dumps({"max_new_tokens": 64}), 64),  # before: 128, more than the server makes
        (json.dumps({"max_new_tokens": None}), 4096),  # no limit: the budget's default
    ],
)
async def test_a_prompt_without_a_limit_is_held_at_the_servers_default(
    start_sidecar: StartSidecar, aiohttp_server: Any, preferred: Any, output: int
) -> None:
    fake = FakeSGLang(info(preferred))
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    status, spent = await charged(run, {"text": PROMPT})
    assert status == 200
    assert spent == pytest.approx(sim.token_cost(1, output))


async def test_model_info_is_asked_before_its_older_name(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    fake = FakeSGLang(info('{"max_new_tokens": 1000}'), path="/model_info")
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    status, spent = await charged(run, {"text": PROMPT})
    assert (status, fake.asked) == (200, ["/model_info"])
    assert spent == pytest.approx(sim.token_cost(1, 1000))


@pytest.mark.parametrize(
    ("params", "output"),
    [
        # each prompt is held at the largest: one without a limit runs to the server's 1000
        ([{"max_new_tokens": 50}, {}], 1000),
        ([{"max_new_tokens": 5000}, {"temperature": 0.5}], 5000),
        ([{"max_new_tokens": 50}, {"max_new_tokens": 20}], 50),  # /get_model_info not needed
    ],
)
async def test_a_batch_is_held_at_its_largest_limit_beside_the_default(
    start_sidecar: StartSidecar, aiohttp_server: Any, params: list[Any], output: int
) -> None:
    fake = FakeSGLang(info('{"max_new_tokens": 1000}'))
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    body = {"text": [PROMPT, PROMPT], "sampling_params": params}
    status, spent = await charged(run, body)
    assert status == 200
    assert spent == pytest.approx(sim.token_cost(2, 2 * output))  # ceil(8 / 4) prompt tokens
    if all("max_new_tokens" in p for p in params):
        assert fake.asked == []


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (info('{"max_new_tokens": "1000"}'), 200),  # a string SGLang cannot compare
        (info('{"max_new_tokens": 1000.5}'), 200),
        (info("max_new_tokens=1000"), 200),  # no JSON text
        ({"error": "nope"}, 200),  # no SGLang answer
        (info('{"max_new_tokens": 1000}'), 500),
        (info('{"max_new_tokens": 1000}'), 404),  # neither /model_info nor /get_model_info
    ],
)
async def test_an_unreadable_default_refuses_a_prompt_without_a_limit(
    start_sidecar: StartSidecar, aiohttp_server: Any, answer: Any, status: int
) -> None:
    # held at 128 it could be charged $0.26 for what the server may run to any length
    fake = FakeSGLang(answer, status=status)
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json={"text": PROMPT}) as r,
    ):
        assert r.status == 503
        assert r.headers["Retry-After"] == "5"
        error = (await r.json())["error"]
    assert error["type"] == "upstream_limit_unknown"
    assert "sampling_params.max_new_tokens" in error["message"]
    assert fake.generated == 0
    assert run.sc.budgets.store.held == {}  # type: ignore[attr-defined]
    # a client that sends its limit is held at it, as before
    sent, spent = await charged(run, {"text": PROMPT, "sampling_params": {"max_new_tokens": 9}})
    assert (sent, fake.generated) == (200, 1)
    assert spent == pytest.approx(sim.token_cost(1, 9))


async def test_a_huge_default_is_held_whole_and_refused_by_the_budget(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    fake = FakeSGLang(info(json.dumps({"max_new_tokens": 10**40})))
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    status, spent = await charged(run, {"text": PROMPT})
    assert (status, spent, fake.generated) == (429, 0.0, 0)


async def test_without_budgets_an_unreadable_default_refuses_nothing(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    fake = FakeSGLang(info("not json"))
    run = await sidecar(start_sidecar, aiohttp_server, fake, budgets={})
    async with aiohttp.ClientSession() as s, s.post(run.url + "/generate", json={"text": "a"}) as r:
        assert r.status == 200
    assert fake.generated == 1


async def test_a_new_default_is_read_again(
    start_sidecar: StartSidecar, aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an SGLang restarted with other --preferred-sampling-params behind a running sidecar; a
    # read that then fails keeps the last value read
    monkeypatch.setattr("sidecar.proxy.settings.SGLangDefault.FRESH_S", 0.0)
    monkeypatch.setattr("sidecar.proxy.settings.SGLangDefault.RETRY_S", 0.0)
    fake = FakeSGLang(info('{"max_new_tokens": 1000}'))
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    _, first = await charged(run, {"text": PROMPT})
    fake.answer = info('{"max_new_tokens": 2000}')
    _, second = await charged(run, {"text": PROMPT})
    fake.status = 500
    _, third = await charged(run, {"text": PROMPT})
    assert first == pytest.approx(sim.token_cost(1, 1000))
    assert second - first == pytest.approx(sim.token_cost(1, 2000))
    assert third - second == pytest.approx(sim.token_cost(1, 2000))


async def test_a_model_info_answer_no_sglang_sends_is_not_read_whole(
    start_sidecar: StartSidecar, aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h-rev10 finding 2: /model_info (as TGI's /info) was read whole, whatever its size, and
    parsed on the event loop: an answer of 50 MB held every request of the sidecar, on any
    route, for 1.9 s, and again every RETRY_S (5 s) while it named no model_path. SGLang states
    a dozen of its arguments there (about 1 KB); an answer over INFO_BYTES (1 MiB) is no
    SGLang's, unread: the default is unknown (503 with budgets on), as for any unreadable one."""
    monkeypatch.setattr("sidecar.proxy.settings.SGLangDefault.RETRY_S", 0.0)
    fake = FakeSGLang(info('{"max_new_tokens": 1000}') | {"pad": "x" * (1 << 20)})
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json={"text": PROMPT}) as r,
    ):
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "upstream_limit_unknown"
    assert (fake.asked, fake.generated) == (["/get_model_info"], 0)
    fake.answer = info('{"max_new_tokens": 1000}')  # a second fetch on the same pool is sound
    status, spent = await charged(run, {"text": PROMPT})
    assert status == 200
    assert spent == pytest.approx(sim.token_cost(1, 1000))


def with_api_key(fake: FakeSGLang, key: str) -> FakeSGLang:
    """`fake` started with --api-key `key`: every path answers 401 to another key, or none."""

    @web.middleware
    async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    fake.app.middlewares.append(api_key)
    return fake


async def test_an_sglang_with_an_api_key_is_asked_with_the_requests_key(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """h-rev10 finding 3: an SGLang started with --api-key asks the key on every path but
    /health and /metrics (utils.py `add_api_key_middleware`), /model_info too. Without an
    upstream key of its own the sidecar passes the client's on (to /tokenize too,
    `tokenize_auth`), but asked /model_info with none: 401, the default unknown, and every
    honest /generate without max_new_tokens was refused 503 with budgets on (before ae21bc6:
    served, held at 128). Now /model_info is asked with the request's key."""
    fake = with_api_key(FakeSGLang(info('{"max_new_tokens": 1000}')), "sk-sglang")
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    headers = {"X-Tollbooth-User": "sg", "Authorization": "Bearer sk-sglang"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + "/generate", json={"text": PROMPT}, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")  # type: ignore[attr-defined]
    assert fake.asked == ["/get_model_info"]
    spent = run.sc.budgets.store.spent["user:sg"] / 1e6  # type: ignore[attr-defined]
    assert spent == pytest.approx(sim.token_cost(1, 1000))


async def test_a_client_with_a_wrong_key_does_not_make_model_info_unknown_for_others(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """h-rev11 finding 1: /model_info is asked with the request's key (5a028fc), and a failed
    read rested it RETRY_S for everyone: one client sending a wrong key (or none) to an SGLang
    started with --api-key made its 401 the server's default unknown, and every other user's
    honest /generate without max_new_tokens was refused 503 upstream_limit_unknown for the next
    5 s (a client sending one such request every 5 s refused them all, always). A refusal of
    the key (401, 403) says nothing of the server: it is that request's alone, not rested."""
    fake = with_api_key(FakeSGLang(info('{"max_new_tokens": 1000}')), "sk-sglang")
    run = await sidecar(start_sidecar, aiohttp_server, fake)
    async with aiohttp.ClientSession() as s:
        bad = {"X-Tollbooth-User": "mallory", "Authorization": "Bearer wrong"}
        async with s.post(run.url + "/generate", json={"text": PROMPT}, headers=bad) as r:
            assert r.status == 503
        good = {"X-Tollbooth-User": "sg", "Authorization": "Bearer sk-sglang"}
        async with s.post(run.url + "/generate", json={"text": PROMPT}, headers=good) as r:
            assert r.status == 200, await r.text()
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold settled")  # type: ignore[attr-defined]
    spent = run.sc.budgets.store.spent["user:sg"] / 1e6  # type: ignore[attr-defined]
    assert spent == pytest.approx(sim.token_cost(1, 1000))
