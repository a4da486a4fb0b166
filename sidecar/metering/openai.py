"""The OpenAI wire as vLLM serves it: chat, completions, the Responses API, embeddings.

Owns: what such a request asks for (model, stream as the server reads it, user, limits, prompt
size), reading `usage` from its response bodies and streams (the reference path: each event SSE-
parsed, decoded and read), removing from a stream exactly the usage we caused (the usage chunk,
per-chunk running totals), and the /tokenize calls that count its prompt after a disconnect.
The learnt-shape fast path for its chunks is `shape.py`'s, beside this one.
Never: counts stream chunks as tokens, invents a count, or touches clocks, sockets and metrics.
A count that cannot be read is None, with the reason in `Usage.unknown_reason`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import ID_CHARS, MODEL_CHARS, REASON_CHARS, USER_CHARS, clean_or_none
from . import llamacpp, reqsize, splice
from .counts import (
    INVALID_USAGE,
    body_value,
    bounded,
    compared,
    count,
    error_type,
    lax_true,
    number,
    total,
    total_present,
)
from .reqsize import body_size, lax_int, prompt_chars
from .sse import Event
from .stream import SSEMeter, choice_index, read_since

_INJECTABLE = (Endpoint.CHAT, Endpoint.COMPLETIONS)
# the routes llama.cpp serves with its completion params, `n_cmpl` among them
_LLAMA_CPP_CMPL = (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES)


class OpenAIAdapter:
    """The OpenAI routes of one server (`api`: "vllm"; TGI's differ only in what `tgi.py`
    overrides: its limit fields and its tokenizer routes)."""

    api = "vllm"

    def __init__(self, *, fast_chat: type[ChatStream] | None = None) -> None:
        # the chat/completions meter with a fast path beside `ChatStream` (`shape.py`'s); with
        # none, `stream(fast=True)` is the reference path too
        self._fast_chat = fast_chat

    # --- requests ---------------------------------------------------------------------------------

    def inspect(
        self,
        endpoint: Endpoint,
        body: bytes,
        text: str | None,
        obj: Mapping[str, Any],
        *,
        inject_usage: bool,
        continuous_usage: bool = False,
    ) -> RequestInfo:
        """Read what the request asks for, with usage asked for as `wire.inspect_request` says."""
        # The output limit as the route's server reads it (only the fields it reads: `reqsize`)
        # and n; the limits present that are no integer the server would read are unreadable.
        fields = reqsize.limit_fields(endpoint, self.api)
        max_tokens, unreadable = reqsize.read_limit(fields, obj)
        n = obj.get("n")
        read_n = n if n is None or type(n) is int else lax_int(n)
        if n is not None and read_n is None:
            unreadable += ("n",)
        n = read_n if read_n is not None and read_n > 0 else None
        if endpoint in _LLAMA_CPP_CMPL and (completions := llamacpp.completions(obj)) > (n or 1):
            # llama.cpp's OpenAI routes copy the body's other fields through to its completion
            # params (server-common.cpp `oaicompat_chat_params_parse`), where `n_cmpl`, else
            # `n`, is the completions per prompt: the most any server behind the route makes.
            # Its /v1/responses too: `server_chat_convert_responses_to_chatcmpl` (server-chat.cpp)
            # starts from a copy of the body, then `oaicompat_chat_params_parse` and
            # `handle_completions_impl` as for a chat (server-context.cpp `post_responses_oai`)
            n = completions
        # An absent field is answered here, without the call that would say so: most bodies
        # have no `stream`, `user` or `temperature`.
        stream = obj.get("stream")
        stream = stream is not None and endpoint is not Endpoint.EMBEDDINGS and lax_true(stream)
        injected = None
        if inject_usage and stream and endpoint in _INJECTABLE and text is not None:
            injected = splice.with_usage_requested(text, obj, continuous_usage)
        sent, injected_usage, strip_chunk_usage = injected or (body, False, False)
        # Built by attribute, not by 20 keyword arguments: a class call passes them in a dict
        # that `__init__` unpacks again (a fifth of what `inspect` cost, counted).
        info = RequestInfo(endpoint, sent, True)
        info.stream = stream
        info.injected_usage = injected_usage
        info.strip_chunk_usage = strip_chunk_usage
        info.model = clean_or_none(obj.get("model"), MODEL_CHARS)
        if (user := obj.get("user")) is not None:
            info.user = clean_or_none(user, USER_CHARS)
        info.max_tokens = max_tokens
        if (temperature := obj.get("temperature")) is not None:
            info.temperature = number(temperature)
        info.n = n
        tools, messages = obj.get("tools"), obj.get("messages")
        info.tools = len(tools) if isinstance(tools, list) else 0
        info.messages = len(messages) if isinstance(messages, list) else 0
        info.prompt_chars = prompt_chars(obj)
        info.choices = (n or 1) * _prompts(endpoint, obj)  # n: None or positive
        if (echo := obj.get("echo")) is not None:
            info.echoed = lax_true(echo)
        info.utf8 = text is not None
        info.text_chars, info.prompt_ids = body_size(obj)
        info.unreadable = unreadable
        # the cap on counted output: only from limits every server behind the route obeys
        info.output_cap = reqsize.output_cap(
            reqsize.capping_limit(endpoint, max_tokens, obj), obj, obj
        )
        if endpoint is Endpoint.EMBEDDINGS:
            info.output_cap = 0  # nothing is generated: any output counted is no measurement
        elif endpoint is Endpoint.RESPONSES and _server_tools(tools):
            info.output_cap = None  # one generation per built-in tool call, each with its limit
        return info

    # --- responses --------------------------------------------------------------------------------

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete (non-streaming) response; `sequences` and `per_prompt` tell
        whether the choices of a body that reports only its first one's share one prompt."""
        return body_usage(endpoint, body_value(body), one_prompt=per_prompt >= sequences)

    def stream(
        self, endpoint: Endpoint, *, fast: bool = True, **options: Any
    ) -> ChatStream | ResponsesStream:
        """The meter for a streamed response; `fast` adds the fast chat path given at start."""
        if endpoint is Endpoint.RESPONSES:
            return ResponsesStream(endpoint, fast=fast, **options)
        if fast and self._fast_chat is not None:
            return self._fast_chat(endpoint, **options)
        return ChatStream(endpoint, fast=fast, **options)

    # --- after a disconnect -----------------------------------------------------------------------

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        """The upstream calls that count this request's prompt exactly as its generation did:
        (path, JSON body) pairs whose counts add up to the prompt tokens. None when no call can.
        vLLM's /tokenize renders chat messages with the same template inputs as the chat route."""
        obj = body_value(info.body)
        if not isinstance(obj, dict):
            return None
        if info.endpoint is Endpoint.CHAT and isinstance(obj.get("messages"), list):
            body = {k: obj[k] for k in _VLLM_TEMPLATE_KEYS if k in obj}
            return [("/tokenize", json.dumps(body).encode())]
        if info.endpoint is Endpoint.COMPLETIONS and (prompt := one_prompt(obj)) is not None:
            keep = {k: obj[k] for k in ("model", "add_special_tokens") if k in obj}
            return [("/tokenize", json.dumps({**keep, "prompt": prompt}).encode())]
        return None

    def prompt_token_ids(self, info: RequestInfo) -> int | None:
        """A completion whose prompt is token ids is counted without asking anyone."""
        if info.endpoint is not Endpoint.COMPLETIONS:
            return None
        obj = body_value(info.body)
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return len(prompt)
        return None


# Chat request fields that change how vLLM renders the prompt; /tokenize takes the same ones.
_VLLM_TEMPLATE_KEYS = (
    "model",
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
)


def one_prompt(obj: Mapping[str, Any]) -> str | None:
    """A completion's one text prompt; None for a batch, token ids (counted without asking) or a
    truncated prompt."""
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or "truncate_prompt_tokens" in obj:
        return None
    return prompt


def _server_tools(tools: object) -> bool:
    """Does a Responses request name a tool the server runs itself (web_search_preview,
    code_interpreter, container, mcp: anything but a client's function)? vLLM then generates
    again after each call, limited by the context left, not by `max_output_tokens`
    (`_generate_with_builtin_tools`), and reports every generation's output."""
    if not isinstance(tools, list):
        return False
    return any(not isinstance(t, dict) or t.get("type") != "function" for t in tools)


def _prompts(endpoint: Endpoint, obj: Mapping[str, Any]) -> int:
    """A completion's prompt list gives one choice per prompt (times n); a token-id list is one,
    and so is a list of token ids and strings (`llamacpp.prompts`).
    vLLM's `prompt_embeds` (one base64 tensor, or a list of them: `CompletionRequest`) are
    prompts too, served before the text ones ("the prompt embeds are always returned first",
    docs/features/prompt_embeds.md): a request's prompts are both together."""
    if endpoint is not Endpoint.COMPLETIONS:
        return 1
    prompt, embeds = obj.get("prompt"), obj.get("prompt_embeds")
    # llama.cpp's /v1/completions tokenizes `prompt` as its /completion does (one prompt for a
    # list mixing token ids and strings); vLLM takes no such list
    texts = llamacpp.prompts(obj)
    if embeds is None:
        return texts
    tensors = len(embeds) if isinstance(embeds, list) else 1
    return max(1, tensors + (texts if prompt is not None else 0))


def body_usage(endpoint: Endpoint, obj: object, *, one_prompt: bool = True) -> Usage:
    """Usage of a decoded OpenAI response body (`one_prompt`: its choices share one prompt)."""
    if not isinstance(obj, dict):
        return Usage(unknown_reason="unparseable_response")
    if obj.get("error") is not None and "choices" not in obj:  # Responses bodies carry error: null
        return Usage(error=error_type(obj), unknown_reason="error_response")
    usage = obj.get("usage")
    model = clean_or_none(obj.get("model"), MODEL_CHARS)
    rid = clean_or_none(obj.get("id"), ID_CHARS)
    reasons = _finish_reasons(obj)
    if endpoint is Endpoint.RESPONSES:
        reasons = (s,) if (s := clean_or_none(obj.get("status"), REASON_CHARS)) else ()
    if not isinstance(usage, dict):
        return Usage(
            model=model, response_id=rid, finish_reasons=reasons, unknown_reason="no_usage"
        )
    read = read_usage(usage, endpoint, model=model, response_id=rid, finish_reasons=reasons)
    if endpoint in _INJECTABLE and _first_result_only(obj) and read.unknown_reason is None:
        return _others_unreported(read, one_prompt)
    return read


def _first_result_only(obj: Mapping[str, Any]) -> bool:
    """Is this llama.cpp's body of several results whose usage is the first one's alone? Its
    `handle_completions_impl` (server-context.cpp), not streamed, with several results on
    /v1/chat/completions or /v1/completions (`n`/`n_cmpl` above 1, or a `prompt` list), appends
    the other results' `choices[0]` to the first result's body and sends that body, its `usage`
    the first completion's counts (server-task.cpp `to_json_oaicompat_chat`,
    `to_json_oaicompat`). Told by `timings`: every final result of llama.cpp carries it
    (`send_final_response` sets `res->timings`; `prompt_n` is a count, so `if (timings.prompt_n
    >= 0)` always adds it), and no vLLM, SGLang, TGI or Ollama body has one (vLLM's usage of
    several choices counts every one of them, read as it is)."""
    choices = obj.get("choices")
    return isinstance(obj.get("timings"), dict) and isinstance(choices, list) and len(choices) > 1


def _others_unreported(usage: Usage, one_prompt: bool) -> Usage:
    """The usage of a body that counts only its first result: the other completions' output is
    in no count (unknown, charged the hold: `choices_unreported`); the input is measured when
    every choice is of the one prompt (each result reports the whole prompt, evaluated once:
    `llamacpp.shared_prompts`), else the other prompts' is unknown too."""
    kept = one_prompt and usage.input_tokens is not None
    return replace(
        usage,
        input_tokens=usage.input_tokens if kept else None,
        cached_input_tokens=usage.cached_input_tokens if kept else None,
        output_tokens=None,
        reasoning_tokens=None,
        unknown_reason="choices_unreported",
    )


def read_usage(
    usage: Mapping[str, Any],
    endpoint: Endpoint,
    *,
    model: str | None = None,
    response_id: str | None = None,
    finish_reasons: tuple[str, ...] = (),
) -> Usage:
    """An OpenAI-style `usage` object (chat/completions/embeddings or the Responses API's), with
    the response's other fields when they are known."""
    if endpoint is Endpoint.RESPONSES:
        raw_in, raw_out = usage.get("input_tokens"), usage.get("output_tokens")
        details = usage.get("input_tokens_details")
        out_details = usage.get("output_tokens_details")
    else:
        raw_in, raw_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        out_details = usage.get("completion_tokens_details")
    raw_cached = details.get("cached_tokens") if isinstance(details, dict) else None
    raw_reasoning = out_details.get("reasoning_tokens") if isinstance(out_details, dict) else None
    # `count` of each, and `invalid` of each inlined: sent (not None) but no count read
    inp, out = count(raw_in), count(raw_out)
    cached = None if raw_cached is None else count(raw_cached)
    reasoning = None if raw_reasoning is None else count(raw_reasoning)
    # Cached tokens are a part of the input: more of them than input, or of no input count, is a
    # broken count (as for reasoning, below).
    more_cached = cached is not None and (inp is None or cached > inp)
    # Reasoning tokens are a part of the output: more of them than output is a broken count.
    more_reasoning = reasoning is not None and (out is None or reasoning > out)
    if (
        (inp is None and raw_in is not None)
        or (out is None and raw_out is not None)
        or (cached is None and raw_cached is not None)
        or (reasoning is None and raw_reasoning is not None)
        or more_cached
        or more_reasoning
    ):
        return Usage(
            model=model,
            response_id=response_id,
            finish_reasons=finish_reasons,
            unknown_reason=INVALID_USAGE,
        )
    if out is None and endpoint is Endpoint.EMBEDDINGS and inp is not None:
        out = 0  # embeddings generate nothing: zero is what happened, not a guess
    missing = inp is None or out is None
    return Usage(
        input_tokens=inp,
        output_tokens=out,
        cached_input_tokens=cached,
        reasoning_tokens=reasoning,
        model=model,
        response_id=response_id,
        finish_reasons=finish_reasons,
        unknown_reason="incomplete_usage" if missing else None,
    )


def _finish_reasons(obj: Mapping[str, Any]) -> tuple[str, ...]:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return ()
    reasons = []  # a loop, not a generator: one choice is the usual case
    for c in choices:
        if isinstance(c, dict) and (r := clean_or_none(c.get("finish_reason"), REASON_CHARS)):
            reasons.append(r)
    return tuple(reasons)


# --- streams --------------------------------------------------------------------------------------


class ChatStream(SSEMeter):
    """A chat or completions stream, the reference path: every event SSE-parsed, decoded, read.

    Totals come from the usage-only chunk (`choices: []`) when it came, else from the running
    usage riding on each choice's chunks (vLLM's `continuous_usage_stats`).
    """

    def __init__(self, endpoint: Endpoint, **options: Any) -> None:
        super().__init__(endpoint, **options)
        # the usage-only chunks' usage: the last one's (one choice), or up to one per choice
        self._final_usage: list[Mapping[str, Any] | bytes] = []
        self._final_skips = 0  # the events over the limit before the first of them kept
        self._extra_usage = False  # more usage-only chunks than choices came
        self._finished_then = -1  # the choices finished when the last usage-only chunk came
        # usage riding on a choice (vLLM's running totals, TGI); bytes from the wire fast path
        self._choice_usage: dict[int, Mapping[str, Any] | bytes] = {}
        self._choice_usage_then: dict[int, Mapping[str, Any] | bytes] = {}  # at the last skip
        # a chunk of a choice the request did not ask for came (`stream.choice_index`)
        self._stray = False

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        """Read one decoded chunk; True when it is the usage chunk we caused."""
        s = self._s
        s.model = s.model or clean_or_none(obj.get("model"), MODEL_CHARS)
        s.response_id = s.response_id or clean_or_none(obj.get("id"), ID_CHARS)
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(choices, list) and choices:
            if any(_carries_output(c) for c in choices):
                s.token_events += 1
            for c in choices:
                if not isinstance(c, dict):
                    continue
                if (index := choice_index(c, self._choices)) is None:
                    self._stray = True
                elif r := clean_or_none(c.get("finish_reason"), REASON_CHARS):
                    s.finish[index] = r
            if isinstance(usage, dict):
                first = choices[0] if isinstance(choices[0], dict) else {}
                if (index := choice_index(first, self._choices)) is not None:
                    self._choice_usage[index] = usage
                self._cut = self._strip_chunk
            return False
        if isinstance(usage, dict) and isinstance(choices, list):
            if self._choices < 2:
                # the request's totals, not a part of them: a repeated usage chunk replaces the
                # one before (the last word, as a client's SDK keeps it), never adds to it
                self._final_usage = [usage]
                self._final_skips = self._skips
            else:
                self._several_usage(usage)
            return self._strip
        return False

    def _several_usage(self, usage: Mapping[str, Any]) -> None:
        """A usage-only chunk of several choices. llama.cpp sends one per completion, that
        completion's counts right after its finish chunk (`to_json_oaicompat_chat_stream`: one
        result's chunks); vLLM and SGLang one of the totals, after every choice's finish chunk.
        So one with no choice finished since the usage-only chunk before it repeats that one
        (vLLM's totals sent again): it replaces it, never adds to it. Else it is a part, added up
        (`_counted_usage`)."""
        finished, self._finished_then = self._finished_then, len(self._s.finish)
        if self._final_usage and finished == self._finished_then:
            self._final_usage[-1] = usage
        elif len(self._final_usage) < self._choices:
            if not self._final_usage:
                self._final_skips = self._skips
            self._final_usage.append(usage)
        else:
            self._extra_usage = True  # more parts than choices: no choice's own

    def _cut_event(self, ev: Event) -> bytes:
        return _without_usage(ev)

    def _skipped(self) -> None:
        super()._skipped()
        self._choice_usage_then = dict(self._choice_usage)

    def _read_after_skips(self) -> bool:
        """The usage-only chunks, when they are read as the totals: one choice's last (its
        totals), or a part per choice, every one after the last event over the limit (which may
        have been a part: fewer parts, vLLM's totals among them, stay unknown). Else each
        choice's running totals, each read after it."""
        if self._final_usage:
            whole = len(self._final_usage) >= self._choices
            return whole and self._final_skips == self._skips
        return read_since(self._choice_usage, self._choice_usage_then)

    def _running_input(self, parts: Mapping[int, Usage]) -> int | None:
        """A chat's choices share one prompt. A batched completion's choice `i` belongs to prompt
        `i // n`, and each choice's running usage carries its own prompt's size: one per prompt
        (`parts` has every choice's, so every prompt's)."""
        if None in (p.input_tokens for p in parts.values()):
            return None
        if self.endpoint is Endpoint.CHAT:
            return max(p.input_tokens or 0 for p in parts.values())
        prompts: dict[int, int] = {}
        for i, p in parts.items():
            prompts[i // self._per_prompt] = p.input_tokens or 0
        return sum(prompts.values())

    def _counted_usage(self) -> Usage:
        """The totals if they came (with several choices: one part per choice, or fewer once
        [DONE] came); else vLLM's running totals (exact up to the last chunk received, and with
        several choices only when every choice sent them), each prompt's once: at the stream's
        end as for a client that left; else unknown (as they are beside a choice the request did
        not ask for). A usage on a choice's chunk that counts no prompt is no running total
        (`_counts_a_prompt`): beside another choice's, that choice's output is unknown, so the
        request's is."""
        running = {i: u for i, u in self._choice_usage.items() if _counts_a_prompt(u)}
        if self._extra_usage:
            # more usage-only chunks than the request has choices: which are parts and which
            # repeat another cannot be told
            return replace(self._base(), unknown_reason=INVALID_USAGE)
        if 0 < len(self._final_usage) < self._choices and not self.done:
            # Parts of the totals, not yet all: llama.cpp sends each completion's usage-only
            # chunk as that completion ends, the others still generating; vLLM its one chunk
            # of totals right before [DONE]. Fewer parts than choices are the request's usage
            # only once [DONE] came; before, some choice's tokens may be in none of them, and
            # only every choice's running totals (vLLM's, all sent by then) measure it.
            if len(running) < self._choices:
                return replace(self._base(), unknown_reason="incomplete_usage")
        elif self._final_usage or not running:
            # A chat's choices share one prompt: its input is counted once (the largest part's);
            # a completion's parts may each be another prompt's, so their inputs add up.
            shared = self.endpoint is Endpoint.CHAT
            return _totals(self._base(), self._final_usage, self.endpoint, shared_prompt=shared)
        if len(running) < len(self._choice_usage):
            return replace(self._base(), unknown_reason="incomplete_usage")
        if self._stray:
            # running totals beside a choice the request did not ask for: whose tokens it had,
            # and so each choice's, cannot be told (the request's own totals would say)
            return replace(self._base(), unknown_reason=INVALID_USAGE)
        if self._choices < 2:
            return _totals(self._base(), [*running.values()], self.endpoint)
        if len(running) < self._choices:
            # a choice without running usage: its output so far was never read (llama.cpp's
            # /v1/completions puts each result's usage on that result's final chunk alone)
            return replace(self._base(), unknown_reason="incomplete_usage")
        parts = {i: read_usage(_decoded(u), self.endpoint) for i, u in running.items()}
        inp = self._running_input(parts)
        reason = next((p.unknown_reason for p in parts.values() if p.unknown_reason), None)
        return bounded(
            replace(
                self._base(),
                input_tokens=inp,
                output_tokens=total(p.output_tokens for p in parts.values()),
                unknown_reason=None if inp is not None else reason or "incomplete_usage",
            )
        )


class ResponsesStream(SSEMeter):
    """The Responses API's typed events: a `.delta` is a token event; the terminal event
    (`response.completed`, `.incomplete`, `.failed`) carries the response with its usage.

    A request of several choices (llama.cpp's `n_cmpl`) may be several responses in one stream:
    llama.cpp's `post_responses_oai` runs the body as a chat (`handle_completions_impl`), and
    streamed, each completion sends its own events (`to_json_oaicompat_resp` for its partial
    results, `to_json_oaicompat_resp_stream` for its final one, server-task.cpp), interleaved,
    each under its own response id (`task_result_state`'s `oai_resp_id`, "resp_" and a random
    string, one state per task, children too: server-queue.cpp `post_tasks`) and ending with its
    own terminal event, whose usage is that completion's: the stream ends after the last. Each
    response id is then its own response, up to the request's choices (more is invalid usage).
    """

    def __init__(self, endpoint: Endpoint, **options: Any) -> None:
        super().__init__(endpoint, **options)
        self._idle = False  # the last output item is done, no delta since
        # each response by its id (one response when one choice): where it is in the stream's
        # order, its terminal event's usage (None: that event had none), and the events over
        # the limit before that event
        self._seen: dict[object, int] = {}
        self._ends: dict[object, Mapping[str, Any] | None] = {}
        self._end_skips: dict[object, int] = {}
        self._extra = False  # more responses than choices

    @property
    def finished(self) -> bool:
        if self.done:
            return True
        if len(self._seen) > 1:  # several responses: every one seen has ended (more may come)
            return len(self._ends) >= len(self._seen)
        return self._idle

    def _read(self, ev: Event, obj: Mapping[str, Any]) -> bool:
        kind = compared(obj.get("type")) or ""
        if kind.endswith(".delta"):
            self._s.token_events += 1
            self._idle = False
        elif kind == "response.output_item.done":
            self._idle = True
        response = obj.get("response")
        if not isinstance(response, dict):
            return False
        self._s.model = self._s.model or clean_or_none(response.get("model"), MODEL_CHARS)
        self._s.response_id = self._s.response_id or clean_or_none(response.get("id"), ID_CHARS)
        position = self._position(response.get("id"))
        if position is not None and kind in _TERMINAL:
            if (status := clean_or_none(response.get("status"), REASON_CHARS)) is not None:
                self._s.finish[position] = status
            # One response, so one final word: each terminal event carries the whole response
            # (its usage the totals, not an increment), and a later one of the same response
            # replaces an earlier one (usage and all, as a client's SDK keeps the last).
            usage = response.get("usage")
            key = self._key(response.get("id"))
            self._ends[key] = usage if isinstance(usage, dict) else None
            self._end_skips[key] = self._skips
            self.done = len(self._ends) >= self._choices
            if kind == "response.failed":
                self._s.error = self._s.error or "response.failed"
        return False

    def _read_after_skips(self) -> bool:
        # each terminal event carries its whole response: every choice's read after the last
        # event over the limit (which may have been another response's), nothing before them
        # is a part of their usage
        ends = self._end_skips.values()
        return len(self._ends) >= self._choices and all(n == self._skips for n in ends)

    def _key(self, rid: object) -> object:
        """The response an event is of: one when the request asked one choice (any id)."""
        return rid if self._choices > 1 and isinstance(rid, str) else None

    def _position(self, rid: object) -> int | None:
        """The response's place in the stream; None for one past the request's choices."""
        key = self._key(rid)
        if key not in self._seen:
            if len(self._seen) >= self._choices:
                self._extra = True
                return None
            self._seen[key] = len(self._seen)
        return self._seen[key]

    def _counted_usage(self) -> Usage:
        """Every response's final usage, added up, the prompt they share counted once (each of
        llama.cpp's completions reports the whole prompt, evaluated once: `shared_prompts`);
        unknown while a response seen has not ended (its output so far is in no count)."""
        base = self._base()
        if self._extra:
            return replace(base, unknown_reason=INVALID_USAGE)
        ends = [u for u in self._ends.values() if u is not None]
        if not ends or len(ends) < len(self._ends):
            return _totals(base, [], self.endpoint)
        if len(self._ends) < len(self._seen):
            return replace(base, unknown_reason="incomplete_usage")
        return _totals(base, [*ends], self.endpoint, shared_prompt=True)


_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _totals(
    base: Usage,
    totals: list[Mapping[str, Any] | bytes],
    endpoint: Endpoint,
    *,
    shared_prompt: bool = False,
) -> Usage:
    """A stream's usage: the sum of its usage objects (the last usage chunk, the usage-only
    chunks of a request with several choices, or one choice's running totals), with the
    stream's other fields. `shared_prompt`: the parts are choices of one prompt, whose input
    (and its cached part) is counted once, the largest part's, not added up."""
    if not totals:
        return replace(base, unknown_reason="stream_without_usage")
    parts = [read_usage(_decoded(u), endpoint) for u in totals]
    inp, out = total(p.input_tokens for p in parts), total(p.output_tokens for p in parts)
    # a part of a sum that is unknown (one of its parts invalid, or without it) is no count
    cached = None if inp is None else total_present(p.cached_input_tokens for p in parts)
    if shared_prompt and len(parts) > 1 and inp is not None:
        inp = max(p.input_tokens or 0 for p in parts)
        present = [p.cached_input_tokens for p in parts if p.cached_input_tokens is not None]
        cached = max(present) if present else None
    reasoning = None if out is None else total_present(p.reasoning_tokens for p in parts)
    return bounded(
        replace(
            base,
            input_tokens=inp,
            output_tokens=out,
            cached_input_tokens=cached,
            reasoning_tokens=reasoning,
            unknown_reason=next((p.unknown_reason for p in parts if p.unknown_reason), None),
        )
    )


def _counts_a_prompt(usage: Mapping[str, Any] | bytes) -> bool:
    """Can usage riding on a choice's chunk be a measurement? Not when its `prompt_tokens` is 0:
    every generation has a prompt of at least one token (vLLM refuses an empty one, "The decoder
    prompt cannot be empty", v1 `InputProcessor._validate_prompt_len`; TGI an empty input,
    "`inputs` cannot be empty"), so their running totals, and the totals TGI puts on a finish
    chunk, count one. Ollama's /v1/completions puts an all-zero `Usage{}` on every chunk, its
    finish chunk too, once `include_usage` is asked for (middleware/openai.go `CompleteWriter`):
    read as running totals, a client that left before the usage chunk was billed 0 tokens. (An
    empty prompt a server does answer, with 0s on its finish chunk, is then unmeasured: charged
    its hold, never free.) Any other value is left to `read_usage` (absent: incomplete; no
    count: invalid)."""
    return count(_decoded(usage).get("prompt_tokens")) != 0


def _decoded(usage: Mapping[str, Any] | bytes) -> Mapping[str, Any]:
    """Running usage the wire fast path kept as bytes (an object of numbers), decoded."""
    if isinstance(usage, bytes):
        decoded: Mapping[str, Any] = json.loads(usage)
        return decoded
    return usage


DELTA_OUTPUT = (
    "content",
    "reasoning_content",
    "reasoning",
    "tool_calls",
    "function_call",
    "refusal",
)


# vLLM's chunk ends `,"usage":{...}}` (compact JSON, usage last; its values are numbers and one
# nested object). A raw newline cannot be inside a JSON string, nor an unescaped quote, so this
# can only match the top-level object's last member, right before the end of the data line.
_USAGE_LAST = re.compile(rb',"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}(?=\}[ \t]*[\r\n])')


def _without_usage(ev: Event) -> bytes:
    """The event's bytes with its JSON's `usage` member cut out, every other byte kept.

    Only a single-line `data:` event is cut (vLLM's shape); any other is forwarded as it came.
    """
    raw = ev.raw
    if raw.count(b"\ndata:") + raw.startswith(b"data:") != 1:
        return raw
    if (m := _USAGE_LAST.search(raw)) is not None:
        return raw[: m.start()] + raw[m.end() :]
    data = ev.data or ""
    cut = splice.without(data, "usage")
    encoded = data.encode("utf-8")
    at = raw.find(encoded)
    if cut is None or at < 0:
        return raw
    return raw[:at] + cut.encode("utf-8") + raw[at + len(encoded) :]


def _carries_output(choice: object) -> bool:
    """Does this chunk carry generated output? vLLM's first chat chunk (the role, empty content)
    is sent before prefill finishes, so it must not count as the first token."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(delta.get(k) for k in DELTA_OUTPUT)
    return bool(choice.get("text"))
