"""Proxy overhead: one load sent direct, through a minimal pass-through proxy and through tollbooth.

Run: `.venv/bin/python benchmarks/overhead.py [--requests N] [--concurrency C]`

Every server runs in its own process (uvloop when available), so the three paths differ only in
what sits between the load generator and the fast upstream. Results are printed and written to
benchmarks/results/overhead.json with the conditions (CPU count, Python, versions).
Nothing here is asserted: speed is reported, never tested.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

MODEL = "bench-model"
CHUNKS = 16
RESULTS = Path(__file__).parent / "results"


# --- the processes under test ---------------------------------------------------------------------


def _chunk(i: int) -> bytes:
    obj = {
        "id": "b",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {"prompt_tokens": 12, "completion_tokens": CHUNKS, "total_tokens": 12 + CHUNKS}
BODY = json.dumps(
    {
        "id": "b",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hello " * 16},
            }
        ],
        "usage": USAGE,
    }
).encode()
FINAL = (
    b"data: "
    + json.dumps(
        {
            "id": "b",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [],
            "usage": USAGE,
        }
    ).encode()
    + b"\n\n"
)


async def upstream_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=BODY, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(CHUNKS):
        await resp.write(_chunk(i))
    if (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(FINAL)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def run_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream_handler)
    _serve(app, port)


def run_minimal_proxy(port: int, upstream: str) -> None:
    """The least a correct streaming proxy does: forward, stream back, nothing else."""
    state: dict[str, aiohttp.ClientSession] = {}

    async def ctx(app: web.Application) -> Any:
        state["s"] = aiohttp.ClientSession(auto_decompress=False)
        yield
        await state["s"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with state["s"].request(
            request.method, upstream + request.path_qs, data=data, headers=headers
        ) as up:
            resp = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.headers["Content-Type"]}
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.cleanup_ctx.append(ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    _serve(app, port)


def _serve(app: web.Application, port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- load -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.post(url + "/v1/chat/completions", json={"model": MODEL}) as r:
                    await r.read()
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not start")


async def throughput(url: str, n: int, concurrency: int) -> dict[str, float]:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    latencies: list[float] = []
    remaining = iter(range(n))
    conn = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            for _ in remaining:
                t = time.perf_counter()
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    await r.read()
                    assert r.status == 200
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "requests": n,
        "rps": n / wall,
        "p50_ms": _pct(latencies, 50) * 1e3,
        "p99_ms": _pct(latencies, 99) * 1e3,
    }


async def stream_ttft(url: str, n: int) -> dict[str, float]:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=payload) as r:
                first = await r.content.readany()
                ttfts.append(time.perf_counter() - t)
                assert first.startswith(b"data:")
                await r.read()
    return {
        "requests": n,
        "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
        "ttft_p90_ms": _pct(ttfts, 90) * 1e3,
    }


def _pct(values: list[float], p: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]
        if len(values) > 1
        else values[0]
    )


# --- orchestration --------------------------------------------------------------------------------


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--stream-requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the paths this many times")
    args = ap.parse_args()

    up_port, min_port, tb_port, admin_port, full_port, full_admin = (free_port() for _ in range(6))
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [
        spawn([sys.executable, __file__, "_upstream", str(up_port)]),
        spawn([sys.executable, __file__, "_minimal", str(min_port), upstream]),
    ]
    tmp = Path(tempfile.mkdtemp())
    cfg = tmp / "bench.yaml"
    cfg.write_text(
        f"pricing:\n  models:\n    {MODEL}: {{input_per_1m: 0.2, output_per_1m: 0.6}}\n"
        "logging:\n  access_log: off\n  level: WARNING\n"
    )
    full = tmp / "full.yaml"  # what a production deployment turns on: ledger, access log, audit
    full.write_text(
        f"pricing:\n  models:\n    {MODEL}: {{input_per_1m: 0.2, output_per_1m: 0.6}}\n"
        f"ledger:\n  path: {tmp / 'ledger.db'}\n"
        f"logging:\n  access_log: {tmp / 'access.log'}\n  level: WARNING\n"
        f"audit:\n  path: {tmp / 'audit.jsonl'}\n"
    )
    for conf, port, admin in ((cfg, tb_port, admin_port), (full, full_port, full_admin)):
        cmd = [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(conf)]
        cmd += ["--upstream", upstream, "--listen", f"127.0.0.1:{port}"]
        procs.append(spawn([*cmd, "--admin-listen", f"127.0.0.1:{admin}"]))
    paths = {
        "direct": upstream,
        "minimal_proxy": f"http://127.0.0.1:{min_port}",
        "tollbooth": f"http://127.0.0.1:{tb_port}",
        "tollbooth_full": f"http://127.0.0.1:{full_port}",
    }
    try:
        results = asyncio.run(_measure(paths, args))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    report(results, args)


async def _measure(paths: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    for url in paths.values():
        await wait_ready(url)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {k: {"tp": [], "ttft": []} for k in paths}
    for url in paths.values():  # warm-up: connections, JIT-free but caches and pools
        await throughput(url, 300, args.concurrency)
    for _ in range(args.rounds):
        for name, url in paths.items():
            runs[name]["tp"].append(await throughput(url, args.requests, args.concurrency))
            runs[name]["ttft"].append(await stream_ttft(url, args.stream_requests))
    out: dict[str, Any] = {}
    for name, r in runs.items():
        out[name] = {
            "rps": statistics.median(x["rps"] for x in r["tp"]),
            "latency_p50_ms": statistics.median(x["p50_ms"] for x in r["tp"]),
            "latency_p99_ms": statistics.median(x["p99_ms"] for x in r["tp"]),
            "stream_ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in r["ttft"]),
            "stream_ttft_p90_ms": statistics.median(x["ttft_p90_ms"] for x in r["ttft"]),
        }
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    direct, minimal, tb = results["direct"], results["minimal_proxy"], results["tollbooth"]
    full = results["tollbooth_full"]
    summary = {
        "tollbooth_rps_vs_minimal": tb["rps"] / minimal["rps"],
        "tollbooth_full_rps_vs_minimal": full["rps"] / minimal["rps"],
        "tollbooth_full_added_ttft_p50_ms_vs_direct": full["stream_ttft_p50_ms"]
        - direct["stream_ttft_p50_ms"],
        "tollbooth_added_ttft_p50_ms_vs_direct": tb["stream_ttft_p50_ms"]
        - direct["stream_ttft_p50_ms"],
        "minimal_added_ttft_p50_ms_vs_direct": minimal["stream_ttft_p50_ms"]
        - direct["stream_ttft_p50_ms"],
    }
    conditions = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "aiohttp": aiohttp.__version__,
        "requests_per_round": args.requests,
        "concurrency": args.concurrency,
        "stream_requests_per_round": args.stream_requests,
        "rounds": args.rounds,
        "stream_chunks": CHUNKS,
        "note": "load generator, upstream and proxy share the same machine; medians of rounds",
        "tollbooth": "metering, pricing, metrics; no ledger, access log off",
        "tollbooth_full": "plus SQLite ledger, JSON access log to a file, audit capture",
    }
    doc = {
        "conditions": conditions,
        "paths": results,
        "summary": summary,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overhead.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"{'path':<14} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'TTFT p50 ms':>12} {'TTFT p90 ms':>12}"
    )
    for name, r in results.items():
        print(
            f"{name:<14} {r['rps']:8.0f} {r['latency_p50_ms']:8.2f} {r['latency_p99_ms']:8.2f} "
            f"{r['stream_ttft_p50_ms']:12.3f} {r['stream_ttft_p90_ms']:12.3f}"
        )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        run_upstream(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_minimal":
        run_minimal_proxy(int(sys.argv[2]), sys.argv[3])
    else:
        main()
