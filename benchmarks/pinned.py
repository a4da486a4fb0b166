"""Proxy overhead with the proxy alone on its core and wrk as the load generator.

Run: `make bench-pinned` or `.venv/bin/python benchmarks/pinned.py [--tree [LABEL=]PATH ...]`
(needs `wrk`: `sudo apt-get install wrk` on Debian/Ubuntu; and at least two CPUs).

benchmarks/overhead.py drives its paths with a Python load generator sharing the cores with the
proxies, which pulls every ratio toward 1. Here the process under test (the minimal pass-through
proxy, or tollbooth with metering only or with its default outputs) runs pinned to one CPU
(`--proxy-cpu`, 0) and nothing else of the benchmark does; the fake upstream and wrk (one thread)
run pinned to the other (`--load-cpu`, 1). The minimal proxy, the tollbooth start-up and the
events the upstream sends are overhead.py's; the upstream itself is, by default, a leaner server
of the same bytes (raw asyncio: overhead.py's aiohttp one costs about as much CPU per streamed
event as the minimal proxy, so on the load CPU it would cap the streams; `--upstream aiohttp`
runs that one). Every tollbooth and the minimal proxy run at once, each idle while another is
measured; rounds take the targets in turn, each round starting one later.

Loads, per target and round: non-streaming requests/s (`--connections` closed-loop connections,
16-token replies) and streaming chunks/s (`--streams` connections, each stream `--tokens`
one-token chunks: chunks/s = completed streams/s x tokens). Before the rounds, a check pass reads
every response body in wrk (benchmarks/pinned.lua) and requires each to be whole: status 200 and,
for a stream, exactly `--tokens` content chunks ending with `data: [DONE]`; in the rounds, the
bytes wrk read must cover that many whole responses.

What one write and one read carry, in the streams: the lean upstream writes each stream's next
`--events-per-write` events (default 8) in one write, every event still its own HTTP chunk. With
one event a write, the upstream's write(2) and wrk's read(2) per event cost the load CPU about as
much per chunk as the minimal proxy costs its own (measured on 2 vCPUs: the load CPU ~0.9-1.0
busy with every target, direct under 1x the minimal proxy, so the streams measured the load
side). A saturated proxy reads many events at once whatever the upstream's writes (measured, one
event a write: 7 to 40 a read), and with 8 a write more (50 to 60 a read for the minimal proxy, 70
to 110 for tollbooth): per-read costs, which the minimal proxy mostly is, are spread over more
chunks, per-event ones (tollbooth's metering) are not, so the ratio to the minimal proxy is the
stricter for tollbooth, and CPU per chunk is of that many events a read, not of one (a real engine
at decode pace sends one event a read: a proxy's CPU per chunk is then higher). Each run records
the proxy's and the upstream's read/write calls per chunk (/proc/PID/io); the conditions say N.

Reported: medians of rounds, and per target the median and quartiles of its per-round ratio to the
minimal proxy's figure in the same round. Whether the load side was the bottleneck is checked
and said: wrk's CPU per run (must stay well below a core), the proxy's CPU (near one core when it
is the bottleneck), how busy each CPU was and how much of that was neither the proxy nor the load
side (other work on the machine: noise), and direct against the minimal proxy (direct must be
well above). `--tree` (repeatable) runs the tollbooth of other checkouts in the same rounds,
e.g. before and after a change: `--rev e714d0c --tree after=.` (`--rev` exports a commit
of this repository to a temporary directory), or `git worktree add /tmp/before e714d0c` and
`--tree before=/tmp/before --tree after=.`. Results, with the conditions (CPU model, load
average before and after, versions, each tree's commit), go to benchmarks/results/pinned.json.
Nothing is asserted: speed is reported, never tested.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import overhead as ov

ROOT = Path(__file__).resolve().parent.parent
LUA = Path(__file__).with_name("pinned.lua")
KINDS = ("metering", "default")  # overhead.KINDS; `--kinds` takes default_no_running too
NO_WRK = (
    "wrk is not installed. Install it with `sudo apt-get install wrk` (Debian/Ubuntu; the package "
    "is `wrk`), `brew install wrk` (macOS), or build it from https://github.com/wg/wrk."
)


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes]  # the process under test; for direct, the upstream itself
    tree: str | None = None
    kind: str | None = None
    idle_rss_mib: float = 0.0
    shortest_body: dict[str, int] = field(default_factory=dict)  # of the check pass, per load
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"req": [], "stream": []})


@dataclass
class Tree:
    label: str
    path: Path
    commit: str | None
    dirty: bool | None
    imports_from: str = ""


# --- a leaner fake engine: overhead.py's events, one write each, without aiohttp's per-write cost -


def _framed(event: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(event), event)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(ov.BODY),
    ov.BODY,
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
FRAMED = {e: _framed(e) for e in [ov.ROLE, ov.ROLE_RUNNING, *ov.TOKENS, *ov.TOKENS_RUNNING]}


class Engine:
    """Every open stream gets its next event in each step, as a batched engine's decode step
    gives each sequence its next token; a step runs as soon as the last one has: the fastest
    this fake can go. The events are overhead.py's (stream_events). With `per_write` 1 each
    event is one write; with N, a step gives each stream its next N consecutive events in one
    write (an engine N decode steps ahead of the proxy's reads, as when it outruns them), so
    the load side's syscalls per chunk fall N-fold and every read behind it carries N events
    or more (pinned.py measures and reports how many)."""

    def __init__(self, per_write: int = 1) -> None:
        self.streams: list[tuple[asyncio.Transport, list[bytes]]] = []
        self.stepping = False
        self.per_write = per_write

    def add(self, transport: asyncio.Transport, events: list[bytes], done: Any) -> None:
        self.streams.append((transport, [done, *reversed(events)]))  # popped from the end
        if not self.stepping:
            self.stepping = True
            asyncio.get_running_loop().call_soon(self.step)

    def step(self) -> None:
        alive = []
        for transport, events in self.streams:
            if transport.is_closing():
                continue
            ended = events[-1]
            if callable(ended):
                ended()  # the stream has ended: the connection takes its next request
                continue
            if self.per_write == 1:
                transport.write(events.pop())
            else:
                n = min(self.per_write, len(events) - 1)  # never the end marker
                transport.write(b"".join(events[: -n - 1 : -1]))
                del events[-n:]
            alive.append((transport, events))
        self.streams = alive
        self.stepping = bool(alive)
        if alive:
            asyncio.get_running_loop().call_soon(self.step)


class LeanHTTP(asyncio.Protocol):
    """Just enough HTTP/1.1 for the benchmark's clients: keep-alive, Content-Length bodies."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.buf, self.busy = engine, b"", False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:  # a request sent while a stream is going waits for its end
            self.next_request()

    def next_request(self) -> None:
        self.busy = False
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:])}
        if "chunked" in fields.get("transfer-encoding", "").lower():
            self.transport.write(b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\n\r\n")
            self.transport.close()
            return
        size = int(fields.get("content-length", 0))
        if len(self.buf) < end + 4 + size:
            return
        body, self.buf = self.buf[end + 4 : end + 4 + size], self.buf[end + 4 + size :]
        self.busy = True
        self.answer(head[0].split(" ")[1], body)

    def answer(self, path: str, raw: bytes) -> None:
        assert self.transport is not None
        if path != "/v1/chat/completions" or not raw:
            self.transport.write(NOT_FOUND)
            return self.next_request()
        body = json.loads(raw)
        if not body.get("stream"):
            self.transport.write(REPLY)
            return self.next_request()
        first, tokens, tail = ov.stream_events(body)
        events = [FRAMED.get(e) or _framed(e) for e in (first, *tokens)]
        self.transport.write(STREAM_HEAD + events[0])
        last = b"".join(_framed(e) for e in tail) + b"0\r\n\r\n"
        self.engine.add(self.transport, [*events[1:], last], self.next_request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def run_lean_upstream(port: int, per_write: int) -> None:
    async def serve() -> None:
        engine = Engine(per_write)
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
        server = await loop.create_server(lambda: LeanHTTP(engine), "127.0.0.1", port)
        async with server:
            await stop

    ov._run(serve())


def start_upstream(kind: str, port: int, cpu: int, per_write: int) -> subprocess.Popen[bytes]:
    if kind == "aiohttp":
        return ov.start_upstream(port, pin(cpu))
    argv = [sys.executable, __file__, "_lean_upstream", str(port), str(per_write)]
    return ov.spawn([*pin(cpu), *argv])


# --- the trees under test -------------------------------------------------------------------------


def git(path: Path, *args: str) -> str | None:
    r = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def parse_tree(spec: str) -> Tree:
    """`LABEL=PATH` or `PATH` (labelled by its directory name)."""
    label, sep, path = spec.partition("=")
    if not sep or "/" in label:
        label, path = "", spec
    where = Path(path).resolve()
    if not (where / "pyproject.toml").is_file():
        sys.exit(f"--tree {spec}: {where} has no pyproject.toml (not a tollbooth checkout)")
    commit = git(where, "rev-parse", "HEAD")
    status = git(where, "status", "--porcelain", "--untracked-files=no")
    dirty = None if status is None else bool(status)
    return Tree(re.sub(r"\W", "_", label or where.name), where, commit, dirty)


def archive_rev(rev: str, tmp: Path) -> Tree:
    """`--rev REV`: this repository's commit REV, exported (git archive) under `tmp`."""
    commit = git(ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}")
    if commit is None:
        sys.exit(f"--rev {rev}: not a commit of {ROOT}")
    where = tmp / f"rev-{commit[:12]}"
    where.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return Tree(re.sub(r"\W", "_", rev), where, commit, False)


def check_imports(tree: Tree, tmp: Path) -> None:
    """The tollbooth started for a tree must be that tree's code, not an installed copy."""
    cmd, env = ov.tollbooth_command(tree.path)
    module = cmd[-1].split(" import ", 1)[0].removeprefix("import sys; from ")
    probe = f"import importlib.util as u; print(u.find_spec({module!r}).origin)"
    r = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp, capture_output=True)
    tree.imports_from = r.stdout.decode().strip()
    if not tree.imports_from.startswith(str(tree.path) + os.sep):
        sys.exit(f"--tree {tree.path}: {module} imports from {tree.imports_from or r.stderr!r}")


# --- processes, pinned ----------------------------------------------------------------------------


def pin(cpu: int) -> tuple[str, ...]:
    return ("taskset", "--cpu-list", str(cpu))


def allowed_cpus(pid: int) -> list[str]:
    """Cpus_allowed_list of every thread of `pid` (distinct values)."""
    found = set()
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return sorted(found)


def start_targets(
    args: argparse.Namespace, trees: list[Tree], tmp: Path
) -> tuple[list[Target], subprocess.Popen[bytes]]:
    up_port, min_port = ov.free_port(), ov.free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    up = start_upstream(args.upstream, up_port, args.load_cpu, args.events_per_write)
    targets = [Target("direct", upstream, up)]
    minimal = ov.start_minimal(min_port, upstream, pin(args.proxy_cpu))
    targets.append(Target("minimal_proxy", f"http://127.0.0.1:{min_port}", minimal))
    for tree in trees:
        for kind in args.kinds:
            name = f"{tree.label}_{kind}"
            url, proc = ov.start_tollbooth(
                tree.path, name, kind, tmp, upstream, pin(args.proxy_cpu)
            )
            targets.append(Target(name, url, proc, tree.label, kind))
    return targets, up


def wait_started(targets: list[Target], tmp: Path) -> None:
    for t in targets:
        try:
            ov._run(ov.wait_ready(t.url))
        except (RuntimeError, aiohttp.ClientError) as e:
            log = tmp / f"{t.name}.stderr"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            sys.exit(f"{t.name} did not start ({e}); its stderr ends:\n{tail}")
    time.sleep(1.0)  # start-up settles before idle memory is read
    for t in targets:
        t.idle_rss_mib = ov.memory(t.proc.pid)["VmRSS"]


# --- one wrk run, and what each CPU did meanwhile -------------------------------------------------


def cpu_times() -> dict[int, tuple[float, float, float]]:
    """Seconds since boot of each CPU in tasks (user, nice, system), in interrupts (irq, softirq)
    and stolen by the hypervisor, from /proc/stat."""
    times = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *ticks = line.split()
        if name.startswith("cpu") and name != "cpu":
            t = [int(x) / ov.CLK_TCK for x in ticks]
            times[int(name[3:])] = (t[0] + t[1] + t[2], t[5] + t[6], t[7])
    return times


def cpu_use(
    r: dict[str, Any], role: str, before: Any, after: Any, ours: float, wall: float
) -> None:
    """How busy the CPU was, and how much of it was not the benchmark's processes: `*_other`,
    all of it (other tasks, interrupts, steal: an upper bound of the noise, since the kernel may
    keep our own sockets' softirq work out of our processes' time), and `*_other_tasks`, other
    processes alone (a lower bound: with tick accounting, softirq ticks are charged to our tasks
    too)."""
    tasks, irq, steal = ((a - b) / wall for a, b in zip(after, before, strict=True))
    r[f"{role}_busy"] = tasks + irq + steal
    r[f"{role}_irq"], r[f"{role}_steal"] = irq, steal
    r[f"{role}_other"] = max(0.0, tasks + irq + steal - ours)
    r[f"{role}_other_tasks"] = max(0.0, tasks - ours)


def syscalls(pid: int) -> tuple[int, int]:
    """read(2)- and write(2)-family calls of `pid`, every thread (/proc/PID/io syscr, syscw: uvloop
    reads and writes its sockets with read and write/writev; recv/send calls are not counted)."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["syscr"]), int(io["syscw"])


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def body(args: argparse.Namespace, stream: bool) -> str:
    payload: dict[str, Any] = {"model": ov.MODEL, "messages": [{"role": "user", "content": "hi"}]}
    payload["max_tokens"] = args.tokens if stream else ov.REPLY_TOKENS
    if stream:
        payload["stream"] = True
    return json.dumps(payload, separators=(",", ":"))


def wrk(
    args: argparse.Namespace, t: Target, up: int, stream: bool, seconds: int, check: bool = False
) -> dict[str, Any]:
    """One wrk run against `t`: its figures, and CPU seconds of wrk, the process under test, the
    upstream and each CPU over it (wrk is the only child waited for meanwhile: RUSAGE_CHILDREN)."""
    connections = args.streams if stream else args.connections
    env = {
        **os.environ,
        "TB_BODY": body(args, stream),
        "TB_CHUNKS": str(args.tokens if stream else 0),
    }
    if check:
        env["TB_CHECK"] = "1"
    cmd = [*pin(args.load_cpu), "wrk", "-t1", f"-c{connections}", f"-d{seconds}s"]
    cmd += ["--timeout", "30s", "-s", str(LUA), t.url + "/v1/chat/completions"]
    calls = (syscalls(t.proc.pid), syscalls(up))
    before = (children_cpu(), ov.cpu_seconds(t.proc.pid), ov.cpu_seconds(up), cpu_times())
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60)
    wall = time.perf_counter() - start
    after = (children_cpu(), ov.cpu_seconds(t.proc.pid), ov.cpu_seconds(up), cpu_times())
    calls_after = (syscalls(t.proc.pid), syscalls(up))
    line = next((s for s in out.stdout.splitlines() if s.startswith("TBJSON ")), None)
    if out.returncode != 0 or line is None:
        sys.exit(f"wrk against {t.name} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    r: dict[str, Any] = json.loads(line.removeprefix("TBJSON "))
    duration = r["duration_us"] / 1e6
    r["rps"] = r["requests"] / duration
    if stream:
        r["chunks_per_s"] = r["rps"] * args.tokens
    r["errors"] = sum(r.pop(k) for k in ("connect_errors", "read_errors", "write_errors"))
    r["errors"] += r.pop("status_errors") + r.pop("timeouts")
    r["wrk_cores"] = (after[0] - before[0]) / wall
    r["proxy_cores"] = (after[1] - before[1]) / wall if t.name != "direct" else 0.0
    # CPU per unit served: the proxy's own cost, which other work on its CPU disturbs far less
    # than its throughput (completed units: the run's last, partial streams are not counted)
    units = r["requests"] * (args.tokens if stream else 1)
    r["proxy_cpu_us_per_unit"] = (after[1] - before[1]) / units * 1e6 if units else 0.0
    r["upstream_cores"] = (after[2] - before[2]) / wall
    # what one read or write carried: calls per unit served (a chunk, or a request)
    for role, (b, a) in (
        ("proxy", (calls[0], calls_after[0])),
        ("upstream", (calls[1], calls_after[1])),
    ):
        r[f"{role}_reads_per_unit"] = (a[0] - b[0]) / units if units else 0.0
        r[f"{role}_writes_per_unit"] = (a[1] - b[1]) / units if units else 0.0
    ours = r["wrk_cores"] + r["upstream_cores"]
    cpus = (("proxy_cpu", args.proxy_cpu, r["proxy_cores"]), ("load_cpu", args.load_cpu, ours))
    for role, cpu, mine in cpus:
        cpu_use(r, role, before[3][cpu], after[3][cpu], mine, wall)
    return r


# --- the check pass, then the rounds --------------------------------------------------------------


def check_whole(args: argparse.Namespace, targets: list[Target], up: int) -> None:
    """Each target, each load, once with every body read: all whole, or the run stops. Keeps
    the shortest whole body of each. It also warms the pools and caches up."""
    for t in targets:
        for load, stream in (("req", False), ("stream", True)):
            r = wrk(args, t, up, stream, args.check_seconds, check=True)
            if r["checked"] == 0 or r["complete"] != r["checked"] or r["errors"]:
                sys.exit(
                    f"{t.name} {load}: {r['complete']} of {r['checked']} responses whole, "
                    f"{r['errors']} errors: {r}"
                )
            t.shortest_body[load] = r["shortest_body"]


def bytes_cover(r: dict[str, Any], shortest_body: int) -> bool:
    """The bytes wrk read cover every completed response whole: at least the shortest whole body
    of the check pass for each (the headers and chunk framing on top vary with how the writes
    group events, so this bound is loose; the check pass is the exact one)."""
    return bool(r["bytes"] >= r["requests"] * shortest_body)


def rounds(args: argparse.Namespace, targets: list[Target], up: int) -> None:
    for i in range(args.rounds):
        k = i % len(targets)
        for t in targets[k:] + targets[:k]:  # each goes first in turn
            for load, stream in (("req", False), ("stream", True)):
                r = wrk(args, t, up, stream, args.seconds)
                r["bytes_whole"] = bytes_cover(r, t.shortest_body[load])
                t.runs[load].append(r)
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)


# --- results --------------------------------------------------------------------------------------


def summarize(targets: list[Target]) -> dict[str, Any]:
    base = next(t for t in targets if t.name == "minimal_proxy").runs
    out: dict[str, Any] = {}
    for t in targets:
        req, stream = t.runs["req"], t.runs["stream"]
        out[t.name] = {
            "tree": t.tree,
            "kind": t.kind,
            "requests": ov._medians(req),
            "stream": ov._medians(stream),
            "vs_minimal": {
                "rps": ov._paired(req, base["req"], "rps"),
                "chunks_per_s": ov._paired(stream, base["stream"], "chunks_per_s"),
            },
            "vs_minimal_quartiles": {
                "rps": ov._quartiles(req, base["req"], "rps"),
                "chunks_per_s": ov._quartiles(stream, base["stream"], "chunks_per_s"),
            },
            # CPU per request, per chunk, over the minimal proxy's (paired by round, median)
            "cpu_vs_minimal": {
                "per_request": ov._paired(req, base["req"], "proxy_cpu_us_per_unit"),
                "per_chunk": ov._paired(stream, base["stream"], "proxy_cpu_us_per_unit"),
            },
            "rss_mib": {"idle": t.idle_rss_mib, "loaded_peak": ov.memory(t.proc.pid)["VmHWM"]},
            "affinity": allowed_cpus(t.proc.pid),
            "shortest_whole_body": t.shortest_body,
            "rounds": t.runs,
        }
    return out


def bottleneck(args: argparse.Namespace, paths: dict[str, Any]) -> dict[str, Any]:
    """Was the proxy the bottleneck in every proxied run? The reasons it may not have been."""
    problems = []
    proxied = {n: p for n, p in paths.items() if n != "direct"}
    runs = [
        (n, load, r)
        for n, p in proxied.items()
        for load in ("req", "stream")
        for r in p["rounds"][load]
    ]
    wrk_max = max(r["wrk_cores"] for _, _, r in runs)
    if wrk_max > args.wrk_cpu_max:
        problems.append(f"wrk used up to {wrk_max:.2f} of a core (limit {args.wrk_cpu_max})")
    direct = {k: paths["direct"]["vs_minimal"][k] for k in ("rps", "chunks_per_s")}
    for k, x in direct.items():
        if x < args.direct_min:
            problems.append(
                f"direct is only {x:.2f}x the minimal proxy's {k} "
                f"(want >= {args.direct_min}): the load side may limit"
            )
    proxy_min = min(r["proxy_cores"] for _, _, r in runs)
    if proxy_min < 0.9:
        problems.append(
            f"a proxy used as little as {proxy_min:.2f} of its core: it was not "
            "always the bottleneck (other work on its CPU? see proxy_cpu_other_tasks)"
        )
    load_own = max(r["wrk_cores"] + r["upstream_cores"] for _, _, r in runs)
    if load_own > 0.85:
        problems.append(
            f"wrk and the upstream used up to {load_own:.2f} of their core: they may limit"
        )
    other = max(max(r["proxy_cpu_other_tasks"], r["load_cpu_other_tasks"]) for _, _, r in runs)
    if other > 0.1:
        problems.append(
            f"other processes took up to {other:.2f} of a core: the figures are noisy "
            "(cpu_vs_minimal, CPU per unit, is the steadier one)"
        )
    every = [
        (n, load, r) for n, p in paths.items() for load in p["rounds"] for r in p["rounds"][load]
    ]
    bad = [f"{n} {load}" for n, load, r in every if r["errors"] or not r["bytes_whole"]]
    if bad:
        problems.append(f"errors or short responses in: {', '.join(sorted(set(bad)))}")
    return {
        "wrk_cores_max": wrk_max,
        "proxy_cores_min": proxy_min,
        "load_side_cores_max": load_own,
        "proxy_cpu_other_max": max(r["proxy_cpu_other"] for _, _, r in runs),
        "load_cpu_other_max": max(r["load_cpu_other"] for _, _, r in runs),
        "proxy_cpu_other_tasks_max": max(r["proxy_cpu_other_tasks"] for _, _, r in runs),
        "load_cpu_other_tasks_max": max(r["load_cpu_other_tasks"] for _, _, r in runs),
        "irq_max": max(max(r["proxy_cpu_irq"], r["load_cpu_irq"]) for _, _, r in runs),
        "steal_max": max(max(r["proxy_cpu_steal"], r["load_cpu_steal"]) for _, _, r in runs),
        "direct_vs_minimal": direct,
        "problems": problems,
        "ok": not problems,
    }


def conditions(
    args: argparse.Namespace, trees: list[Tree], load: tuple[Any, Any]
) -> dict[str, Any]:
    from importlib.metadata import version

    ver = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    return {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "proxy_cpu": args.proxy_cpu,
        "load_cpu": args.load_cpu,
        "load_average_before": load[0],
        "load_average_after": load[1],
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": version("uvloop"),
        "wrk": (ver.stdout + ver.stderr).splitlines()[0].strip(),
        "bench_commit": git(ROOT, "rev-parse", "HEAD"),
        "bench_dirty": bool(git(ROOT, "status", "--porcelain", "--", "benchmarks")),
        "trees": [
            {
                "label": t.label,
                "path": str(t.path),
                "commit": t.commit,
                "dirty": t.dirty,
                "imports_from": t.imports_from,
            }
            for t in trees
        ],
        "rounds": args.rounds,
        "seconds_per_run": args.seconds,
        "request_connections": args.connections,
        "reply_tokens": ov.REPLY_TOKENS,
        "stream_connections": args.streams,
        "stream_tokens": args.tokens,
        "wrk_threads": 1,
        "upstream": args.upstream,
        "upstream_events_per_write": args.events_per_write,
        "stream_writes": f"the upstream writes each stream's next {args.events_per_write} "
        "event(s) in one write (the HTTP chunk framing stays one chunk per event); a proxy's read "
        "from it carries that many events or more: *_reads_per_unit, *_writes_per_unit are the "
        "read(2)/write(2) calls of the process per chunk (per request in the requests half), from "
        "/proc/PID/io, so 1/proxy_reads_per_unit is the chunks one read carried on average (its "
        "reads of the client's requests included)",
        "note": "the process under test alone on proxy_cpu; the upstream and wrk on load_cpu; "
        "medians of rounds; x minimal: each round's figure over the minimal proxy's in the same "
        "round, median (quartiles); *_cores: CPU seconds per second of the run; *_cpu_other: "
        "what else took that CPU (noise: other tasks, interrupts, steal; *_other_tasks: other "
        "processes alone); proxy_cpu_us_per_unit: the process under test's CPU "
        "per request or chunk (for direct, the upstream's)",
        "metering": "metering, pricing, metrics; ledger, access log and audit off",
        "default": "plus SQLite ledger, JSON access log to a file, audit capture",
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def table(paths: dict[str, Any]) -> str:
    head = (
        f"{'target':<24} {'req/s':>7} {'x min (quartiles)':>17} {'chunks/s':>8} "
        f"{'x min (quartiles)':>17} {'CPU/req':>7} {'CPU/ch':>6} "
        f"{'proxy':>9} {'wrk':>9} {'other':>9} {'ch/read':>7}"
    )
    lines = [head]
    for name, p in paths.items():
        x, q, cpu = p["vs_minimal"], p["vs_minimal_quartiles"], p["cpu_vs_minimal"]
        cells = [
            f"{x[k]:.2f} ({q[k][0]:.2f}-{q[k][1]:.2f})".rjust(17) for k in ("rps", "chunks_per_s")
        ]
        req, st = p["requests"], p["stream"]
        other = [max(r["proxy_cpu_other_tasks"], r["load_cpu_other_tasks"]) for r in (req, st)]
        reads = st["proxy_reads_per_unit"] if name != "direct" else 0
        per_read = f"{1 / reads:7.1f}" if reads else f"{'-':>7}"
        lines.append(
            f"{name:<24} {req['rps']:7.0f} {cells[0]} {st['chunks_per_s']:8.0f} {cells[1]} "
            f"{cpu['per_request']:7.2f} {cpu['per_chunk']:6.2f} "
            f"{req['proxy_cores']:4.2f}/{st['proxy_cores']:4.2f} "
            f"{req['wrk_cores']:4.2f}/{st['wrk_cores']:4.2f} {other[0]:4.2f}/{other[1]:4.2f} "
            f"{per_read}"
        )
    lines.append(
        "x min: over the minimal proxy's, per round, median (quartiles); CPU/req, CPU/ch: the "
        "proxy's CPU per request, per chunk, x the minimal proxy's; proxy, wrk: cores used "
        "(requests/streams, medians); other: of a core, what other processes took on the busier "
        "CPU; ch/read: stream chunks per read(2) of the proxy (median)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="[LABEL=]PATH",
        help="a tollbooth checkout to measure (repeatable; default: this one)",
    )
    ap.add_argument(
        "--rev",
        action="append",
        default=[],
        metavar="REV",
        help="a commit of this repository to measure, exported to a temporary directory "
        "(repeatable; measured before the --tree ones)",
    )
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=ov.KINDS)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=5, help="per target, load and round")
    ap.add_argument("--check-seconds", type=int, default=1, help="the whole-response check pass")
    ap.add_argument("--connections", type=int, default=16, help="non-streaming connections")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=256, help="one-token chunks per stream")
    ap.add_argument("--proxy-cpu", type=int, default=0)
    ap.add_argument("--load-cpu", type=int, default=1)
    ap.add_argument("--wrk-cpu-max", type=float, default=0.5, help="cores; above: said, not hidden")
    ap.add_argument(
        "--direct-min", type=float, default=1.5, help="direct x minimal proxy, at least"
    )
    ap.add_argument(
        "--upstream",
        choices=("lean", "aiohttp"),
        default="lean",
        help="the fake engine: lean (raw asyncio, cheap per event, so it is not the limit) or "
        "overhead.py's aiohttp one",
    )
    ap.add_argument(
        "--events-per-write",
        type=int,
        default=None,
        metavar="N",
        help="the lean upstream writes each stream's next N events in one write (default 8; 1: "
        "one event a write, which costs the load CPU more per chunk than the minimal proxy; "
        "aiohttp: always 1); each read behind it then carries N events or more",
    )
    ap.add_argument("--out", type=Path, default=ov.RESULTS / "pinned.json")
    args = ap.parse_args()
    if args.events_per_write is None:
        args.events_per_write = 8 if args.upstream == "lean" else 1
    if args.events_per_write < 1 or (args.upstream == "aiohttp" and args.events_per_write != 1):
        sys.exit("--events-per-write: at least 1, and only 1 with --upstream aiohttp")
    if shutil.which("wrk") is None:
        sys.exit(NO_WRK)
    if (
        not {args.proxy_cpu, args.load_cpu} <= os.sched_getaffinity(0)
        or args.proxy_cpu == args.load_cpu
    ):
        sys.exit(
            f"need two distinct CPUs this process may use, got {sorted(os.sched_getaffinity(0))}"
        )
    os.sched_setaffinity(0, {args.load_cpu})  # this script, mostly waiting, stays off the proxy's
    tmp = Path(tempfile.mkdtemp(prefix="tollbooth-pinned-"))
    trees = [archive_rev(rev, tmp) for rev in args.rev]
    trees += [parse_tree(s) for s in args.tree or ([] if trees else [str(ROOT)])]
    if len({t.label for t in trees}) < len(trees):
        sys.exit("two trees share a label: name them, --tree LABEL=PATH")
    for tree in trees:
        check_imports(tree, tmp)
    load_before = os.getloadavg()
    targets, up = start_targets(args, trees, tmp)
    try:
        wait_started(targets, tmp)
        check_whole(args, targets, up.pid)
        rounds(args, targets, up.pid)
        paths = summarize(targets)
    finally:
        for t in targets:
            t.proc.send_signal(signal.SIGTERM)
        for t in targets:
            try:
                t.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                t.proc.kill()
                t.proc.wait()
        for tree in trees:  # a --rev export
            if tree.path.parent == tmp:
                shutil.rmtree(tree.path)
    report(args, trees, paths, (load_before, os.getloadavg()))
    shutil.rmtree(tmp)  # kept when a run stops: the servers' stderr says why


def report(
    args: argparse.Namespace, trees: list[Tree], paths: dict[str, Any], load: tuple[Any, Any]
) -> None:
    checks = bottleneck(args, paths)
    summary = {
        name: {
            "rps_vs_minimal": p["vs_minimal"]["rps"],
            "rps_vs_minimal_quartiles": p["vs_minimal_quartiles"]["rps"],
            "chunks_per_s_vs_minimal": p["vs_minimal"]["chunks_per_s"],
            "chunks_per_s_vs_minimal_quartiles": p["vs_minimal_quartiles"]["chunks_per_s"],
            "rps": p["requests"]["rps"],
            "chunks_per_s": p["stream"]["chunks_per_s"],
        }
        for name, p in paths.items()
    }
    doc = {
        "conditions": conditions(args, trees, load),
        "bottleneck": checks,
        "summary": summary,
        "paths": paths,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(paths))
    print(f"load average before {load[0]}, after {load[1]}")
    if checks["ok"]:
        print("the proxy was the bottleneck in every run (wrk, load CPU, direct: see 'bottleneck')")
    for problem in checks["problems"]:
        print(f"WARNING: {problem}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_lean_upstream":
        run_lean_upstream(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
