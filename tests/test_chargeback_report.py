"""Chargeback reports (issue 25): by user, team, project, tag, model, day and month, over --since
or --month; every dimension's sums equal the ledger's, and a budget month starts at the budget
day's start hour on its first day."""

from __future__ import annotations

import calendar
import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.billing import ledger, report

HOUR = 6  # budgets.day_start_hour_utc
NOV_1 = calendar.timegm((2026, 11, 1, 0, 0, 0))
# (ts, user, team, project, tags, model, input, output, cost): across the October/November edge
ROWS = [
    (NOV_1 + HOUR * 3600 - 1, "ann", "ops", "atlas", "eu,prod", "m1", 10, 5, 0.25),  # October
    (NOV_1 + HOUR * 3600, "ann", "ops", "atlas", "prod", "m1", 20, 7, 0.5),  # November
    (NOV_1 + 86400 * 3, "bob", None, "zeus", None, "m2", 3, 1, 1.0),
    (NOV_1 + 86400 * 30 + HOUR * 3600 + 5, "cy", "ml", None, "eu", "m2", 8, 2, 0.125),  # Dec
    (NOV_1 + 86400 * 10, "cy", "ml", "zeus", "eu", "m1", 4, 4, None),  # unknown cost
]


@pytest.fixture
def path(tmp_path: Path) -> str:
    p = tmp_path / "l.db"
    conn = ledger.connect(p)
    with conn:
        for i, (ts, user, team, project, tags, model, inp, out, cost) in enumerate(ROWS):
            conn.execute(
                ledger.INSERT,
                ledger.Row(ts, f"r{i}", None, model, "/v1/chat/completions", user, inp, 0, out,
                           cost, "200", 0, None, None, 0.1, None, team, None,
                           project=project, tags=tags),
            )  # fmt: skip
    conn.close()
    return str(p)


@pytest.mark.parametrize("by", ["user", "team", "project", "model", "day", "month"])
def test_every_dimension_sums_to_the_ledger(path: str, by: str) -> None:
    rows = report.chargeback(path, 0.0, by, HOUR)
    assert sum(r["requests"] for r in rows) == len(ROWS)
    assert sum(r["input_tokens"] for r in rows) == sum(r[6] for r in ROWS)
    assert sum(r["output_tokens"] for r in rows) == sum(r[7] for r in ROWS)
    known = [r for r in rows if r["cost_usd"] is not None]
    unknown = [r for r in rows if r["cost_usd"] is None]
    assert sum(r["unknown_cost_requests"] for r in unknown) == 1  # shown as unknown, never 0
    assert len(unknown) == 1
    known_total = sum(r[8] for r in ROWS if r[8] is not None)
    unknown_group = unknown[0][by]
    in_unknown = sum(r[8] or 0 for r in ROWS if unknown_group in report.keys_of(r, by, HOUR * 3600))
    assert sum(r["cost_usd"] for r in known) == pytest.approx(known_total - in_unknown)


def test_by_tag_a_request_is_in_each_of_its_tags(path: str) -> None:
    rows = {r["tag"]: r for r in report.chargeback(path, 0.0, "tag", HOUR)}
    assert set(rows) == {"eu", "prod", report.NONE}
    assert rows["prod"]["cost_usd"] == pytest.approx(0.75)
    assert rows[report.NONE]["cost_usd"] == pytest.approx(1.0)
    assert rows["eu"]["requests"] == 3 and rows["eu"]["cost_usd"] is None


def test_a_budget_month_starts_at_the_day_start_hour(path: str) -> None:
    by_month = {r["month"]: r for r in report.chargeback(path, 0.0, "month", HOUR)}
    assert {m: r["requests"] for m, r in by_month.items()} == {
        "2026-10": 1,
        "2026-11": 3,
        "2026-12": 1,
    }
    start, end = report.month_bounds("2026-11", HOUR)
    assert (start, end) == (NOV_1 + HOUR * 3600, calendar.timegm((2026, 12, 1, HOUR, 0, 0)))
    nov = report.chargeback(path, start, "project", HOUR, end)
    assert {r["project"]: r["requests"] for r in nov} == {"atlas": 1, "zeus": 2}
    with pytest.raises(ValueError):
        report.month_bounds("2026-13")


def test_cli_month_by_team_as_csv_and_json(path: str) -> None:
    def cli(fmt: str) -> str:
        args = ["report", "--ledger", path, "--month", "2026-11", "--by", "team"]
        args += ["--day-start-hour-utc", str(HOUR), "--format", fmt]
        out = subprocess.run(
            [sys.executable, "-m", "sidecar.core.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout

    got = {r["team"]: r for r in json.loads(cli("json"))}
    assert {t: r["requests"] for t, r in got.items()} == {"ops": 1, "ml": 1, report.NONE: 1}
    assert got["ml"]["cost_usd"] is None and got["ops"]["cost_usd"] == 0.5
    table = list(csv.DictReader(io.StringIO(cli("csv"))))
    assert {r["team"]: r["cost_usd"] for r in table} == {"ops": "0.5", report.NONE: "1.0", "ml": ""}


def test_the_fleet_ledger_gives_the_same_report(path: str, postgres: Any) -> None:
    import psycopg

    from sidecar.billing import fleet_ledger

    url = postgres.database()
    with psycopg.connect(url) as conn:
        fleet_ledger.create_schema(conn)
        for i, (ts, user, team, project, tags, model, inp, out, cost) in enumerate(ROWS):
            conn.execute(
                'INSERT INTO requests (source, seq, ts, request_id, model, endpoint, "user", '
                "input_tokens, output_tokens, cost_usd, status, stream, duration_s, team, "
                "project, tags) VALUES ('s', %s, %s, %s, %s, '/v1/x', %s, %s, %s, %s, '200', "
                "0, 0.1, %s, %s, %s)",
                (i, ts, f"r{i}", model, user, inp, out, cost, team, project, tags),
            )
    start, end = report.month_bounds("2026-11", HOUR)
    for by in report.DIMENSIONS:
        assert report.chargeback(url, 0.0, by, HOUR) == report.chargeback(path, 0.0, by, HOUR)
        assert report.chargeback(url, start, by, HOUR, end) == report.chargeback(
            path, start, by, HOUR, end
        )
