"""The llama.cpp server's native wire: `/completion` and `/infill`.

Owns: what such a request asks for (`n_predict`, else `max_completion_tokens`, else
`max_tokens`; `stream` a JSON boolean; several prompts in one `prompt` list), usage from a
complete body (one result, or a list of them for several prompts or completions) and from its
SSE stream, whose `data:` events carry running counts and end, per result, with a `stop: true`
event holding the totals (no `[DONE]`).
Never: counts a prompt's input once per completion (`shared_prompts`: its `n_cmpl` completions
share one evaluation), or reads `tokens_cached` as cached input: llama.cpp sets it to the tokens
in the slot's cache after the request (`n_past`: prompt plus output), so the cached prefix is
`timings.cache_n` (tools/server/server-task.cpp, `to_json_non_oaicompat`,
`result_timings::to_json`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import MODEL_CHARS, REASON_CHARS, USER_CHARS, clean_or_none
from . import reqsize
from .counts import Counts, body_results, counts_of, error_type, number, summed, total
from .reqsize import prompt_chars
from .stream import CountsStream


class LlamaCppAdapter(reqsize.ReadOnly):
    """llama.cpp's /completion and /infill (tools/server/server.cpp, server-task.cpp). No call
    counts a prompt after a disconnect: every event carries its count (`tokens_evaluated`)."""

    api = "llamacpp"

    def read(self, info: RequestInfo, obj: Mapping[str, Any]) -> None:
        info.max_tokens = _limit(obj)
        info.stream = obj.get("stream") is True  # nlohmann's get<bool>: only a JSON boolean
        info.user = clean_or_none(obj.get("user"), USER_CHARS)
        info.temperature = number(obj.get("temperature"))
        info.prompt_chars = prompt_chars(obj)
        per_prompt = completions(obj)
        info.n = info.choices = prompts(obj) * per_prompt
        info.per_prompt = per_prompt  # results i // per_prompt are one prompt's
        info.output_cap = reqsize.output_cap(info.max_tokens, _read_limits(obj), {})

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete response: one result object, or a list (one per prompt and
        completion: `per_prompt` completions of each prompt, adjacent, `shared_prompts`, when
        there are as many as the request's `sequences`, its choices; a server that makes one
        result a prompt, ignoring `n_cmpl`, lists each prompt's own)."""
        results = body_results(body)
        if results is None:
            return Usage(unknown_reason="no_usage")
        first = results[0]
        if "error" in first and "content" not in first:
            return Usage(error=error_type(first), unknown_reason="error_response")
        reasons = tuple(r for r in (_reason(x) for x in results) if r)
        model = clean_or_none(first.get("model"), MODEL_CHARS)
        shared = per_prompt if len(results) == sequences else 1
        if shared > 1:
            # grouped by each result's own `index` (prompt * n_cmpl + completion), not its place
            # in the list; indexes that are not each place once group nothing: each result's
            # own input, never fewer prompts than were evaluated
            order = [r.get("index") for r in results]
            if all(type(i) is int for i in order) and {*order} == {*range(len(order))}:
                results = sorted(results, key=lambda r: r["index"])
            else:
                shared = 1
        counts = shared_prompts([_final_counts(r) for r in results], shared)
        return summed(counts, model, reasons)

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> LlamaCppStream:
        """The meter for a streamed response (the reference SSE path: no fast path yet)."""
        return LlamaCppStream(endpoint, **options)


_LIMIT_KEYS = ("n_predict", "max_completion_tokens", "max_tokens")  # the first read is the limit


def _limit(obj: Mapping[str, Any]) -> int | None:
    """llama.cpp reads `n_predict`, else `max_completion_tokens`, else `max_tokens`
    (server-task.cpp `params_from_json_cmpl`: `json_value(data, "n_predict", json_value(data,
    "max_completion_tokens", json_value(data, "max_tokens", n_predict)))`). `json_value` reads a
    null, or a value nlohmann's get<int> refuses (a string, a list, an object: its type_error
    caught), as absent: its default, the next field. A number is read as get<int> reads it (a
    fraction truncated) and so is a boolean (0 or 1). -1 (the default) and any other value below
    1 mean no limit of the request's own, so the default worst case applies. A server with the
    schema (server-schema.cpp, `field_num::eval`) reads the same first field and refuses one of
    the wrong type (nothing generated): the field read here is never one a server ignores."""
    for key in _LIMIT_KEYS:
        value = obj.get(key)
        if value is None or not isinstance(value, (int, float)):  # a boolean is an int
            continue  # absent to json_value: the next field is its default
        if isinstance(value, float):  # get<int>: truncated; one past int32 is no limit read
            value = int(value) if value == value and abs(value) < 2**31 else 0
        return int(value) if value > 0 else None
    return None


def _read_limits(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """`obj` without the limit fields llama.cpp reads as absent (no number: `_limit`), for the
    output cap: a wrong-typed one is no limit any llama.cpp obeys, so no reason for no cap."""
    if all(isinstance(obj.get(k), (int, float, type(None))) for k in _LIMIT_KEYS):
        return obj  # the usual body: no copy
    return {
        k: v
        for k, v in obj.items()
        if k not in _LIMIT_KEYS or isinstance(v, (int, float, type(None)))
    }


def prompts(obj: Mapping[str, Any]) -> int:
    """Results one request makes: a `prompt` list holding strings or token lists is several
    prompts (one result each); a list of token ids is one prompt, and so is a list holding both
    token ids and strings (`tokenize_input_prompts`: `json_is_array_of_mixed_numbers_strings`,
    read by `tokenize_mixed`)."""
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt:
        ids = any(type(p) is int for p in prompt)  # a JSON integer (a boolean is none)
        if ids and (all(type(p) is int for p in prompt) or any(type(p) is str for p in prompt)):
            return 1
        return len(prompt)
    return 1


def completions(obj: Mapping[str, Any]) -> int:
    """Completions of each prompt: `n_cmpl`, else its alias `n` (a null one is absent), as
    llama.cpp's schema reads them (server-schema.cpp, `field_num::eval`: nlohmann's get<int>,
    so a fraction is truncated and a boolean is 0 or 1). Results are numbered prompt * n_cmpl +
    completion (`server_response_reader::post_tasks`). A value below 1 (or above the server's
    `n_parallel`, unknown here) is refused. An `n_cmpl` no number could be (a string) is read
    as its default, `n` (`params_from_json_cmpl`: `json_value(data, "n_cmpl",
    json_value(data, "n", 1))`, and `json_value` answers a wrong type with its default; a server
    whose schema refuses it generates nothing, so `n` is the most either makes); an `n` no
    number could be, as 1."""
    value = obj.get("n_cmpl")
    if value is None or not isinstance(value, (int, float)):  # a boolean is an int
        value = obj.get("n")
    if isinstance(value, float):
        value = int(value) if value == value and abs(value) < 2**31 else None
    if type(value) is not int or value < 1:  # a boolean reads as 0 or 1
        return 1
    return value


def shared_prompts(counts: list[Counts | None], per_prompt: int) -> list[Counts | None]:
    """The results' counts (in index order) with each prompt's input counted once: the
    `per_prompt` completions of a prompt (`n_cmpl`, numbered prompt * n_cmpl + completion) share
    its one evaluation. llama.cpp evaluates the prompt in the first completion's slot (the parent
    task) and copies that slot's cache and `stats` to the others (server-context.cpp
    `copy_state_to`, from `decode` once the parent's prompt is done), and every result reports
    its task's whole prompt (`send_final_response`: `n_prompt_tokens` is `task->n_tokens()`,
    `n_prompt_tokens_cache` the copied `stats.n_prompt_cached`): the same prompt and cached
    counts in each. So a prompt's input and cached input are its first completion's, its output
    every completion's. A list of prompts is each prompt's own input, added up. Invalid counts
    (None) are left for `summed` to make the usage invalid."""
    if per_prompt < 2 or len(counts) < 2 or None in counts:
        return counts
    shared: list[Counts | None] = []
    for start in range(0, len(counts), per_prompt):
        group = [c for c in counts[start : start + per_prompt] if c is not None]
        inp, _, cached = group[0]
        shared.append((inp, total(c[1] for c in group), cached))
    return shared


def _reason(obj: Mapping[str, Any]) -> str | None:
    return clean_or_none(obj.get("stop_type"), REASON_CHARS)


def _final_counts(obj: Mapping[str, Any]) -> Counts | None:
    """A result's counts: tokens_evaluated is the whole prompt (cache included), tokens_predicted
    the output, timings.cache_n the prompt tokens reused from the cache."""
    timings = obj.get("timings")
    cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
    return counts_of((obj.get("tokens_evaluated"), obj.get("tokens_predicted"), cache_n))


class LlamaCppStream(CountsStream):
    """A streamed /completion or /infill: one `data:` event per step of output, each with the
    running `tokens_predicted` and `tokens_evaluated` of its prompt (`index`); the prompt's last,
    `stop: true`, holds its totals. `:` lines (keep-alive) are SSE comments."""

    _counts_of = staticmethod(_final_counts)  # read as a body result is (no wrapper frame an event)

    def _step(self, index: int, read: Counts, obj: Mapping[str, Any]) -> None:
        if obj.get("stop") is True:
            self._s.finish[index] = _reason(obj) or "stop"
            if self._s.model is None:
                self._s.model = clean_or_none(obj.get("model"), MODEL_CHARS)
            self.done = len(self._s.finish) >= self._choices
        elif obj.get("content"):
            self._s.token_events += 1

    def _counted_usage(self) -> Usage:
        """Every result's latest counts, each prompt's input once (`shared_prompts`); a result
        asked for and never read leaves the sums unknown, as `CountsStream` has them."""
        if self._invalid or len(self._counts) < self._choices or self._per_prompt < 2:
            return super()._counted_usage()
        base = self._base()
        counts: list[Counts | None] = [self._counts[i] for i in sorted(self._counts)]
        usage = summed(shared_prompts(counts, self._per_prompt), base.model, base.finish_reasons)
        return replace(usage, error=base.error)
