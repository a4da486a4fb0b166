"""Request bodies sent with a Content-Encoding (gzip, deflate, br ...).

vLLM (uvicorn/FastAPI) and TGI (axum, with no request-decompression layer) read only
uncompressed JSON. A metered route refuses such a body with 415 before reading it, so nothing is
decoded (a gzip bomb costs the sidecar nothing) and nothing contradicting its headers is ever
forwarded. A route whose body is streamed gets the client's bytes and headers unchanged.
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import pytest
from aiohttp import web

from sidecar.core.app import PROXY_SERVER_OPTIONS
from tests.conftest import StartSidecar
from tests.fakes import MODEL, FakeUpstream
from tests.rawhttp import raw_request

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "one two"}]}
).encode()


async def raw_upstream(aiohttp_server: Any) -> tuple[FakeUpstream, str]:
    """The fake engine on a server that leaves request bodies as they came (like vLLM and TGI),
    so `seen` holds the bytes the sidecar sent."""
    fake = FakeUpstream()
    server = await aiohttp_server(fake.app, **PROXY_SERVER_OPTIONS)
    return fake, str(server.make_url("")).rstrip("/")


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("x-gzip", gzip.compress(BODY)),
        ("GZIP", gzip.compress(BODY)),
        ("identity, gzip", gzip.compress(BODY)),
        ("br", b"\x8b\x03\x80hello\x03"),
    ],
    ids=["gzip", "deflate", "x-gzip", "GZIP", "identity-gzip", "br"],
)
async def test_a_compressed_body_on_a_metered_route_is_refused_415(
    start_sidecar: StartSidecar, aiohttp_server: Any, encoding: str, body: bytes
) -> None:
    """Before: the body was decoded for metering and forwarded decoded under the client's
    `Content-Encoding: gzip`, and the engine answered 500. Now: 415, nothing forwarded."""
    fake, url = await raw_upstream(aiohttp_server)
    run = await start_sidecar(upstream_url=url)
    r = await raw_request(run.url, CHAT, body, headers={"Content-Encoding": encoding})
    assert r.status == 415, r.body[:300]
    assert json.loads(r.body)["error"]["type"] == "unsupported_content_encoding"
    assert fake.seen == []
    assert run.value("tollbooth_requests_refused_total", reason="content_encoding") == 1
    assert run.value("llm_requests_total", model=MODEL, api_endpoint=CHAT, status="415") is None


async def test_identity_is_no_encoding(start_sidecar: StartSidecar, aiohttp_server: Any) -> None:
    fake, url = await raw_upstream(aiohttp_server)
    run = await start_sidecar(upstream_url=url)
    r = await raw_request(run.url, CHAT, BODY, headers={"Content-Encoding": "identity"})
    assert r.status == 200, r.body[:300]
    assert fake.seen[-1]["body"] == BODY


async def recorder(aiohttp_server: Any) -> tuple[list[dict[str, Any]], str]:
    """An upstream that records each POST's raw body and headers, whatever the path (not the
    readiness probe's GETs)."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "headers": request.headers.copy()})
        seen[-1]["body"] = await request.read()
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/{tail:.*}", record)
    server = await aiohttp_server(app, **PROXY_SERVER_OPTIONS)
    return seen, str(server.make_url("")).rstrip("/")


@pytest.mark.parametrize("path", ["/tokenize", "/echo"])
async def test_a_streamed_route_gets_the_clients_bytes_and_headers_unchanged(
    start_sidecar: StartSidecar, aiohttp_server: Any, path: str
) -> None:
    """A free route (/tokenize) and a forwarded unmetered POST (/echo) stream the body: the
    upstream receives exactly the compressed bytes the client sent, under its Content-Encoding
    (before: aiohttp's server decoded them, and the decoded body went on under the header)."""
    seen, url = await recorder(aiohttp_server)
    run = await start_sidecar({"metering": {"unknown_routes": "forward"}}, upstream_url=url)
    sent = gzip.compress(BODY)
    r = await raw_request(run.url, path, sent, headers={"Content-Encoding": "gzip"})
    assert r.status == 200, r.body[:300]
    assert [s["path"] for s in seen] == [path]
    assert seen[0]["body"] == sent
    assert seen[0]["headers"]["Content-Encoding"] == "gzip"


async def test_a_gzip_bomb_is_never_decoded(
    start_sidecar: StartSidecar, aiohttp_server: Any
) -> None:
    """256 MiB of JSON whitespace in 256 KiB of gzip: refused before a byte is read, so no
    memory is reserved or taken for it; on a streamed route it reaches the upstream compressed."""
    bomb = gzip.compress(b"{" + b" " * (256 * 1024 * 1024) + b"}", compresslevel=9)
    assert len(bomb) < 1024 * 1024
    seen, url = await recorder(aiohttp_server)
    run = await start_sidecar({"metering": {"unknown_routes": "forward"}}, upstream_url=url)
    r = await raw_request(run.url, CHAT, bomb, headers={"Content-Encoding": "gzip"})
    assert r.status == 415
    assert seen == []
    assert run.sc.proxy is not None and run.sc.proxy.memory.peak == 0
    r = await raw_request(run.url, "/echo", bomb, headers={"Content-Encoding": "gzip"})
    assert r.status == 200
    assert seen[-1]["body"] == bomb
    assert run.sc.proxy.memory.peak == 0
