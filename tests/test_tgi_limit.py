"""TGI's own output limit: what a request that sets none is held and charged at (h-rev6, 4).

TGI runs a request without `max_new_tokens` (`max_tokens` on its OpenAI routes) up to
`max_total_tokens` less its prompt (router/src/validation.rs `validate_input`, since v3.0.0), on
every route: /generate, /generate_stream, /, each /vertex instance and /v1/chat/completions and
/v1/completions. Such a request was held at `budgets.default_max_output_tokens` (4096), and one
whose output went unmeasured (every /vertex answer, a client that left) was charged that hold:
output up to 32,768 tokens for a hold of 4,096. The fake TGI answers /info as TGI does.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

# $1 a thousand tokens either way: a charge in micro-dollars is its tokens x 1,000
PRICES = {"default": {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}
BUDGETS = {"user_daily_usd": 1000.0}
TOTAL = 32768  # the fake TGI's max_total_tokens in these tests
PROMPT = "one two three"  # 13 characters: the hold's estimate is ceil(13 / 4) = 4 tokens


async def tgi(start_sidecar: StartSidecar, total: int | None = TOTAL, **config: Any) -> Running:
    run = await start_sidecar(
        {"upstream": {"api": "tgi"}, "pricing": PRICES, "budgets": BUDGETS, **config}
    )
    assert run.upstream is not None and run.upstream.info_body is not None
    if total is None:
        run.upstream.info_body = None  # /info answers 404
    else:
        run.upstream.info_body["max_total_tokens"] = total
    return run


async def settled(run: Running) -> int:
    """What the anonymous user was charged, once every hold has settled (micro-dollars)."""
    store = run.sc.budgets.store
    await wait_for(
        lambda: not store.holds and bool(store.spent.get("user:anonymous")), "the charge settled"
    )
    return int(store.spent["user:anonymous"])


async def post(run: Running, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(run.url + path, json=body) as r:
        return r.status, await r.json()


# --- /vertex: never measured, always charged its hold ---------------------------------------------


@pytest.mark.parametrize(
    "instances,tokens",
    [
        # before: (4 + 4,096) x $0.001 = $4.100 for up to 32,768 tokens of output
        ([{"inputs": PROMPT}], 4 + TOTAL),
        # a chat instance without max_tokens: ceil(("user" + 13) / 4) = 5 prompt tokens
        ([{"messages": [{"role": "user", "content": PROMPT}]}], 5 + TOTAL),
        # one instance without a limit: every instance is held at the largest
        (
            [{"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}, {"inputs": PROMPT}],
            7 + 2 * TOTAL,
        ),
    ],
)
async def test_a_vertex_instance_without_a_limit_is_charged_max_total_tokens(
    start_sidecar: StartSidecar, instances: list[dict[str, Any]], tokens: int
) -> None:
    run = await tgi(start_sidecar)
    status, answer = await post(run, "/vertex", {"instances": instances})
    assert status == 200 and len(answer["predictions"]) == len(instances)
    assert await settled(run) == tokens * 1000


async def test_max_total_tokens_is_read_beside_a_configured_model_name(
    start_sidecar: StartSidecar,
) -> None:
    # upstream.model_name names the model, so /info is never asked for it: the limit still is
    run = await tgi(start_sidecar, upstream={"api": "tgi", "model_name": "named"})
    status, _ = await post(run, "/vertex", {"instances": [{"inputs": PROMPT}]})
    assert status == 200
    assert await settled(run) == (4 + TOTAL) * 1000
    assert run.value("llm_requests_total", model="named", api_endpoint="/vertex", status_code="200")


async def test_a_vertex_request_with_its_limits_is_charged_as_before(
    start_sidecar: StartSidecar,
) -> None:
    run = await tgi(start_sidecar, total=None)  # /info is not even needed
    body = {"instances": [{"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}]}
    status, _ = await post(run, "/vertex", body)
    assert status == 200
    assert await settled(run) == (4 + 20) * 1000


@pytest.mark.parametrize("info", [None, {"model_id": "m"}, {"max_total_tokens": "32768"}])
async def test_without_max_total_tokens_a_request_without_a_limit_is_refused(
    start_sidecar: StartSidecar, info: dict[str, Any] | None
) -> None:
    # held at 4,096 it would be charged $4.1 for what TGI may run to any length: refused instead
    run = await tgi(start_sidecar)
    assert run.upstream is not None
    run.upstream.info_body = info
    for path, body in (
        ("/vertex", {"instances": [{"inputs": PROMPT}]}),
        ("/generate", {"inputs": PROMPT}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ):
        status, answer = await post(run, path, body)
        assert status == 503, path
        assert answer["error"]["type"] == "upstream_limit_unknown"
        assert "max_new_tokens" in answer["error"]["message"]
    assert run.upstream.seen == []
    assert run.sc.budgets.store.held == {}


async def test_an_info_answer_no_tgi_sends_is_not_read_whole(start_sidecar: StartSidecar) -> None:
    """h-rev10 finding 2: /info was read whole and parsed on the event loop, whatever its size
    (50 MB: 1.9 s of every request's time). TGI states a dozen of its arguments there; an answer
    over INFO_BYTES (1 MiB) is not read: its limit unknown (503 with budgets on)."""
    run = await tgi(start_sidecar)
    assert run.upstream is not None and run.upstream.info_body is not None
    run.upstream.info_body["pad"] = "x" * (1 << 20)
    status, answer = await post(run, "/vertex", {"instances": [{"inputs": PROMPT}]})
    assert (status, answer["error"]["type"]) == (503, "upstream_limit_unknown")


@pytest.mark.parametrize("budgets", [BUDGETS, {}])
async def test_an_info_answer_nested_past_the_parsers_depth_breaks_no_request(
    start_sidecar: StartSidecar, budgets: dict[str, Any]
) -> None:
    """json.loads raises RecursionError, not ValueError, on 100,000 nested arrays: it escaped
    /info's read in the request's path and the request was answered 500."""
    run = await tgi(start_sidecar, budgets=budgets)
    assert run.upstream is not None
    run.upstream.info_body = b"[" * 100_000 + b"]" * 100_000
    status, answer = await post(run, "/vertex", {"instances": [{"inputs": PROMPT}]})
    if budgets:  # the limit unknown: refused as for any unreadable /info
        assert (status, answer["error"]["type"]) == (503, "upstream_limit_unknown")
    else:
        assert status == 200


async def test_without_budgets_an_unknown_limit_refuses_nothing(
    start_sidecar: StartSidecar,
) -> None:
    run = await tgi(start_sidecar, total=None, budgets={})
    status, _ = await post(run, "/vertex", {"instances": [{"inputs": PROMPT}]})
    assert status == 200


async def test_a_new_max_total_tokens_is_read_again(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a TGI restarted with a longer --max-total-tokens behind a running sidecar
    monkeypatch.setattr("sidecar.proxy.settings.TgiInfo.FRESH_S", 0.0)
    run = await tgi(start_sidecar, total=1000)
    body = {"instances": [{"inputs": PROMPT}]}
    assert (await post(run, "/vertex", body))[0] == 200
    assert await settled(run) == (4 + 1000) * 1000
    assert run.upstream is not None and run.upstream.info_body is not None
    run.upstream.info_body["max_total_tokens"] = 50_000
    assert (await post(run, "/vertex", body))[0] == 200
    assert await settled(run) == (4 + 1000 + 4 + 50_000) * 1000


# --- a client that leaves before the counts: charged the hold too ---------------------------------


@pytest.mark.parametrize(
    "path,body,tokens",
    [
        # before: (4 + 4,096) x $0.001 = $4.100
        ("/generate", {"inputs": PROMPT}, 4 + TOTAL),
        ("/", {"inputs": PROMPT}, 4 + TOTAL),
        # ceil(("user" + 13) / 4) = 5 prompt tokens
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
            5 + TOTAL,
        ),
        ("/v1/completions", {"model": MODEL, "prompt": PROMPT}, 4 + TOTAL),
    ],
)
async def test_leaving_a_request_without_a_limit_is_charged_max_total_tokens(
    start_sidecar: StartSidecar, path: str, body: dict[str, Any], tokens: int
) -> None:
    run = await tgi(start_sidecar)
    assert run.upstream is not None
    upstream = run.upstream

    async def send() -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + path, json=body, headers={"X-Fake": "sleep:2"}) as r,
        ):
            await r.read()

    task = asyncio.ensure_future(send())
    await wait_for(lambda: any(r["path"] == path for r in upstream.seen), "the upstream's request")
    task.cancel()  # the client leaves while the server generates
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await settled(run) == tokens * 1000


@pytest.mark.parametrize("counted", [True, False])
async def test_leaving_a_generate_stream_without_a_limit(
    start_sidecar: StartSidecar, counted: bool
) -> None:
    # its token events (one a token) and the prompt /tokenize counts are its usage: 3 + 1 tokens
    # (docs/traffic.md); without the prompt's count it is unmeasured and charged its hold, before
    # (4 + 4,096) x $0.001 = $4.100
    run = await tgi(start_sidecar, metering={"drain_after_disconnect_s": 0.05})
    assert run.upstream is not None
    run.upstream.tokenize_fails = not counted
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            run.url + "/generate_stream",
            json={"inputs": PROMPT},
            headers={"X-Fake": "slow-stream:2"},  # the client leaves well before the next
        )
        assert r.status == 200
        await r.content.readany()
        r.close()
    assert await settled(run) == ((3 + 1) if counted else (4 + TOTAL)) * 1000


async def test_an_answer_measured_in_full_is_charged_what_was_measured(
    start_sidecar: StartSidecar,
) -> None:
    # held at max_total_tokens, charged its counts (the fixture's 10 tokens, 3 of prompt)
    run = await tgi(start_sidecar)
    status, _ = await post(run, "/generate", {"inputs": PROMPT})
    assert status == 200
    assert await settled(run) == (3 + 10) * 1000
