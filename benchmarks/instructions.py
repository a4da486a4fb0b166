"""Instructions per request and per streamed chunk, of the minimal pass-through and of tollbooth,
counted by callgrind.

Run: `.venv/bin/python benchmarks/instructions.py [--rev REV] [--tree [LABEL=]PATH]` (needs
Debian's valgrind; about 5 minutes a tree; `--rev e714d0c --tree after=.` counts a commit beside
this checkout, whatever the layout of either).

Why: on the shared 2-core machine a throughput ratio moves by about ±0.1 from one round to the
next (`benchmarks/overhead.py`), so a change worth a few percent cannot be seen there. An
instruction count repeats to about 0.1%. It is not time: cache misses, branch mispredictions and
the kernel's side of every system call are not in it, and a Python-heavy path costs more time per
instruction than copying bytes in C. Use it to compare trees and to attribute tollbooth's own work;
use overhead.py for what a client gets.

How: each proxy runs under `valgrind --tool=callgrind` in front of overhead.py's fast upstream
(which runs natively). After a warm-up the counters are zeroed (`callgrind_control -z`), a fixed
load is sent, and the counters dumped (`-d`):
- requests: `--requests` non-streaming requests on 8 connections (16-token replies; 0: none, the
  streams alone);
- streams: `--streams` streams of `--tokens` one-token chunks, 8 at a time, with the upstream
  pacing each stream's events (`--pace`) so that, even at valgrind's speed, a read carries about one
  event, as it does under overhead.py's load (without pacing the slowed proxy reads many events at
  once and the minimal proxy forwards them as one write, which a fast proxy never sees). The
  client's reads that held more than one event are reported (`multi_event_reads`).
Counts are of the proxy's process, every thread (the ledger and log writers too).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
import overhead as ov
import pinned

CONNECTIONS = 8


def callgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p", "--dump-instr=no"]


def start(
    tmp: Path, upstream: str, trees: dict[str, Path]
) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    paths: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    port = ov.free_port()
    cmd = [sys.executable, ov.__file__, "_minimal", str(port), upstream]
    paths["minimal_proxy"] = (
        ov.spawn(callgrind(tmp / "minimal_proxy") + cmd),
        f"http://127.0.0.1:{port}",
    )
    for prefix, tree in trees.items():
        for kind in ("metering", "default"):
            name = f"{prefix}_{kind}"
            conf = tmp / f"{name}.yaml"
            conf.write_text(ov.PRICES + ov.tollbooth_config(kind, tmp / name))
            port, admin = ov.free_port(), ov.free_port()
            cmd, env = ov.tollbooth_command(tree)  # the tree's own CLI, wherever its layout has it
            cmd += ["serve", "--config", str(conf), "--upstream", upstream]
            cmd += ["--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"]
            paths[name] = (
                ov.spawn(callgrind(tmp / name) + cmd, cwd=tmp, env=env),
                f"http://127.0.0.1:{port}",
            )
    return paths


async def wait_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(2400):  # start-up under valgrind takes a minute or two
            try:
                async with s.post(url + "/v1/chat/completions", json={"model": ov.MODEL}) as r:
                    await r.read()
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not start")


async def requests(url: str, n: int) -> dict[str, int]:
    payload = {"model": ov.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    left = [n]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTIONS)) as s:

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    await r.read()
                    assert r.status == 200

        await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    return {"requests": n}


async def streams(url: str, n: int, tokens: int, pace: float) -> dict[str, int]:
    payload = {
        "model": ov.MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
        "bench_pace_s": pace,
    }
    left, chunks, multi = [n], [0], [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTIONS)) as s:

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    assert r.status == 200
                    async for data in r.content.iter_any():
                        multi[0] += data.count(b"\n\n") > 1
                chunks[0] += tokens

        await asyncio.gather(*(worker() for _ in range(CONNECTIONS)))
    return {"chunks": chunks[0], "multi_event_reads": multi[0]}


def zero(pid: int) -> None:
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)


def dump(pid: int, out: Path) -> int:
    """Dump the counters; the instructions counted since the last zero."""
    prefix = f"{out}.{pid}"
    before = set(glob.glob(prefix + "*"))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    for _ in range(100):
        new = set(glob.glob(prefix + "*")) - before
        if new:
            time.sleep(0.5)  # let it finish writing
            for line in Path(new.pop()).read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    return int(line.split()[1])
        time.sleep(0.1)
    raise RuntimeError(f"no callgrind dump from {pid}")


async def measure(
    paths: dict[str, tuple[subprocess.Popen[bytes], str]], tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    for _, url in paths.values():
        await wait_ready(url)
    out: dict[str, Any] = {}
    for name, (proc, url) in paths.items():
        await requests(url, 100)  # warm-up: connection pools, caches
        await streams(url, CONNECTIONS, 16, 0.0)
        per_request = None  # `--requests 0`: the streams alone
        if args.requests:
            zero(proc.pid)
            await requests(url, args.requests)
            per_request = dump(proc.pid, tmp / name) / args.requests
        zero(proc.pid)
        st = await streams(url, args.streams, args.tokens, args.pace)
        per_chunk = dump(proc.pid, tmp / name) / st["chunks"]
        out[name] = {"per_request": per_request, "per_chunk": per_chunk, **st}
        req = per_request or 0.0
        print(f"{name:<22} {req:10.0f} per request {per_chunk:9.0f} per chunk", flush=True)
    base = out["minimal_proxy"]
    for r in out.values():
        r["vs_minimal"] = {"per_chunk": r["per_chunk"] / base["per_chunk"]}
        if args.requests:
            r["vs_minimal"]["per_request"] = r["per_request"] / base["per_request"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--pace", type=float, default=0.02, help="seconds between a stream's events")
    ap.add_argument("--out", type=Path, default=ov.RESULTS / "instructions.json")
    ap.add_argument("--compare", type=Path, help="also count tollbooth from this checkout")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[LABEL=]PATH",
        help="count tollbooth from this checkout (repeatable; default: this one)",
    )
    ap.add_argument(
        "--rev",
        action="append",
        default=[],
        metavar="REV",
        help="count this repository's commit REV, exported to a temporary directory",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    chosen = [pinned.archive_rev(rev, tmp) for rev in args.rev]
    chosen += [pinned.parse_tree(spec) for spec in args.tree]
    trees = {t.label: t.path for t in chosen} or {"tollbooth": pinned.ROOT}
    commits = {t.label: t.commit for t in chosen}
    if args.compare is not None:  # the same configurations from another checkout, in the run
        trees["compare"] = args.compare.resolve()
    up_port = ov.free_port()
    upstream_url = f"http://127.0.0.1:{up_port}"
    upstream = ov.spawn([sys.executable, ov.__file__, "_upstream", str(up_port)])
    paths = start(tmp, upstream_url, trees)
    try:
        results = asyncio.run(measure(paths, tmp, args))
    finally:
        for proc, _ in [*paths.values(), (upstream, "")]:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in [*paths.values(), (upstream, "")]:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    valgrind = subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout
    doc = {
        "conditions": {
            "counter": "callgrind instructions (Ir) of the proxy's process, all threads",
            "valgrind": valgrind.strip(),
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
            "requests": args.requests,
            "connections": CONNECTIONS,
            "streams": args.streams,
            "stream_tokens": args.tokens,
            "pace_s": args.pace,
            "trees": {
                label: {
                    "path": str(path),
                    "commit": commits.get(label) or pinned.git(path, "rev-parse", "HEAD"),
                }
                for label, path in trees.items()
            },
        },
        "paths": results,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v["vs_minimal"] for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
