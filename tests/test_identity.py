"""Verified identity: API keys mapped to principals, 401s, end users, upstream credentials.

Each test attacks a way a client could bill someone else or be served unbilled.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from sidecar.config import Config, ConfigError, build, validate
from sidecar.proxy.identity import add_key, read_keys
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

MSGS = [{"role": "user", "content": "one two three four five"}]
ALICE_KEY, BOB_KEY = "sk-alice-0123456789", "sk-bob-0123456789"


def keys_file(path: Path, *entries: tuple[str, str, str | None]) -> str:
    keys = []
    for key, user, team in entries:
        entry = {"sha256": hashlib.sha256(key.encode()).hexdigest(), "user": user}
        if team:
            entry["team"] = team
        keys.append(entry)
    path.write_text(yaml.safe_dump({"keys": keys}))
    return str(path)


@pytest.fixture
def keys(tmp_path: Path) -> str:
    return keys_file(
        tmp_path / "keys.yaml", (ALICE_KEY, "alice", "research"), (BOB_KEY, "bob", "research")
    )


async def ledger_rows(run: Running, n: int) -> list[tuple[Any, ...]]:
    """The ledger's rows once `n` have been written (the writer commits every 50 ms here)."""
    rows: list[tuple[Any, ...]] = []
    for _ in range(100):
        conn = sqlite3.connect(run.sc.config.ledger.path)
        rows = conn.execute("SELECT user, team, end_user FROM requests ORDER BY id").fetchall()
        conn.close()
        if len(rows) >= n:
            break
        await asyncio.sleep(0.05)
    return rows


async def test_spoofed_header_and_body_user_are_billed_to_the_key(
    start_sidecar: StartSidecar, oai: Any, keys: str, tmp_path: Path
) -> None:
    run = await start_sidecar(
        {
            "identity": {"keys_file": keys},
            "ledger": {"path": str(tmp_path / "l.db"), "flush_interval_s": 0.05},
        }
    )
    client = oai(run, api_key=ALICE_KEY)
    await client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=4,
        user="mallory-end-user",
        extra_headers={"X-Tollbooth-User": "bob"},
    )
    assert (
        run.value(
            "llm_tokens_total",
            model=MODEL,
            token_type="output",
            api_endpoint="/v1/chat/completions",
            user_id="alice",
        )
        == 4
    )
    assert (
        run.value(
            "llm_tokens_total",
            model=MODEL,
            token_type="output",
            api_endpoint="/v1/chat/completions",
            user_id="bob",
        )
        is None
    )
    assert await ledger_rows(run, 1) == [("alice", "research", "mallory-end-user")]


async def test_unknown_and_missing_keys_get_401_before_the_upstream(
    start_sidecar: StartSidecar, oai: Any, keys: str
) -> None:
    run = await start_sidecar({"identity": {"keys_file": keys}})
    with pytest.raises(openai.AuthenticationError) as err:
        await oai(run, api_key="sk-made-up").chat.completions.create(model=MODEL, messages=MSGS)
    assert err.value.body["code"] == "invalid_api_key"
    async with aiohttp.ClientSession() as s:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            async with s.request(method, run.url + path, json={"model": MODEL}) as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "invalid_api_key"
    assert run.upstream is not None and run.upstream.seen == []
    assert run.value("llm_auth_rejections_total", reason="invalid") == 1
    assert run.value("llm_auth_rejections_total", reason="missing") == 2


async def test_unknown_keys_share_one_anonymous_principal(
    start_sidecar: StartSidecar, oai: Any, keys: str
) -> None:
    run = await start_sidecar({"identity": {"keys_file": keys, "unknown_key": "anonymous"}})
    for key in ("sk-invented-1", "sk-invented-2"):
        await oai(run, api_key=key).chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=2, extra_headers={"X-Tollbooth-User": "x"}
        )
    labels = dict(model=MODEL, token_type="output", api_endpoint="/v1/chat/completions")
    assert run.value("llm_tokens_total", **labels, user_id="anonymous") == 4


async def test_trusted_header_without_a_keys_file(start_sidecar: StartSidecar, oai: Any) -> None:
    run = await start_sidecar({"identity": {"trust_user_header": False}})
    await oai(run, api_key="sk-z").chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2, extra_headers={"X-Tollbooth-User": "carol"}
    )
    kid = "key-" + hashlib.sha256(b"sk-z").hexdigest()[:12]
    labels = dict(model=MODEL, token_type="output", api_endpoint="/v1/chat/completions")
    assert run.value("llm_tokens_total", **labels, user_id=kid) == 2


async def test_team_budget_covers_all_its_members(
    start_sidecar: StartSidecar, oai: Any, keys: str
) -> None:
    prices = {"models": {MODEL: {"input_per_1m": 10000.0, "output_per_1m": 10000.0}}}
    run = await start_sidecar(
        {
            "identity": {"keys_file": keys},
            "pricing": prices,
            "budgets": {"teams": {"research": 0.25}},
        }
    )
    # each holds $0.11 (6 estimated prompt tokens + 5 output), spends $0.10
    await oai(run, api_key=ALICE_KEY).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5
    )
    await oai(run, api_key=BOB_KEY).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5
    )
    with pytest.raises(openai.RateLimitError) as err:
        await oai(run, api_key=ALICE_KEY).chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=5
        )
    assert "team 'research'" in err.value.body["message"]
    assert run.value("llm_budget_rejections_total", scope="team") == 1


async def test_upstream_key_replaces_the_clients(
    start_sidecar: StartSidecar, oai: Any, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_KEY", "upstream-secret")
    run = await start_sidecar(
        {"identity": {"keys_file": keys}, "upstream": {"api_key_env": "VLLM_KEY"}}
    )
    await oai(run, api_key=ALICE_KEY).chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2
    )
    async with (
        aiohttp.ClientSession() as s,
        s.get(run.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE_KEY}"}) as r,
    ):
        assert r.status == 200
    assert run.upstream is not None
    sent = [seen["headers"]["Authorization"] for seen in run.upstream.seen]
    assert sent == ["Bearer upstream-secret"] * 2


def test_upstream_key_variable_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.core.app import Sidecar

    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    cfg = validate(build(Config, {"upstream": {"api_key_env": "NO_SUCH_KEY_VAR"}}))
    with pytest.raises(ConfigError, match="NO_SUCH_KEY_VAR"):
        Sidecar(cfg)


def test_credentials_in_the_upstream_url_are_refused_without_echo() -> None:
    with pytest.raises(ConfigError) as err:
        validate(build(Config, {"upstream": {"url": "http://admin:hunter2@10.0.0.1:8000"}}))
    assert "hunter2" not in str(err.value) and "admin" not in str(err.value)
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", "serve", "--upstream", "http://u:hunter2@h:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "credentials" in proc.stderr and "hunter2" not in proc.stderr + proc.stdout


async def test_keys_add_prints_the_key_once_and_stores_its_hash(
    start_sidecar: StartSidecar, oai: Any, tmp_path: Path
) -> None:
    path = str(tmp_path / "keys.yaml")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.core.cli",
            "keys",
            "add",
            "--file",
            path,
            "--user",
            "dana",
            "--team",
            "ops",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    key = proc.stdout.strip()
    stored = Path(path).read_text()
    assert key.startswith("tb-") and key not in stored
    assert hashlib.sha256(key.encode()).hexdigest() in stored
    assert Path(path).stat().st_mode & 0o077 == 0
    run = await start_sidecar({"identity": {"keys_file": path}})
    # a key added while running is accepted after the reload SIGHUP triggers
    second = add_key(path, "erin", None)
    with pytest.raises(openai.AuthenticationError):
        await oai(run, api_key=second).chat.completions.create(model=MODEL, messages=MSGS)
    run.sc.reload()
    for k, user in ((key, "dana"), (second, "erin")):
        await oai(run, api_key=k).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
        labels = dict(model=MODEL, token_type="output", api_endpoint="/v1/chat/completions")
        assert run.value("llm_tokens_total", **labels, user_id=user) == 1
    assert {p.user for p in read_keys(path).values()} == {"dana", "erin"}


def test_a_bad_keys_file_stops_the_start(tmp_path: Path) -> None:
    from sidecar.core.app import Sidecar

    bad = tmp_path / "keys.yaml"
    bad.write_text("keys: [{sha256: nothex, user: a}]")
    cfg = validate(build(Config, {"identity": {"keys_file": str(bad)}}))
    with pytest.raises(ConfigError, match="sha256"):
        Sidecar(cfg)


async def test_no_credential_reaches_a_log_an_audit_record_or_the_ledger(
    start_sidecar: StartSidecar,
    oai: Any,
    keys: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("VLLM_KEY", "upstream-secret-zz")
    prices = {"default": {"input_per_1m": 1e6, "output_per_1m": 1e6}}
    run = await start_sidecar(
        {
            "identity": {"keys_file": keys},
            "upstream": {"api_key_env": "VLLM_KEY"},
            "pricing": prices,
            "audit": {"total_cost_usd": 0.0, "input_cost_usd": 0.0},  # audit every request
            "logging": {"access_log": str(tmp_path / "access.log")},
            "ledger": {"path": str(tmp_path / "l.db"), "flush_interval_s": 0.05},
        }
    )
    client = oai(run, api_key=ALICE_KEY)
    await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    stream = await client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=2, stream=True
    )
    async for _ in stream:
        pass
    with pytest.raises(openai.AuthenticationError):
        await oai(run, api_key="sk-wrong-key-zz").chat.completions.create(
            model=MODEL, messages=MSGS
        )
    await ledger_rows(run, 2)

    def both_requests_in(name: str) -> bool:  # the audit and access-log writers run in threads
        path = tmp_path / name
        return path.exists() and path.read_text().count('"endpoint":"/v1/chat/completions"') == 2

    await wait_for(lambda: both_requests_in("audit.jsonl"), "the audit records")
    await wait_for(lambda: both_requests_in("access.log"), "the access log lines")
    written = "".join(p.read_text(errors="replace") for p in tmp_path.iterdir() if p.is_file())
    written += caplog.text
    for secret in ("upstream-secret-zz", ALICE_KEY, "sk-wrong-key-zz"):
        assert secret not in written


async def test_a_reused_request_id_never_shares_a_hold(
    start_sidecar: StartSidecar, oai: Any
) -> None:
    """Two users' concurrent requests under one X-Request-Id: each is charged its own cost.
    (A burst of one user under one id: tests/test_budget.py.)"""
    prices = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
    run = await start_sidecar({"pricing": prices, "budgets": {"user_daily_usd": 0.05}})
    client = oai(run)
    await asyncio.gather(
        *(
            client.chat.completions.create(
                model=MODEL,
                messages=MSGS,
                max_tokens=tokens,
                extra_headers={
                    "X-Tollbooth-User": user,
                    "X-Request-Id": "same-id",
                    "X-Fake": "sleep:0.2",
                },
            )
            for user, tokens in (("ivan", 10), ("judy", 4))
        )
    )
    spent = run.sc.budgets.store.spent
    assert (spent["user:ivan"], spent["user:judy"]) == ((5 + 10) * 1000, (5 + 4) * 1000)
    assert run.value("llm_spend_today_usd", user_id="judy") == pytest.approx(0.009)


async def test_an_unknown_clients_body_is_never_parsed(
    start_sidecar: StartSidecar, keys: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sidecar.proxy.request

    parsed: list[bytes] = []
    real = sidecar.proxy.request.inspect_request

    def spy(endpoint: Any, body: bytes, **kw: Any) -> Any:
        parsed.append(body)
        return real(endpoint, body, **kw)

    monkeypatch.setattr(sidecar.proxy.request, "inspect_request", spy)
    run = await start_sidecar({"identity": {"keys_file": keys}})
    async with aiohttp.ClientSession() as s:
        body = b"[" + b"[]," * 300_000 + b"[]]"
        async with s.post(run.url + "/v1/chat/completions", data=body) as r:
            assert r.status == 401
        async with s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": MSGS, "max_tokens": 1},
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as r:
            assert r.status == 200
    assert len(parsed) == 1 and b"fake/llama" in parsed[0]


async def test_hostile_values_get_an_answer_not_a_500(
    start_sidecar: StartSidecar, keys: str
) -> None:
    prices = {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 1.0}}}
    run = await start_sidecar(
        {"identity": {"keys_file": keys}, "pricing": prices, "budgets": {"user_daily_usd": 1.0}}
    )
    host, port = run.url.removeprefix("http://").split(":")
    for auth in (b"Bearer \xff\xfe", b"Bearer caf\xe9"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Authorization: " + auth + b"\r\nConnection: close\r\n\r\n{}"
        )
        status = (await reader.readline()).split()[1]
        writer.close()
        assert status == b"401"
    async with aiohttp.ClientSession() as s:
        huge = {"model": MODEL, "messages": MSGS, "max_tokens": 10**400, "n": 10**400}
        async with s.post(
            run.url + "/v1/chat/completions",
            data=json.dumps(huge),
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as r:
            assert r.status == 429  # a worst case this large exceeds any budget
    assert run.value("tollbooth_metering_errors_total", stage="gate") is None


async def test_a_key_in_a_malformed_header_line_is_not_logged(tmp_path: Path) -> None:
    from tests.procs import start_tollbooth

    key = "tb-" + "S3cretKeyValue_" * 3
    tb = await start_tollbooth(
        tmp_path, {"upstream": {"url": "http://127.0.0.1:9"}}, ready_path="/healthz"
    )
    try:
        host, port = tb.url.removeprefix("http://").split(":")
        for line in (
            b"Authorization: Bearer " + key.encode() + b"\x01",
            b"Authorization: Bearer " + key.encode() + b" " * 9000,
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
            assert (await reader.readline()).split()[1] == b"400"
            writer.close()
    finally:
        await tb.stop(signal.SIGTERM)
    log = tb.log.read_text()
    # aiohttp did log each bad line, with the key in it redacted
    errors = [
        r["exception"]
        for r in map(json.loads, log.splitlines())
        if r["logger"] == "aiohttp.server" and r["level"] == "error"
    ]
    assert len(errors) == 2
    assert "BadHttpMessage: 400" in errors[0] and "LineTooLong: 400" in errors[1]
    assert all("Bearer [redacted]" in e for e in errors)
    assert "S3cretKeyValue" not in log


@pytest.mark.parametrize(
    "url",
    [
        "user:sk-SECRET9@host:8000",
        "http://host:8000/?api_key=sk-SECRET9",
        "http://host:sk-SECRET9",
        "http://tok-SECRET9@host",
    ],
)
def test_no_form_of_upstream_url_is_echoed(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(build(Config, {"upstream": {"url": url}}))
    assert "SECRET9" not in str(err.value)


def test_a_trusted_header_cannot_override_verified_keys(keys: str) -> None:
    with pytest.raises(ConfigError, match="trust_user_header"):
        validate(build(Config, {"identity": {"keys_file": keys, "trust_user_header": True}}))
