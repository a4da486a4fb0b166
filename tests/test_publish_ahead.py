"""Series known ahead are published at 0 and never held; only a series first exposed carrying a
value is (sidecar/telemetry/exposition.py). A person reading /metrics is told so, and can read the
true values."""

from __future__ import annotations

import hashlib
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.telemetry.exposition import (
    MAX_USER_SERIES_AHEAD,
    SIDECAR_STATUSES,
    endpoints_for,
    publish_ahead,
    published,
)
from sidecar.telemetry.metrics import Metrics
from tests.conftest import StartSidecar
from tests.fakes import MODEL

EP = "/v1/chat/completions"
KEY = "sk-known-0123456789"
Shown = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("prometheus_client.metrics.time.time", c)
    return c


def shown(reg: CollectorRegistry) -> Shown:
    text = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_a_series_first_shown_at_zero_is_never_held(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=30)
    publish_ahead(m, ["m"], [EP], [])
    errors = key("llm_requests_total", model="m", api_endpoint=EP, status_code="502")
    assert shown(reg)[errors] == 0  # scraped at 0
    clock.now += 1
    m.requests.labels("m", EP, "502").inc()
    assert shown(reg)[errors] == 1  # the next scrape has it: no hold


def test_a_series_first_shown_carrying_a_value_is_still_held(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=30)
    m.requests.labels("m", EP, "500").inc()  # an upstream status nobody foresaw
    k = key("llm_requests_total", model="m", api_endpoint=EP, status_code="500")
    assert shown(reg)[k] == 0
    clock.now += 29
    assert shown(reg)[k] == 0
    clock.now += 1
    assert shown(reg)[k] == 1


def test_a_histogram_published_ahead_shows_its_first_observation_at_once(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=30)
    publish_ahead(m, ["m"], [EP], [])
    shown(reg)
    m.request_cost.labels("m", EP).observe(0.12)
    out = shown(reg)
    assert out[key("llm_request_cost_usd_count", model="m", api_endpoint=EP)] == 1
    assert out[key("llm_request_cost_usd_bucket", model="m", api_endpoint=EP, le="0.1")] == 0


def test_what_is_published_ahead() -> None:
    m = Metrics()
    n = publish_ahead(m, ["a", "b"], endpoints_for("vllm"), ["alice"])
    eps = endpoints_for("vllm")
    assert "/generate" not in eps and EP in eps and "other" not in eps
    assert "/generate" in endpoints_for("tgi")
    for status in ("429", "499", "502", "503", "504", "stream_error"):
        assert status in SIDECAR_STATUSES
        assert (
            m.registry.get_sample_value(
                "llm_requests_total", {"model": "b", "api_endpoint": EP, "status_code": status}
            )
            == 0
        )
    cost = {"model": "a", "token_type": "output", "api_endpoint": EP, "user_id": "alice"}
    assert m.registry.get_sample_value("llm_cost_usd_total", cost) == 0
    assert m.registry.get_sample_value("llm_tokens_total", cost) == 0
    assert (
        m.registry.get_sample_value(
            "llm_request_duration_seconds_count", {"model": "a", "api_endpoint": EP}
        )
        == 0
    )
    for length in ("llm_request_prompt_tokens_count", "llm_request_output_tokens_count"):
        assert m.registry.get_sample_value(length, {"model": "b"}) == 0
    users = {s.labels.get("user_id") for s in next(iter(m.cost.collect())).samples}
    assert users == {"alice"}  # no phantom "anonymous"
    assert not next(iter(m.finish_reasons.collect())).samples  # the server's words: not ahead
    assert n == 2 * (len(eps) * (len(SIDECAR_STATUSES) + 4) + 2) + 2 * 2 * len(eps) * 2 + 1


def test_known_users_ahead_are_bounded() -> None:
    m = Metrics()
    eps = endpoints_for("vllm")
    users = [f"u{i}" for i in range(MAX_USER_SERIES_AHEAD)]
    publish_ahead(m, ["a"], eps, users)
    cost = next(iter(m.cost.collect()))
    n = sum(1 for s in cost.samples if s.name == "llm_cost_usd_total")
    per_user = len(eps) * 2
    assert n == (MAX_USER_SERIES_AHEAD // (2 * per_user)) * per_user


def keys_file(path: Path, user: str) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    path.write_text(yaml.safe_dump({"keys": [{"sha256": digest, "user": user}]}))
    return str(path)


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.text()


async def test_a_known_users_first_request_shows_at_once(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    keys = keys_file(tmp_path / "keys.yaml", "known")
    run = await start_sidecar(
        {
            "identity": {"keys_file": keys},
            "pricing": {"models": {MODEL: {"input_per_1m": 1.0, "output_per_1m": 2.0}}},
            "metering": {"new_series_hold_s": 3600},
        }
    )
    first = await metrics_text(run.admin_url + "/metrics")  # the scrape before any request
    assert f'llm_cost_usd_total{{api_endpoint="{EP}",model="{MODEL}",' in first
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + EP,
            json={"model": MODEL, "messages": [{"role": "user", "content": "a b"}]},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as r,
    ):
        assert r.status == 200
    text = await metrics_text(run.admin_url + "/metrics")
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("llm_tokens_total{")
        and 'user_id="known"' in ln
        and "input" in ln
        and EP in ln
    )
    assert not line.endswith(" 0.0"), line
    assert 'user_id="anonymous"' not in text


async def test_held_families_say_so_and_hold_0_shows_the_truth(
    start_sidecar: StartSidecar,
) -> None:
    run = await start_sidecar({"metering": {"new_series_hold_s": 3600}})
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + EP,
            json={"model": MODEL, "messages": [{"role": "user", "content": "a b"}]},
            headers={"X-Tollbooth-User": "fresh"},
        ) as r,
    ):
        assert r.status == 200
    held, true = (
        await metrics_text(run.admin_url + "/metrics"),
        await metrics_text(run.admin_url + "/metrics?hold=0"),
    )

    def tokens(text: str) -> float:
        fams = text_string_to_metric_families(text)
        fam = next(f for f in fams if f.name == "llm_tokens")
        return sum(s.value for s in fam.samples if s.labels.get("user_id") == "fresh")

    assert tokens(held) == 0 and tokens(true) > 0
    help_line = next(ln for ln in held.splitlines() if ln.startswith("# HELP llm_tokens_total"))
    assert "3600 s" in help_line and "/metrics?hold=0" in help_line
    health = next(ln for ln in held.splitlines() if ln.startswith("# HELP llm_ledger_errors"))
    assert "hold" not in health  # not a held family
