"""The panels issue 26 added, each evaluated as the dashboard JSON has it through a real Prometheus
(Debian's 2.42, 1 s scrapes, the project's rules) scraping a real sidecar process in front of the
simulator; expected values from the ledger and from what the clients themselves received.

- *Today: spend by team* (cost): the keys file's teams' spend today, equal to the ledger's;
- *Top 10 users by spend, selected range* (cost, an instant query): exactly the ten biggest
  spenders of the ledger, no user at $0 (a known user published ahead and idle), no `anonymous`;
- *Prompt length* / *Output length p50 / p99 by model* (latency): the quantiles Prometheus'
  algorithm gives for the ledger's own per-request counts in TOKEN_COUNT_BUCKETS;
- *Finish reasons by model* (latency): the finish reasons the clients received, per model.

One scenario for the module (about 25 s, a graceful restart in the middle), read by several tests.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import json
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from tollbooth_lab.simulator import EngineParams, create_simulator

from alerts.build import render_rules
from sidecar.telemetry.metrics import TOKEN_COUNT_BUCKETS
from sidecar.telemetry.thresholds import DEFAULT
from tests.procs import (
    Prometheus,
    free_port,
    require_prometheus,
    start_prometheus,
    start_tollbooth,
)
from tests.test_e2e_increase import grafana, scrapes, serve
from tests.waiting import wait_for

require_prometheus()

pytestmark = [pytest.mark.binaries, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).parents[1]
JOB = DEFAULT.job
HOLD_S = 5.0  # above the 1 s scrape interval, with room for scrapes a loaded machine fails
PRICES = {
    "sim-a": {"input_per_1m": 1000.0, "output_per_1m": 3000.0},
    "sim-b": {"input_per_1m": 5000.0, "output_per_1m": 9000.0},
}
# Twelve spenders (user i sends i + 1 requests: distinct totals), three teams and users without
# one, and a known user who never sends anything.
TEAMS = {"ml": ("u00", "u01", "u02", "u03"), "web": ("u04", "u05", "u06"), "ops": ("u07",)}
SPENDERS = tuple(f"u{i:02d}" for i in range(12))
IDLE = "idle"


def key_of(user: str) -> str:
    return f"sk-panels-{user}-0123456789"


def keys_file(path: Path) -> Path:
    team = {u: t for t, users in TEAMS.items() for u in users}
    entries = []
    for user in (*SPENDERS, IDLE):
        entry = {"sha256": hashlib.sha256(key_of(user).encode()).hexdigest(), "user": user}
        if user in team:
            entry["team"] = team[user]
        entries.append(entry)
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path


@dataclass
class Run:
    prom: Prometheus
    started: float
    ledger: Path
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)  # as the clients saw them

    async def aligned(self) -> float:
        """The newest scrape of the sidecar: increase() there needs no extrapolation."""
        res = await self.prom.query(f'timestamp(up{{job="{JOB}"}})')
        return float(res[0]["value"][1])

    async def panel(self, dashboard: str, title: str, whole_run: bool = False) -> list[list[Any]]:
        """Each of the panel's targets' result, evaluated at the newest scrape; `$__range` is the
        run; with `whole_run`, `$__rate_interval` too (a rate over the whole run)."""
        at = await self.aligned()
        range_s = at - self.started
        out = []
        for expr in panel_exprs(dashboard, title):
            if whole_run:
                expr = expr.replace("$__rate_interval", f"{int(range_s) + 1}s")
            out.append(await self.prom.query(grafana(expr, range_s), at))
        return out


def panel_exprs(dashboard: str, title: str) -> list[str]:
    data = json.loads((ROOT / "dashboards/generated" / dashboard).read_text())
    panel = next(p for p in data["panels"] if p["title"] == title)
    return [t["expr"] for t in panel["targets"]]


async def send(url: str, user: str, model: str, i: int, reasons: Counter[tuple[str, str]]) -> None:
    """One request; the finish reasons the client received are counted."""
    stream = i % 2 == 1
    body = {
        "model": model,
        "max_tokens": 4 + 13 * i,  # lengths that spread over several buckets
        "stream": stream,
        "messages": [{"role": "user", "content": f"tell {user} story {i} " * (1 + 7 * i)}],
    }
    headers = {"Authorization": f"Bearer {key_of(user)}"}
    async with (
        aiohttp.ClientSession(headers=headers) as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        if not stream:
            for c in (await r.json())["choices"]:
                reasons[(model, c["finish_reason"])] += 1
            return
        for line in (await r.text()).splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("finish_reason"):
                        reasons[(model, c["finish_reason"])] += 1


async def up(prom: Prometheus) -> bool:
    return bool(await prom.query(f'up{{job="{JOB}"}} == 1'))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    tmp = tmp_path_factory.mktemp("panels")
    engine, engine_addr = await serve(create_simulator("vllm", EngineParams(step_base_s=0.0005)))
    ledger = tmp / "ledger.db"
    cfg = {
        "upstream": {"url": f"http://{engine_addr}"},
        "pricing": {"models": PRICES},
        "identity": {"keys_file": str(keys_file(tmp / "keys.yaml"))},
        "metering": {"new_series_hold_s": HOLD_S},
        "ledger": {"path": str(ledger)},
        "logging": {"access_log": "off"},
    }
    ports = (free_port(), free_port())
    tb = await start_tollbooth(tmp, cfg, ports=ports)
    rules = tmp / "rules.yml"
    rules.write_text(render_rules(DEFAULT))
    every = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    scrape = [
        {"job_name": JOB, "static_configs": [{"targets": [tb.admin.removeprefix("http://")]}]}
    ]
    prom = None
    try:
        prom = await start_prometheus(
            tmp, "prom", {"global": every, "rule_files": [str(rules)], "scrape_configs": scrape}
        )
        await wait_for(functools.partial(up, prom), "the first scrape of the sidecar", 30)
        started = time.time()
        await scrapes([prom], 2)  # every series published ahead is scraped at 0 first
        r = Run(prom, started, ledger)
        jobs = [
            (user, ("sim-a", "sim-b")[(n + i) % 2], i)
            for n, user in enumerate(SPENDERS)
            for i in range(n + 1)
        ]
        for k in range(0, len(jobs), 8):  # eight at a time
            if k == 40:  # a graceful restart, right after a batch: today's gauges come back from
                # the ledger, counters and histograms from the carry file (the last requests'
                # observations, after the last scrape, are not lost)
                await tb.stop(signal.SIGTERM)
                tb = await start_tollbooth(tmp, cfg, ports=ports)
            await asyncio.gather(*(send(tb.url, *job, r.reasons) for job in jobs[k : k + 8]))
        await wait_for(functools.partial(ledger_rows, ledger, len(jobs)), "every ledger row")
        await scrapes([prom], HOLD_S + 3)  # held series released and scraped at their value
        yield r
    finally:
        if prom is not None:
            await prom.stop()
        await tb.stop(signal.SIGTERM)
        await engine.cleanup()


def ledger_rows(db: Path, n: int) -> bool:
    if not db.exists():
        return False
    with sqlite3.connect(db) as con:
        return bool(con.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == n)


def ledger(db: Path, sql: str) -> list[Any]:
    with sqlite3.connect(db) as con:
        return list(con.execute(sql))


async def test_today_spend_by_team_equals_the_ledger(run: Run) -> None:
    sql = "SELECT team, SUM(cost_usd) FROM requests WHERE team IS NOT NULL GROUP BY team"
    expected = dict(ledger(run.ledger, sql))
    assert set(expected) == set(TEAMS)
    (result,) = await run.panel("cost.json", "Today: spend by team")
    shown = {r["metric"]["team"]: float(r["value"][1]) for r in result}
    assert shown == pytest.approx(expected, rel=1e-9)
    print(f"today by team: {shown} (ledger {expected})")


async def test_top_ten_is_ten_spenders_over_the_range_and_no_one_at_zero(run: Run) -> None:
    spend = dict(ledger(run.ledger, "SELECT user, SUM(cost_usd) FROM requests GROUP BY user"))
    assert set(spend) == set(SPENDERS) and IDLE not in spend
    top = dict(sorted(spend.items(), key=lambda kv: -kv[1])[:10])
    (result,) = await run.panel("cost.json", "Top 10 users by spend, selected range")
    shown = {r["metric"]["user_id"]: float(r["value"][1]) for r in result}
    assert len(result) == 10 and set(shown) == set(top)  # the idle known user: not listed
    assert shown == pytest.approx(top, rel=1e-9)
    # the idle user's series exist (published ahead at 0): the panel leaves them out on purpose
    idle = await run.prom.query(f'llm_cost_usd_total{{job="{JOB}",user_id="{IDLE}"}}')
    assert idle and all(float(s["value"][1]) == 0 for s in idle)
    print(f"top 10: {shown}")


def quantile(q: float, values: list[int], bounds: tuple[float, ...]) -> float:
    """Prometheus' histogram_quantile (promql/quantile.go bucketQuantile) over `values`
    observed into cumulative buckets with upper bounds `bounds` (and +Inf)."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    cumulative = [sum(counts[: i + 1]) for i in range(len(counts))]
    rank = q * cumulative[-1]
    b = next(i for i, c in enumerate(cumulative) if c >= rank)
    if b == len(bounds):  # in +Inf: the highest finite bound
        return bounds[-1]
    start, below = (0.0, 0) if b == 0 else (bounds[b - 1], cumulative[b - 1])
    return start + (bounds[b] - start) * (rank - below) / (cumulative[b] - below)


@pytest.mark.parametrize("title,column", [("Prompt", "input_tokens"), ("Output", "output_tokens")])
async def test_length_quantiles_are_the_ledgers_counts(run: Run, title: str, column: str) -> None:
    rows = ledger(run.ledger, f"SELECT model, {column} FROM requests WHERE {column} IS NOT NULL")
    by_model: dict[str, list[int]] = {}
    for model, n in rows:
        by_model.setdefault(model, []).append(n)
    assert set(by_model) == set(PRICES) and len(rows) == 78
    p50, p99 = await run.panel("latency.json", f"{title} length p50 / p99 by model", True)
    got = {
        (r["metric"]["model"], p): float(r["value"][1])
        for p, result in (("p50", p50), ("p99", p99))
        for r in result
    }
    expected = {
        (model, p): quantile(q, values, TOKEN_COUNT_BUCKETS)
        for model, values in by_model.items()
        for p, q in (("p50", 0.5), ("p99", 0.99))
    }
    assert got == pytest.approx(expected, rel=1e-9)
    print(f"{title.lower()} length quantiles: {got}")


async def test_finish_reasons_are_what_the_clients_received(run: Run) -> None:
    at = await run.aligned()
    window = int(at - run.started) + 1
    (result,) = await run.panel("latency.json", "Finish reasons by model", whole_run=True)
    shown = {
        (r["metric"]["model"], r["metric"]["finish_reason"]): float(r["value"][1]) * window
        for r in result
    }
    assert sum(run.reasons.values()) == 78 and {r for _, r in run.reasons} == {"stop", "length"}
    assert shown == pytest.approx(dict(run.reasons), rel=1e-9)
    print(f"finish reasons (rate x window): {shown}")
