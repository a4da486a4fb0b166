"""HTTP/1.1 over a plain socket, for requests no client library would send as written.

aiohttp's and httpx's clients normalise paths (`/v1/./x` becomes `/v1/x`) before sending; an
attacker's client does not. The request target here goes on the wire byte for byte.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes  # de-chunked

    def text(self) -> str:
        return self.body.decode()


async def raw_request(
    base_url: str,
    target: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> RawResponse:
    """Send `method target` exactly as given to the server at `base_url`; read the whole answer."""
    parts = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return RawResponse(int(status_line.split()[1]), hdrs, rest)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)
