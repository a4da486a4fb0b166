"""The fleet ledger against a real PostgreSQL: rows shipped from the SQLite outbox, counted once,
nothing lost while the database is down, and the same report and audit output from either."""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from sidecar.billing import ledger as sqlite_ledger
from sidecar.billing.fleet_ledger import Shipper
from sidecar.billing.report import chargeback
from sidecar.config import LedgerConfig
from sidecar.telemetry.metrics import Metrics
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.waiting import wait_for

MSGS = [{"role": "user", "content": "one two three four five"}]
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}  # $0.001/token


def count(url: str, table: str = "requests") -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            f"SELECT COUNT(*), COUNT(DISTINCT (source, seq)) FROM {table}"
        ).fetchone()
    assert row is not None and row[0] == row[1]
    return int(row[0])


async def shipped(url: str, n: int, table: str = "requests", deadline_s: float = 15.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if count(url, table) >= n:
                assert count(url, table) == n
                return
        except psycopg.Error:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{table}: fewer than {n} rows reached PostgreSQL")


def fleet_ledger(tmp: Path, pg_url: str, name: str = "a") -> dict[str, Any]:
    return {
        "path": str(tmp / f"ledger-{name}.db"),
        "postgres_url": pg_url,
        "flush_interval_s": 0.05,
        "ship_interval_s": 0.1,
    }


async def send(run: Running, n: int, user: str, **headers: str) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            async with s.post(
                run.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": MSGS, "max_tokens": 5},
                headers={"X-Tollbooth-User": user, **headers},
            ) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


def cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


async def test_the_fleet_report_and_audit_read_postgresql_with_the_same_output(
    start_sidecar: StartSidecar, postgres: Any, tmp_path: Path
) -> None:
    url = postgres.database()
    led = fleet_ledger(tmp_path, url)
    run = await start_sidecar(
        {
            "pricing": PRICES,
            "ledger": led,
            "audit": {"sink": "ledger", "total_cost_usd": 0.005},  # every request is audited
        }
    )
    # a client repeating X-Request-Id still gets one row per request
    await send(run, 3, "ann", **{"X-Request-Id": "same"})
    await send(run, 2, "bob")
    await shipped(url, 5)
    await shipped(url, 5, "audit")
    for by in ("user", "model", "day"):
        assert chargeback(url, 0, by) == chargeback(led["path"], 0, by)
    for hour in (7, 23):  # budget days that start later than midnight UTC
        assert chargeback(url, 0, "day", hour) == chargeback(led["path"], 0, "day", hour)
    report = json.loads(cli("report", "--ledger", url, "--since", "1d", "--format", "json"))
    assert {r["user"]: r["requests"] for r in report} == {"ann": 3, "bob": 2}
    assert cli("audit", "--ledger", url, "--since", "1d") == cli(
        "audit", "--ledger", led["path"], "--since", "1d"
    )
    assert cli("audit", "--ledger", url, "--since", "1d").count("ann") == 3


async def test_postgresql_stopped_and_restarted_loses_no_row(
    start_sidecar: StartSidecar, postgres: Any, tmp_path: Path
) -> None:
    url = postgres.database()
    run = await start_sidecar({"pricing": PRICES, "ledger": fleet_ledger(tmp_path, url)})
    assert await send(run, 4, "ann") == [200] * 4
    await shipped(url, 4)
    postgres.stop()
    try:
        assert await send(run, 6, "ann") == [200] * 6  # traffic never waits for the database
        await wait_for(lambda: run.value("llm_ledger_unshipped_rows") == 6, "6 rows waiting")
        assert (run.value("llm_ledger_ship_errors_total") or 0) >= 1
    finally:
        postgres.start()
    await shipped(url, 10)
    await wait_for(lambda: run.value("llm_ledger_unshipped_rows") == 0, "the backlog measured")
    assert run.value("llm_ledger_shipped_rows_total", table="requests") == 10


def write_rows(path: Path, n: int, start_ts: float) -> None:
    conn = sqlite_ledger.connect(path)
    with conn:
        for i in range(n):
            conn.execute(
                sqlite_ledger.INSERT,
                (start_ts + i, f"r{i}", None, "m", "chat", "u", 1, 0, 1, 0.5, "200", 0)
                + (None,) * (len(sqlite_ledger.Row._fields) - 12),
            )
    conn.close()


def test_a_batch_sent_twice_counts_once_and_reused_row_ids_never_collide(
    postgres: Any, tmp_path: Path
) -> None:
    url = postgres.database()
    path = tmp_path / "outbox.db"
    # the shipping thread waits an hour: every shipment here is the test's own
    config = LedgerConfig(path=str(path), postgres_url=url, ship_interval_s=3600.0)
    write_rows(path, 3, time.time())
    shipper = Shipper(config, Metrics())
    shipper.open()
    assert shipper.ship() == 3
    assert count(url) == 3
    db = sqlite3.connect(path)
    shipped_columns = ", ".join(f'"{c}"' for c in shipper._columns["requests"])
    rows = db.execute(f"SELECT id, {shipped_columns} FROM requests").fetchall()
    source = db.execute("SELECT source FROM outbox WHERE tbl = 'requests'").fetchone()[0]
    shipper._send("requests", source, shipper._columns["requests"], rows)  # sent again
    assert count(url) == 3
    shipper.close()
    # retention emptied the table at the next start: SQLite hands out the same row ids again
    with db:
        db.execute("DELETE FROM requests")
    db.close()
    again = Shipper(config, Metrics())
    again.open()  # after the ledger's retention, before any new row
    write_rows(path, 2, time.time())
    assert again.ship() == 2
    again.close()
    assert count(url) == 5


async def test_an_outbox_that_cannot_be_opened_never_stops_traffic(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    # a directory is no SQLite file; nothing listens on the database's port
    led = {"path": str(tmp_path), "postgres_url": "postgresql://postgres@127.0.0.1:9/none"}
    run = await start_sidecar({"pricing": PRICES, "ledger": led})
    assert await send(run, 1, "ann") == [200]
    assert (run.value("llm_ledger_ship_errors_total") or 0) >= 1


def test_a_copied_or_restored_outbox_file_loses_no_row(postgres: Any, tmp_path: Path) -> None:
    url = postgres.database()
    a, b, backup = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "backup.db"
    renamed = 0.0

    def ship(path: Path) -> None:
        nonlocal renamed
        metrics = Metrics()
        shipper = Shipper(LedgerConfig(path=str(path), postgres_url=url), metrics)
        shipper.open()
        shipper.close()  # one last shipment
        for table in ("requests", "audit"):
            renamed += (
                metrics.registry.get_sample_value(
                    "llm_ledger_outbox_renamed_total", {"table": table}
                )
                or 0.0
            )

    t = time.time()
    write_rows(a, 2, t)
    ship(a)
    shutil.copy(a, b)  # a cloned volume: two sidecars, one outbox name
    write_rows(a, 3, t + 10)
    write_rows(b, 3, t + 20)
    ship(a)
    ship(b)  # its row numbers 3..5 are a's in PostgreSQL: renamed, shipped under the new name
    assert count(url) == 8 and renamed == 1
    shutil.copy(b, backup)
    write_rows(b, 2, t + 30)
    ship(b)
    shutil.copy(backup, b)  # restored from the older backup: rows 6 and 7 are taken
    write_rows(b, 2, t + 40)
    ship(b)
    assert count(url) == 12 and renamed == 2
