"""Headless Chromium (Debian's `chromium`) for tests of what a browser shows, and a watch on the
network: every request Chromium makes, to any host, goes to a recording proxy on loopback.

The proxy answers each request 404 (a CONNECT: 502) and keeps its first line, so a test can assert
that a page fetched nothing (`Browser.fetched`). Chromium's own background traffic is turned off
by its flags where a flag exists; what remains (its component updater and account check, which
no flag of Debian's build stops) goes to Google's service hosts in `CHROMIUM_OWN`, and is left
out of `fetched`. `test_the_watch_sees_a_page_fetch` checks that the watch sees what a page asks.
"""

from __future__ import annotations

import collections
import os
import shutil
import socket
import socketserver
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.services import require
from tests.waiting import wait_for_sync

CHROMIUM = shutil.which("chromium")
TIMEOUT_S = 90
QUIET = [  # no traffic of Chromium's own: the watch must see only what the page asks for
    "--headless",
    "--disable-gpu",
    "--no-sandbox",  # tests may run as root
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--metrics-recording-only",
    "--disable-client-side-phishing-detection",
    "--disable-component-extensions-with-background-pages",
    "--disable-domain-reliability",
    "--disable-breakpad",
    "--no-pings",
    "--no-service-autorun",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication,"
    "NetworkTimeServiceQuerying,CertificateTransparencyComponentUpdater,DialMediaRouteProvider",
    "--hide-scrollbars",
]


# Where Chromium itself connects whatever the page (seen: update.googleapis.com,
# accounts.google.com, clients2.google.com): a page's request to any other host is in `fetched`.
CHROMIUM_OWN = ("google.com", "googleapis.com", "gvt1.com")


def host_of(request_line: str) -> str:
    """The host of a proxy request line: 'GET http://h:80/p HTTP/1.1' or 'CONNECT h:443 ...'."""
    parts = request_line.split()
    target = parts[1] if len(parts) > 1 else ""
    target = target.split("://", 1)[-1]
    return target.split("/", 1)[0].rsplit(":", 1)[0].lower()


def chromium_own(request_line: str) -> bool:
    host = host_of(request_line)
    return any(host == d or host.endswith("." + d) for d in CHROMIUM_OWN)


SENTINEL = "TOLLBOOTH-SENTINEL"


class _Recorder(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        try:
            line = self.rfile.readline(8192).decode("latin-1").strip()
            with self.server.lock:
                self.server.seen.append(line)
        finally:
            with self.server.lock:
                self.server.handled += 1
        if line == SENTINEL:
            return
        status = "502 Bad Gateway" if line.startswith("CONNECT") else "404 Not Found"
        self.wfile.write(
            f"HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.seen: list[str] = []
        self.lock = threading.Lock()
        self.accepted = self.handled = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.accepted += 1
        super().process_request(request, client_address)

    def settled(self) -> bool:
        """Every connection accepted so far is handled, and the last is the sentinel: all that
        reached the watch before the sentinel was sent is in `seen`."""
        with self.lock:
            return self.handled == self.accepted and SENTINEL in self.seen


class Browser:
    def __init__(self, profile: Path, server: _Server) -> None:
        self.profile, self.server = profile, server
        self.proxy_port = server.server_address[1]

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert CHROMIUM is not None
        cmd = [
            CHROMIUM,
            *QUIET,
            f"--user-data-dir={self.profile}",
            f"--proxy-server=http://127.0.0.1:{self.proxy_port}",
            "--proxy-bypass-list=<-loopback>",  # loopback too goes through the watch
            *args,
        ]
        home = self.profile.parent / "chromium-home"  # its crash and cache folders, not ~'s
        env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
        env["XDG_CACHE_HOME"] = str(home / ".cache")
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=True, env=env
        )

    def fetched(self) -> list[str]:
        """The requests made since the last call, but Chromium's own."""
        with socket.create_connection(("127.0.0.1", self.proxy_port), timeout=10) as s:
            s.sendall(SENTINEL.encode() + b"\r\n")
        wait_for_sync(self.server.settled, "the watch to handle every connection")
        with self.server.lock:
            seen, self.server.seen[:] = list(self.server.seen), []
        # A connection that closed before a request line asked for nothing: Chromium 156 opens
        # one to its proxy ahead of need (a preconnect) and may close it unused.
        return [line for line in seen if line and line != SENTINEL and not chromium_own(line)]

    def dump_dom(self, page: Path) -> str:
        """The DOM after the page loaded, as Chromium serialises it."""
        return self._run("--dump-dom", page.resolve().as_uri()).stdout

    def screenshot(self, page: Path, out: Path, width: int, height: int) -> None:
        self._run(f"--window-size={width},{height}", f"--screenshot={out}", page.resolve().as_uri())


@contextmanager
def browser(tmp: Path) -> Iterator[Browser]:
    require("chromium", CHROMIUM)
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, name="proxy-watch", daemon=True)
    thread.start()
    try:
        yield Browser(tmp / "chromium-profile", server)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def png_pixels(path: Path) -> collections.Counter[tuple[int, int, int]]:
    """How many pixels of each RGB colour a screenshot has (8-bit RGB or RGBA, not interlaced:
    what Chromium writes), decoded here so that no imaging library is needed."""
    data = path.read_bytes()
    width, height = png_size(path)
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    depth, colour_type, interlace = header[8], header[9], header[12]
    assert depth == 8 and colour_type in (2, 6) and interlace == 0, "an unexpected PNG"
    bpp = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    counts: collections.Counter[tuple[int, int, int]] = collections.Counter()
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = _unfilter(raw[start], bytearray(raw[start + 1 : start + 1 + stride]), prev, bpp)
        counts.update(zip(row[0::bpp], row[1::bpp], row[2::bpp], strict=True))
        prev = row
    return counts


def _unfilter(kind: int, row: bytearray, prev: bytearray, bpp: int) -> bytearray:
    for i in range(len(row)):
        a = row[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if kind == 1:
            row[i] = (row[i] + a) & 0xFF
        elif kind == 2:
            row[i] = (row[i] + b) & 0xFF
        elif kind == 3:
            row[i] = (row[i] + (a + b) // 2) & 0xFF
        elif kind == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return row


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises for a file that is not a PNG."""
    data = path.read_bytes()[:24]
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height
