"""The ledger: rows equal completed requests, a bounded loss on a hard kill, spend survives
restarts, and a broken ledger file never breaks traffic. These run tollbooth as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.billing.ledger import INSERT as INSERT_ROWS
from sidecar.billing.ledger import Ledger, Row, connect
from sidecar.telemetry.metrics import Metrics
from tests.fakes import MODEL
from tests.procs import Tollbooth, start_tollbooth
from tests.waiting import wait_for, wait_for_sync

MSGS = [{"role": "user", "content": "one two three four five"}]
PRICES = {"models": {MODEL: {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}}
FLUSH = 0.25


def config(server: Any, db: Path, **extra: Any) -> dict[str, Any]:
    return {
        "upstream": {"url": str(server.make_url("")).rstrip("/")},
        "pricing": PRICES,
        "ledger": {"path": str(db), "flush_interval_s": FLUSH},
        "logging": {"access_log": "off"},
        **extra,
    }


def rows(db: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(
            "SELECT user, input_tokens, output_tokens, cost_usd, status FROM requests"
        ).fetchall()
    finally:
        conn.close()


def on_disk(db: Path) -> int:
    """Rows in the ledger file so far (0 before the writer created it)."""
    with contextlib.suppress(sqlite3.OperationalError):
        if db.is_file():
            return len(rows(db))
    return 0


async def load(url: str, seconds: float, users: int = 3) -> list[float]:
    """Closed-loop load for `seconds`; returns the completion time of each request."""
    done: list[float] = []
    stop_at = time.monotonic() + seconds
    async with aiohttp.ClientSession() as s:

        async def worker(i: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    async with s.post(
                        url + "/v1/chat/completions",
                        json={"model": MODEL, "messages": MSGS, "max_tokens": 2},
                        headers={"X-Tollbooth-User": f"user{i}"},
                    ) as r:
                        await r.read()
                        if r.status == 200:
                            done.append(time.monotonic())
                except aiohttp.ClientError:
                    return

        await asyncio.gather(*(worker(i) for i in range(users)))
    return done


async def test_sigterm_flushes_every_completed_request(upstream: Any, tmp_path: Path) -> None:
    _, server = upstream
    db = tmp_path / "ledger.db"
    tb = await start_tollbooth(tmp_path, config(server, db))
    done = await load(tb.url, 0.8)
    assert await tb.stop(signal.SIGTERM) == 0
    got = rows(db)
    assert len(got) == len(done) > 10
    assert {r[4] for r in got} == {"200"}
    assert all(r[1] == 5 and r[2] == 2 for r in got)


async def test_hard_kill_loses_at_most_the_flush_interval(upstream: Any, tmp_path: Path) -> None:
    _, server = upstream
    db = tmp_path / "ledger.db"
    tb = await start_tollbooth(tmp_path, config(server, db))
    task = asyncio.create_task(load(tb.url, 10.0))
    await wait_for(lambda: on_disk(db) > 10, "rows on disk")
    await asyncio.sleep(FLUSH + 0.3)  # a lower bound: those rows ended a flush interval before
    killed_at = time.monotonic()
    await tb.stop(signal.SIGKILL)
    done = await task
    kept = len(rows(db))
    # Every request that finished a flush interval (plus commit slack) before the kill is on disk.
    slack = 0.25
    must_have = sum(1 for t in done if t < killed_at - FLUSH - slack)
    assert must_have > 10
    assert must_have <= kept <= len(done)


async def test_restart_restores_todays_spend(upstream: Any, tmp_path: Path) -> None:
    _, server = upstream
    db = tmp_path / "ledger.db"
    tb = await start_tollbooth(tmp_path, config(server, db))
    await load(tb.url, 0.3, users=1)
    async with aiohttp.ClientSession() as s, s.get(tb.admin + "/metrics") as r:
        before = _spend(await r.text())
    await tb.stop(signal.SIGTERM)
    tb = await start_tollbooth(tmp_path, config(server, db))
    try:
        async with aiohttp.ClientSession() as s, s.get(tb.admin + "/metrics") as r:
            after = _spend(await r.text())
        assert before > 0
        assert after == pytest.approx(before)
    finally:
        await tb.stop(signal.SIGTERM)


def _spend(metrics_text: str) -> float:
    line = next(
        ln
        for ln in metrics_text.splitlines()
        if ln.startswith('llm_spend_today_usd{user_id="user0"}')
    )
    return float(line.split()[-1])


@pytest.mark.parametrize("breakage", ["corrupt", "locked"])
async def test_broken_ledger_does_not_break_traffic(
    upstream: Any, tmp_path: Path, breakage: str
) -> None:
    _, server = upstream
    db = tmp_path / "ledger.db"
    holder = None
    if breakage == "corrupt":
        db.write_bytes(b"this is not a database" * 100)
    else:
        holder = connect(db)
        holder.execute("BEGIN EXCLUSIVE")
    tb = await start_tollbooth(tmp_path, config(server, db), ready_path="/healthz")
    try:
        done = await load(tb.url, 0.5, users=1)
        assert len(done) > 5
        async with aiohttp.ClientSession() as s, s.get(tb.admin + "/metrics") as r:
            text = await r.text()
        errors = [ln for ln in text.splitlines() if ln.startswith("llm_ledger_errors_total{")]
        assert sum(float(ln.split()[-1]) for ln in errors) >= 1
        status, body = await readyz(tb)  # serving, but not ready: its rows cannot be kept
        assert status == 503 and body["checks"]["ledger"].startswith("unwritable")
        if holder is not None:  # the lock goes away: the rows written meanwhile arrive
            holder.rollback()
            holder.close()
            holder = None
            for _ in range(100):  # reconnect and flush
                await asyncio.sleep(0.1)
                if len(rows(db)) == len(done):
                    break
            assert len(rows(db)) == len(done)
            assert (await readyz(tb))[0] == 200
    finally:
        if holder is not None:
            holder.close()
        await tb.stop(signal.SIGTERM)


async def readyz(tb: Tollbooth) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(tb.admin + "/readyz") as r:
        return r.status, await r.json()


async def test_a_deleted_or_replaced_ledger_file_is_reopened(upstream: Any, tmp_path: Path) -> None:
    """Deleted or replaced while open, the file would swallow rows into an unlinked inode: the
    writer notices (before each write), opens the path again, counts it; if it cannot, /readyz
    says so until it can."""
    _, server = upstream
    db = tmp_path / "ledger.db"
    tb = await start_tollbooth(tmp_path, config(server, db))
    try:
        first = await load(tb.url, 0.3, users=1)
        await wait_for_rows(db, len(first))
        for suffix in ("", "-wal", "-shm"):  # what an operator's `rm ledger.db*` does
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        second = await load(tb.url, 0.3, users=1)
        await wait_for_rows(db, len(second))
        assert await metric(tb, "llm_ledger_reopens_total") == 1
        assert (await readyz(tb))[0] == 200

        archive = tmp_path / "archive.db"  # moved away, its -wal left behind by name
        db.rename(archive)
        third = await load(tb.url, 0.3, users=1)
        await wait_for_rows(db, len(third))  # a new file: the old WAL was not replayed into it
        assert len(rows(archive)) == len(second)  # and the moved file has all of its rows
        assert await metric(tb, "llm_ledger_reopens_total") == 2

        replacement = tmp_path / "other.db"  # replaced by another file: the rows go there
        connect(replacement).close()
        replacement.replace(db)
        fourth = await load(tb.url, 0.3, users=1)
        await wait_for_rows(db, len(fourth))
        assert await metric(tb, "llm_ledger_reopens_total") == 3

        db.unlink()
        db.mkdir()  # the path cannot be opened as a file: not ready, rows wait in memory
        fifth = await load(tb.url, 0.3, users=1)
        for _ in range(50):
            status, body = await readyz(tb)
            if status == 503:
                break
            await asyncio.sleep(0.1)
        assert status == 503 and body["checks"]["ledger"].startswith("unwritable")
        db.rmdir()
        await wait_for_rows(db, len(fifth))  # reopened: the waiting rows arrive
        assert (await readyz(tb))[0] == 200
    finally:
        await tb.stop(signal.SIGTERM)


async def wait_for_rows(db: Path, n: int) -> None:
    for _ in range(100):
        with contextlib.suppress(sqlite3.OperationalError):  # created, schema not there yet
            if db.is_file() and len(rows(db)) == n:
                return
        await asyncio.sleep(0.1)
    assert db.is_file() and len(rows(db)) == n


async def metric(tb: Tollbooth, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(tb.admin + "/metrics") as r:
        text = await r.text()
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[-1])


def test_writer_retries_rows_after_a_failure(tmp_path: Path) -> None:
    from sidecar.config import LedgerConfig

    metrics = Metrics()
    ledger = Ledger(LedgerConfig(path=str(tmp_path / "l.db"), flush_interval_s=0.05), metrics)
    ledger.open()
    calls = {"n": 0}
    real_write = ledger._write

    def flaky(batch: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise sqlite3.OperationalError("disk I/O error")
        real_write(batch)

    ledger._write = flaky  # type: ignore[method-assign]
    ledger.append_audit((time.time(), "r1", None, "m", "u", "test", "{}"))
    wait_for_sync(lambda: calls["n"] >= 2, "the batch written again after the failure")
    ledger.close()
    conn = sqlite3.connect(tmp_path / "l.db")
    assert conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 1
    assert metrics.registry.get_sample_value("llm_ledger_errors_total", {"stage": "write"}) == 1


def test_rows_are_made_in_the_writer_and_a_bad_one_loses_only_itself(tmp_path: Path) -> None:
    from sidecar.config import LedgerConfig

    metrics = Metrics()
    ledger = Ledger(LedgerConfig(path=str(tmp_path / "l.db"), flush_interval_s=0.05), metrics)
    ledger.open()

    def broken() -> tuple[Any, ...]:
        raise ValueError("no row")

    ledger.append_audit(broken)
    ledger.append_audit(lambda: (time.time(), "r2", None, "m", "u", "test", "{}"))
    ledger.close()
    conn = sqlite3.connect(tmp_path / "l.db")
    assert conn.execute("SELECT request_id FROM audit").fetchall() == [("r2",)]
    assert (
        metrics.registry.get_sample_value("tollbooth_metering_errors_total", {"stage": "ledger"})
        == 1
    )


@pytest.mark.parametrize("limit", [None, 96])  # SQLite's limit on variables per statement
def test_rows_go_in_many_per_statement_all_of_them_in_order(tmp_path: Path, limit: Any) -> None:
    from sidecar.billing.ledger import INSERT, ROWS_PER_STATEMENT

    conn = connect(tmp_path / "l.db")
    if limit is not None:
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)  # 4 rows of 24 columns
    sent = []
    PAD = (None,) * (len(Row._fields) - 18)  # columns added since (device, reasoning, chargeback)
    for n in (1, 5, sum(ROWS_PER_STATEMENT) + 300):
        rows = [(float(i), f"r{len(sent) + i}", None, "m", "/e", "u", i, None, 1, 0.5, "200", 1,
                 None, None, 0.1, None, None, None, *PAD) for i in range(n)]  # fmt: skip
        with conn:
            Ledger._insert(conn, INSERT, rows)
        sent += [r[1] for r in rows]
    got = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY id")]
    assert got == sent


def test_none_is_stored_as_null_and_every_other_value_as_it_was(tmp_path: Path) -> None:
    """Values bound as NULL through the None adapter (bind_none_directly) and as before: each
    column's stored type and value, row by row, read back."""
    conn = connect(tmp_path / "l.db")
    assert sqlite3.adapters[(type(None), sqlite3.PrepareProtocol)](None) is None
    n = len(Row._fields)
    rows = [
        (1.5, "r1", None, "m", "/e", "u", 3, None, 2**62, 1e-300, "200", 0, *(None,) * (n - 12)),
        (2.0, "r2", "t" * 32, "mé", "/e", "ü", 0, 7, None, None, "stream_error", 1,
         0.1, 0.25, 3.0000001, "x", "team", "end", 0.5, 10.0, 0.01, 4, 1.5, "p", "a,b", 0.02),
    ]  # fmt: skip
    with conn:
        Ledger._insert(conn, INSERT_ROWS, rows)
    cols = ", ".join(Row._fields)
    kinds = ", ".join(f"typeof({c})" for c in Row._fields)
    got = conn.execute(f"SELECT {cols}, {kinds} FROM requests ORDER BY id").fetchall()
    want_kind = {type(None): "null", int: "integer", float: "real", str: "text"}
    assert [g[:n] for g in got] == rows
    assert [list(g[n:]) for g in got] == [[want_kind[type(v)] for v in r] for r in rows]
