"""RSS of a running sidecar while many clients hold large request bodies (issue 21, item 6).

Run: `.venv/bin/python benchmarks/request_memory.py [--connections 40 100 200] [--mib 15]
[--tree PATH] [--extra KEY=VALUE ...]`. `--tree` runs the `tollbooth serve` of another checkout
(the code before a change); `--extra server.max_buffered_request_bytes=0` turns a limit off.

For each connection count, a fresh `tollbooth serve` (keys file, defaults otherwise, access log
off) in front of an upstream in this process that reads each request and answers only when
told. Two attacks, each from one key and from a key per connection:
- held: every connection sends a body's headers and all of it but the last 10 bytes, and waits;
- complete: every connection sends a whole body; the upstream holds its answer.
Once every byte sent has reached the sidecar's socket (SIOCOUTQ 0 on each client socket) and the
answers to refused requests are in, the sidecar's VmRSS and VmHWM (its peak) are read from /proc.
Results are printed and written to benchmarks/results/request_memory.json with the conditions.
Nothing here is asserted: memory is reported here, and bounded in tests/test_request_memory.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import platform
import struct
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from tollbooth_lab.bench.runner import free_port

from sidecar.proxy.identity import add_key

RESULTS = Path(__file__).parent / "results"
MiB = 1024 * 1024
ROOT = Path(__file__).parents[1]


def body_of(size: int) -> bytes:
    shell = json.dumps({"model": "m", "max_tokens": 2, "messages": [{"content": ""}]})
    cut = shell.rindex('""') + 1
    return (shell[:cut] + "a" * (size - len(shell)) + shell[cut:]).encode()


def proc_status(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) / 1024
    return out


class Upstream:
    """Reads every request whole, then waits for `release` before answering."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.app = web.Application(client_max_size=1 << 30)
        self.app.router.add_post("/{tail:.*}", self.handle)
        self.app.router.add_get("/{tail:.*}", self.ok)

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        await self.release.wait()
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"choices": [], "model": "m", "usage": usage})


async def start_sidecar(
    tmp: Path, tree: Path, upstream: str, keys: str, extra: dict[str, Any]
) -> tuple[asyncio.subprocess.Process, int]:
    port, admin = free_port(), free_port()
    config: dict[str, Any] = {
        "upstream": {"url": upstream},
        "identity": {"keys_file": keys},
        "logging": {"access_log": "off"},
        "audit": {"path": str(tmp / "audit.jsonl")},
        "gpu": {"enabled": False},
    }
    for dotted, value in extra.items():
        node = config
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = yaml.safe_load(value)
    (tmp / "c.yaml").write_text(yaml.safe_dump(config))
    log = (tmp / "tb.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sidecar.core.cli", "serve", "--config", str(tmp / "c.yaml"),
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
        cwd=tree, stdout=log, stderr=log,
    )  # fmt: skip
    for _ in range(400):
        with contextlib.suppress(OSError):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc, port
        await asyncio.sleep(0.05)
    raise RuntimeError((tmp / "tb.log").read_text()[-2000:])


def unsent(writer: asyncio.StreamWriter) -> int:
    sock = writer.get_extra_info("socket")
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])


async def status_line(reader: asyncio.StreamReader) -> int:
    line = await reader.readline()
    return int(line.split()[1]) if line else 0


async def attack(
    port: int, keys: list[str], body: bytes, n: int, held: bool
) -> tuple[list[asyncio.StreamWriter], list[asyncio.Task[int]]]:
    writers, answers = [], []
    for i in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {keys[i % len(keys)]}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        answers.append(asyncio.ensure_future(status_line(reader)))
        writer.write(head.encode() + (body[:-10] if held else body))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writers.append(writer)
    return writers, answers


async def settle(writers: list[asyncio.StreamWriter], answers: list[asyncio.Task[int]]) -> None:
    """Until every byte sent has been acked, or its connection answered; bounded."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pending = [
            w for w, a in zip(writers, answers, strict=True) if not a.done() and unsent(w) > 0
        ]
        if not pending:
            return
        await asyncio.sleep(0.05)


async def one(
    tree: Path, n: int, size: int, held: bool, per_conn_keys: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    up = Upstream()
    runner = web.AppRunner(up.app, auto_decompress=False)
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        keys_path = str(tmp / "keys.yaml")
        keys = [add_key(keys_path, f"u{i}", None) for i in range(n if per_conn_keys else 1)]
        proc, port = await start_sidecar(tmp, tree, f"http://127.0.0.1:{up_port}", keys_path, extra)
        try:
            before = proc_status(proc.pid)
            writers, answers = await attack(port, keys, body_of(size), n, held)
            await settle(writers, answers)
            await asyncio.sleep(0.5)  # let the last reads land in the process (a measurement)
            after = proc_status(proc.pid)
            statuses = [a.result() for a in answers if a.done()]
            up.release.set()
            for w in writers:
                w.close()
            for a in answers:
                a.cancel()
        finally:
            proc.terminate()
            await proc.wait()
    await runner.cleanup()
    return {
        "attack": "held" if held else "complete",
        "connections": n,
        "keys": "one per connection" if per_conn_keys else "one",
        "body_mib": size / MiB,
        "rss_before_mib": round(before["VmRSS"], 1),
        "rss_after_mib": round(after["VmRSS"], 1),
        "rss_peak_mib": round(after["VmHWM"], 1),
        "answered_before_the_body": {str(s): statuses.count(s) for s in sorted(set(statuses))},
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, nargs="+", default=[40, 100, 200])
    ap.add_argument("--mib", type=float, default=15)
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--out", type=Path, default=RESULTS / "request_memory.json")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.extra)
    rows = []
    for n in args.connections:
        for held in (True, False):
            for per_conn in (False, True):
                row = await one(args.tree, n, int(args.mib * MiB), held, per_conn, extra)
                print(json.dumps(row))
                rows.append(row)
    conditions = {
        "tree": str(args.tree),
        "extra": extra,
        "python": sys.version.split()[0],
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
