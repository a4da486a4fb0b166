"""Each request's device-seconds, energy and device cost in the ledger, and the migration of a
ledger written before those columns existed (sidecar/billing/ledger.py `_add_missing_columns`).

OLD_SCHEMA is the ledger's schema as of commit d835a64 (before this change), copied verbatim: a
file made with it, holding a row, is opened by today's writer. Guards: the columns are added,
the old row kept (its device columns NULL), and a new request's row carries its device-seconds
and device cost (one GPU of eight attributed: tests/test_gpu_engine_only.py).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartSidecar
from tests.fakes import MODEL, FakeNVML
from tests.test_reconcile import FakeVllm, chat
from tests.waiting import wait_for

OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    trace_id TEXT,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    user TEXT NOT NULL,
    input_tokens INTEGER,
    cached_input_tokens INTEGER,
    output_tokens INTEGER,
    cost_usd REAL,
    status TEXT NOT NULL,
    stream INTEGER NOT NULL,
    queue_s REAL,
    ttft_s REAL,
    duration_s REAL,
    error TEXT,
    team TEXT,
    end_user TEXT
);
CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    trace_id TEXT,
    model TEXT NOT NULL,
    user TEXT NOT NULL,
    reason TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_ts ON audit (ts);
"""


def old_ledger(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.executescript(OLD_SCHEMA)
        conn.execute(
            "INSERT INTO requests (ts, request_id, model, endpoint, user, input_tokens, "
            "output_tokens, cost_usd, status, stream) VALUES (?, 'old', 'm', '/e', 'u', 3, 4, "
            "0.5, '200', 0)",
            (time.time(),),  # today's: the retention would prune an older one
        )
    conn.close()


async def test_an_old_ledger_gets_the_device_columns_and_new_rows_fill_them(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    db = tmp_path / "ledger.db"
    old_ledger(db)
    listed = tmp_path / "engine-gpus"
    listed.write_text("GPU-0000-2")
    engine = await aiohttp_server(FakeVllm().app)
    run = await start_sidecar(
        {
            "ledger": {"path": str(db), "flush_interval_s": 0.02},
            "gpu": {"devices_file": str(listed), "poll_interval_s": 0.05},
            "pricing": {"gpu_hour_usd": 3.6},
            "reconcile": {"enabled": False},
        },
        upstream_url=str(engine.make_url("")).rstrip("/"),
        wire_kwargs={"nvml": FakeNVML(gpus=8)},
    )
    await chat(run.url, 3, 4)

    def rows() -> list[tuple[Any, ...]]:
        with sqlite3.connect(db) as conn:
            got = conn.execute(
                "SELECT request_id, device_seconds, energy_j, device_cost_usd FROM requests "
                "ORDER BY id"
            ).fetchall()
        conn.close()
        return got

    await wait_for(lambda: len(rows()) == 2, "the new request's row")
    old, new = rows()
    assert old == ("old", None, None, None)
    seconds = run.value("llm_device_seconds_total", model=MODEL, user_id="anonymous")
    assert new[1] is not None and new[1] > 0 and new[1] == pytest.approx(seconds)
    assert new[3] == pytest.approx(new[1] / 3600 * 3.6)


def test_the_fleet_ledger_ships_the_device_columns(postgres: Any, tmp_path: Path) -> None:
    """An outbox written by today's code (OLD_SCHEMA) and opened by this one ships its rows, and
    a row with device columns reaches PostgreSQL with them."""
    import psycopg

    from sidecar.billing import ledger as sqlite_ledger
    from sidecar.billing.fleet_ledger import Shipper
    from sidecar.config import LedgerConfig
    from sidecar.telemetry.metrics import Metrics

    db = tmp_path / "outbox.db"
    old_ledger(db)
    conn = sqlite_ledger.connect(db)
    with conn:
        conn.execute(
            sqlite_ledger.INSERT,
            (time.time(), "new", None, "m", "/e", "u", 1, 0, 1, 0.5, "200", 0)
            + (None,) * 6
            + (2.5, 700.0, 0.0025)
            + (None,) * (len(sqlite_ledger.Row._fields) - 21),  # later columns (reasoning)
        )
    conn.close()
    url = postgres.database()
    config = LedgerConfig(path=str(db), postgres_url=url, ship_interval_s=3600.0)  # ours only
    shipper = Shipper(config, Metrics())
    shipper.open()
    try:
        assert shipper.ship() == 2
        with psycopg.connect(url) as pg:
            got = pg.execute(
                "SELECT request_id, device_seconds, energy_j, device_cost_usd FROM requests "
                "ORDER BY request_id"
            ).fetchall()
        assert got == [("new", 2.5, 700.0, 0.0025), ("old", None, None, None)]
    finally:
        shipper.close()
