"""No writer thread dies from one row: the SQLite ledger, the PostgreSQL shipper, the access log
and the audit writer write a refused row cleaned or keep it aside (counted), go on with the
others, and a writer that cannot write makes /readyz not ready."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from sidecar.billing import ledger as sqlite_ledger
from sidecar.billing.fleet_ledger import Shipper
from sidecar.billing.ledger import INSERT, Ledger, Row
from sidecar.config import LedgerConfig
from sidecar.telemetry.logs import BatchWriter, json_line
from sidecar.telemetry.metrics import Metrics
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL

MSGS = [{"role": "user", "content": "one two three"}]


def audit_row(rid: str, model: str = "m", user: str = "u") -> tuple[Any, ...]:
    return (time.time(), rid, None, model, user, "test", "{}")


def request_row(rid: str, model: str = "m", tokens: int | None = 1, stream: int = 0) -> Row:
    t = time.time()
    return Row(t, rid, None, model, "/v1/chat/completions", "u", tokens, None, 1, 0.1, "200",
               stream, None, None, 0.1, None, None, None, None, None, None, None)  # fmt: skip


def stage(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value("llm_ledger_errors_total", {"stage": name}) or 0.0


def until(check: Callable[[], bool], what: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(what)


def opened(tmp_path: Path) -> tuple[Ledger, Metrics]:
    metrics = Metrics()
    cfg = LedgerConfig(path=str(tmp_path / "l.db"), flush_interval_s=0.02)
    led = Ledger(cfg, metrics)
    led.open()
    return led, metrics


def count(db: Path, table: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
    finally:
        conn.close()


# --- the SQLite ledger ---------------------------------------------------------------------------


def test_rows_the_driver_refuses_are_written_cleaned_and_the_writer_goes_on(
    tmp_path: Path,
) -> None:
    """Issue 21 #3, from inside: rows that skipped the boundary (a surrogate, a NUL, a count past
    64 bits). Before, the UnicodeEncodeError killed the thread and no later row was written."""
    led, metrics = opened(tmp_path)
    try:
        led.append_audit(audit_row("r1", model="\ud800", user="a\x00b"))
        led._put(INSERT, request_row("r2", model="x\udfff", tokens=10**30))
        until(lambda: stage(metrics, "row") == 2, "the refused rows were not written cleaned")
        led.append_audit(audit_row("r3"))  # a later flush: the thread is alive
        until(lambda: count(tmp_path / "l.db", "audit") == 2, "later rows were not written")
        assert led.problem is None and led._thread is not None and led._thread.is_alive()
    finally:
        led.close()
    conn = sqlite3.connect(tmp_path / "l.db")
    audit = conn.execute("SELECT request_id, model, user FROM audit ORDER BY id").fetchall()
    assert audit == [("r1", "\ufffd", "a\ufffdb"), ("r3", "m", "u")]
    req = conn.execute("SELECT model, input_tokens, output_tokens FROM requests").fetchall()
    assert req == [("x\ufffd", None, 1)]  # a count past 64 bits is not measured, not a wrap


def test_a_row_refused_even_cleaned_is_kept_aside_and_the_batch_is_written(
    tmp_path: Path,
) -> None:
    """Before, a constraint error was retried with its whole batch forever: nothing written."""
    led, metrics = opened(tmp_path)
    try:
        led.append_audit(audit_row("good1"))
        led.append_audit((time.time(), "bad", None, None, "u", "test", "{}"))  # model NOT NULL
        led.append_audit(audit_row("good2"))
        until(lambda: count(tmp_path / "l.db", "audit") == 2, "the good rows were not written")
        assert stage(metrics, "kept") == 1 and led.problem is None
        assert [k[1][1] for k in led.kept] == ["bad"]
        set_aside = {"where": "memory"}
        assert metrics.registry.get_sample_value("llm_ledger_rows_set_aside", set_aside) == 1
    finally:
        led.close()


def test_a_writer_failing_on_anything_is_not_ready_counted_and_writes_again(
    tmp_path: Path,
) -> None:
    """Any exception, not only sqlite3.Error: before, a RuntimeError ended the thread."""
    led, metrics = opened(tmp_path)
    broken = {"on": True}
    real = led._reopen_if_replaced

    def reopen() -> None:
        if broken["on"]:
            raise RuntimeError("a bug")
        real()

    led._reopen_if_replaced = reopen  # type: ignore[method-assign]
    try:
        led.append_audit(audit_row("r1"))
        until(lambda: led.problem is not None, "the failing writer stayed ready")
        until(lambda: stage(metrics, "write") >= 2, "the writer did not try again")
        assert "RuntimeError" in (led.problem or "")
        broken["on"] = False
        until(lambda: count(tmp_path / "l.db", "audit") == 1, "the waiting row was not written")
        until(lambda: led.problem is None, "the writer stayed not ready")
    finally:
        led.close()


def test_a_failure_not_about_a_row_retries_the_batch_and_keeps_nothing_aside(
    tmp_path: Path,
) -> None:
    """Row by row is for rows the database refuses; anything else (here a RuntimeError inside the
    write) fails every row alike: the batch waits whole, nothing is cleaned or kept aside."""
    led, metrics = opened(tmp_path)
    real, calls = Ledger._insert, {"n": 0}

    def insert(conn: sqlite3.Connection, sql: str, rows: list[tuple[Any, ...]]) -> None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("not about a row")
        real(conn, sql, rows)

    led._insert = insert  # type: ignore[method-assign]
    try:
        led.append_audit(audit_row("r1"))
        led.append_audit(audit_row("r2"))
        until(lambda: count(tmp_path / "l.db", "audit") == 2, "the batch was not written")
        assert stage(metrics, "write") == 2
        assert stage(metrics, "row") == stage(metrics, "kept") == 0 and not led.kept
    finally:
        led.close()


async def readyz(run: Running) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(run.admin_url + "/readyz") as r:
        return r.status, await r.json()


async def wait_ready(run: Running, status: int) -> dict[str, Any]:
    for _ in range(200):
        got, body = await readyz(run)
        if got == status:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"/readyz never answered {status}: {body}")


async def test_the_running_sidecar_is_not_ready_while_its_ledger_cannot_write(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    db = tmp_path / "ledger.db"
    run = await start_sidecar(
        {"ledger": {"path": str(db), "flush_interval_s": 0.05}, "logging": {"access_log": "off"}}
    )
    await wait_ready(run, 200)
    led = run.sc.ledger
    real, broken = led._reopen_if_replaced, {"on": True}

    def reopen() -> None:
        if broken["on"]:
            raise MemoryError("no memory for this batch")
        real()

    led._reopen_if_replaced = reopen
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 1}
        async with s.post(run.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200  # traffic goes on
    checks = (await wait_ready(run, 503))["checks"]
    assert checks["ledger"].startswith("unwritable: write failed: MemoryError")
    assert (run.value("llm_ledger_errors_total", stage="write") or 0) >= 1
    broken["on"] = False
    await wait_ready(run, 200)
    assert count(db, "requests") == 1


# --- the access log and the audit writer ---------------------------------------------------------


def test_a_line_the_file_refuses_is_written_cleaned_and_the_batch_goes_on(tmp_path: Path) -> None:
    """Before, one unencodable line lost the whole batch of lines with it."""
    path = tmp_path / "access.log"
    errors = {"n": 0}
    with open(path, "a", encoding="utf-8") as f:

        def write(lines: Any) -> None:
            f.write("\n".join(lines) + "\n")
            f.flush()

        writer: BatchWriter[str] = BatchWriter(
            "t", str, write, on_error=lambda: errors.update(n=errors["n"] + 1)
        )
        for line in ("good1", "bad \ud800", "good2"):
            writer.put(line)
        writer.drain()
        assert writer.problem is None
    assert path.read_text(encoding="utf-8").splitlines() == ["good1", "bad \ufffd", "good2"]
    assert errors["n"] == 0


def test_a_json_line_with_a_lone_surrogate_is_written_cleaned() -> None:
    """The access log's and the audit record's encoder (orjson refuses surrogates): before, the
    record was lost (an audit record with captured prompt text, for one)."""
    line = json_line({"model": "m\ud800", "text": {"prompt": "hi\udfff"}, "n": 1})
    assert line == '{"model":"m\ufffd","text":{"prompt":"hi\ufffd"},"n":1}'


def test_a_writer_that_cannot_write_reports_it_and_counts_the_lines() -> None:
    errors = {"n": 0}

    def write(lines: Any) -> None:
        raise OSError(28, "No space left on device")

    writer: BatchWriter[str] = BatchWriter(
        "t", str, write, on_error=lambda: errors.update(n=errors["n"] + 1)
    )
    writer.put("a")
    writer.put("b")
    writer.drain()
    assert errors["n"] == 2 and "No space left" in (writer.problem or "")


async def test_the_running_sidecar_is_not_ready_while_its_access_log_cannot_write(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar({"logging": {"access_log": str(tmp_path / "access.log")}})
    await wait_ready(run, 200)
    run.sc.access_log._file.close()  # every write now raises
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 1}
        async with s.post(run.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    checks = (await wait_ready(run, 503))["checks"]
    assert checks["access_log"].startswith("unwritable: write failed")
    assert (run.value("tollbooth_access_log_errors_total") or 0) >= 1


# --- the PostgreSQL shipper ----------------------------------------------------------------------


def outbox(tmp_path: Path, rows: list[Row]) -> Path:
    path = tmp_path / "outbox.db"
    conn = sqlite_ledger.connect(path)
    with conn:
        for row in rows:
            conn.execute(INSERT, row)
    conn.close()
    return path


def pg_rows(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        try:
            sql = "SELECT request_id, model, stream FROM requests ORDER BY seq"
            return conn.execute(sql).fetchall()
        except psycopg.errors.UndefinedTable:  # nothing shipped yet
            return []


def test_a_nul_in_model_is_shipped_cleaned_and_shipping_goes_on(
    postgres: Any, tmp_path: Path
) -> None:
    """Issue 21 #4: PostgreSQL refuses "a\\u0000b" (an outbox written before the boundary
    cleaned it); before, that outbox never shipped again."""
    url = postgres.database()
    path = outbox(
        tmp_path, [request_row("r1"), request_row("r2", model="a\x00b"), request_row("r3")]
    )
    metrics = Metrics()
    shipper = Shipper(LedgerConfig(path=str(path), postgres_url=url), metrics)
    shipper.open()
    try:
        shipper.ship()  # now, or the thread's next shipment
        until(lambda: len(pg_rows(url)) == 3, "rows after the NUL were not shipped")
        assert [r[:2] for r in pg_rows(url)] == [("r1", "m"), ("r2", "a\ufffdb"), ("r3", "m")]
        assert stage(metrics, "ship_row") == 1 and shipper.problem is None
        conn = sqlite_ledger.connect(path)
        with conn:
            conn.execute(INSERT, request_row("r4"))
        conn.close()
        until(lambda: len(pg_rows(url)) == 4, "a later row was not shipped")
    finally:
        shipper.close()


def test_a_row_postgres_refuses_even_cleaned_is_quarantined(postgres: Any, tmp_path: Path) -> None:
    """`stream` is a SMALLINT there: 70000 is out of its range, cleaned or not."""
    url = postgres.database()
    path = outbox(
        tmp_path, [request_row("r1"), request_row("bad", stream=70000), request_row("r3")]
    )
    metrics = Metrics()
    shipper = Shipper(LedgerConfig(path=str(path), postgres_url=url), metrics)
    shipper.open()
    try:
        until(lambda: len(pg_rows(url)) == 2, "the rows around the refused one were not shipped")
        assert [r[0] for r in pg_rows(url)] == ["r1", "r3"]
        until(lambda: stage(metrics, "ship_kept") == 1, "the refused row was not counted")
        conn = sqlite3.connect(path)
        kept = conn.execute("SELECT tbl, id, error FROM quarantine").fetchall()
        conn.close()
        assert [(t, i) for t, i, _ in kept] == [("requests", 2)] and "smallint" in kept[0][2]
        set_aside = {"where": "quarantine"}
        until(
            lambda: metrics.registry.get_sample_value("llm_ledger_rows_set_aside", set_aside) == 1,
            "the quarantined row is not in llm_ledger_rows_set_aside",
        )
    finally:
        shipper.close()


async def test_the_writer_failing_gauge_follows_the_writers(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    run = await start_sidecar(
        {"ledger": {"path": str(tmp_path / "l.db"), "flush_interval_s": 0.05}}
    )
    await wait_ready(run, 200)
    assert run.value("tollbooth_writer_failing", writer="ledger") == 0
    run.sc.ledger.problem = "write failed: disk I/O error"
    assert run.value("tollbooth_writer_failing", writer="ledger") == 1
