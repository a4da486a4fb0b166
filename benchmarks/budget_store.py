"""Budget store cost: reserve + settle, in-process (LocalStore) and in Redis (RedisStore).

Run: `.venv/bin/python benchmarks/budget_store.py [--n N] [--concurrency C]` (starts its own
redis-server on a free loopback port; Debian's redis-server must be installed).

Two measurements per store:
- sequential: one request at a time; `reserve` is what a request waits for before it may go
  upstream; `reserve + settle` adds the settlement's own round trip (in the sidecar it runs in the
  background, so no request waits for it).
- concurrent: C workers reserving and settling through the background queue, until every
  settlement has reached the store; holds per second.
Results are printed and written to benchmarks/results/budget_store.json with the conditions.
Nothing here is asserted: speed is reported, never tested.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis as redis_sync

from sidecar.billing.budget import DAY, Hold, LocalStore, Scope
from sidecar.billing.redis_store import RedisStore
from sidecar.config import BudgetConfig
from sidecar.telemetry.metrics import Metrics

RESULTS = Path(__file__).parent / "results"
TODAY = int(time.time() // DAY * DAY)
SCOPES = (
    Scope("global", "*", 10**15),
    Scope("team", "research", 10**15),
    Scope("user", "bench", 10**15),
)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(statistics.median(samples) * 1e6, 1),
        "p99_us": round(pct(samples, 99) * 1e6, 1),
        "mean_us": round(statistics.fmean(samples) * 1e6, 1),
    }


async def sequential(store: Any, n: int, prefix: str, remote: bool) -> dict[str, Any]:
    reserve, both = [], []
    for i in range(n):
        hold = Hold(f"{prefix}-s{i}", TODAY, 16_000, SCOPES)
        t0 = time.perf_counter()
        verdict = await store.reserve(hold)
        t1 = time.perf_counter()
        assert verdict.admitted
        if remote:  # the settlement's round trip, as the background settler makes it
            store.open.pop(hold.request_id)
            await store._settle_batch([(hold, 15_000, int(time.time() * 1000))])
        else:
            store.settle(hold.request_id, 15_000)
        t2 = time.perf_counter()
        reserve.append(t1 - t0)
        both.append(t2 - t0)
    return {"reserve": summary(reserve), "reserve_plus_settle": summary(both)}


async def concurrent(store: Any, n: int, c: int, prefix: str, remote: bool) -> dict[str, Any]:
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            hold = Hold(f"{prefix}-c{i}", TODAY, 16_000, SCOPES)
            assert (await store.reserve(hold)).admitted
            store.settle(hold.request_id, 15_000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    while remote and (store.queue or store._wake.is_set()):  # the settler is idle again
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - t0
    return {"holds_per_s": round(n / elapsed), "seconds": round(elapsed, 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(n: int, c: int, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    local = LocalStore(max_scopes=10)
    out["local"] = {
        "sequential": await sequential(local, n, "l", False),
        "concurrent": await concurrent(local, n, c, "l", False),
    }
    cfg = BudgetConfig(store=url, store_timeout_s=1.0)
    store = RedisStore(cfg, Metrics(), lambda: TODAY, None, max_scopes=10)
    await store.seed(TODAY, {})
    store.start()
    await sequential(store, min(n, 500), "warm", True)  # scripts loaded, connections open
    out["redis"] = {
        "sequential": await sequential(store, n, "r", True),
        "concurrent": await concurrent(store, n, c, "r", True),
    }
    await store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    binary = shutil.which("redis-server")
    if not binary:
        sys.exit("redis-server not found (apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis_sync.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis_sync.ConnectionError:
                    time.sleep(0.05)
            version = client.info()["redis_version"]
            try:
                import uvloop

                results = uvloop.run(run(args.n, args.concurrency, f"redis://127.0.0.1:{port}/0"))
            except ImportError:
                results = asyncio.run(run(args.n, args.concurrency, f"redis://127.0.0.1:{port}/0"))
        finally:
            server.terminate()
            server.wait()
    import redis as redis_pkg

    doc = {
        "conditions": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "redis_server": version,
            "redis_py": redis_pkg.__version__,
            "scopes_per_hold": len(SCOPES),
            "n": args.n,
            "concurrency": args.concurrency,
            "where": "redis-server and the benchmark on one machine, loopback TCP",
        },
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "budget_store.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
