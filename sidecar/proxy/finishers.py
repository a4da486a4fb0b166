"""Work that outlives a request's handler, so a request whose client left is still billed.

Owns: the bounded set of background tasks that finish such requests (keep reading a finished
stream to its usage chunk, or cancel the upstream mid-generation; relay.finish_later starts them),
and the exact prompt size from the upstream's own tokenizer when the wire did not give it (and
the credentials those calls present).
Never: runs without a deadline, holds more than `limit` tasks (beyond it a request is recorded at
once with what was measured), or sends anything to a client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import aiohttp

from ..credentials import API_KEY_HEADER
from ..exchange import Exchange, RequestInfo, Usage
from ..metering.counts import count as token_count
from ..metering.counts import unmeasured
from ..metering.wire import StreamMeter, prompt_token_ids, tokenize_requests
from ..telemetry.metrics import Metrics
from .upstream import Upstream, UpstreamResponse

log = logging.getLogger("tollbooth.finishers")


class Finishers:
    """Background tasks, each ending by recording its exchange; bounded in number."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run `coro` in the background; None (and `coro` closed) when at the limit."""
        if len(self._tasks) >= self.limit:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, grace: float) -> None:
        """Let running tasks end within `grace` seconds (each is bounded anyway), then cancel."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


class PromptCounter:
    """The prompt's exact token count, from the upstream that served the request.

    The calls come from the request's wire adapter (`wire.tokenize_requests`: the same template
    inputs the generation used); vLLM answers `{"count": N}`, /v1/messages/count_tokens
    `{"input_tokens": N}`, TGI's /tokenize a list of tokens and /chat_tokenize
    `{"tokenize_response": [...]}`. Any failure gives None, counted as a tokenize upstream error.
    """

    TIMEOUT_S = 2.0

    def __init__(self, upstream: Upstream, api: str, metrics: Metrics) -> None:
        self.upstream, self.api, self.metrics = upstream, api, metrics

    async def count(self, info: RequestInfo, headers: dict[str, str]) -> int | None:
        api = info.api or self.api
        if (ids := prompt_token_ids(info, api)) is not None:
            return ids
        calls = tokenize_requests(info, api)
        if not calls:
            return None
        total = 0
        for path, body in calls:
            n = await self._one(path, body, headers)
            if n is None:
                self.metrics.upstream_errors.labels("tokenize").inc()
                return None
            total += n
        return token_count(total)  # several prompts: their sum under the same ceiling

    async def _one(self, path: str, body: bytes, headers: dict[str, str]) -> int | None:
        hdrs = {**headers, "Content-Type": "application/json"}
        try:
            status, data = await self.upstream.fetch(
                "POST", path, body=body, headers=hdrs, timeout=self.TIMEOUT_S
            )
            return _count(json.loads(data)) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as exc:
            log.warning("upstream %s failed: %r", path, exc)
            return None


def _count(data: object) -> int | None:
    if isinstance(data, dict):
        if "count" in data:  # vLLM's: a count like any other from the upstream
            return token_count(data["count"])
        if "input_tokens" in data:  # Anthropic's /v1/messages/count_tokens
            return token_count(data["input_tokens"])
        tokens = data.get("tokenize_response")
        return len(tokens) if isinstance(tokens, list) else None
    if isinstance(data, list):
        if data and isinstance(data[0], list):  # a batch of one input
            return len(data[0]) if len(data) == 1 else None
        return len(data)
    return None


# --- after the client left ------------------------------------------------------------------------


async def stream_usage(up: UpstreamResponse, meter: StreamMeter, drain_s: float) -> Usage:
    """Usage of a stream whose client left. A finished generation is read on (at most `drain_s`)
    to its usage chunk; one still generating is cancelled by the caller closing `up`."""
    if meter.finished and not meter.done:
        try:
            async with asyncio.timeout(drain_s):
                async for chunk in up.content.iter_any():
                    meter.feed(chunk)  # nobody is listening: the bytes are only metered
                    if meter.done:
                        break
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.info("reading on after the client left ended early: %r", exc)
    return read_whole(meter, meter.usage_so_far())


def read_whole(meter: StreamMeter, usage: Usage) -> Usage:
    """`usage`, or none at all once the meter failed (`passthrough`): the rest of the stream
    went by unread, so the counts read before it are no measurement (a SGLang stream's first
    count, 1 token, stood for its last, 500)."""
    return unmeasured(usage, "metering_error") if meter.passthrough else usage


async def with_prompt_count(
    usage: Usage,
    info: RequestInfo,
    counter: PromptCounter | None,
    headers: dict[str, str],
    *,
    client_left: bool,
) -> Usage:
    """`usage` with its input count from the upstream's tokenizer when the wire lacked it."""
    if usage.input_tokens is None and counter is not None:
        n = await counter.count(info, headers)
        if n is not None:
            usage = replace(usage, input_tokens=n)
    if usage.input_tokens is not None and usage.output_tokens is not None:
        return replace(usage, unknown_reason=None)
    if client_left:
        return replace(usage, unknown_reason="client_disconnected")
    return usage


def tokenize_auth(ex: Exchange, authorization: str | None) -> dict[str, str]:
    """The sidecar's own /tokenize calls authenticate as the proxied request did: the upstream
    client adds the upstream key when one is configured, else the client's key is passed on."""
    if authorization:
        return {}
    got = ex.request_headers
    return {k: v for k in ("Authorization", API_KEY_HEADER) if (v := got.get(k))}
