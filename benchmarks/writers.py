"""CPU per request of each default output (ledger, access log, audit), writer by writer.

Run: `.venv/bin/python benchmarks/writers.py [--requests N] [--rate R] [--rounds K]`

The exchanges are real: `--requests` non-streaming requests (pinned.py's body, overhead.py's
upstream reply) go through an in-process tollbooth with metering only, and a sink keeps each
finished exchange. Each output's own code then takes them, on this one thread, timed with
`time.thread_time` (CPU, not wall): the event loop's share (the sink the meter calls), and the
writer thread's share (the ledger's `_flush`, the access log's `drain`), called directly in
batches of what arrives in one flush interval at `--rate` requests/s. The threads' own wake-ups
(a few a second, idle or not) and GIL hand-offs are not in these figures. Reported: median over
rounds of microseconds per record; the outputs' lines and rows are those the server writes.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).parent))
import overhead as ov

from sidecar.billing.audit import Audit
from sidecar.billing.ledger import Ledger
from sidecar.config import AuditConfig, Config, LedgerConfig, LoggingConfig, build, validate
from sidecar.core.app import PROXY_SERVER_OPTIONS, Sidecar, create_app
from sidecar.core.wiring import wire
from sidecar.exchange import Exchange
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry.accesslog import AccessLog
from sidecar.telemetry.metrics import Metrics
from sidecar.telemetry.thresholds import DEFAULT

PAYLOAD = json.dumps(
    {"model": ov.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
    separators=(",", ":"),
)
PRICES = {"models": {ov.MODEL: {"input_per_1m": 0.2, "output_per_1m": 0.6}}}


async def capture(n: int) -> tuple[list[Exchange], PriceBook]:
    up = web.Application()
    up.router.add_post("/v1/chat/completions", ov.upstream_handler)
    up_server = TestServer(up)
    await up_server.start_server()
    data = {
        "upstream": {"url": str(up_server.make_url("")).rstrip("/")},
        "logging": {"access_log": "off", "level": "WARNING"},
        "audit": {"enabled": False},
        "pricing": PRICES,
    }
    sc = wire(Sidecar(validate(build(Config, data))))
    kept: list[Exchange] = []
    sc.meter.add_sink("capture", kept.append)
    server = TestServer(create_app(sc), **PROXY_SERVER_OPTIONS)
    await server.start_server()
    url = str(server.make_url("/v1/chat/completions"))
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s:

        async def client(k: int) -> None:
            for _ in range(k):
                async with s.post(url, data=PAYLOAD, headers=headers) as r:
                    await r.read()

        await asyncio.gather(*(client(n // 8) for _ in range(8)))
    await server.close()
    await up_server.close()
    return kept, sc.prices


def per_record(spent: float, n: int) -> float:
    return spent / n * 1e6


def batches(
    exs: list[Exchange], batch: int, put: Callable[[Exchange], object], flush: Callable[[], object]
) -> tuple[float, float]:
    """CPU per record of `put` (each record) and of `flush` (after each batch), this thread's."""
    putting = flushing = 0.0
    for i in range(0, len(exs), batch):
        t = time.thread_time()
        for ex in exs[i : i + batch]:
            put(ex)
        putting += time.thread_time() - t
        t = time.thread_time()
        flush()
        flushing += time.thread_time() - t
    return per_record(putting, len(exs)), per_record(flushing, len(exs))


def ledger_round(exs: list[Exchange], batch: int, tmp: Path, k: int) -> tuple[float, float]:
    ledger = Ledger(LedgerConfig(path=str(tmp / f"ledger{k}.db")), Metrics())
    assert ledger._try_connect()
    timed = batches(exs, batch, ledger.append, ledger._flush)
    assert not ledger._pending and ledger.problem is None
    ledger.close()
    return timed


def access_round(exs: list[Exchange], batch: int, tmp: Path, k: int) -> tuple[float, float]:
    log = AccessLog(LoggingConfig(access_log=str(tmp / f"access{k}.log")), metrics=Metrics())
    log.start()
    writer = log._writer
    assert writer is not None
    writer._stop.set()  # the thread ends; this thread drains
    assert writer._thread is not None
    writer._thread.join()
    timed = batches(exs, batch, log.write, writer.drain)
    log.stop()
    return timed


def audit_round(exs: list[Exchange], prices: PriceBook, tmp: Path, k: int) -> float:
    config = AuditConfig(path=str(tmp / f"audit{k}.jsonl"))
    audit = Audit(config, DEFAULT, prices, Metrics())
    t = time.thread_time()
    for ex in exs:
        audit.check(ex)
    spent = time.thread_time() - t
    assert not any(ex.audited for ex in exs)  # none over the limit at these prices
    return per_record(spent, len(exs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="captured through the proxy")
    ap.add_argument("--copies", type=int, default=10, help="records per captured exchange")
    ap.add_argument("--rate", type=float, default=4000.0, help="requests/s: sets the batch sizes")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    exs, prices = asyncio.run(capture(args.requests))
    exs = [copy.copy(ex) for ex in exs for _ in range(args.copies)]
    ledger_batch = max(1, int(args.rate * LedgerConfig().flush_interval_s))
    access_batch = max(1, int(args.rate * 0.1))  # BatchWriter's interval_s
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for k in range(args.rounds):
            lp, lf = ledger_round(exs, ledger_batch, tmp, k)
            ap_, ad = access_round(exs, access_batch, tmp, k)
            au = audit_round(exs, prices, tmp, k)
            for name, v in {
                "ledger.append": lp,
                "ledger._flush": lf,
                "access_log.write": ap_,
                "access_log.drain": ad,
                "audit.check": au,
            }.items():
                runs.setdefault(name, []).append(v)
    med = {name: round(statistics.median(v), 3) for name, v in runs.items()}
    med["total"] = round(sum(med.values()), 3)
    doc: dict[str, Any] = {
        "us_per_record (median of rounds)": med,
        "records": len(exs),
        "batches": {"ledger": ledger_batch, "access_log": access_batch},
        "rounds": {name: [round(x, 3) for x in v] for name, v in runs.items()},
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
