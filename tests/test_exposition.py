"""What /metrics shows: a new cumulative series reads 0 for the hold, then its value; the
registry always holds the truth. The proof against Prometheus is tests/test_e2e_increase.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as om
from prometheus_client.parser import text_string_to_metric_families

from sidecar.telemetry.exposition import (
    CARRY_MAX_AGE_S,
    HeldView,
    carry_path,
    published,
    read_by_increase,
    restore,
    save,
)
from sidecar.telemetry.metrics import OTHER, LabelCap, Metrics
from tests.conftest import StartSidecar
from tests.fakes import MODEL

EP = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """One clock for the children's `_created` stamps and the view."""
    c = Clock()
    monkeypatch.setattr("prometheus_client.metrics.time.time", c)
    return c


def shown(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def cost_key(user: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = {"model": "m", "token_type": "input", "api_endpoint": EP, "user_id": user}
    return "llm_cost_usd_total", tuple(sorted(labels.items()))


def test_a_new_series_reads_zero_for_the_hold_then_its_value(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=30)
    m.cost.labels("m", "input", EP, "new").inc(2.5)
    assert shown(reg)[cost_key("new")] == 0.0
    clock.now += 29.9
    assert shown(reg)[cost_key("new")] == 0.0
    clock.now += 0.2
    assert shown(reg)[cost_key("new")] == 2.5
    # the registry is never changed: budgets, tests and the demo read the truth
    labels = {"model": "m", "token_type": "input", "api_endpoint": EP, "user_id": "new"}
    assert m.registry.get_sample_value("llm_cost_usd_total", labels) == 2.5


def test_each_series_has_its_own_hold(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=10)
    m.cost.labels("m", "input", EP, "old").inc(1)
    shown(reg)
    clock.now += 11
    m.cost.labels("m", "input", EP, "late").inc(3)
    now = shown(reg)
    assert now[cost_key("old")] == 1 and now[cost_key("late")] == 0


def test_histograms_are_held_whole_and_keep_exemplars(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=5)
    m.request_cost.labels("m", EP).observe(0.3, {"trace_id": "abc"})
    text = om.generate_latest(reg).decode()  # type: ignore[no-untyped-call]
    held = [ln for ln in text.splitlines() if ln.startswith("llm_request_cost_usd_")]
    for ln in held:
        if not ln.startswith("llm_request_cost_usd_created"):
            assert " 0.0" in ln, ln
    assert any('# {trace_id="abc"} 0.3' in ln for ln in held)
    clock.now += 6
    after = shown(reg)
    inf = ("le", "+Inf")
    count = [v for (n, lbl), v in after.items() if n.endswith("_bucket") and inf in lbl]
    assert count == [1.0]


def test_the_hold_starts_when_a_series_is_first_shown(clock: Clock) -> None:
    """A scraper that starts late (or comes back) still sees a new series at 0 first."""
    m = Metrics()
    reg, _ = published(m, hold_s=10)
    m.cost.labels("m", "input", EP, "early").inc(1)
    clock.now += 600  # nobody scraped for ten minutes
    assert shown(reg)[cost_key("early")] == 0
    clock.now += 10
    assert shown(reg)[cost_key("early")] == 1


def test_gauges_and_internal_counters_are_shown_at_once(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=60)
    m.spend_today.labels("u").set(4.0)
    m.ledger_errors.labels("write").inc()
    now = shown(reg)
    assert now[("llm_spend_today_usd", (("user_id", "u"),))] == 4.0
    assert now[("llm_ledger_errors_total", (("stage", "write"),))] == 1.0


def test_old_families_pass_through_untouched(clock: Clock) -> None:
    m = Metrics()
    view = HeldView(m.registry, read_by_increase(m), 5, clock)
    m.tokens.labels("m", "input", EP, "u").inc(7)
    list(view.collect())
    clock.now += 6
    fams = {f.name: f for f in view.collect()}
    originals = {f.name: f for f in m.registry.collect()}
    assert fams["llm_tokens"].samples == originals["llm_tokens"].samples


def test_without_created_samples_the_hold_runs_from_the_first_exposure(clock: Clock) -> None:
    m = Metrics()
    m.tokens.labels("m", "input", EP, "u").inc(7)

    class NoCreated:  # what PROMETHEUS_DISABLE_CREATED_SERIES makes of the registry
        def collect(self) -> Any:
            for fam in m.registry.collect():
                fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
                yield fam

    reg = CollectorRegistry()
    reg.register(HeldView(NoCreated(), read_by_increase(m), 5, clock))  # type: ignore[arg-type]
    key = (
        "llm_tokens_total",
        tuple(
            sorted(
                {"model": "m", "token_type": "input", "api_endpoint": EP, "user_id": "u"}.items()
            )
        ),
    )
    clock.now += 100  # created long ago, but never shown before
    assert shown(reg)[key] == 0
    clock.now += 6
    assert shown(reg)[key] == 7


def test_zero_hold_is_the_plain_registry(clock: Clock) -> None:
    m = Metrics()
    reg, _ = published(m, hold_s=0)
    m.cost.labels("m", "input", EP, "u").inc(1.5)
    assert shown(reg)[cost_key("u")] == 1.5


async def test_the_admin_app_serves_the_held_view(start_sidecar: StartSidecar) -> None:
    run = await start_sidecar({"metering": {"new_series_hold_s": 3600}})
    async with aiohttp.ClientSession() as s:
        async with s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "a b"}]},
            headers={"X-Tollbooth-User": "fresh"},
        ) as r:
            assert r.status == 200
        async with s.get(run.admin_url + "/metrics") as r:
            text = await r.text()
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("llm_tokens_total{") and 'user_id="fresh"' in ln and "input" in ln
    )
    assert line.endswith(" 0.0")
    assert run.value(
        "llm_tokens_total", model=MODEL, token_type="input", api_endpoint=EP, user_id="fresh"
    )


def test_counters_go_on_in_the_next_process(clock: Clock, tmp_path: Path) -> None:
    """A graceful restart is no reset: what no scraper saw yet, every scraper sees after it."""
    m = Metrics()
    reg, view = published(m, hold_s=10)
    m.cost.labels("m", "input", EP, "seen").inc(1)
    shown(reg)
    clock.now += 11
    shown(reg)  # "seen" is published at 1
    m.cost.labels("m", "input", EP, "seen").inc(2)  # after the last scrape
    m.cost.labels("m", "input", EP, "held").inc(3)
    shown(reg)  # shown at 0 once
    m.cost.labels("m", "input", EP, "never").inc(4)  # never shown at all
    m.request_cost.labels("m", EP).observe(0.2)  # after the last scrape: goes on from there
    m.ledger_errors.labels("write").inc()  # not read by increase(): not carried
    path = tmp_path / "ledger.db.series.json"
    assert save(view, path, clock) == 4
    nxt = Metrics()
    reg2, view2 = published(nxt, hold_s=10)
    assert restore(nxt, view2, path, clock=clock) == 4
    assert not path.exists()  # never applied twice
    for user, value in (("held", 3.0), ("never", 4.0), ("seen", 3.0)):
        labels = {"model": "m", "token_type": "input", "api_endpoint": EP, "user_id": user}
        assert nxt.registry.get_sample_value("llm_cost_usd_total", labels) == value
    count = {"model": "m", "api_endpoint": EP}
    assert nxt.registry.get_sample_value("llm_request_cost_usd_count", count) == 1
    assert nxt.registry.get_sample_value("llm_request_cost_usd_sum", count) == 0.2
    bucket = {**count, "le": "0.25"}
    assert nxt.registry.get_sample_value("llm_request_cost_usd_bucket", bucket) == 1
    assert nxt.registry.get_sample_value("llm_request_cost_usd_bucket", {**count, "le": "0.1"}) == 0
    assert nxt.registry.get_sample_value("llm_ledger_errors_total", {"stage": "write"}) == 0
    now = shown(reg2)
    assert now[cost_key("seen")] == 3  # scrapers saw it above 0: it goes on at once
    assert now[cost_key("held")] == 0 and now[cost_key("never")] == 0  # still at 0 first
    clock.now += 11
    assert shown(reg2)[cost_key("held")] == 3


def test_a_counter_without_labels_goes_on_in_the_next_process(clock: Clock, tmp_path: Path) -> None:
    """The fleet's unlabelled counters were saved, then not restored ("No label names were set"):
    each graceful restart reset them, and a rule reading their increase() saw a reset."""
    m = Metrics()
    view = published(m, hold_s=10)[1]
    m.store_bypassed.inc(2)
    m.holds_expired.inc(1)
    path = tmp_path / "ledger.db.series.json"
    save(view, path, clock)
    nxt = Metrics()
    restore(nxt, published(nxt, hold_s=10)[1], path, clock=clock)
    assert nxt.registry.get_sample_value("llm_budget_store_bypassed_total") == 2
    assert nxt.registry.get_sample_value("llm_budget_holds_expired_total") == 1


def test_carried_series_pass_the_caps_of_the_new_process(clock: Clock, tmp_path: Path) -> None:
    m = Metrics()
    _, view = published(m, hold_s=10)
    for user in ("a", "b", "c"):
        m.tokens.labels("m", "input", EP, user).inc(1)
    path = tmp_path / "s.json"
    save(view, path, clock)
    nxt = Metrics()
    cap = LabelCap(2)

    def relabel(labels: dict[str, str]) -> dict[str, str]:
        return {**labels, "user_id": cap(labels["user_id"])}

    restore(nxt, published(nxt, 10)[1], path, relabel, clock)
    users = {
        s.labels["user_id"]: s.value
        for fam in nxt.registry.collect()
        if fam.name == "llm_tokens"
        for s in fam.samples
        if s.name == "llm_tokens_total"
    }
    assert users == {"a": 1, "b": 1, OTHER: 1}


def test_stale_or_broken_carry_files_are_dropped(clock: Clock, tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    m0 = Metrics()
    _, v0 = published(m0, hold_s=10)
    assert restore(m0, v0, path, clock=clock) == 0  # none: nothing to do
    path.write_text("{not json")
    assert restore(m0, v0, path, clock=clock) == 0
    m = Metrics()
    _, view = published(m, hold_s=10)
    m.tokens.labels("m", "input", EP, "u").inc(5)
    assert save(view, path, clock) == 1
    clock.now += CARRY_MAX_AGE_S + 1
    nxt = Metrics()
    assert restore(nxt, published(nxt, 10)[1], path, clock=clock) == 0 and not path.exists()
    assert carry_path(None) is None
    assert carry_path("/var/lib/t/ledger.db") == Path("/var/lib/t/ledger.db.series.json")


def test_a_histogram_seen_by_scrapers_goes_on_at_once_and_other_bounds_reset(
    clock: Clock, tmp_path: Path
) -> None:
    """A histogram child carries its buckets and sum like a counter its value: one a scraper
    saw is shown at its value at once in the next process (a 0 would read as a reset and count
    it twice); saved under other bucket bounds, it goes on from 0 (a reset), never misfiled."""
    m = Metrics()
    reg, view = published(m, hold_s=10)
    m.duration.labels("m", EP).observe(0.5)
    shown(reg)
    clock.now += 11
    shown(reg)  # published at its value
    m.duration.labels("m", EP).observe(3.0)  # after the last scrape
    path = tmp_path / "ledger.db.series.json"
    save(view, path, clock)
    nxt = Metrics()
    reg2, view2 = published(nxt, hold_s=10)
    restore(nxt, view2, path, clock=clock)
    labels = {"model": "m", "api_endpoint": EP}
    first = shown(reg2)
    assert first[("llm_request_duration_seconds_count", tuple(sorted(labels.items())))] == 2
    assert nxt.registry.get_sample_value("llm_request_duration_seconds_sum", labels) == 3.5
    assert not path.exists()  # applied once
    m.duration.labels("m", EP).observe(1.0)
    save(view, path, clock)
    saved = json.loads(path.read_text())
    for s in saved["series"]:
        if "le" in s:
            s["le"] = s["le"][1:]  # a release with other bounds
            s["buckets"] = s["buckets"][1:]
    path.write_text(json.dumps(saved))
    other = Metrics()
    restore(other, published(other, hold_s=10)[1], path, clock=clock)
    assert other.registry.get_sample_value("llm_request_duration_seconds_count", labels) == 0
