"""The usage ledger: one SQLite row per request, written off the event loop in batches.

Owns: the schema, a writer thread that makes the rows and commits them every `flush_interval_s`
(so a hard kill loses at most that much), retrying rows after a failed write, reopening the file
when it was deleted or replaced under it (checked before each write), retention, and the reads
that restore today's spend and feed `tollbooth report`. A row SQLite or the driver refuses (an
unencodable string, an integer past 64 bits) is found by writing the batch row by row, and written
cleaned (`text.clean` on every text field), or kept aside when even that fails: each counted in
`llm_ledger_errors_total{stage}`, the other rows written.
Never: blocks the event loop (a request only appends a reference to an in-memory queue), fails a
request, or lets its writer thread die (any exception is caught, counted and retried, and
`problem` says why rows cannot be written, for /readyz).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeAlias, cast

from aiohttp import web

from ..config import LedgerConfig
from ..exchange import CleanupContext, Exchange, billed_model, consumed
from ..telemetry.metrics import Metrics
from ..text import clean
from .budget import SpendRow

log = logging.getLogger("tollbooth.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,                 -- request start, unix seconds (UTC)
    request_id TEXT NOT NULL,
    trace_id TEXT,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    user TEXT NOT NULL,
    input_tokens INTEGER,             -- NULL: not measured
    cached_input_tokens INTEGER,
    output_tokens INTEGER,
    cost_usd REAL,                    -- NULL: unknown (never a made-up 0)
    status TEXT NOT NULL,
    stream INTEGER NOT NULL,
    queue_s REAL,
    ttft_s REAL,
    duration_s REAL,
    error TEXT,
    team TEXT,                        -- the billed principal's team (keys file)
    end_user TEXT,                    -- the body's `user`: recorded, not billed when keys verify
    device_seconds REAL,              -- the engine's GPUs' time attributed (NULL: no telemetry)
    energy_j REAL,                    -- NULL unless final when the row was written (docs)
    device_cost_usd REAL,             -- device_seconds at pricing.gpu_hour_usd
    reasoning_tokens INTEGER,         -- a part of output_tokens, never added; NULL: not reported
    audio_seconds REAL,               -- input audio the server reported (NULL: none reported)
    project TEXT,                     -- the principal's project (keys file, trusted header)
    tags TEXT,                        -- its tags, sorted, comma-joined (a tag has no comma)
    budget_usd REAL                   -- what its budgets were charged (NULL: no budget hold)
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
    record TEXT NOT NULL              -- the audit record, JSON
);
CREATE INDEX IF NOT EXISTS audit_ts ON audit (ts);
"""

RECONNECT_S = 1.0  # how often an unopenable ledger file is tried again
KEPT_ROWS = 1000  # rows refused even cleaned, kept in memory (and logged) for an operator
SAFE_TEXT_CHARS = 1 << 20  # a cleaned row's text fields: audit records can be long

# What waits for the writer: the values of a row, or a function that makes them (in the thread).
Values: TypeAlias = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


class Row(NamedTuple):
    """One `requests` row, in column order (a tuple: cheap to build on the event loop)."""

    ts: float
    request_id: str
    trace_id: str | None
    model: str
    endpoint: str
    user: str
    input_tokens: int | None
    cached_input_tokens: int | None
    output_tokens: int | None
    cost_usd: float | None
    status: str
    stream: int
    queue_s: float | None
    ttft_s: float | None
    duration_s: float | None
    error: str | None
    team: str | None
    end_user: str | None
    device_seconds: float | None = None  # the columns after team and end_user default to NULL
    energy_j: float | None = None
    device_cost_usd: float | None = None
    reasoning_tokens: int | None = None
    audio_seconds: float | None = None
    project: str | None = None  # defaults: rows built before these columns still make a Row
    tags: str | None = None  # sorted, comma-joined; NULL: none
    # the budgets' charge: at least the hold where usage was not measured, so a restart
    # restores what the budgets had counted, not only the measured cost
    budget_usd: float | None = None


@functools.cache
def schema_columns(table: str) -> tuple[tuple[str, str, bool], ...]:
    """(name, SQLite type, NOT NULL) of each column of `table` in SCHEMA but its row id, in order,
    as SQLite reads the schema: the statements, the upgrade and the fleet's tables follow it."""
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(SCHEMA)
        info = conn.execute(f"PRAGMA table_info({table})").fetchall()
    return tuple((name, kind, bool(not_null)) for _, name, kind, not_null, _, pk in info if not pk)


def insert_sql(table: str) -> str:
    names = [name for name, _, _ in schema_columns(table)]
    return f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join(['?'] * len(names))})"


INSERT = insert_sql("requests")  # a Row's values, in its order
INSERT_AUDIT = insert_sql("audit")


def row_of(ex: Exchange) -> Row:
    u = ex.usage
    if ex.cost is not None:
        cost: float | None = ex.cost.total_usd
    else:
        cost = None if consumed(ex) else 0.0  # refused before generating anything: nothing spent
    return Row(
        ex.started_at,
        ex.request_id,
        ex.trace_id,
        billed_model(ex),
        ex.endpoint.value,
        ex.user_id,
        u.input_tokens,
        u.cached_input_tokens,
        u.output_tokens,
        cost,
        ex.status_label,
        int(ex.info.stream),
        ex.queue_s,
        ex.ttft_s,
        ex.duration_s,
        ex.error,
        ex.team,
        ex.end_user,
        ex.device_seconds,
        ex.energy_j,
        ex.device_cost_usd,
        u.reasoning_tokens,
        u.audio_seconds,
        ex.project,
        ",".join(ex.tags) if ex.tags else None,
        ex.budget_charge_usd,
    )


def bind_none_directly() -> None:
    """NULL bound without the driver's adapter search. The driver binds an exact int, float or
    str at once but sends every other value, None too, through `sqlite3.adapters`: a lookup
    that misses, then two attribute lookups, one raising an AttributeError it discards. A row
    has a dozen or more None, so that search was most of the CPU of an insert (callgrind,
    benchmarks/writers.py). Registered for None, the lookup hits and the adapter returns None,
    bound as NULL as before; it is the sqlite3 module's registry, so every connection of the
    process gets it, with the same result (and `sqlite3.adapt(None)` returns None instead of
    raising; nothing here calls it). `{}.get` is a C callable: None for None."""
    sqlite3.register_adapter(type(None), _NO_ADAPTER.get)


_NO_ADAPTER: dict[Any, Any] = {}


def connect(path: str | Path) -> sqlite3.Connection:
    bind_none_directly()
    # A short busy timeout: a locked file makes the writer retry later, not stall the flushes.
    conn = sqlite3.connect(str(path), timeout=1.0, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at each checkpointed commit
    conn.executescript(SCHEMA)
    _add_missing_columns(conn)
    return conn


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Ledgers written before a column existed get it (NULL in their old rows)."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
    for column, kind, not_null in schema_columns("requests"):
        if column not in have and not not_null:  # every ledger has had the NOT NULL ones
            conn.execute(f"ALTER TABLE requests ADD COLUMN {column} {kind}")


class Ledger:
    """Append rows from the event loop; a thread commits them in batches."""

    def __init__(self, config: LedgerConfig, metrics: Metrics) -> None:
        assert config.path is not None
        self.config = config
        self.metrics = metrics
        self._pending: collections.deque[tuple[str, Values]] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._retry_at = 0.0
        self._file_id: tuple[int, int] | None = None  # (device, inode) of the file we opened
        self.problem: str | None = "not open yet"  # why rows cannot be written now (readiness)
        self.kept: collections.deque[tuple[str, tuple[Any, ...], str]] = collections.deque(
            maxlen=KEPT_ROWS
        )  # (statement, values, error) of rows refused even cleaned
        metrics.ledger_set_aside.labels("memory").set_function(lambda: len(self.kept))

    # --- event-loop side (never blocks on disk)

    def append(self, ex: Exchange) -> None:
        """A sink. The row is made by the writer thread at its next flush (the exchange is
        complete and no longer changes); until then the queue holds a reference, not a copy."""
        self._put(INSERT, functools.partial(row_of, ex))

    def append_audit(self, values: Values) -> None:
        self._put(INSERT_AUDIT, values)

    def _put(self, sql: str, values: Values) -> None:
        with self._lock:
            if len(self._pending) >= self.config.max_pending_rows:
                self._pending.popleft()
                self.metrics.ledger_dropped.inc()
            self._pending.append((sql, values))

    # --- lifecycle

    def open(self) -> None:
        """Open (creating if needed), apply retention, start the writer thread.

        A file that cannot be opened (corrupt, locked, unwritable) is logged and counted, and the
        writer keeps retrying while rows wait in memory: traffic is never refused for it.
        """
        self._try_connect()
        self._thread = threading.Thread(target=self._run, name="tollbooth-ledger", daemon=True)
        self._thread.start()

    def _try_connect(self) -> bool:
        conn = None
        try:
            conn = connect(self.config.path)  # type: ignore[arg-type]
            cutoff = time.time() - self.config.retention_days * 86400
            with conn:
                conn.execute("DELETE FROM requests WHERE ts < ?", (cutoff,))
                conn.execute("DELETE FROM audit WHERE ts < ?", (cutoff,))
        except sqlite3.Error as exc:
            log.error("ledger %s cannot be opened (will retry): %s", self.config.path, exc)
            self.metrics.ledger_errors.labels("open").inc()
            if conn is not None:
                conn.close()
            self._retry_at = time.monotonic() + RECONNECT_S
            self.problem = f"cannot be opened: {exc}"
            return False
        self._conn, self._file_id, self.problem = conn, _file_id(self.config.path), None
        return True

    def _reopen_if_replaced(self) -> None:
        """Deleted or replaced under us, the open file is an unlinked inode: rows written there
        are lost. Close it and open the path again (a new file, or the replacement)."""
        if self._conn is None or _file_id(self.config.path) == self._file_id:
            return
        log.warning("ledger %s was deleted or replaced: opening it again", self.config.path)
        self.metrics.ledger_reopens.inc()
        with contextlib.suppress(sqlite3.Error):
            # Move the old file's WAL into it and empty the WAL: SQLite finds a WAL by name, so a
            # WAL left behind would be replayed into the file that now has the path.
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()
        self._conn = None
        self._try_connect()

    def spend_rows(self, day: float, month: float) -> list[SpendRow]:
        """This month's known spend by scope (`spend_rows`); none without the file."""
        if self._conn is None:
            log.error("ledger unavailable: this month's spend starts from zero")
            return []
        return spend_rows(self._conn, day, month)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._conn is not None:
            self._conn.close()

    # --- writer thread

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.config.flush_interval_s):
                self._flush()
            self._flush()
            if self._pending:  # one last try after a failure at shutdown
                time.sleep(min(0.5, self.config.flush_interval_s))
                self._flush()
            if self._pending:
                self.metrics.ledger_dropped.inc(len(self._pending))
                log.error("ledger closed with %d rows unwritten", len(self._pending))
        finally:  # not reached while it runs: _flush catches everything; but never silently
            if not self._stop.is_set():
                self.problem = "the writer thread stopped"

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, collections.deque()
        if not batch:
            return
        batch = self._made(batch)  # rows from here on, also when the write fails and is retried
        try:
            self._write(batch)
        except Exception as exc:  # any: the thread goes on, the batch waits for the next flush
            self._failed(batch, exc)

    def _failed(self, batch: collections.deque[tuple[str, Values]], exc: Exception) -> None:
        if self._conn is not None or not isinstance(exc, sqlite3.Error):  # else: counted at open
            log.error("ledger write of %d rows failed (will retry): %r", len(batch), exc)
            self.metrics.ledger_errors.labels("write").inc()
            self.problem = f"write failed: {exc!r}"[:300]
        with self._lock:  # put the batch back in front of what arrived meanwhile
            batch.extend(self._pending)
            while len(batch) > self.config.max_pending_rows:
                batch.popleft()
                self.metrics.ledger_dropped.inc()
            self._pending = batch

    def _made(
        self, batch: collections.deque[tuple[str, Values]]
    ) -> collections.deque[tuple[str, Values]]:
        """The batch with every row made (a row that cannot be made is logged and left out)."""
        out: collections.deque[tuple[str, Values]] = collections.deque()
        for sql, values in batch:
            if callable(values):
                try:
                    values = values()
                except Exception:  # a bug: the row is lost, the others are written
                    log.exception("a ledger row could not be made")
                    self.metrics.metering_errors.labels("ledger").inc()
                    self.metrics.ledger_errors.labels("make").inc()
                    continue
            out.append((sql, values))
        return out

    def _write(self, batch: Iterable[tuple[str, Values]]) -> None:
        self._reopen_if_replaced()
        reconnect_due = time.monotonic() >= self._retry_at
        if self._conn is None and not (reconnect_due and self._try_connect()):
            raise sqlite3.OperationalError("ledger not open")
        assert self._conn is not None
        try:
            with self._conn:
                for sql, run in itertools.groupby(batch, key=lambda item: item[0]):
                    rows = [cast(tuple[Any, ...], values) for _, values in run]  # made by _made
                    self._insert(self._conn, sql, rows)
        except Exception as exc:
            if not about_a_row(exc):
                raise
            with self._conn:  # rolled back: again row by row, to find the rows refused
                self._write_each(self._conn, batch)
        self.problem = None

    def _write_each(self, conn: sqlite3.Connection, batch: Iterable[tuple[str, Values]]) -> None:
        """Each row as it is; a refused one cleaned; one refused even then kept aside."""
        for sql, values in batch:
            row = cast(tuple[Any, ...], values)
            write = functools.partial(conn.execute, sql)
            refused, refused_cleaned = write_or_clean(write, row, about_a_row)
            if refused_cleaned is not None:
                self._keep_aside(sql, row, refused_cleaned)
            elif refused is not None:
                log.error("a ledger row was refused as it was (%r): written cleaned", refused)
                self.metrics.ledger_errors.labels("row").inc()

    def _keep_aside(self, sql: str, row: tuple[Any, ...], exc: Exception) -> None:
        self.kept.append((sql, row, repr(exc)))
        self.metrics.ledger_errors.labels("kept").inc()
        log.error(
            "a ledger row was refused even cleaned (%r), kept aside: %s", exc, ascii(row)[:2000]
        )

    @staticmethod
    def _insert(conn: sqlite3.Connection, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """Many rows per statement. SQLite runs a statement without the GIL: one statement per
        row (executemany) made this thread and the event loop trade the GIL row by row."""
        most = max(1, conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(rows[0]))
        i = 0
        while i < len(rows):
            n = next(k for k in ROWS_PER_STATEMENT if k <= most and k <= len(rows) - i)
            conn.execute(_multi_row(sql, n), [v for row in rows[i : i + n] for v in row])
            i += n


# What a value can make the driver raise: a string it cannot encode (UnicodeEncodeError is a
# ValueError), an integer past 64 bits (OverflowError), a value of no SQL type (TypeError).
VALUE_ERRORS = (ValueError, TypeError, OverflowError)
_ROW_ERRORS = (
    *VALUE_ERRORS,
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,
)


def about_a_row(exc: BaseException) -> bool:
    """Whether `exc` is about the row being written (see VALUE_ERRORS, and SQLite's constraint and
    binding errors), not about the file, the disk, a lock or anything else, which would fail every
    row alike: that batch waits and is retried whole (the writer is not ready meanwhile)."""
    return isinstance(exc, _ROW_ERRORS)


def write_or_clean(
    write: Callable[[tuple[Any, ...]], object],
    row: tuple[Any, ...],
    about_the_row: Callable[[BaseException], bool],
) -> tuple[Exception | None, Exception | None]:
    """`write(row)`, and where that is refused for the row's data, `write(cleaned(row))`: what
    refused the row as it was and what refused it even cleaned (None: nothing). Any other error
    is raised: it would fail every row alike."""
    try:
        write(row)
        return None, None
    except Exception as exc:
        if not about_the_row(exc):
            raise
        refused = exc
    try:
        write(cleaned(row))
    except Exception as exc:
        if not about_the_row(exc):
            raise
        return refused, exc
    return refused, None


_INT64 = 1 << 63


def cleaned(values: Iterable[Any]) -> tuple[Any, ...]:
    """A row as any SQLite or PostgreSQL driver takes it: text through `clean`, an integer past 64
    bits as NULL (not measured), a value of no SQL type as its text."""
    return tuple(_cleaned(v) for v in values)


def _cleaned(v: Any) -> Any:
    if v is None or isinstance(v, float | bytes | bool):
        return v
    if isinstance(v, int):
        return v if -_INT64 <= v < _INT64 else None
    return clean(v if isinstance(v, str) else repr(v), SAFE_TEXT_CHARS)


# Statement sizes, largest first: few distinct statements, so SQLite's statement cache holds them.
ROWS_PER_STATEMENT = (256, 64, 16, 4, 1)


@functools.lru_cache(maxsize=16)
def _multi_row(sql: str, n: int) -> str:
    """`INSERT ... VALUES (?, ...)` for n rows: the same statement with n value lists."""
    head, _, values = sql.partition(" VALUES ")
    return f"{head} VALUES {', '.join([values] * n)}"


SPEND_ROWS = (
    'SELECT "user", team, project, tags, model, CASE WHEN ts >= {p} THEN 1 ELSE 0 END, '
    "SUM(cost_usd), SUM(COALESCE(budget_usd, cost_usd)) FROM requests "
    "WHERE ts >= {p} AND COALESCE(budget_usd, cost_usd) IS NOT NULL {more} "
    "GROUP BY 1, 2, 3, 4, 5, 6"  # by position: the day's parameter is in the first column
)


def spend_rows(conn: sqlite3.Connection, day: float, month: float) -> list[SpendRow]:
    """Known spend since the budget month's start `month`, grouped by every scope kind, each
    row marked 1 when it is of the budget day that starts at `day` (budget.SpendRow)."""
    sql = SPEND_ROWS.format(p="?", more="")
    return [spend_row(r) for r in conn.execute(sql, (day, month)).fetchall()]


def spend_row(r: Any) -> SpendRow:
    """(..., measured cost, what the budgets were charged): a group of requests whose cost is
    unknown but that were charged their holds has no measured cost (0 for the gauge)."""
    return (r[0], r[1], r[2], r[3], r[4], int(r[5]), float(r[6] or 0.0), float(r[7]))


def _file_id(path: str | Path | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # type: ignore[arg-type]
    except OSError:
        return None
    return st.st_dev, st.st_ino


def ledger_context(
    ledger: Ledger, on_open: Callable[[Ledger], Awaitable[None]] | None = None
) -> CleanupContext:
    """A cleanup context: open before the first request, flush and close after the last."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await asyncio.to_thread(ledger.open)
        if on_open is not None:
            await on_open(ledger)
        yield
        await asyncio.to_thread(ledger.close)

    return ctx
