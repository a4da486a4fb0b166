"""The simulator's Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`).

Owns: Messages requests and responses as vLLM serves them (vllm/entrypoints/anthropic/serving.py:
`message_start` with the prompt's count, one `content_block_delta` per token, a `message_delta`
with the cumulative output and the input repeated, `message_stop`, then vLLM's `data: [DONE]`),
Anthropic's error shape, and a simulated prompt cache: a `system` whose blocks carry
`cache_control` is written to the cache the first time (`cache_creation_input_tokens`) and read
from it after (`cache_read_input_tokens`), and, as in Anthropic's API, those tokens are left out
of `input_tokens`. Every number here is simulated.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from sidecar.metering.counts import lax_true

from .engine import Engine, OutOfMemory, chat_prompt, tokenize

_STOP = {"stop": "end_turn", "length": "max_tokens"}  # vLLM's stop_reason_map


@dataclass
class PromptCache:
    """The system prompts marked `cache_control` seen so far (bounded: the simulator's)."""

    seen: set[str] = field(default_factory=set)
    limit: int = 1024

    def use(self, prefix: str) -> bool:
        """True when `prefix` was cached before; else it is cached now."""
        if prefix in self.seen:
            return True
        if len(self.seen) < self.limit:
            self.seen.add(prefix)
        return False


CACHE = web.AppKey("anthropic_cache", PromptCache)
ENGINE = web.AppKey("anthropic_engine", Engine)  # the server's engine (server.py holds its key)


class Invalid(Exception):
    pass


def error(status: int, message: str, err_type: str = "invalid_request_error") -> web.Response:
    body = {"type": "error", "error": {"type": err_type, "message": message}}
    return web.json_response(body, status=status)


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return ""


@dataclass
class Prompt:
    text: str  # the whole prompt, templated
    cached_prefix: str | None  # the system text marked cache_control


def prompt_of(body: dict[str, Any]) -> Prompt:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise Invalid("messages: a non-empty list is required")
    system = body.get("system")
    chat: list[dict[str, object]] = [{"role": "system", "content": _text(system)}] if system else []
    chat += [m for m in msgs if isinstance(m, dict)]
    marked = isinstance(system, list) and any(
        isinstance(b, dict) and b.get("cache_control") for b in system
    )
    return Prompt(chat_prompt(chat), _text(system) if marked else None)


def _usage(cache: PromptCache, prompt: Prompt) -> dict[str, int]:
    """Anthropic's input counts: `input_tokens` without the cache's reads and writes."""
    total = len(tokenize(prompt.text))
    if prompt.cached_prefix is None:
        return {"input_tokens": total}
    cached = min(len(tokenize(prompt.cached_prefix)), total)
    hit = cache.use(prompt.cached_prefix)
    return {
        "input_tokens": total - cached,
        "cache_creation_input_tokens": 0 if hit else cached,
        "cache_read_input_tokens": cached if hit else 0,
    }


def _limit(body: dict[str, Any]) -> int:
    v = body.get("max_tokens")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise Invalid("max_tokens: a positive integer is required")
    return v


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise Invalid(f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise Invalid("model: a string is required")
    return body


async def count_tokens(request: web.Request) -> web.Response:
    try:
        prompt = prompt_of(await _body(request))
    except Invalid as exc:
        return error(400, str(exc))
    return web.json_response({"input_tokens": len(tokenize(prompt.text))})


async def messages(request: web.Request) -> web.StreamResponse:
    engine: Engine = request.app[ENGINE]
    try:
        body = await _body(request)
        prompt, limit = prompt_of(body), _limit(body)
    except Invalid as exc:
        return error(400, str(exc))
    if len(tokenize(prompt.text)) + limit > engine.p.max_model_len:
        return error(400, f"the prompt and max_tokens exceed {engine.p.max_model_len} tokens")
    usage = _usage(request.app[CACHE], prompt)
    seq = engine.submit(prompt.text, limit, 0)
    mid = "msg_" + uuid.uuid4().hex
    if not lax_true(body.get("stream")):
        return await _whole(engine, seq, mid, body["model"], usage)
    return await _stream(request, engine, seq, mid, body["model"], usage)


async def _whole(
    engine: Engine, seq: Any, mid: str, model: str, usage: dict[str, int]
) -> web.Response:
    try:
        text = "".join([t async for t in engine.generate(seq)])
    except OutOfMemory as exc:
        return error(500, str(exc), "api_error")
    return web.json_response(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": model,
            "stop_reason": _STOP.get(seq.finish_reason, "end_turn"),
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": seq.generated},
        }
    )


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


async def _stream(
    request: web.Request, engine: Engine, seq: Any, mid: str, model: str, usage: dict[str, int]
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    message = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model}
    start_usage = {**usage, "output_tokens": 0}
    await resp.write(
        _event(
            "message_start", {"type": "message_start", "message": {**message, "usage": start_usage}}
        )
    )
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    await resp.write(_event("content_block_start", block))
    try:
        async for t in engine.generate(seq):
            delta = {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": t},
            }
            await resp.write(_event("content_block_delta", delta))
    except OutOfMemory as exc:
        err = {"type": "error", "error": {"type": "internal_error", "message": str(exc)}}
        await resp.write(_event("error", err) + b"data: [DONE]\n\n")
        return resp
    await resp.write(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
    final = {
        "type": "message_delta",
        "delta": {"stop_reason": _STOP.get(seq.finish_reason, "end_turn")},
        "usage": {**usage, "output_tokens": seq.generated},
    }
    await resp.write(_event("message_delta", final))
    await resp.write(_event("message_stop", {"type": "message_stop"}) + b"data: [DONE]\n\n")
    return resp


def add_routes(app: web.Application, engine: Engine) -> None:
    """Serve the Messages API on `app` (vLLM, SGLang, llama.cpp and Ollama all do)."""
    app[CACHE] = PromptCache()
    app[ENGINE] = engine
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
