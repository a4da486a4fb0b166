"""Chargeback identity (issue 25): keys carry a project and tags, a trusted gateway may set them
through configured headers (made safe at the boundary), and ledger rows record them; ledgers
written before the columns existed (SQLite and PostgreSQL) are upgraded in place."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from sidecar.billing import fleet_ledger, ledger
from sidecar.config import ConfigError
from sidecar.proxy.identity import MAX_TAGS, read_keys
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL

MSGS = [{"role": "user", "content": "one two three four five"}]
KEY = "sk-erin-0123456789"

# The `requests` table as the code before issue 25 wrote it (commit 4660ceb), verbatim.
OLD_SCHEMA = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, request_id TEXT NOT NULL, trace_id TEXT,
    model TEXT NOT NULL, endpoint TEXT NOT NULL, user TEXT NOT NULL, input_tokens INTEGER,
    cached_input_tokens INTEGER, output_tokens INTEGER, cost_usd REAL, status TEXT NOT NULL,
    stream INTEGER NOT NULL, queue_s REAL, ttft_s REAL, duration_s REAL, error TEXT,
    team TEXT, end_user TEXT
);
CREATE INDEX requests_ts ON requests (ts);
"""
OLD_ROW = (1.0, "r-old", None, "m", "/v1/chat/completions", "alice", 1, 0, 2, 0.5, "200", 0)


async def rows(run: Running, n: int) -> list[tuple[Any, ...]]:
    """project, tags of the ledger's rows once `n` are written (bounded wait)."""
    found: list[tuple[Any, ...]] = []
    for _ in range(200):
        conn = sqlite3.connect(run.sc.config.ledger.path)
        found = conn.execute("SELECT user, project, tags FROM requests ORDER BY id").fetchall()
        conn.close()
        if len(found) >= n:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {n} ledger rows: {found}")


def keys_add(path: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", "keys", "add", "--file", path, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


async def test_keys_add_project_and_repeated_tags_reach_the_ledger(
    start_sidecar: StartSidecar, oai: Any, tmp_path: Path
) -> None:
    path = str(tmp_path / "keys.yaml")
    key = keys_add(path, "--user", "dana", "--project", "atlas", "--tag", "prod", "--tag", "eu")
    (principal,) = read_keys(path).values()
    assert (principal.project, principal.tags) == ("atlas", ("eu", "prod"))
    run = await start_sidecar(
        {
            "identity": {"keys_file": path},
            "ledger": {"path": str(tmp_path / "l.db"), "flush_interval_s": 0.05},
        }
    )
    await oai(run, api_key=key).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert await rows(run, 1) == [("dana", "atlas", "eu,prod")]


def test_keys_file_refuses_bad_project_and_tags(tmp_path: Path) -> None:
    sha = hashlib.sha256(KEY.encode()).hexdigest()
    bad: list[dict[str, Any]] = [
        {"project": "a b"},
        {"tags": "prod"},
        {"tags": ["ok", "no,comma"]},
        {"tags": [f"t{i}" for i in range(MAX_TAGS + 1)]},
        {"cost_centre": "x"},
    ]
    for extra in bad:
        p = tmp_path / "k.yaml"
        p.write_text(yaml.safe_dump({"keys": [{"sha256": sha, "user": "erin", **extra}]}))
        with pytest.raises(ConfigError):
            read_keys(str(p))


async def test_trusted_headers_set_project_and_tags_made_safe(
    start_sidecar: StartSidecar, oai: Any, tmp_path: Path
) -> None:
    run = await start_sidecar(
        {
            "identity": {"project_header": "X-Project", "tags_header": "X-Tags"},
            "ledger": {"path": str(tmp_path / "l.db"), "flush_interval_s": 0.05},
        }
    )
    tags = ",".join(["b", "a", "a", " ", "x" * 500] + [f"t{i:02}" for i in range(40)])
    await oai(run, api_key="sk-z").chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=2,
        extra_headers={
            "X-Tollbooth-User": "carol",
            "X-Project": "atl\tas" + "p" * 300,
            "X-Tags": tags,
        },
    )
    ((user, project, tagtext),) = await rows(run, 1)
    assert user == "carol"
    assert "\t" not in project and len(project) <= 64 and project.startswith("atl")
    got = tagtext.split(",")
    assert got == sorted(set(got)) and len(got) == MAX_TAGS
    assert "a" in got and "b" in got and all(0 < len(t) <= 64 for t in got)


def test_an_old_sqlite_ledger_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(OLD_SCHEMA)
    old.execute(
        "INSERT INTO requests (ts, request_id, trace_id, model, endpoint, user, input_tokens, "
        "cached_input_tokens, output_tokens, cost_usd, status, stream) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        OLD_ROW,
    )
    old.commit()
    old.close()
    conn = ledger.connect(path)
    new = ledger.Row(
        *OLD_ROW[:1], "r-new", *OLD_ROW[2:], None, None, None, None, "ops", None,
        project="atlas", tags="eu,prod",
    )  # fmt: skip
    with conn:
        conn.execute(ledger.INSERT, new)
    got = conn.execute("SELECT request_id, cost_usd, team, project, tags FROM requests ORDER BY id")
    assert got.fetchall() == [
        ("r-old", 0.5, None, None, None),
        ("r-new", 0.5, "ops", "atlas", "eu,prod"),
    ]
    conn.close()


def test_an_old_postgresql_ledger_is_upgraded_in_place(
    postgres: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres.database()
    old_columns = {
        c: t for c, t in fleet_ledger.REQUEST_COLUMNS.items() if c not in ("project", "tags")
    }
    assert len(old_columns) == len(fleet_ledger.REQUEST_COLUMNS) - 2
    with psycopg.connect(url) as conn:
        with monkeypatch.context() as m:
            m.setattr(fleet_ledger, "TABLES", {**fleet_ledger.TABLES, "requests": old_columns})
            fleet_ledger.create_schema(conn)
        conn.execute(
            'INSERT INTO requests (source, seq, ts, request_id, model, endpoint, "user", status, '
            "stream, cost_usd) VALUES ('a', 1, 1.0, 'r-old', 'm', '/v1/x', 'alice', '200', 0, 0.5)"
        )
        conn.commit()
        fleet_ledger.create_schema(conn)
        conn.execute(
            'INSERT INTO requests (source, seq, ts, request_id, model, endpoint, "user", status, '
            "stream, cost_usd, project, tags) "
            "VALUES ('a', 2, 1.0, 'r-new', 'm', '/v1/x', 'bob', '200', 0, 0.25, 'atlas', 'eu')"
        )
        got = conn.execute("SELECT request_id, cost_usd, project, tags FROM requests ORDER BY seq")
        assert got.fetchall() == [("r-old", 0.5, None, None), ("r-new", 0.25, "atlas", "eu")]
