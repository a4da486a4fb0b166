"""The fleet's ledger in PostgreSQL, fed from each sidecar's SQLite ledger as an outbox.

Owns: the PostgreSQL schema (`requests` and `audit`, each row keyed by the outbox that wrote it
and its row number there, so a batch sent twice counts once), the shipper thread that copies new
outbox rows about once a second and records in the outbox how far it got (a PostgreSQL outage
loses nothing: rows wait in SQLite), retention by day, and the fleet's reads: today's spend that
seeds the shared budget store, and the rows `tollbooth report` and `tollbooth audit` show. A
batch PostgreSQL refuses for its data (a NUL, a constraint) is sent again row by row: a refused
row goes cleaned (`text.clean` on every text field), or, refused even then, into the outbox's
`quarantine` table; each counted in `llm_ledger_errors_total{stage}`, the other rows shipped.
Never: runs on the event loop, deletes an outbox row (the local ledger's retention does), prints
a connection string, stops shipping for one row, or lets its thread die.

Why psycopg 3 (with psycopg-pool) rather than asyncpg: shipping is a batch job in its own
thread and the reports are synchronous commands, and psycopg serves both (sync API, `COPY`
support); it speaks libpq, so every libpq setting works as operators expect (PGPASSWORD,
PGPASSFILE, service files, sslmode); and it ships type hints. asyncpg is async-only and has none of
libpq's configuration, for speed that a once-a-second batch does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import psycopg
from aiohttp import web
from psycopg_pool import ConnectionPool, PoolTimeout

from ..config import LedgerConfig
from ..exchange import CleanupContext
from ..telemetry.metrics import Metrics
from . import ledger
from .budget import SpendRow

log = logging.getLogger("tollbooth.ledger")

DAY = 86400
PG_TIMEOUT_S = 5.0  # connect, and each statement
POOL_WAIT_S = 1.0  # wait for a pooled connection: a database that is down fails the shipment fast
PRUNE_EVERY_S = 3600.0
LOG_EVERY_S = 60.0  # a long outage logs once a minute, not once a second

# PostgreSQL's type for each of the SQLite ledger's column types; `stream` (0 or 1) is a SMALLINT.
PG_TYPES = {"REAL": "DOUBLE PRECISION", "INTEGER": "BIGINT", "TEXT": "TEXT"}


def pg_columns(table: str) -> dict[str, str]:
    """The PostgreSQL type of each column of the ledger's `table` (ledger.SCHEMA) but its row id:
    the columns shipped (of an outbox written before some of them, those it has)."""
    columns = {}
    for name, kind, not_null in ledger.schema_columns(table):
        pg = "SMALLINT" if name == "stream" else PG_TYPES[kind]
        columns[name] = f"{pg} NOT NULL" if not_null else pg
    return columns


REQUEST_COLUMNS = pg_columns("requests")
AUDIT_COLUMNS = pg_columns("audit")
TABLES = {"requests": REQUEST_COLUMNS, "audit": AUDIT_COLUMNS}
# Report and audit read `ts >= since ORDER BY ts`; the reseed sums cost by user and team over
# today's rows (an index-only scan with the INCLUDE columns).
INDEXES = (
    'CREATE INDEX IF NOT EXISTS requests_ts ON requests (ts) INCLUDE ("user", team, cost_usd)',
    "CREATE INDEX IF NOT EXISTS requests_request_id ON requests (request_id)",
    "CREATE INDEX IF NOT EXISTS audit_ts ON audit (ts)",
)
SCHEMA_LOCK = 0x70_11_B0_07  # advisory lock: sidecars starting together create the schema once

OUTBOX = """
CREATE TABLE IF NOT EXISTS outbox (
    tbl TEXT PRIMARY KEY,        -- a ledger table shipped to PostgreSQL
    source TEXT NOT NULL,        -- this outbox's name there (with the row id: the primary key)
    last_id INTEGER NOT NULL     -- every row with id <= last_id is in PostgreSQL (or quarantined)
);
CREATE TABLE IF NOT EXISTS quarantine (
    tbl TEXT NOT NULL,           -- rows PostgreSQL refused even cleaned: still in the local table
    id INTEGER NOT NULL,
    ts REAL NOT NULL,            -- when
    error TEXT NOT NULL,
    PRIMARY KEY (tbl, id)
);
"""


def conninfo(url: str) -> str:
    """The URL with its scheme in lower case: libpq takes `PostgreSQL://` for a key=value string
    and would print it whole in its error."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in ("postgresql", "postgres"):
        return f"{scheme.lower()}{sep}{rest}"
    return url


def refused_row(exc: BaseException) -> bool:
    """Whether PostgreSQL or the driver refused the data (a NUL in text, a value out of range, a
    constraint), which a row by row retry isolates; a connection, a timeout or the schema fail
    every row alike and make the batch wait."""
    return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError, *ledger.VALUE_ERRORS))


class Clash(Exception):
    """Rows of this outbox met other rows under the same (source, seq) in PostgreSQL: the
    outbox file was copied to another sidecar or restored from an older backup."""

    def __init__(self, seq: int) -> None:
        super().__init__(f"outbox row {seq} is another row in PostgreSQL")
        self.seq = seq


def q(name: str) -> str:
    return f'"{name}"'


def create_schema(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        for table, columns in TABLES.items():
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {table} (source TEXT NOT NULL, seq BIGINT NOT NULL, "
                + ", ".join(f"{q(c)} {t}" for c, t in columns.items())
                + ", PRIMARY KEY (source, seq))"
            )
            for c, t in columns.items():  # a table made by an older version gets new columns
                kind = t.replace(" NOT NULL", "")
                conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {q(c)} {kind}")
        for sql in INDEXES:
            conn.execute(sql)


class Shipper:
    """Copies new outbox rows to PostgreSQL from its own thread."""

    def __init__(
        self,
        config: LedgerConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert config.path and config.postgres_url
        self.config, self.metrics, self.clock = config, metrics, clock
        self.pool = ConnectionPool(
            conninfo(config.postgres_url),
            min_size=1,
            max_size=2,
            open=False,
            timeout=POOL_WAIT_S,
            name="tollbooth-ledger",
            check=ConnectionPool.check_connection,
            kwargs={
                "connect_timeout": int(PG_TIMEOUT_S),
                "application_name": "tollbooth",
                "options": f"-c statement_timeout={int(PG_TIMEOUT_S * 1000)}",
            },
        )
        self.lock = threading.Lock()  # held while shipping; the reseed's read takes it too
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._db: sqlite3.Connection | None = None
        self._inode = 0
        self._schema = False
        self._columns: dict[str, list[str]] = {}
        self._verified: set[tuple[str, str]] = set()  # (table, source) checked against PostgreSQL
        self._pruned_at = -PRUNE_EVERY_S
        self._logged_at = -LOG_EVERY_S
        # Why shipping is stuck for a reason of its own (not PostgreSQL being away, which
        # llm_ledger_ship_errors_total shows while rows wait safely in SQLite): for /readyz.
        self.problem: str | None = None

    # --- lifecycle

    def open(self) -> None:
        """Blocking (call in a thread), after the local ledger opened and applied retention and
        before the first request: rows already in the outbox are all it will ever hold below
        the next row id."""
        self.pool.open(wait=False)
        with self.lock:
            try:
                self._connect_outbox(fresh_start=True)
            except (sqlite3.Error, OSError) as exc:  # the thread tries again; traffic goes on
                log.error("ledger outbox cannot be opened (will retry): %s", exc)
                self.metrics.ledger_ship_errors.inc()
        self._thread = threading.Thread(target=self._run, name="tollbooth-shipper", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """After the local ledger has written its last rows: one last shipment, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.ship()
        self.pool.close(timeout=PG_TIMEOUT_S)
        if self._db is not None:
            self._db.close()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.config.ship_interval_s):
                self.ship()
        finally:  # ship() catches everything; but a thread that ends is never silent
            if not self._stop.is_set():
                self.problem = "the shipper thread stopped"

    # --- the outbox (SQLite)

    def _connect_outbox(self, *, fresh_start: bool = False) -> sqlite3.Connection:
        path = self.config.path
        assert path is not None
        inode = os.stat(path).st_ino if os.path.exists(path) else 0
        if self._db is not None and inode == self._inode:
            return self._db
        if self._db is not None:  # the file was replaced: a new outbox, shipped from its start
            self._db.close()
        db = ledger.connect(path)
        db.executescript(OUTBOX)
        self._db, self._inode = db, os.stat(path).st_ino
        self._columns = {t: self._shared_columns(db, t, cols) for t, cols in TABLES.items()}
        for table in TABLES:
            self._check_row_ids(db, table, fresh_start)
        return db

    @staticmethod
    def _shared_columns(db: sqlite3.Connection, table: str, known: Iterable[str]) -> list[str]:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        return [c for c in known if c in have]

    def _check_row_ids(self, db: sqlite3.Connection, table: str, fresh_start: bool) -> None:
        """SQLite reuses row ids once the newest rows are deleted (retention emptied the table):
        rows written after that get a new source name, so they never collide with shipped ones.
        At start nothing new was written yet, so what remains was shipped; later, every row is
        shipped again under the new name (retention only empties a table of rows that old)."""
        _, last = self._mark(db, table)
        (top,) = db.execute(f"SELECT COALESCE(MAX(id), 0) FROM {table}").fetchone()
        if last > top:
            with db:
                db.execute(
                    "UPDATE outbox SET source = ?, last_id = ? WHERE tbl = ?",
                    (uuid.uuid4().hex, top if fresh_start else 0, table),
                )

    @staticmethod
    def _mark(db: sqlite3.Connection, table: str) -> tuple[str, int]:
        row = db.execute("SELECT source, last_id FROM outbox WHERE tbl = ?", (table,)).fetchone()
        if row is not None:
            return str(row[0]), int(row[1])
        with db:
            db.execute(
                "INSERT OR IGNORE INTO outbox (tbl, source, last_id) VALUES (?, ?, 0)",
                (table, uuid.uuid4().hex),
            )
        return Shipper._mark(db, table)

    # --- shipping

    def ship(self) -> int:
        """Ship everything new; returns the rows sent. Errors are logged, counted and retried
        on the next call."""
        with self.lock:
            try:
                db = self._connect_outbox()
                for table in TABLES:
                    self._check_row_ids(db, table, fresh_start=False)
                sent = sum(self._ship_table(db, table) for table in TABLES)
                self._prune()
            except (psycopg.Error, PoolTimeout, sqlite3.Error, OSError) as exc:
                self.metrics.ledger_ship_errors.inc()
                if time.monotonic() - self._logged_at >= LOG_EVERY_S:
                    self._logged_at = time.monotonic()
                    log.error("ledger rows not shipped to PostgreSQL (will retry): %s", exc)
                sent = 0
            except Exception as exc:  # a bug: counted, not ready, tried again; the thread lives
                log.exception("ledger shipping failed (will retry)")
                self.metrics.ledger_ship_errors.inc()
                self.metrics.ledger_errors.labels("ship").inc()
                self.problem = f"shipping failed: {exc!r}"[:300]
                sent = 0
            else:
                self.problem = None
            self._measure_backlog()
            return sent

    def _ship_table(self, db: sqlite3.Connection, table: str) -> int:
        sent = 0
        while True:
            source, last = self._mark(db, table)
            cols = self._columns[table]
            rows = db.execute(
                f"SELECT id, {', '.join(q(c) for c in cols)} FROM {table} WHERE id > ? "
                "ORDER BY id LIMIT ?",
                (last, self.config.ship_batch_rows),
            ).fetchall()
            if (table, source) not in self._verified:
                self._verify(db, table, source, last)
                continue
            if not rows:
                return sent
            try:
                self._send(table, source, cols, rows)
            except Clash as clash:  # rows before the clash are ours; the rest go under a new name
                rows = [r for r in rows if r[0] < clash.seq]
                if rows:
                    self._send(table, source, cols, rows)
                self._rename(db, table, clash.seq - 1)
                if not rows:
                    continue
            except Exception as exc:
                if not refused_row(exc):
                    raise
                rows = self._send_each(db, table, source, cols, rows)
                if not rows:
                    continue
            with db:  # only after PostgreSQL committed: a crash in between sends the batch again
                db.execute("UPDATE outbox SET last_id = ? WHERE tbl = ?", (rows[-1][0], table))
            self.metrics.ledger_shipped.labels(table).inc(len(rows))
            sent += len(rows)
            if len(rows) < self.config.ship_batch_rows:
                return sent

    def _send_each(
        self, db: sqlite3.Connection, table: str, source: str, cols: list[str], rows: list[Any]
    ) -> list[Any]:
        """The batch one row at a time, a refused row cleaned; returns the rows done (sent, or
        quarantined), up to a clash (then renamed, as in `_ship_table`). Rare: only after
        PostgreSQL refused a batch."""

        def send(row: tuple[Any, ...]) -> None:
            self._send(table, source, cols, [row])

        done: list[Any] = []
        for row in rows:
            try:
                refused, refused_cleaned = ledger.write_or_clean(send, row, refused_row)
            except Clash as clash:
                self._rename(db, table, clash.seq - 1)
                return done
            if refused_cleaned is not None:
                self._quarantine(db, table, row, refused_cleaned)
            elif refused is not None:
                why = "PostgreSQL refused outbox row %s/%d (%r): shipped cleaned"
                log.error(why, table, row[0], refused)
                self.metrics.ledger_errors.labels("ship_row").inc()
            done.append(row)
        return done

    def _quarantine(self, db: sqlite3.Connection, table: str, row: Any, exc: Exception) -> None:
        """A row PostgreSQL refuses even cleaned: noted in the outbox, passed over, counted."""
        with db:
            db.execute(
                "INSERT OR REPLACE INTO quarantine (tbl, id, ts, error) VALUES (?, ?, ?, ?)",
                (table, row[0], time.time(), repr(exc)[:1000]),
            )
        self.metrics.ledger_errors.labels("ship_kept").inc()
        log.error(
            "PostgreSQL refused outbox row %s/%d even cleaned (%r): quarantined", table, row[0], exc
        )

    def _rename(self, db: sqlite3.Connection, table: str, last_id: int) -> None:
        with db:
            db.execute(
                "UPDATE outbox SET source = ?, last_id = ? WHERE tbl = ?",
                (uuid.uuid4().hex, last_id, table),
            )
        self.metrics.ledger_renamed.labels(table).inc()
        log.warning(
            "ledger outbox '%s' shares row numbers with another in PostgreSQL (a copied or "
            "restored ledger file): rows after %d are shipped under a new name",
            table,
            last_id,
        )

    def _verify(self, db: sqlite3.Connection, table: str, source: str, last: int) -> None:
        """Once per outbox name: rows PostgreSQL has under it beyond `last` must be this outbox's
        own (a crash between PostgreSQL's commit and the outbox's update); other rows there mean
        the file was restored from an older backup or copied, and it gets a new name."""
        sql = (
            f"SELECT seq, request_id, ts FROM {table} WHERE source = %s AND seq > %s "
            "ORDER BY seq LIMIT %s"
        )
        with self._postgres() as conn:
            theirs = conn.execute(sql, (source, last, self.config.ship_batch_rows)).fetchall()
        for seq, request_id, ts in theirs:
            row = db.execute(f"SELECT request_id, ts FROM {table} WHERE id = ?", (seq,)).fetchone()
            if row is None or (request_id, ts) not in (row, ledger.cleaned(row)):  # sent cleaned
                self._rename(db, table, last)
                return
        self._verified.add((table, source))

    def _send(self, table: str, source: str, cols: list[str], rows: list[Any]) -> None:
        names = ", ".join(["source", "seq", *(q(c) for c in cols)])
        with self._postgres() as conn, conn.cursor() as cur:
            cur.execute(
                f"CREATE TEMP TABLE IF NOT EXISTS incoming_{table} (LIKE {table}) "
                "ON COMMIT DELETE ROWS"
            )
            with cur.copy(f"COPY incoming_{table} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row((source, *row))
            cur.execute(
                f"INSERT INTO {table} ({names}) SELECT {names} FROM incoming_{table} "
                "ON CONFLICT DO NOTHING"
            )
            if cur.rowcount < len(rows):  # a batch sent again, or another outbox's rows
                cur.execute(
                    f"SELECT MIN(i.seq) FROM incoming_{table} i JOIN {table} t "
                    "ON t.source = i.source AND t.seq = i.seq "
                    "WHERE t.request_id <> i.request_id OR t.ts <> i.ts"
                )
                (clash,) = cur.fetchone() or (None,)
                if clash is not None:
                    raise Clash(int(clash))  # nothing of this batch is committed

    @contextlib.contextmanager
    def _postgres(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection, the schema created on the first."""
        with self.pool.connection(timeout=POOL_WAIT_S) as conn:
            if not self._schema:
                create_schema(conn)
                self._schema = True
            yield conn

    def _prune(self) -> None:
        """Retention by day: whole UTC days older than `retention_days` go, at most hourly."""
        if time.monotonic() - self._pruned_at < PRUNE_EVERY_S or not self._schema:
            return
        cutoff = (self.clock() // DAY - self.config.retention_days) * DAY
        with self._postgres() as conn:  # the schema exists
            for table in TABLES:
                conn.execute(f"DELETE FROM {table} WHERE ts < %s", (cutoff,))
        self._pruned_at = time.monotonic()

    def _measure_backlog(self) -> None:
        if self._db is None:
            return
        try:
            _, last = self._mark(self._db, "requests")
            sql = "SELECT COUNT(*) FROM requests WHERE id > ?"
            (n,) = self._db.execute(sql, (last,)).fetchone()
            (kept,) = self._db.execute("SELECT COUNT(*) FROM quarantine").fetchone()
        except sqlite3.Error:
            return
        self.metrics.ledger_unshipped.set(n)
        self.metrics.ledger_set_aside.labels("quarantine").set(kept)

    # --- reads for the budget store

    def spend_rows(self, day: float, month: float) -> tuple[list[SpendRow], float]:
        """The fleet's spend since the budget month's start by every scope kind (ledger.
        spend_rows), and when it was read: PostgreSQL plus this sidecar's rows not shipped yet,
        read with shipping paused. Blocking: call in a thread."""
        with self.lock:
            read_at = self.clock()
            with self._postgres() as conn:
                sql = ledger.SPEND_ROWS.format(p="%s", more="")
                rows = conn.execute(sql, (day, month)).fetchall()
            db = self._connect_outbox()
            _, last = self._mark(db, "requests")
            sql = ledger.SPEND_ROWS.format(p="?", more="AND id > ?")
            rows += db.execute(sql, (day, month, last)).fetchall()
        return [ledger.spend_row(r) for r in rows], read_at


def local_spend_rows(path: str, day: float, month: float) -> list[SpendRow]:
    """One sidecar's spend this month from its own SQLite ledger, on a connection of its own."""
    uri = f"file:{path}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=PG_TIMEOUT_S)) as conn:
        return ledger.spend_rows(conn, day, month)


def shipper_contexts(shipper: Shipper) -> tuple[CleanupContext, CleanupContext]:
    """Two cleanup contexts around the local ledger's: `outer` (before it) ships what the ledger
    wrote last after the ledger closed; `inner` (after it) starts shipping once the ledger is
    open and its retention applied."""

    async def outer(app: web.Application) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(shipper.close)

    async def inner(app: web.Application) -> AsyncIterator[None]:
        await asyncio.to_thread(shipper.open)
        yield

    return outer, inner


# --- reads for `tollbooth report` and `tollbooth audit` -------------------------------------------


def _read(url: str, sql: str, params: tuple[Any, ...]) -> list[Any]:
    try:
        with psycopg.connect(conninfo(url), connect_timeout=int(PG_TIMEOUT_S)) as conn:
            return conn.execute(sql, params).fetchall()
    except psycopg.Error as exc:  # the message never carries the connection string
        raise ValueError(f"the PostgreSQL ledger cannot be read: {exc}") from None


def request_rows(url: str, columns: Iterable[str], since: float, until: float) -> list[Any]:
    """Chargeback: the `columns` of each request in [since, until)."""
    cols = ", ".join(q(c) for c in columns)
    end = until if math.isfinite(until) else 1e300
    sql = f"SELECT {cols} FROM requests WHERE ts >= %s AND ts < %s ORDER BY ts"
    return _read(url, sql, (since, end))


def audit_records(url: str, since: float) -> list[str]:
    rows = _read(url, "SELECT record FROM audit WHERE ts >= %s ORDER BY ts", (since,))
    return [str(r[0]) for r in rows]
