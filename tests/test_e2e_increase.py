"""Spend that adds up in Prometheus: a real sidecar process in front of the simulator, scraped by
two real Prometheus servers (an HA pair, Debian's 2.42), while users and models appear mid-run and
the sidecar restarts in the middle. increase() per user and in total must equal the ledger; every
dashboard query must return data, except the short list in docs/metrics.md of panels that need a
GPU or a server that reports cached tokens.

One scenario for the module (about 20 s), read by several tests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import re
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from tollbooth_lab.simulator import EngineParams, create_simulator

from alerts.build import render_rules
from sidecar.telemetry.thresholds import DEFAULT, load
from tests.procs import (
    Prometheus,
    Tollbooth,
    free_port,
    require_prometheus,
    start_prometheus,
    start_tollbooth,
)
from tests.waiting import wait_for

require_prometheus()

pytestmark = [pytest.mark.binaries, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).parents[1]
# Above the 1 s scrape interval of both servers, with room for scrapes a loaded machine fails
# (each times out at the interval): every server must sample a held series at 0 at least once.
HOLD_S = 5.0
PRICES = {  # USD per million tokens: large, so every request costs a readable amount
    "sim-a": {"input_per_1m": 1000.0, "output_per_1m": 3000.0},
    "sim-b": {"input_per_1m": 5000.0, "output_per_1m": 9000.0},
    "sim-c": {"input_per_1m": 200.0, "output_per_1m": 800.0},
}
JOB, ENGINE_JOB = DEFAULT.job, DEFAULT.engine_job
WINDOW = "10m"  # longer than the whole run: every series starts inside it
# The real rules, with the limits lowered so this run's new users go over them.
THRESHOLDS = load(daily_spend_usd=1.0, user_daily_spend_usd=0.3)


@dataclass
class Run:
    proms: list[Prometheus]
    started: float
    ledger: Path

    async def aligned(self, prom: Prometheus) -> float:
        """The time of the newest scrape of the sidecar: increase() there needs no extrapolation."""
        res = await prom.query(f'timestamp(up{{job="{JOB}"}})')
        return float(res[0]["value"][1])


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


async def chat(tb: Tollbooth, user: str, model: str, n: int, stream: bool = False) -> None:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 6,
        "stream": stream,
        "messages": [{"role": "user", "content": f"hello from {user} " * 3}],
    }
    async with aiohttp.ClientSession(headers={"X-Tollbooth-User": user}) as s:
        for i in range(n):
            path = "/v1/chat/completions" if i % 3 else "/v1/completions"
            payload = (
                body
                if path.endswith("chat/completions")
                else {
                    "model": model,
                    "max_tokens": 5,
                    "prompt": f"say {user} {i}",
                    "stream": stream,
                }
            )
            async with s.post(tb.url + path, json=payload) as r:
                assert r.status == 200, await r.text()
                await r.read()


async def scrapes(proms: list[Prometheus], n: float) -> None:
    """Until every Prometheus has scraped the sidecar `n` more times (rounded up); a slow
    machine makes it wait longer, never pass with fewer scrapes."""
    more = math.ceil(n)
    for prom in proms:
        start = await scraped(prom)
        await wait_for(
            functools.partial(has_scraped, prom, start + more),
            f"{prom.url}: {more} scrapes",
            timeout=30 + 2 * more,
        )


async def scraped(prom: Prometheus) -> float:
    """How many times `prom` has scraped the sidecar in the last hour, and got its metrics (a
    scrape that failed, up 0, sampled nothing)."""
    res = await prom.query(f'sum_over_time(up{{job="{JOB}"}}[1h])')
    return float(res[0]["value"][1]) if res else 0.0


async def has_scraped(prom: Prometheus, n: float) -> bool:
    return await scraped(prom) >= n


async def scraping(prom: Prometheus) -> bool:
    return len(await prom.query("up == 1")) == 3  # the sidecar and both engines


def tollbooth_config(tmp: Path, upstream: str) -> dict[str, Any]:
    return {
        "upstream": {"url": f"http://{upstream}"},
        "pricing": {"models": PRICES},
        "metering": {"new_series_hold_s": HOLD_S},
        "ledger": {"path": str(tmp / "ledger.db")},
        "admission": {"strategy": "token-budget", "token_budget": 4096},
        # limits far above this run's spend: the budget-state panels have a limit to draw
        "budgets": {"global_daily_usd": 1000.0, "user_daily_usd": 100.0},
        "logging": {"access_log": "off"},
        "audit": {"path": str(tmp / "audit.jsonl")},
    }


def prometheus_config(sidecar_admin: str, engines: list[str], rules: Path) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": JOB, "static_configs": [{"targets": [sidecar_admin]}]},
            {"job_name": ENGINE_JOB, "static_configs": [{"targets": engines}]},
        ],
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    tmp = tmp_path_factory.mktemp("increase")
    fast = EngineParams(step_base_s=0.0005)
    vllm, vllm_addr = await serve(create_simulator("vllm", fast))
    tgi, tgi_addr = await serve(create_simulator("tgi", fast))
    ports = (free_port(), free_port())
    cfg = tollbooth_config(tmp, vllm_addr)
    tb = await start_tollbooth(tmp, cfg, ports=ports)
    rules = tmp / "rules.yml"
    rules.write_text(render_rules(THRESHOLDS))
    prom_cfg = prometheus_config(tb.admin.removeprefix("http://"), [vllm_addr, tgi_addr], rules)
    proms: list[Prometheus] = []
    try:
        for name in ("prom-a", "prom-b"):
            proms.append(await start_prometheus(tmp, name, prom_cfg))
        for prom in proms:  # Prometheus sends its first targets to the scraper after ~5 s
            await wait_for(functools.partial(scraping, prom), f"{prom.url}: its targets", 60)
        started = time.time()
        await asyncio.gather(chat(tb, "alice", "sim-a", 4), chat(tb, "bob", "sim-a", 3))
        await scrapes(proms, 2)
        # a new user on a new model, and a known user on another new model, mid-window
        await asyncio.gather(
            chat(tb, "carol", "sim-b", 4), chat(tb, "alice", "sim-c", 2, stream=True)
        )
        await scrapes(proms, 1.5)
        await tb.stop(signal.SIGTERM)  # a restart: every counter starts again from nothing
        tb = await start_tollbooth(tmp, cfg, ports=ports)
        await asyncio.gather(
            chat(tb, "dave", "sim-a", 3),  # first seen after the restart
            chat(tb, "bob", "sim-b", 3, stream=True),
            chat(tb, "carol", "sim-b", 2),
        )
        await scrapes(proms, HOLD_S + 3)  # shown, held, released and scraped at its value, by both
        yield Run(proms, started, Path(cfg["ledger"]["path"]))
    finally:
        for p in proms:
            await p.stop()
        await tb.stop(signal.SIGTERM)
        await vllm.cleanup()
        await tgi.cleanup()


def ledger_by_user(db: Path) -> dict[str, tuple[float, float]]:
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT user, SUM(cost_usd), SUM(input_tokens) + SUM(output_tokens) FROM requests "
            "GROUP BY user"
        ).fetchall()
    return {u: (cost, tokens) for u, cost, tokens in rows}


def by_user(result: list[Any]) -> dict[str, float]:
    return {r["metric"].get("user_id", ""): float(r["value"][1]) for r in result}


async def test_increase_per_user_and_in_total_equals_the_ledger(run: Run) -> None:
    ledger = ledger_by_user(run.ledger)
    assert set(ledger) == {"alice", "bob", "carol", "dave"}
    for prom in run.proms:  # each server of the HA pair on its own
        at = await run.aligned(prom)
        cost = by_user(
            await prom.query(
                f'sum by (user_id) (increase(llm_cost_usd_total{{job="{JOB}"}}[{WINDOW}]))', at
            )
        )
        tokens = by_user(
            await prom.query(
                f'sum by (user_id) (increase(llm_tokens_total{{job="{JOB}"}}[{WINDOW}]))', at
            )
        )
        total = await prom.query(f'sum(increase(llm_cost_usd_total{{job="{JOB}"}}[{WINDOW}]))', at)
        for user, (usd, toks) in ledger.items():
            assert cost.get(user, 0.0) == pytest.approx(usd, rel=0.02), (prom.url, user, cost)
            assert tokens.get(user, 0.0) == pytest.approx(toks, rel=0.02), (prom.url, user)
        spent = sum(usd for usd, _ in ledger.values())
        assert float(total[0]["value"][1]) == pytest.approx(spent, rel=0.02)


async def test_spend_alerts_fire_for_new_users(run: Run) -> None:
    """The alerts the under-count silenced: users first seen mid-run, one after the restart."""
    ledger = ledger_by_user(run.ledger)
    over = {u for u, (usd, _) in ledger.items() if usd > THRESHOLDS.user_daily_spend_usd}
    assert over and over != set(ledger)  # the run has users on both sides of the limit
    assert sum(usd for usd, _ in ledger.values()) > THRESHOLDS.daily_spend_usd
    for prom in run.proms:
        firing = await prom.query('ALERTS{alertstate="firing"}')
        names = {a["metric"]["alertname"] for a in firing}
        users = {
            a["metric"]["user_id"]
            for a in firing
            if a["metric"]["alertname"] == "LLMUserDailySpendHigh"
        }
        # sim-b's chat requests cost about $0.12 each: over the $0.10 per-request limit too
        assert names == {"LLMDailySpendHigh", "LLMUserDailySpendHigh", "LLMRequestCostHigh"}
        assert users == over


# Dashboard targets that have no data in this run, and why (docs/metrics.md keeps the same list).
# Everything else must return data: a healthy system shows 0, not "No data".
EMPTY_HERE = {
    ("gpu.json", "GPU utilisation", "A"): "NVML",
    ("gpu.json", "GPU memory used", "A"): "NVML",
    ("gpu.json", "Power draw", "A"): "NVML",
    ("gpu.json", "GPU temperature", "A"): "NVML",
    ("gpu.json", "Tokens per GPU-second", "A"): "NVML",
    ("gpu.json", "Energy per 1k tokens", "A"): "NVML",
    ("gpu.json", "Device cost vs token-price cost", "A"): "NVML",
    ("user.json", "Device time, selected range", "A"): "NVML",
    ("user.json", "Cached input share", "A"): "a server that reports cached prompt tokens",
    ("cost.json", "Today: spend by team", "A"): "a keys file that names teams",
    ("latency.json", "Fleet: budget store and ledger shipping", "C"): "a shared budget store",
}


def dashboard_targets() -> list[tuple[tuple[str, str, str], str]]:
    out = []
    for path in sorted((ROOT / "dashboards/generated").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel.get("targets", []):
                out.append(((path.name, panel["title"], t["refId"]), t["expr"]))
    return out


def grafana(expr: str, range_s: float) -> str:
    """What Grafana sends for the variables: all instances and models, one user, 1 s scrapes."""
    values = {
        "$__rate_interval": "4s",  # Grafana's floor: four scrape intervals
        "$__range": f"{int(range_s) + 1}s",
        "$__interval": "1s",
        "$job": JOB,
        "$engine_job": ENGINE_JOB,
        "$instance": ".*",
        "$model": ".*",
        "$user_id": "carol",
    }
    for k in sorted(values, key=len, reverse=True):
        expr = expr.replace(k, values[k])
    assert "$" not in expr, expr
    return expr


def has_data(result: list[Any]) -> bool:
    return any(v[1] not in ("NaN", "+Inf", "-Inf") for series in result for v in series["values"])


async def test_every_dashboard_query_returns_data_or_is_listed(run: Run) -> None:
    prom = run.proms[0]
    end = await run.aligned(prom)
    empty, missing = [], []
    for key, expr in dashboard_targets():
        result = await prom.query_range(grafana(expr, end - run.started), run.started, end, 1)
        if not has_data(result):
            empty.append(key)
            if key not in EMPTY_HERE:
                missing.append((key, expr))
    assert not missing, [k for k, _ in missing]
    assert set(empty) == set(EMPTY_HERE)  # the list stays short and true
    documented = (ROOT / "docs/metrics.md").read_text()
    for _, title, _ in EMPTY_HERE:
        assert f"*{title}*" in documented, title


async def test_dashboard_variables_have_values(run: Run) -> None:
    prom = run.proms[0]
    at = await run.aligned(prom)
    for path in sorted((ROOT / "dashboards/generated").glob("*.json")):
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            if q := re.fullmatch(r"query_result\((.+)\)", var["definition"]):
                # the user variable: users with tokens in the range, as the regex extracts them
                result = await prom.query(grafana(q.group(1), at - run.started), at)
                pattern = re.compile(var["regex"].strip("/"))
                shown = [",".join(f'{k}="{v}"' for k, v in r["metric"].items()) for r in result]
                users = {m[1] for text in shown if (m := pattern.search(text))}
                assert users == set(ledger_by_user(run.ledger)), users  # every user, no phantom
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert m, var["definition"]
            selector, label = grafana(m.group(1), 60), m.group(2)
            values = await prom.query(f"group by ({label}) ({selector})")
            assert values, (path.name, var["name"])


def panel_expr(dashboard: str, title: str) -> str:
    return next(e for (d, t, _), e in dashboard_targets() if d == dashboard and t == title)


async def test_the_today_row_equals_the_ledger(run: Run) -> None:
    """Spend today by user (the budget-day gauge, restored across the restart) and by model (the
    cost counters over the UTC day), as the cost dashboard's today row asks for them."""
    with sqlite3.connect(run.ledger) as con:
        by_model = dict(con.execute("SELECT model, SUM(cost_usd) FROM requests GROUP BY model"))
    by_user = {u: usd for u, (usd, _) in ledger_by_user(run.ledger).items()}
    prom = run.proms[0]
    at = await run.aligned(prom)
    for title, label, ledger in (
        ("Today: spend by user", "user_id", by_user),
        ("Today: spend by model", "model", by_model),
    ):
        expr = grafana(panel_expr("cost.json", title), at - run.started)
        shown = {r["metric"][label]: float(r["value"][1]) for r in await prom.query(expr, at)}
        assert shown == pytest.approx(ledger, rel=1e-6, abs=1e-9), title


async def test_a_preview_of_every_dashboard_is_written(run: Run, tmp_path: Path) -> None:
    """One HTML page of every panel against this run's Prometheus (under tmp_path, or under
    $TOLLBOOTH_PREVIEW_DIR when set, to keep it); each panel with data or on EMPTY_HERE."""
    from tests.preview import render

    prom = run.proms[0]
    end = await run.aligned(prom)

    async def query(expr: str) -> list[Any]:
        return await prom.query_range(grafana(expr, end - run.started), run.started, end, 1)

    out_dir = Path(os.environ.get("TOLLBOOTH_PREVIEW_DIR") or tmp_path)
    out = out_dir / "dashboards-preview.html"
    has = await render(sorted((ROOT / "dashboards/generated").glob("*.json")), query, out)
    print(f"dashboard preview: {out}")
    listed = {f"{d}: {t}" for d, t, _ in EMPTY_HERE}
    assert {p for p, ok in has.items() if not ok} <= listed
    assert "<svg" in out.read_text()
