"""Proxy overhead: the same loads sent direct, through a minimal pass-through proxy, and through
tollbooth with metering only and with its default outputs (ledger, JSON access log, audit), in
one run.

Run: `.venv/bin/python benchmarks/overhead.py [--rounds N] [--stream-seconds S] ...`

Loads (the paths take turns, `--rounds` times, each round starting with the next path; medians
are reported, and ratios to the minimal proxy are taken round by round, then the median):
- streaming: `--streams` concurrent clients (64), each opening streams of `--tokens` one-token
  chunks (256) back to back: content chunks/s delivered, TTFT p50/p99 under that load, and the
  p99 gap between consecutive content chunks of one stream.
- non-streaming: `--connections` (8) closed-loop connections, 16-token replies: requests/s and
  latency p50/p99.
- idle TTFT: sequential short streams, nothing else running.
For the two proxies and tollbooth: CPU seconds (user+system, all threads, from /proc) per 1,000
content chunks and per non-streaming request, and resident memory idle (after start-up) and
loaded (the peak, VmHWM).

The upstream is a fast fake in its own process that writes one SSE event per token and yields to
its event loop between events, so 64 streams interleave as a batched engine's do; every server
runs in its own process (uvloop). It answers `stream_options` as vLLM does: the usage chunk for
`include_usage`, and running totals on every chunk for `continuous_usage_stats`, which tollbooth
asks for by default (`metering.continuous_usage`) and cuts back out, so that work is measured.
Results go to benchmarks/results/overhead.json with the conditions (CPU count, load average,
versions). Nothing here is asserted: speed is reported, never tested.
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
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

MODEL = "bench-model"
REPLY_TOKENS = 16  # the non-streaming reply
RESULTS = Path(__file__).parent / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the upstream: vLLM's wire format, compact JSON, one event per token -------------------------


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, running: int | None = None) -> bytes:
    """A chunk as vLLM writes it; with `running`, its running totals last (continuous_usage_stats,
    in vLLM's field order)."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    chunk: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [choice],
    }
    if running is not None:
        chunk["usage"] = {
            "prompt_tokens": 12,
            "total_tokens": 12 + running,
            "completion_tokens": running,
        }
    return _event(chunk)


WORDS = ["the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]
ROLE = _chunk({"role": "assistant", "content": ""})
TOKENS = [_chunk({"content": WORDS[i % len(WORDS)]}) for i in range(4096)]
# with running totals: what vLLM sends when asked for continuous_usage_stats (tollbooth asks)
ROLE_RUNNING = _chunk({"role": "assistant", "content": ""}, running=0)
TOKENS_RUNNING = [_chunk({"content": WORDS[i % len(WORDS)]}, running=i + 1) for i in range(4096)]
DONE = b"data: [DONE]\n\n"


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}


BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "hello " * REPLY_TOKENS},
            }
        ],
        "usage": _usage(REPLY_TOKENS),
    },
    separators=(",", ":"),
).encode()


def stream_events(body: dict[str, Any]) -> tuple[bytes, list[bytes], list[bytes]]:
    """What the upstream streams for a request `body`: the role event, the token events (one
    token each), and what follows them (finish, usage when asked, [DONE])."""
    n = min(int(body.get("max_tokens") or 16), len(TOKENS))
    options = body.get("stream_options") or {}
    running = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
    tail = [_chunk({}, "length", n if running else None)]
    if options.get("include_usage"):
        final = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000}
        tail.append(_event({**final, "model": MODEL, "choices": [], "usage": _usage(n)}))
    tokens = TOKENS_RUNNING if running else TOKENS
    return ROLE_RUNNING if running else ROLE, tokens[:n], [*tail, DONE]


async def upstream_handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=BODY, content_type="application/json")
    first, tokens, tail = stream_events(body)
    pace = float(body.get("bench_pace_s") or 0)  # benchmarks/instructions.py: one event a read
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(first)
    for event in tokens:
        await asyncio.sleep(pace)  # one event per write; other streams' events go between them
        await resp.write(event)
    for event in tail:
        await resp.write(event)
    return resp


def run_upstream(port: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream_handler)
    _serve(app, port)


def run_minimal_proxy(port: int, upstream: str) -> None:
    """The least a correct streaming proxy does: forward, stream back, nothing else."""
    state: dict[str, aiohttp.ClientSession] = {}

    async def ctx(app: web.Application) -> Any:
        state["s"] = aiohttp.ClientSession(
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
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


# --- the process under test: CPU and memory from /proc -------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime, every thread


def memory(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


# --- load -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(400):
            try:
                async with s.post(url + "/v1/chat/completions", json={"model": MODEL}) as r:
                    await r.read()
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not start")


async def requests_load(url: str, seconds: float, connections: int) -> dict[str, float]:
    """Closed loop of non-streaming requests for `seconds`."""
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    latencies: list[float] = []
    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn) as s:
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while (t := time.perf_counter()) < stop_at:
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    await r.read()
                    assert r.status == 200
                latencies.append(time.perf_counter() - t)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        wall = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "rps": len(latencies) / wall,
        "p50_ms": pct(latencies, 50) * 1e3,
        "p99_ms": pct(latencies, 99) * 1e3,
    }


class StreamStats:
    def __init__(self) -> None:
        self.chunks = 0
        self.streams = 0
        self.ttft: list[float] = []
        self.gaps: list[float] = []


async def read_stream(r: aiohttp.ClientResponse, t0: float, tokens: int, st: StreamStats) -> None:
    """Count content events (the 2nd..tokens+1th event; the first is the role chunk)."""
    events, last_byte, last_at = 0, 0, 0.0
    async for data in r.content.iter_any():
        now = time.perf_counter()
        before = events
        events += data.count(b"\n\n") + (last_byte == 10 and data[0] == 10)
        last_byte = data[-1]
        content = min(events - 1, tokens) - max(before - 1, 0)
        if content <= 0:
            continue
        if before <= 1:
            st.ttft.append(now - t0)
        else:
            st.gaps.append(now - last_at)
        last_at = now
        st.chunks += content
    assert events >= tokens + 2, (events, tokens)
    st.streams += 1


async def stream_load(url: str, seconds: float, clients: int, tokens: int) -> dict[str, float]:
    """`clients` concurrent clients, each opening streams back to back for `seconds`."""
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
    }
    st = StreamStats()
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as s:
        stop_at = time.perf_counter() + seconds

        async def client() -> None:
            while (t0 := time.perf_counter()) < stop_at:
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200
                    await read_stream(r, t0, tokens, st)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return {
        "streams": st.streams,
        "chunks": st.chunks,
        "chunks_per_s": st.chunks / wall,
        "ttft_p50_ms": pct(st.ttft, 50) * 1e3,
        "ttft_p99_ms": pct(st.ttft, 99) * 1e3,
        "gap_p99_ms": pct(st.gaps, 99) * 1e3,
    }


async def idle_ttft(url: str, n: int) -> dict[str, float]:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    st = StreamStats()
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url + "/v1/chat/completions", json=payload) as r:
                await read_stream(r, t0, 16, st)
    return {"ttft_p50_ms": pct(st.ttft, 50) * 1e3, "ttft_p90_ms": pct(st.ttft, 90) * 1e3}


def pct(values: list[float], p: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1]


# --- orchestration --------------------------------------------------------------------------------


def spawn(
    args: list[str],
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start a server; its stderr goes to `log` (to say why one did not start), else nowhere."""
    out = subprocess.DEVNULL
    if log is None:
        return subprocess.Popen(args, stdout=out, stderr=out, cwd=cwd, env=env)
    with log.open("wb") as err:  # the child holds its own copy of the descriptor
        return subprocess.Popen(args, stdout=out, stderr=err, cwd=cwd, env=env)


PRICES = f"pricing:\n  models:\n    {MODEL}: {{input_per_1m: 0.2, output_per_1m: 0.6}}\n"


KINDS = ("metering", "default", "default_no_running")


def tollbooth_config(kind: str, files: Path) -> str:
    if kind == "metering":  # metering, pricing and metrics only
        return "logging:\n  access_log: off\n  level: WARNING\naudit:\n  enabled: false\n"
    # what a production deployment has on: the ledger, the JSON access log, audit capture
    conf = (
        f"ledger:\n  path: {files}-ledger.db\n"
        f"logging:\n  access_log: {files}-access.log\n  level: WARNING\n"
        f"audit:\n  path: {files}-audit.jsonl\n"
    )
    if kind == "default_no_running":  # without vLLM's running totals (exact disconnect billing)
        conf += "metering:\n  continuous_usage: false\n"
    return conf


def start_upstream(port: int, pin: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """The fake engine in its own process; `pin` prefixes the command (e.g. `taskset -c 1`)."""
    return spawn([*pin, sys.executable, __file__, "_upstream", str(port)])


def start_minimal(port: int, upstream: str, pin: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return spawn([*pin, sys.executable, __file__, "_minimal", str(port), upstream])


def tollbooth_command(tree: Path) -> tuple[list[str], dict[str, str]]:
    """How to start the tollbooth of a checkout: its `tollbooth` console script, read from the
    tree's pyproject.toml at run time (the CLI module moves as the code is laid out), run by this
    interpreter with the tree first on the path, so that two trees compared run on the same
    dependencies. Nothing is written into the tree (no bytecode)."""
    with (tree / "pyproject.toml").open("rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["tollbooth"]
    module, _, func = target.partition(":")
    code = f"import sys; from {module} import {func} as main; sys.argv[0] = 'tollbooth'; "
    code += "sys.exit(main())"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return [sys.executable, "-c", code], env


def start_tollbooth(
    tree: Path, name: str, kind: str, tmp: Path, upstream: str, pin: tuple[str, ...] = ()
) -> tuple[str, subprocess.Popen[bytes]]:
    """One tollbooth of `kind` (KINDS) from `tree` in front of `upstream`: its URL and process;
    its files (config, ledger, logs, stderr) under `tmp`, named `name`."""
    conf = tmp / f"{name}.yaml"
    conf.write_text(PRICES + tollbooth_config(kind, tmp / name))
    port, admin = free_port(), free_port()
    cmd, env = tollbooth_command(tree)
    cmd += ["serve", "--config", str(conf), "--upstream", upstream]
    cmd += ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"]
    proc = spawn([*pin, *cmd], cwd=tmp, env=env, log=tmp / f"{name}.stderr")
    return f"http://127.0.0.1:{port}", proc


def start_paths(
    tmp: Path, compare: Path | None
) -> tuple[dict[str, str], dict[str, int], list[subprocess.Popen[bytes]]]:
    up_port, min_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    procs = {
        "direct": start_upstream(up_port),
        "minimal_proxy": start_minimal(min_port, upstream),
    }
    urls = {"direct": upstream, "minimal_proxy": f"http://127.0.0.1:{min_port}"}
    trees = {"tollbooth": Path(__file__).resolve().parent.parent}
    if compare is not None:  # the same configurations from another checkout, in the same run
        trees["compare"] = compare.resolve()
    for prefix, tree in trees.items():
        for kind in KINDS:
            name = f"{prefix}_{kind}"
            urls[name], procs[name] = start_tollbooth(tree, name, kind, tmp, upstream)
    pids = {name: p.pid for name, p in procs.items()}
    return urls, pids, list(procs.values())


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)  # the load generator too: it shares the CPUs
    except ImportError:
        return asyncio.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8, help="alternate the paths this many times")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--tokens", type=int, default=256, help="one-token chunks per stream")
    ap.add_argument("--stream-seconds", type=float, default=3.0)
    ap.add_argument("--connections", type=int, default=8, help="non-streaming connections")
    ap.add_argument("--request-seconds", type=float, default=2.0)
    ap.add_argument("--idle-streams", type=int, default=50, help="sequential, for idle TTFT")
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead.json")
    ap.add_argument(
        "--compare",
        type=Path,
        help="also run tollbooth from this checkout (e.g. `git worktree` of the previous commit)",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    urls, pids, procs = start_paths(tmp, args.compare)
    load_before = os.getloadavg()
    try:
        results = _run(_measure(urls, pids, args))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    report(results, args, load_before, os.getloadavg())


async def _measure(
    urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace
) -> dict[str, Any]:
    for url in urls.values():
        await wait_ready(url)
    await asyncio.sleep(1.0)  # let start-up settle before reading idle memory
    idle_rss = {name: memory(pid)["VmRSS"] for name, pid in pids.items()}
    for url in urls.values():  # warm-up: connection pools, caches
        await requests_load(url, 0.5, args.connections)
        await stream_load(url, 0.5, args.streams, args.tokens)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        k: {"stream": [], "req": [], "idle": []} for k in urls
    }
    names = list(urls)
    for i in range(args.rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each goes first in turn
            url, pid = urls[name], pids[name]
            cpu = cpu_seconds(pid)
            r = await stream_load(url, args.stream_seconds, args.streams, args.tokens)
            r["cpu_ms_per_1k_chunks"] = (cpu_seconds(pid) - cpu) / r["chunks"] * 1e6
            runs[name]["stream"].append(r)
            cpu = cpu_seconds(pid)
            r = await requests_load(url, args.request_seconds, args.connections)
            r["cpu_ms_per_request"] = (cpu_seconds(pid) - cpu) / r["requests"] * 1e3
            runs[name]["req"].append(r)
            runs[name]["idle"].append(await idle_ttft(url, args.idle_streams))
    out: dict[str, Any] = {}
    base = runs["minimal_proxy"]
    for name, r in runs.items():
        out[name] = {
            "stream": _medians(r["stream"]),
            "requests": _medians(r["req"]),
            "idle": _medians(r["idle"]),
            "rss_mib": {"idle": idle_rss[name], "loaded_peak": memory(pids[name])["VmHWM"]},
            # paired with the minimal proxy's run of the same round, then the median
            "vs_minimal": {
                "chunks_per_s": _paired(r["stream"], base["stream"], "chunks_per_s"),
                "rps": _paired(r["req"], base["req"], "rps"),
            },
            # how much the per-round ratios vary: the first and third quartiles
            "vs_minimal_quartiles": {
                "chunks_per_s": _quartiles(r["stream"], base["stream"], "chunks_per_s"),
                "rps": _quartiles(r["req"], base["req"], "rps"),
            },
            # CPU per unit over the minimal proxy's, paired by round: tollbooth's own cost, beside
            # what the sharing of two cores made of its throughput (it varies as much between runs)
            "cpu_vs_minimal": {
                "per_1k_chunks": _paired(r["stream"], base["stream"], "cpu_ms_per_1k_chunks"),
                "per_request": _paired(r["req"], base["req"], "cpu_ms_per_request"),
            },
            "rounds": {"stream": r["stream"], "requests": r["req"]},
        }
    return out


def _ratios(runs: list[dict[str, float]], base: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] / b[key] for r, b in zip(runs, base, strict=True)]


def _paired(runs: list[dict[str, float]], base: list[dict[str, float]], key: str) -> float:
    return statistics.median(_ratios(runs, base, key))


def _quartiles(runs: list[dict[str, float]], base: list[dict[str, float]], key: str) -> list[float]:
    ratios = _ratios(runs, base, key)
    if len(ratios) < 2:
        return [ratios[0], ratios[0]]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return [q1, q3]


def _medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def report(
    results: dict[str, Any],
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    summary = {
        name: {
            "chunks_per_s_vs_minimal": r["vs_minimal"]["chunks_per_s"],
            "rps_vs_minimal": r["vs_minimal"]["rps"],
        }
        for name, r in results.items()
        if name not in ("direct", "minimal_proxy")
    }
    conditions = {
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "aiohttp": aiohttp.__version__,
        "rounds": args.rounds,
        "stream_clients": args.streams,
        "stream_tokens": args.tokens,
        "stream_seconds_per_round": args.stream_seconds,
        "request_connections": args.connections,
        "request_seconds_per_round": args.request_seconds,
        "reply_tokens": REPLY_TOKENS,
        "idle_ttft_streams": args.idle_streams,
        "note": "load generator, upstream and proxies share the machine; medians of rounds; "
        "x minimal: each round's figure over the minimal proxy's in the same round, median",
        "tollbooth_metering": "metering, pricing, metrics; ledger, access log and audit off",
        "tollbooth_default": "plus SQLite ledger, JSON access log to a file, audit capture",
        "tollbooth_default_no_running": "default, with metering.continuous_usage off: no "
        "running totals asked of vLLM (a client leaving mid-stream is then billed its hold)",
        "compare": str(args.compare) if args.compare else None,
        "cpu_of_direct": "the upstream's own CPU (direct has no proxy)",
    }
    doc = {
        "conditions": conditions,
        "paths": results,
        "summary": summary,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(spread(results))
    print(json.dumps(summary, indent=2))


def table(results: dict[str, Any]) -> str:
    head = (
        f"{'path':<28} {'chunks/s':>9} {'x min':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'gap p99':>8} {'req/s':>7} {'x min':>5} {'p50':>6} {'p99':>6} {'idle TTFT':>9} "
        f"{'ms CPU/1k ch':>12} {'ms CPU/req':>10} {'RSS idle':>8} {'RSS peak':>8}"
    )
    lines = [head]
    for name, r in results.items():
        s, q, x = r["stream"], r["requests"], r["vs_minimal"]
        lines.append(
            f"{name:<28} {s['chunks_per_s']:9.0f} {x['chunks_per_s']:5.2f} "
            f"{s['ttft_p50_ms']:9.2f} {s['ttft_p99_ms']:9.2f} {s['gap_p99_ms']:8.2f} "
            f"{q['rps']:7.0f} {x['rps']:5.2f} {q['p50_ms']:6.2f} {q['p99_ms']:6.2f} "
            f"{r['idle']['ttft_p50_ms']:9.3f} {s['cpu_ms_per_1k_chunks']:12.1f} "
            f"{q['cpu_ms_per_request']:10.3f} {r['rss_mib']['idle']:8.1f} "
            f"{r['rss_mib']['loaded_peak']:8.1f}"
        )
    return "\n".join(lines)


def spread(results: dict[str, Any]) -> str:
    """The x-minimal figures with the quartiles of their per-round ratios (what a rerun may give),
    and CPU per chunk and per request over the minimal proxy's (paired by round, median)."""
    head = f"{'x minimal, median (quartiles)':<28} {'chunks/s':>18} {'req/s':>18}"
    lines = [f"{head} {'CPU/chunk':>9} {'CPU/req':>8}"]
    for name, r in results.items():
        if name == "minimal_proxy":
            continue
        x, q, cpu = r["vs_minimal"], r["vs_minimal_quartiles"], r["cpu_vs_minimal"]
        cells = [
            f"{x[k]:.2f} ({q[k][0]:.2f}-{q[k][1]:.2f})".rjust(18) for k in ("chunks_per_s", "rps")
        ]
        cells += [f"{cpu['per_1k_chunks']:9.2f}", f"{cpu['per_request']:8.2f}"]
        lines.append(f"{name:<28} {' '.join(cells)}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        run_upstream(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_minimal":
        run_minimal_proxy(int(sys.argv[2]), sys.argv[3])
    else:
        main()
