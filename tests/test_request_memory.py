"""Request bytes held in memory are bounded across all connections and per key
(sidecar/proxy/memory.py).

Clients that send the headers of a large body, most of the body, and then wait, each hold its
bytes in the sidecar. A new request that does not fit in what is left gets 503 + Retry-After
before its body is read; the memory reserved never passes the limit, and comes back when the
held requests end.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import io
import json
import struct
import termios
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.proxy.identity import add_key
from sidecar.proxy.memory import HELD_PER_BYTE, RequestMemory, parse_cost
from tests.conftest import Running, StartSidecar
from tests.fakes import MODEL
from tests.procs import start_tollbooth

MiB = 1024 * 1024
CHAT = "/v1/chat/completions"


def chat_body(size: int) -> bytes:
    """A chat request of exactly `size` bytes (one long message)."""
    shell = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"content": ""}]})
    cut = shell.rindex('""') + 1
    return (shell[:cut] + "a" * (size - len(shell)) + shell[cut:]).encode()


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait, bounded, for `condition` (polled: it is state of the sidecar, not an event)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response with a Content-Length, headers and body (the connection may stay
    open after it: aiohttp reads and drops the rest of a refused body for a while)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(headers_of(head).get("content-length", "0"))
    return head + await reader.readexactly(length)


class Held:
    """A connection that sent a request's headers and all its body but the last `short` bytes;
    `answered` reads whatever the sidecar answers (it closes a connection it refuses)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.answered = asyncio.ensure_future(read_response(reader))

    @classmethod
    async def open(cls, url: str, body: bytes, *, short: int = 10, key: str | None = None) -> Held:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        held = cls(reader, writer)
        writer.write(head.encode() + body[: len(body) - short])
        with contextlib.suppress(ConnectionError):  # refused, closed mid-body: see `answered`
            await writer.drain()
        return held

    async def answer(self, timeout: float = 10.0) -> bytes:
        """What the sidecar answered before the body was complete (it never will be)."""
        return await asyncio.wait_for(self.answered, timeout)

    def unsent(self) -> int:
        """Bytes this side wrote that the peer has not acknowledged yet (SIOCOUTQ)."""
        sock = self.writer.get_extra_info("socket")
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        return int(struct.unpack("i", out)[0])

    def close(self) -> None:
        self.answered.cancel()
        self.writer.close()


async def all_sent(held: list[Held]) -> None:
    """Every byte written on these connections has reached the sidecar (its kernel acked it):
    it has their headers, and its handlers are reading their bodies."""
    await until(lambda: all(h.unsent() == 0 for h in held), "the bodies to reach the sidecar", 30)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def headers_of(answer: bytes) -> dict[str, str]:
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head)}


def memory(run: Running) -> RequestMemory:
    assert run.sc.proxy is not None
    return run.sc.proxy.memory


async def test_held_open_bodies_fill_the_pool_and_new_requests_get_503(
    start_sidecar: StartSidecar,
) -> None:
    """Four 1 MiB bodies held open take the 8 MiB; the fifth request is answered 503 with
    Retry-After at once (before its body), counted; once the held ones go, requests are served."""
    limit, size = 8 * MiB, 1 * MiB
    run = await start_sidecar(
        {"server": {"max_buffered_request_bytes": limit, "max_buffered_request_bytes_per_key": 0}}
    )
    body = chat_body(size)
    held = [await Held.open(run.url, body) for _ in range(4)]
    try:
        await all_sent(held)
        late = await Held.open(run.url, body)
        answer = await late.answer()
        late.close()
        assert status_of(answer) == 503, answer[:200]
        assert headers_of(answer)["retry-after"] == "1"
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == (
            "request_memory_full"
        )
        assert run.value("tollbooth_requests_refused_total", reason="memory_total") == 1
        # the four reserved before reading: 2 bytes per byte of each body
        assert memory(run).total == 4 * HELD_PER_BYTE * size
        assert run.value("tollbooth_request_memory_bytes") == memory(run).total
        assert memory(run).peak <= limit
    finally:
        for h in held:
            h.close()
    await until(lambda: memory(run).total == 0, "the held requests to release their memory")
    assert run.upstream is not None and run.upstream.seen == []  # no held body was forwarded
    async with aiohttp.ClientSession() as s, s.post(run.url + CHAT, data=body) as r:
        assert r.status == 200
    assert memory(run).total == 0 and memory(run).peak <= limit


def keys(tmp_path: Path, *users: str) -> tuple[str, list[str]]:
    path = tmp_path / "keys.yaml"
    return str(path), [add_key(str(path), user, None) for user in users]


async def test_one_key_cannot_take_more_than_its_share(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    """Alice fills her 5 MiB share with two held-open bodies (4 MiB); her third request is refused
    (reason memory_key) while Bob, under the same total, is served."""
    path, (alice, bob) = keys(tmp_path, "alice", "bob")
    size = 1 * MiB
    run = await start_sidecar(
        {
            "identity": {"keys_file": path},
            "server": {
                "max_buffered_request_bytes": 64 * MiB,
                # two held bodies, not three; one read and parsed (4 MiB and a little)
                "max_buffered_request_bytes_per_key": 5 * MiB,
            },
        }
    )
    body = chat_body(size)
    held = [await Held.open(run.url, body, key=alice) for _ in range(2)]
    try:
        await all_sent(held)
        third = await Held.open(run.url, body, key=alice)
        answer = await third.answer()
        third.close()
        assert status_of(answer) == 503 and "retry-after" in headers_of(answer), answer[:200]
        assert run.value("tollbooth_requests_refused_total", reason="memory_key") == 1
        headers = {"Authorization": f"Bearer {bob}"}
        async with (
            aiohttp.ClientSession() as s,
            s.post(run.url + CHAT, data=body, headers=headers) as r,
        ):
            assert r.status == 200
        assert set(memory(run).by_bucket) == {"key-" + _sha(alice)[:12]}
    finally:
        for h in held:
            h.close()
    await until(lambda: memory(run).total == 0, "alice's requests to release their memory")
    assert memory(run).by_bucket == {}


def _sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


async def test_a_chunked_body_growing_past_the_room_is_cut_off(
    start_sidecar: StartSidecar,
) -> None:
    """A chunked body has no Content-Length to reserve by: it is counted as it arrives, and cut
    off (503, connection closed) once it grows past the room left; what it held is released."""
    limit = 4 * MiB
    run = await start_sidecar(
        {"server": {"max_buffered_request_bytes": limit, "max_buffered_request_bytes_per_key": 0}}
    )
    one = await Held.open(run.url, chat_body(1 * MiB))  # 2 MiB of the 4 taken
    try:
        await all_sent([one])
        host, port = run.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        piece = b"a" * (64 * 1024)
        sent = 0
        with_answer = asyncio.ensure_future(read_response(reader))
        try:  # 3 MiB (6 MiB of memory) is more than the room: the sidecar answers before
            while sent < 3 * MiB and not with_answer.done():
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                sent += len(piece)
        except ConnectionError:
            pass  # the sidecar closed the connection mid-body: the answer is already read
        answer = await asyncio.wait_for(with_answer, 10)
        writer.close()
        assert status_of(answer) == 503, answer[:200]
        assert run.value("tollbooth_requests_refused_total", reason="memory_total") == 1
        assert memory(run).peak <= limit
        await until(lambda: memory(run).total == HELD_PER_BYTE * MiB, "the cut body's release")
    finally:
        one.close()
    await until(lambda: memory(run).total == 0, "every release")


async def test_a_body_that_could_never_fit_is_413_not_503(start_sidecar: StartSidecar) -> None:
    """Retrying cannot help a body whose reservation is over the limit itself: 413, not 503."""
    run = await start_sidecar(
        {"server": {"max_buffered_request_bytes": 1 * MiB, "max_buffered_request_bytes_per_key": 0}}
    )
    async with aiohttp.ClientSession() as s, s.post(run.url + CHAT, data=chat_body(MiB)) as r:
        assert r.status == 413
        assert (await r.json())["error"]["type"] == "request_too_large"
    assert run.value("tollbooth_requests_refused_total", reason="memory_total_never") == 1
    assert memory(run).total == 0


async def test_parsing_is_counted_while_it_runs(start_sidecar: StartSidecar) -> None:
    """A body whose JSON parses to many small objects (25x its size here) reserves the parse's
    estimate while it is parsed: it is refused when that does not fit, though its bytes did."""
    body = ("[" + ",".join(["{}"] * (MiB // 3)) + "]").encode()
    assert parse_cost(body) > 20 * len(body)
    run = await start_sidecar(
        {"server": {"max_buffered_request_bytes": 8 * MiB, "max_buffered_request_bytes_per_key": 0}}
    )
    async with aiohttp.ClientSession() as s, s.post(run.url + CHAT, data=body) as r:
        assert r.status == 413, await r.text()
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    async with aiohttp.ClientSession() as s, s.post(run.url + CHAT, data=small) as r:
        assert r.status == 200
    assert memory(run).total == 0
    assert memory(run).peak <= 8 * MiB


async def test_a_kept_alive_connection_does_not_keep_its_last_body(
    start_sidecar: StartSidecar,
) -> None:
    """Once a request is answered its body is freed, though its connection stays open for the
    next request. (Before: `request.read()` cached the body on the request, and aiohttp keeps a
    connection's last request until the next one arrives: each idle connection held its last
    body, uncounted, up to the keep-alive timeout.)"""
    run = await start_sidecar()
    body = chat_body(900 * 1024)  # the fake engine takes up to 1 MiB
    tracemalloc.start(40)
    try:
        async with aiohttp.ClientSession() as s:  # keeps the connection open after the answer
            async with s.post(run.url + CHAT, data=io.BytesIO(body)) as r:
                assert r.status == 200
                await r.read()  # the handler returned the answer: it is done with the body
            gc.collect()
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, "*sidecar/proxy/*.py", all_frames=True)]
            )
            kept = [t for t in snap.traces if t.size >= 512 * 1024]
            assert kept == [], [t.traceback.format()[-6:] for t in kept]
    finally:
        tracemalloc.stop()


# --- the process's own memory -------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def refused_in(admin: str) -> float:
    """tollbooth_requests_refused_total of a sidecar process, all reasons, from its /metrics."""
    async with aiohttp.ClientSession() as s, s.get(admin + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tollbooth_requests_refused_total{")
    )


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
async def test_forty_held_open_15_mib_bodies_keep_the_default_sidecar_under_400_mib(
    tmp_path: Path, upstream: Any
) -> None:
    """The attack of issue 21 against a real `tollbooth serve` with the default limits: 40
    connections, each with its own valid key, send a 15 MiB body 10 bytes short of its
    Content-Length and wait (one key reached 988 MiB before the limit). The 8 that fit in 256 MiB
    hold their bodies, the 32 others are refused at once, and the process stays under 400 MiB."""
    _, server = upstream
    path, keys_ = keys(tmp_path, *(f"u{i}" for i in range(40)))
    tb = await start_tollbooth(
        tmp_path,
        {
            "upstream": {"url": str(server.make_url("")).rstrip("/")},
            "identity": {"keys_file": path},
            "logging": {"access_log": "off"},
        },
        ready_path="/healthz",
    )
    held: list[Held] = []
    try:
        body = chat_body(15 * MiB)
        for key in keys_:
            held.append(await Held.open(tb.url, body, key=key))
        deadline = time.monotonic() + 30
        while await refused_in(tb.admin) < 32:  # bounded: the answers come at once
            assert time.monotonic() < deadline, "refusals not counted"
            await asyncio.sleep(0.05)
        await until(lambda: sum(h.answered.done() for h in held) == 32, "32 answers", 30)
        holding = [h for h in held if not h.answered.done()]
        assert len(holding) == 8
        await all_sent(holding)
        for h in held:
            if h.answered.done():
                assert status_of(h.answered.result()) == 503
        rss = rss_mib(tb.proc.pid)
        assert rss < 400, rss
    finally:
        for h in held:
            h.close()
        await tb.stop(15)
