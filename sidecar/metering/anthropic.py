"""The Anthropic Messages wire (`/v1/messages`), as vLLM, SGLang, llama.cpp and Ollama serve it.

Owns: what a Messages request asks for (model, `max_tokens`, `stream`, `metadata.user_id`, the
size of `system`, `messages` and `tools`), usage from a Messages body and from its SSE stream
(`message_start`'s `message.usage`, then `message_delta`'s cumulative `usage`), and the one rule
that turns Anthropic's usage into ours: Anthropic's `input_tokens` EXCLUDES the prompt's cache
reads and cache writes, so our input is `input_tokens + cache_read_input_tokens +
cache_creation_input_tokens` and our cached input is `cache_read_input_tokens` (a part of it,
priced at the cached price; docs/metrics.md). Current SGLang follows it too; an older SGLang
followed the other one (`cache_in_input`): its `input_tokens` was the chat usage's whole
`prompt_tokens`, the cache reads a part of it (anthropic/serving.py `_convert_response`), read
as sent under `upstream.sglang_messages_usage: prompt`.
Never: changes a Messages request or response (nothing is injected: the wire always carries its
usage), counts stream events as tokens, or invents a count. A count that cannot be read is None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import ID_CHARS, MODEL_CHARS, REASON_CHARS, USER_CHARS, clean_or_none
from . import reqsize
from .counts import (
    INVALID_USAGE,
    body_value,
    bounded,
    compared,
    count,
    error_type,
    invalid,
    lax_true,
    number,
)
from .reqsize import prompt_chars
from .sse import Event
from .stream import SSEMeter

# vLLM's AnthropicMessagesRequest: `max_tokens: int`, required and positive (protocol.py).
_LIMIT = ("max_tokens",)
# Anthropic's usage members; the cache ones are absent where the server has no prompt cache.
_CACHE_READ, _CACHE_WRITE = "cache_read_input_tokens", "cache_creation_input_tokens"
# Free (metering.free_routes): it counts a prompt and generates nothing; also how a prompt is
# counted after a disconnect.
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
_COUNTS = ("input_tokens", "output_tokens", _CACHE_READ, _CACHE_WRITE)
_PROMPT_PARTS = (_CACHE_READ, _CACHE_WRITE)
# Ollama's message_start id: "msg_" and 12 random bytes in hex (anthropic/anthropic.go
# `GenerateMessageID`); SGLang's is a uuid4's 32 digits, vLLM's and llama.cpp's a chat id.
_OLLAMA_ID = re.compile(r"msg_[0-9a-f]{24}")


class AnthropicAdapter(reqsize.ReadOnly):
    """`/v1/messages` on any server: the format is Anthropic's, whoever serves it (and a
    Messages prompt is never token ids). `cache_in_input`: the server's `input_tokens` already
    holds the cache reads (an older SGLang's), else they are added to it (Anthropic's rule)."""

    def __init__(self, *, cache_in_input: bool = False) -> None:
        self.cache_in_input = cache_in_input

    def read(self, info: RequestInfo, obj: Mapping[str, Any]) -> None:
        info.max_tokens, info.unreadable = reqsize.read_limit(_LIMIT, obj)
        # vLLM reads `stream: bool | None` with pydantic (lax: "true", 1 stream too)
        info.stream = lax_true(obj.get("stream"))
        if isinstance(meta := obj.get("metadata"), dict):
            info.user = clean_or_none(meta.get("user_id"), USER_CHARS)
        info.temperature = number(obj.get("temperature"))
        info.tools = len(obj["tools"]) if isinstance(obj.get("tools"), list) else 0
        info.messages = len(obj["messages"]) if isinstance(obj.get("messages"), list) else 0
        info.prompt_chars = prompt_chars(obj) + _system_chars(obj.get("system"))
        info.output_cap = reqsize.output_cap(info.max_tokens, obj, obj)

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete Messages response (or its error body)."""
        obj = body_value(body)
        if not isinstance(obj, dict):
            return Usage(unknown_reason="no_usage")
        if obj.get("type") == "error" or obj.get("error") is not None:
            return Usage(error=error_type(obj), unknown_reason="error_response")
        reason = clean_or_none(obj.get("stop_reason"), REASON_CHARS)
        base = Usage(
            model=clean_or_none(obj.get("model"), MODEL_CHARS),
            response_id=clean_or_none(obj.get("id"), ID_CHARS),
            finish_reasons=(reason,) if reason else (),
        )
        usage = obj.get("usage")
        return counted(base, usage if isinstance(usage, dict) else None, self.cache_in_input)

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> MessagesStream:
        """The meter for a Messages stream: the reference path (few events carry usage)."""
        return MessagesStream(endpoint, fast=fast, cache_in_input=self.cache_in_input, **options)

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        """The server's own /v1/messages/count_tokens counts the prompt as the route renders it
        (`{"input_tokens": N}`); the body is the request less what only generation reads."""
        obj = body_value(info.body)
        if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
            return None
        keep = {k: obj[k] for k in _COUNTED_KEYS if k in obj}
        return [(COUNT_TOKENS_PATH, json.dumps(keep).encode())]


# What /v1/messages/count_tokens reads of a Messages request (Anthropic's count_tokens params).
_COUNTED_KEYS = ("model", "messages", "system", "tools", "tool_choice", "thinking")


def _system_chars(system: object) -> int:
    if isinstance(system, str):
        return len(system)
    if isinstance(system, list):
        texts = (b.get("text") for b in system if isinstance(b, dict))
        return sum(len(t) for t in texts if isinstance(t, str))
    return 0


def counted(base: Usage, usage: Mapping[str, Any] | None, cache_in_input: bool = False) -> Usage:
    """`base` with the counts of one Anthropic usage object: input is its `input_tokens` plus
    the cache reads and writes it excludes (or, `cache_in_input`, that already holds them);
    cached input is the cache reads."""
    if usage is None:
        return replace(base, unknown_reason="no_usage")
    raw = tuple(usage.get(k) for k in _COUNTS)
    inp, out, read, write = (count(v) for v in raw)
    if any(invalid(v, n) for v, n in zip(raw, (inp, out, read, write), strict=True)):
        return replace(base, unknown_reason=INVALID_USAGE)
    if inp is None and (read is not None or write is not None):
        return replace(base, unknown_reason=INVALID_USAGE)  # a part of no input count
    if cache_in_input and inp is not None and (read or 0) > inp:
        if inp == 0:
            # current SGLang's clamp of more cached than prompt tokens (`max(prompt - cached,
            # 0)`, logged there as a telemetry bug): the prompt is not known
            return replace(base, unknown_reason=INVALID_USAGE)
        # an input that holds its cache reads is never below them: this server follows
        # Anthropic's rule after all (current SGLang, response_conversion.py: input = prompt -
        # cached, named the older one's by upstream.sglang_messages_usage), by which these counts
        # are exact; read as invalid, such a request was charged its hold
        cache_in_input = False
    total = None if inp is None else inp + (0 if cache_in_input else (read or 0) + (write or 0))
    both = total is not None and out is not None
    return bounded(
        replace(
            base,
            input_tokens=total,
            output_tokens=out,
            cached_input_tokens=read,
            unknown_reason=None if both else "no_usage",
        )
    )


def _without_placeholder(usage: object) -> object:
    """A stream event's usage less the 0s of a placeholder: `input_tokens: 0` without a cache
    count. SGLang sends it in message_start, before its real counts (its chat stream has usage
    on the last chunk only), and in message_delta when that chunk never came (the chat stream
    ended on an error): 0 for every count, output included (anthropic/serving.py
    `_generate_anthropic_stream`, `usage_info` None); vLLM's message_delta too, for a usage-only
    chunk without usage. A prompt is never 0 tokens, unless all of it was read from the cache
    (Anthropic's input excludes cache reads): 0 beside a cache count stands, and so does an
    output of 0 beside a real input."""
    if not isinstance(usage, dict) or not _zero(usage.get("input_tokens")):
        return usage
    if any(usage.get(k) for k in _PROMPT_PARTS):
        return usage
    return {k: v for k, v in usage.items() if not (k in _COUNTS and _zero(v))}


def _without_estimate(message: Mapping[str, Any], usage: object) -> object:
    """message_start's usage less an input that is Ollama's estimate, not a count: its
    `input_tokens` is the first chunk's `prompt_eval_count`, 0 on every chunk but the last, so
    the request's length / 4 in its place (middleware/anthropic.go `EstimateInputTokens`,
    anthropic/anthropic.go `StreamConverter.Process`); the count comes in message_delta. Told by
    what Go writes: no `stop_reason` member (`omitempty`, where vLLM, llama.cpp and Anthropic
    write null) and Ollama's id; no `upstream.api` names Ollama."""
    if not isinstance(usage, dict) or "stop_reason" in message:
        return usage
    mid = message.get("id")
    if not isinstance(mid, str) or _OLLAMA_ID.fullmatch(mid) is None:
        return usage
    return {k: v for k, v in usage.items() if k != "input_tokens"}


def _zero(value: object) -> bool:
    return type(value) is int and value == 0


class MessagesStream(SSEMeter):
    """A Messages stream: `message_start` carries the input (and cache) counts, `message_delta`
    the output so far (cumulative: the last one wins; vLLM repeats the input counts there),
    `content_block_delta` the generated text, `message_stop` the end (vLLM adds `[DONE]`).

    The output is read from `message_delta` only: `message_start`'s `output_tokens` is a
    placeholder (0 from vLLM, 1 from Anthropic) sent before anything was generated, so a client
    that leaves before the first `message_delta` has its output unknown, never that placeholder.
    Ollama's `message_start` input is an estimate, not a count (`_without_estimate`).
    """

    def __init__(self, endpoint: Endpoint, *, cache_in_input: bool = False, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self._usage_obj: dict[str, Any] = {}  # the latest value of each usage member read
        self._member_skips: dict[str, int] = {}  # each member's: events over the limit before
        self._started = False  # message_start was read (where the input and cache counts are)
        self._invalid = False
        self._cache_in_input = cache_in_input

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        kind = compared(obj.get("type"))
        if kind == "content_block_delta":
            self._s.token_events += 1
        elif kind == "message_start" and isinstance(msg := obj.get("message"), dict):
            self._s.model = clean_or_none(msg.get("model"), MODEL_CHARS)
            self._s.response_id = clean_or_none(msg.get("id"), ID_CHARS)
            self._started = True
            usage = _without_estimate(msg, msg.get("usage"))
            self._merge(_without_placeholder(usage), output=False)
        elif kind == "message_delta":
            self._merge(_without_placeholder(obj.get("usage")), output=True)
            delta = obj.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            if (r := clean_or_none(reason, REASON_CHARS)) is not None:
                self._s.finish[0] = r
        elif kind == "message_stop":
            self.done = True
        return False

    def _merge(self, usage: object, *, output: bool) -> None:
        if not isinstance(usage, dict):
            self._invalid = self._invalid or usage is not None
            return
        for key in _COUNTS if output else _COUNTS[:1] + _COUNTS[2:]:
            if key in usage:  # only the counts: an event's other members are never kept
                self._usage_obj[key] = usage[key]
                self._member_skips[key] = self._skips

    def _read_after_skips(self) -> bool:
        # message_delta's usage is cumulative: it supersedes what came before only for the
        # members it repeats. Every member the usage is built from, read after the last event
        # over the limit, and message_start read (an unread one may have held cache counts that
        # no later event repeats)
        skips = self._skips
        return self._started and all(n == skips for n in self._member_skips.values())

    def _counted_usage(self) -> Usage:
        base = self._base()
        if self._invalid:
            return replace(base, unknown_reason=INVALID_USAGE)
        return counted(base, self._usage_obj, self._cache_in_input)
