"""The audio routes' request bodies: multipart forms streamed through, never held whole.

Owns: reading a form's head (its small fields before the file part, at most
`server.audio_form_bytes`, in memory reserved for it, within `server.body_timeout_s`), and the
body sent upstream: that head, then the rest as the client sends it (each read within
`body_timeout_s` of the last, at most `server.max_audio_body_bytes` in all).
Never: holds the file part (a piece of it is in memory only while it is written upstream: the
server's read buffer and the upstream writer's flow control bound it, AUDIO_IN_FLIGHT), changes
a byte, or reads past the head before the gates have let the request through.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from ..exchange import Endpoint, RequestInfo
from ..metering.audio import FormHead, FormScan, LateField, audio_request, boundary
from .memory import HELD_PER_BYTE, TooLarge

# Memory a streamed body holds besides its head, at most, while it is in flight: aiohttp's
# server pauses reading a request once 2 x its read buffer (2 x 64 KiB) is waiting, and the
# upstream writer waits (drain) while the upstream reads slower than the client sends.
AUDIO_IN_FLIGHT = 2 * 2**16


@dataclass(frozen=True, kw_only=True)
class AudioLimits:
    head_bytes: int  # server.audio_form_bytes
    max_body: int  # server.max_audio_body_bytes
    timeout: float  # server.body_timeout_s


async def read_head(
    request: web.Request, endpoint: Endpoint, limits: AudioLimits, room: Callable[[int], None]
) -> RequestInfo:
    """The request as far as its form's head: what it asks for (model, stream, limit) and the
    bytes read so far (`RequestInfo.body`), each piece reserved by `room` before it is kept.
    Raises TooLarge when the Content-Length is past the limit; TimeoutError when the head does
    not come within the body timeout (NoRoom from `room`)."""
    length = request.content_length
    if length is not None and length > limits.max_body:
        raise TooLarge
    room(AUDIO_IN_FLIGHT)
    mark = boundary(request.headers.get("Content-Type"))
    form = FormHead(mark or b"-", limits.head_bytes)
    pieces: list[bytes] = []
    if mark is not None and request.body_exists:
        async with asyncio.timeout(limits.timeout):
            while not form.done and (chunk := await request.content.readany()):
                room(HELD_PER_BYTE * len(chunk))
                pieces.append(chunk)
                form.feed(chunk)
    head = b"".join(pieces)
    if length is not None and len(head) > length:
        raise TooLarge  # more than it said: the server would read it otherwise
    size = length if length is not None else limits.max_body
    return audio_request(endpoint, head, form, length, size)


class Upload:
    """The body for the upstream: the head already read, then the rest as it arrives. Raises
    (which cuts the upstream request short) past the size limit or a silence of the timeout,
    and at a metered form field sent again past the head (`late`, set to why: vLLM would read
    the later one, so what it serves is not what was priced; cut short, it serves nothing).
    `on_complete` is called once the client's last byte is read: until then the server has no
    complete request (a client that leaves mid-upload made it do nothing)."""

    def __init__(
        self,
        request: web.Request,
        head: bytes,
        limits: AudioLimits,
        on_complete: Callable[[], None],
    ) -> None:
        self._request, self._head, self._limits = request, head, limits
        self._on_complete = on_complete
        mark = boundary(request.headers.get("Content-Type"))
        self._scan = FormScan(mark, limits.head_bytes) if mark is not None else None
        self.late: str | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent, content = len(self._head), self._request.content
        if self._head:
            self._check(self._head)
            yield self._head
        while True:
            async with asyncio.timeout(self._limits.timeout):
                chunk = await content.readany()
            if not chunk:
                break
            sent += len(chunk)
            if sent > self._limits.max_body:
                raise TooLarge
            self._check(chunk)
            yield chunk
        if self._request.content_length is None or sent == self._request.content_length:
            self._on_complete()

    def _check(self, chunk: bytes) -> None:
        """Scan `chunk` for the parts' names before it goes upstream; LateField cuts it short."""
        if self._scan is None:
            return
        try:
            self._scan.feed(chunk)
        except LateField as exc:
            self.late = str(exc)
            raise
