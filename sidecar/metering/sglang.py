"""SGLang's native `/generate` (TGI's path: `wire.inspect_request` tells the two apart).

Owns: what an SGLang generate request asks for (`text`, `input_ids` or `input_embeds`, one or
a batch; `sampling_params.max_new_tokens`, absent the server's own default: 128, or the one its
/model_info states, `stated_default`; `sampling_params.n`; `stream` as FastAPI's pydantic reads
a bool), usage from a complete body (`meta_info.{prompt_tokens, completion_tokens,
cached_tokens}`, one object or a list for a batch) and from its SSE stream, where every chunk
carries its prompt's counts so far, then `data: [DONE]`.
Never: changes a byte. Formats: sglang `python/sglang/srt/entrypoints/http_server.py`
(`generate_request`, `model_info`), `srt/managers/io_struct.py` (`GenerateReqInput`),
`srt/managers/tokenizer_manager.py` (`meta_info`, `preferred_sampling_params`),
`srt/sampling/sampling_params.py` (`max_new_tokens=128`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..exchange import Endpoint, RequestInfo, Usage
from ..text import REASON_CHARS, USER_CHARS, clean_or_none
from . import reqsize
from .counts import NO_COUNTS, Counts, body_results, counts_of, error_type, lax_true, number, summed
from .reqsize import lax_int, prompt_chars
from .stream import CountsStream

DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default: an absent limit's, without the flag


class SGLangAdapter(reqsize.ReadOnly):
    """SGLang's /generate (no call counts a prompt after a disconnect: every chunk carries its
    count)."""

    api = "sglang"

    def read(self, info: RequestInfo, obj: Mapping[str, Any]) -> None:
        # SGLang serves its one model: `GenerateReqInput` (managers/io_struct.py) has no `model`
        # and the body's is ignored, so it never prices or names the request (a client would
        # name the price book's cheapest); the model is upstream.model_name (Proxy)
        info.model = None
        params = obj.get("sampling_params")
        # a batch may give one sampling_params per prompt: the largest limit holds for all
        given = [p if isinstance(p, dict) else {} for p in _listed(params)] or [{}]
        read = [_limit(p["max_new_tokens"]) for p in given if "max_new_tokens" in p]
        limits = [lim for lim, _ in read]
        top = 0 if None in limits else max(limits, default=0)  # type: ignore[type-var]
        first = given[0]
        info.stream = lax_true(obj.get("stream"))
        info.user = clean_or_none(obj.get("user"), USER_CHARS)
        # A prompt without max_new_tokens runs to the server's own default: 128 unless it was
        # started with --preferred-sampling-params (tokenizer_manager.py: `{**self.
        # preferred_sampling_params, **obj.sampling_params}`), which the proxy asks it for
        # (`stated_default`); until then it has no limit here, and caps no count.
        defaulted = len(read) < len(given)
        info.max_tokens = info.output_cap = (top or None) if not defaulted else None
        info.limit_beside_default = top if defaulted and None not in limits else None
        info.temperature = number(first.get("temperature"))
        info.prompt_chars = prompt_chars(obj)
        info.n = max(1, lax_int(first.get("n")) or 1)
        info.choices = _prompts(obj) * info.n
        info.unreadable = tuple(dict.fromkeys(k for _, bad in read for k in bad))

    def usage_from_body(
        self,
        endpoint: Endpoint,
        body: bytes,
        headers: Mapping[str, str],
        *,
        sequences: int = 1,
        per_prompt: int = 1,
    ) -> Usage:
        """Usage of a complete response: one object with `meta_info`, or a list (a batch)."""
        results = body_results(body)
        if results is None:
            return Usage(unknown_reason="no_usage")
        if "error" in results[0] or results[0].get("object") == "error":
            return Usage(error=error_type(results[0]), unknown_reason="error_response")
        reasons = tuple(r for r in (_reason(x) for x in results) if r)
        return summed([_counts(r) for r in results], None, reasons)

    def stream(self, endpoint: Endpoint, *, fast: bool = True, **options: Any) -> SGLangStream:
        """The meter for a streamed /generate (the reference SSE path)."""
        return SGLangStream(endpoint, **options)


def _listed(params: Any) -> list[Any]:
    return params if isinstance(params, list) else [params]


def _limit(value: Any) -> tuple[int | None, tuple[str, ...]]:
    """A present `max_new_tokens`: null or below 1 no limit of its own."""
    if value is None:
        return None, ()
    read = value if type(value) is int else lax_int(value)
    if read is None:
        return None, ("max_new_tokens",)
    return (read if read > 0 else None), ()


def stated_default(body: bytes) -> int | None:
    """The max_new_tokens SGLang's /generate gives a prompt that sets none, from its GET
    /model_info (/get_model_info before it, now its alias) answer: `preferred_sampling_params`,
    the --preferred-sampling-params flag's JSON text as given (http_server.py `model_info`:
    `server_args.preferred_sampling_params`; a router may answer a JSON object). Null, absent
    (an SGLang before the flag) or without max_new_tokens: `DEFAULT_MAX_NEW_TOKENS`; its
    max_new_tokens null or below 1: 0, no limit of its own (a body's is read so). None when it
    cannot be read: the answer is no JSON object naming a `model_path`, the text no JSON
    object, the count no JSON integer (SGLang's `SamplingParams` takes the value unchecked)."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or "model_path" not in data:
            return None
        stated = data.get("preferred_sampling_params")
        stated = json.loads(stated) if isinstance(stated, str) and stated else stated
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError among them
        return None
    if stated is None or stated == "":  # SGLang reads an empty flag as none
        return DEFAULT_MAX_NEW_TOKENS
    if not isinstance(stated, dict):
        return None
    value = stated.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if value is None:
        return 0
    return max(value, 0) if type(value) is int else None


def _prompts(obj: Mapping[str, Any]) -> int:
    """Prompts in the request: a `text` list, an `input_ids` list of lists, or (with neither)
    an `input_embeds` list of embedding matrices ([prompt][token][hidden]) is a batch
    (`GenerateReqInput._determine_batch_size`: one prompt's embeddings are [token][hidden])."""
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list) and text:
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    embeds = obj.get("input_embeds")
    if text is None and ids is None and isinstance(embeds, list) and embeds:
        first = embeds[0]
        if isinstance(first, list) and first and isinstance(first[0], list):
            return len(embeds)
    return 1


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("meta_info")
    return meta if isinstance(meta, dict) else {}


def _reason(obj: Mapping[str, Any]) -> str | None:
    finish = _meta(obj).get("finish_reason")  # {"type": "length", "length": 8} or null
    return clean_or_none(finish.get("type"), REASON_CHARS) if isinstance(finish, dict) else None


def _counts(obj: Mapping[str, Any]) -> Counts | None:
    meta = _meta(obj)
    return counts_of(
        (meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens"))
    )


class SGLangStream(CountsStream):
    """A streamed /generate: `data:` chunks, each with its prompt's (`index`) `meta_info` so far
    (cumulative), then `data: [DONE]`."""

    _counts_of = staticmethod(_counts)  # read as a body result is (no wrapper frame an event)

    def _step(self, index: int, read: Counts, obj: Mapping[str, Any]) -> None:
        if (read[1] or 0) > (self._counts.get(index, NO_COUNTS)[1] or 0):
            self._s.token_events += 1
        if (reason := _reason(obj)) is not None:
            self._s.finish[index] = reason
