"""Fully loaded GPU cost (issue 25): the idle GPU time of a report's period as its own line, and
`--spread-idle` sharing its cost by use, in table, csv, json and html; unknown (never invented)
where the GPU count or the GPU price is not known."""

from __future__ import annotations

import calendar
import csv
import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sidecar.billing import chargeback, idle, ledger
from sidecar.billing.idle import IDLE, Capacity

NOV_1 = calendar.timegm((2026, 11, 1, 0, 0, 0))
DEC_1 = calendar.timegm((2026, 12, 1, 0, 0, 0))
PERIOD_S = DEC_1 - NOV_1
RATE = 3.6  # $/GPU-h: a device-second costs $0.001
# (ts, user, tags, cost, device_s, device_cost)
ROWS = [
    (NOV_1 + 10, "ann", "eu,prod", 0.25, 100.0, 0.1),
    (NOV_1 + 20, "ann", "prod", 0.5, 300.0, 0.3),
    (NOV_1 + 30, "bob", "eu", 1.0, 600.0, 0.6),
    (NOV_1 + 40, "cy", None, 0.125, None, None),  # not admitted: no device time
]
USED = 1000.0


def write(path: Path, rows: list[tuple[Any, ...]]) -> str:
    conn = ledger.connect(path)
    with conn:
        for i, (ts, user, tags, cost, ds, dc) in enumerate(rows):
            conn.execute(
                ledger.INSERT,
                ledger.Row(ts, f"r{i}", None, "m", "/v1/chat/completions", user, 10, 0, 5, cost,
                           "200", 0, None, None, 0.1, None, "t", None, ds, None, dc, tags=tags),
            )  # fmt: skip
    conn.close()
    return str(path)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return write(tmp_path / "l.db", ROWS)


def build(path: str, by: str = "user", gpus: int | None = 2, **kw: Any) -> chargeback.Report:
    cap = Capacity(gpus, "--gpus") if gpus else Capacity(None, chargeback.NO_GPU_COUNT)
    kw.setdefault("now", DEC_1 + 86400)
    return chargeback.build(path, NOV_1, DEC_1, by, gpus=cap, **kw)


def test_idle_is_the_gpu_time_of_the_period_less_the_requests(path: str) -> None:
    i = build(path).idle
    assert i is not None
    assert (i.gpus, i.available_s, i.used_s) == (2, 2.0 * PERIOD_S, USED)
    assert i.idle_s == 2.0 * PERIOD_S - USED
    assert i.gpu_hour_usd == pytest.approx(RATE, rel=1e-12)  # from the ledger's own costs
    assert i.rate_source.startswith("ledger")
    assert i.idle_cost_usd == pytest.approx((2 * PERIOD_S - USED) / 1000, rel=1e-12)
    assert i.note is None
    assert i.unmeasured_requests == 1  # cy's request, which held no GPU
    assert "(requests without device-seconds: 1," in chargeback.render(build(path), "table")


def test_a_month_not_over_has_had_its_time_so_far(path: str) -> None:
    now = NOV_1 + 86400  # one day into November
    rep = chargeback.build(path, NOV_1, DEC_1, "user", gpus=Capacity(1, "--gpus"), now=now)
    assert rep.idle is not None and rep.idle.available_s == 86400.0
    assert rep.idle.idle_s == 86400.0 - USED


def test_without_a_gpu_count_idle_is_unknown_not_guessed(path: str) -> None:
    rep = build(path, gpus=None)
    assert rep.idle is not None  # the ledger has GPU data: the line is there, unknown
    assert (rep.idle.idle_s, rep.idle.idle_cost_usd, rep.idle.available_s) == (None, None, None)
    assert rep.idle.used_s == USED and "pass --gpus" in (rep.idle.note or "")
    text = chargeback.render(rep, "table")
    idle_line = next(line for line in text.splitlines() if line.startswith(IDLE))
    assert "unknown" in idle_line and "0.000 " not in idle_line.split("$0.0000", 1)[1]
    assert "idle GPU: unknown (the GPU count is not known" in text
    row = json.loads(chargeback.render(rep, "json"))[-1]
    assert row["user"] == IDLE and row["device_seconds"] is None
    assert row["idle_gpu"]["idle_device_seconds"] is None


def test_no_gpu_data_no_idle_line(tmp_path: Path) -> None:
    p = write(tmp_path / "cpu.db", [(NOV_1 + 1, "ann", None, 0.5, None, None)])
    rep = build(p, gpus=None)
    assert rep.idle is None
    assert IDLE not in chargeback.render(rep, "table")
    assert [r["user"] for r in json.loads(chargeback.render(rep, "json"))] == ["ann"]
    assert "No GPU data in the ledger" in chargeback.render(rep, "html")


def test_more_use_than_the_stated_gpus_is_not_a_negative_idle(path: str) -> None:
    rep = chargeback.build(path, NOV_1, NOV_1 + 400, "user", gpus=Capacity(1, "--gpus"), now=DEC_1)
    assert rep.idle is not None and rep.idle.idle_s is None and rep.idle.idle_cost_usd is None
    assert "exceed" in (rep.idle.note or "")


def test_the_price_book_prices_idle_time_and_is_named(path: str, tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_hour_usd: 7.2\n")
    book = chargeback.price_book(str(prices), None)
    digest = hashlib.sha256(prices.read_bytes()).hexdigest()
    assert book.label == f"pricing file {prices} (sha256 {digest})"
    i = build(path, book=book).idle
    assert i is not None and i.gpu_hour_usd == 7.2 and i.rate_source == f"pricing file {prices}"
    assert i.idle_cost_usd == pytest.approx((2 * PERIOD_S - USED) / 3600 * 7.2, rel=1e-12)
    assert chargeback.price_book(None, None).label == "unknown"


def test_two_gpu_prices_in_the_ledger_leave_the_idle_cost_unknown(tmp_path: Path) -> None:
    rows = [(NOV_1 + 1, "a", None, 0.1, 100.0, 0.1), (NOV_1 + 2, "b", None, 0.1, 100.0, 0.2)]
    i = build(write(tmp_path / "two.db", rows)).idle
    assert i is not None and i.idle_s is not None
    assert (i.gpu_hour_usd, i.idle_cost_usd) == (None, None)
    assert "no GPU price" in (i.note or "")


def test_a_config_with_explicit_gpu_devices_gives_the_count(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gpu:\n  devices: ['0', '1', '2']\npricing:\n  gpu_hour_usd: 2.0\n")
    assert chargeback.capacity(None, str(cfg)) == Capacity(3, f"config {cfg} gpu.devices")
    assert chargeback.capacity(4, str(cfg)) == Capacity(4, "--gpus")
    assert chargeback.price_book(None, str(cfg)).gpu_hour_usd == 2.0
    cfg.write_text("gpu:\n  devices_file: /run/engine/gpus\n")  # known only at run time
    assert chargeback.capacity(None, str(cfg)).gpus is None
    with pytest.raises(ValueError):
        chargeback.capacity(0, None)


@pytest.mark.parametrize("by", ["user", "day", "month"])
def test_spread_idle_shares_the_idle_cost_by_use(path: str, by: str) -> None:
    rep = build(path, by, spread_idle=True)
    assert rep.idle is not None and rep.idle.idle_cost_usd is not None
    cost = rep.idle.idle_cost_usd
    shares = {g[by]: g["idle_share_usd"] for g in rep.groups}
    assert sum(shares.values()) == pytest.approx(cost, rel=1e-9)  # all of it, once
    if by == "user":
        assert shares["ann"] == pytest.approx(cost * 400 / USED, rel=1e-9)
        assert shares["bob"] == pytest.approx(cost * 600 / USED, rel=1e-9)
        assert shares["cy"] == 0.0  # no device time: no share
        loaded = {g["user"]: g["loaded_device_cost_usd"] for g in rep.groups}
        assert loaded["ann"] == pytest.approx(0.4 + shares["ann"], rel=1e-9)
        assert loaded["cy"] is None  # its device cost is unknown, so is its loaded cost
    table = list(csv.DictReader(io.StringIO(chargeback.render(rep, "csv"))))
    assert table[-1][by] == IDLE
    device = sum(float(r["device_cost_usd"]) for r in table if r["device_cost_usd"])
    loaded_sum = sum(
        float(r["loaded_device_cost_usd"]) for r in table[:-1] if r["loaded_device_cost_usd"]
    )
    assert device == pytest.approx(loaded_sum, rel=1e-9)  # the idle line is what was spread


def test_spread_by_tag_counts_a_request_in_each_tag(path: str) -> None:
    rep = build(path, "tag", spread_idle=True)
    assert rep.idle is not None and rep.idle.idle_cost_usd is not None
    shares = {g["tag"]: g["idle_share_usd"] for g in rep.groups}
    cost = rep.idle.idle_cost_usd
    assert shares["prod"] == pytest.approx(cost * 400 / USED, rel=1e-9)
    assert shares["eu"] == pytest.approx(cost * 700 / USED, rel=1e-9)


def test_spread_without_a_known_idle_cost_is_unknown(path: str) -> None:
    rep = build(path, gpus=None, spread_idle=True)
    assert {g["idle_share_usd"] for g in rep.groups} == {None}


def test_the_cli_spreads_idle_in_every_format(path: str) -> None:
    def cli(fmt: str) -> str:
        args = ["report", "--ledger", path, "--month", "2026-11", "--gpus", "2", "--spread-idle"]
        return subprocess.run(
            [sys.executable, "-m", "sidecar.core.cli", *args, "--format", fmt],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip

    rows = json.loads(cli("json"))
    assert rows[-1]["user"] == IDLE
    assert rows[-1]["idle_gpu"]["idle_device_seconds"] == 2.0 * PERIOD_S - USED
    assert sum(r["idle_share_usd"] for r in rows[:-1]) == pytest.approx(
        rows[-1]["idle_gpu"]["idle_cost_usd"], rel=1e-9
    )
    assert list(csv.DictReader(io.StringIO(cli("csv"))))[-1]["user"] == IDLE
    table = cli("table")
    assert "idle cost spread over the groups by device-seconds" in table
    assert "2 GPUs (--gpus) x 720.000 h = 1440.000 GPU-h available" in table
    assert "<th>idle share usd</th>" in cli("html")
    bad = subprocess.run(
        [sys.executable, "-m", "sidecar.core.cli", "report", "--ledger", path, "--gpus", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--gpus '0'" in bad.stderr


def test_the_fleet_ledger_gives_the_same_device_columns(path: str, postgres: Any) -> None:
    import psycopg

    from sidecar.billing import fleet_ledger

    url = postgres.database()
    with psycopg.connect(url) as conn:
        fleet_ledger.create_schema(conn)
        for i, (ts, user, tags, cost, ds, dc) in enumerate(ROWS):
            conn.execute(
                'INSERT INTO requests (source, seq, ts, request_id, model, endpoint, "user", '
                "input_tokens, output_tokens, cost_usd, status, stream, duration_s, team, tags, "
                "device_seconds, device_cost_usd) VALUES ('s', %s, %s, %s, 'm', '/v1/x', %s, 10, "
                "5, %s, '200', 0, 0.1, 't', %s, %s, %s)",
                (i, ts, f"r{i}", user, cost, tags, ds, dc),
            )
    for by in ("user", "tag", "day"):
        a, b = build(url, by, spread_idle=True), build(path, by, spread_idle=True)
        assert a.groups == b.groups and a.idle == b.idle
    assert idle.ledger_rate([]) is None


def test_a_period_without_requests_is_all_idle(path: str, tmp_path: Path) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_hour_usd: 3.6\n")
    book = chargeback.price_book(str(prices), None)
    start, end = DEC_1, DEC_1 + 3600  # after the ledger's rows
    rep = chargeback.build(path, start, end, "team", book=book, gpus=Capacity(2, "--gpus"), now=end)
    assert rep.groups == [] and rep.idle is not None
    assert (rep.idle.idle_s, rep.idle.idle_cost_usd) == (7200.0, pytest.approx(7.2, rel=1e-12))
    assert json.loads(chargeback.render(rep, "json"))[0]["device_seconds"] == 7200.0
    assert chargeback.render(rep, "table").splitlines()[1].startswith(IDLE)
    assert f"<td>{IDLE}</td>" in chargeback.render(rep, "html")
    future = chargeback.build(path, end, end + 60, "team", gpus=Capacity(2, "--gpus"), now=start)
    assert future.idle is not None and future.idle.available_s == 0.0  # a period to come
