"""What a request can cost, read from its body: the text the server may tokenize and the output
limit as the route's server reads it. The budget's hold (docs/budgets.md) is made of these.

Owns: which strings of a body count as prompt text (every one, keys of nested objects too, but
base64 media in a message's media part), the token ids sent as a prompt, and the output limit of
each route on vLLM and TGI (the table in docs/budgets.md, each row from the engine's source), and
the cap on counted output (`output_cap`: from limits every server behind the route obeys).
Never: skips a string for what it says, reads a limit from a field the route's server ignores,
caps output with a field some server behind the route ignores, or recurses (a deeply nested body
must not exhaust the stack).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..exchange import Endpoint, RequestInfo
from ..text import MODEL_CHARS, clean_or_none

_LAX_INT = re.compile(r"[0-9]+(?:_[0-9]+)*(?:\.0*)?")
_BIG = 2**62  # any longer number of digits reads as this (a hold that large is refused)


def lax_int(value: object) -> int | None:
    """An integer as vLLM's request models read one (pydantic's lax mode): an int, a bool, a float
    without a fraction, or a string of one ("+8", " 30_000 ", "30000.0"). None otherwise."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and len(value) < 64:
        text = value.strip().removeprefix("+")
        if _LAX_INT.fullmatch(text):
            digits = text.partition(".")[0].replace("_", "")
            return int(digits) if len(digits) < 19 else _BIG
    return None


# --- output limits --------------------------------------------------------------------------------

# The fields each route's server reads its output limit from, first positive first (the table in
# docs/budgets.md names the source of each). vLLM's chat takes `max_completion_tokens or
# max_tokens`; TGI's chat reads `max_tokens` with `max_completion_tokens` as its serde alias (a
# body with both is refused there, so either may be read). A route's other fields are no limit.
_VLLM_LIMITS: Mapping[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
    Endpoint.RESPONSES: ("max_output_tokens",),
}
_TGI_LIMITS: Mapping[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: ("max_tokens", "max_completion_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
}
_TGI_NATIVE_LIMIT = ("max_new_tokens",)  # in `parameters`


def limit_fields(endpoint: Endpoint, api: str) -> tuple[str, ...]:
    """The fields the route's limit is read from (in `parameters` on TGI's native routes)."""
    if endpoint.is_tgi_native:
        return _TGI_NATIVE_LIMIT
    return (_TGI_LIMITS if api == "tgi" else _VLLM_LIMITS).get(endpoint, ())


def case_twins(values: Mapping[str, Any], fields: tuple[str, ...]) -> tuple[str, ...]:
    """The keys of `values` that are one of `fields` only when case is ignored (`MAX_TOKENS`,
    `Options`, `max_token\u017f`). Go's encoding/json (Ollama's server, its /v1 routes and
    /v1/messages too) matches a key to a field so (Unicode simple folding), the last one read
    winning, and merges a second object into a map field: a limit the sidecar read in
    `max_tokens` is not the one such a server obeys. `casefold` folds a superset of Go's."""
    if _OWN_FOLDS.issuperset(values) and _OWN_FOLDS.issuperset(fields):
        return ()  # the usual keys, seen before: each its own fold (below), no key is a twin
    folded, unlike = _folds(fields)
    joined = "".join(values)
    if not unlike and joined.isascii() and joined.islower():
        _learn_own_folds(values)
        _learn_own_folds(fields)
        return ()  # every key is its own fold, and so is every field: no key is a twin
    return tuple(k for k in values if k not in fields and k.casefold() in folded)


# Strings known to be their own fold: a key that is one is no twin of fields that are all their own
# (a twin's fold is a field's fold, that field itself, and a twin is no field). One set lookup a
# key (its hash JSON decoding computed already) costs less than the join and scans below it.
# Learnt from what passed those scans: at most this many strings, of at most this length, so a
# client's odd keys fill it only so far (then they take the scans, as before).
_OWN_FOLDS_KEPT, _OWN_FOLD_CHARS = 1024, 64
_OWN_FOLDS: set[str] = set()


def _learn_own_folds(keys: Iterable[str]) -> None:
    """Keep those of `keys` that are their own fold, while there is room."""
    for k in keys:
        if len(_OWN_FOLDS) >= _OWN_FOLDS_KEPT:
            return
        if len(k) <= _OWN_FOLD_CHARS and k.casefold() == k:
            _OWN_FOLDS.add(k)


@functools.cache
def _folds(fields: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """The folds of `fields`, and those of them that are not a field's own spelling."""
    folded = frozenset(f.casefold() for f in fields)
    return folded, folded - frozenset(fields)


def read_limit(
    fields: tuple[str, ...], values: Mapping[str, Any]
) -> tuple[int | None, tuple[str, ...]]:
    """(the first positive of `fields` in `values`, the fields present that are no integer the
    server would read). A 0 or a missing field falls through to the next. A key that is one of
    `fields` but for its case (`case_twins`) makes the limit unreadable."""
    twins = case_twins(values, fields)
    if twins:
        return None, twins
    limit: int | None = None
    unreadable: tuple[str, ...] = ()
    for key in fields:
        value = values.get(key)
        if value is None:
            continue
        read = value if type(value) is int else lax_int(value)
        if read is None:
            unreadable += (key,)
        elif limit is None and read > 0:
            limit = read
    return limit, unreadable


# Every field any route of vLLM or TGI reads a limit from (`parameters.max_new_tokens` on TGI's),
# and llama.cpp's `n_predict`: its OpenAI routes copy the body's other fields over the limit they
# mapped from `max_tokens` (`oaicompat_chat_params_parse`, "if n_predict is present, we overwrite
# the value specified earlier by max_tokens"), and `params_from_json_cmpl` reads it first.
_ANY_LIMIT = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")

# The one limit field every server that may answer the route obeys, where a field the route's
# server reads may be ignored by another behind the same path. Ollama's /v1/chat/completions
# reads `max_tokens` only (openai/openai.go `ChatCompletionRequest`, sent on as `num_predict`):
# vLLM's `max_completion_tokens` (TGI's alias) limits nothing there.
_OBEYED_EVERYWHERE: Mapping[Endpoint, str] = {Endpoint.CHAT: "max_tokens"}


def capping_limit(
    endpoint: Endpoint, route_limit: int | None, obj: Mapping[str, Any]
) -> int | None:
    """The route's limit as a cap on counted output (`output_cap`'s `route_limit`): None, so no
    cap, when the body lacks the field every server of the route obeys (a server that ignores
    the others generates to its own end). With it present, `output_cap` takes the largest of
    every limit field, that one included (and no cap when it is 0 or no integer)."""
    field = _OBEYED_EVERYWHERE.get(endpoint)
    if field is None or obj.get(field) is not None:
        return route_limit
    return None


def output_cap(
    route_limit: int | None, obj: Mapping[str, Any], params: Mapping[str, Any]
) -> int | None:
    """The most output a choice can have been asked for: the largest of the route's limit and
    every other limit field in the body (a server of another version may read another one),
    or None (no cap) without a route limit or with a limit field that is 0 or no integer (a
    server may read that as no limit)."""
    if route_limit is None or case_twins(obj, _ANY_LIMIT):
        return None
    cap = route_limit
    for values, fields in ((obj, _ANY_LIMIT), (params, _TGI_NATIVE_LIMIT)):
        for key in fields:  # loops, not a list built: a comprehension is a call of its own
            value = values.get(key)
            if value is None:
                continue
            read = value if type(value) is int else lax_int(value)
            if read is None or read <= 0:
                return None
            if read > cap:
                cap = read
    return cap


def vertex_limit(instance: Mapping[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """TGI's /vertex instance: a generate request (`inputs`, `parameters.max_new_tokens`) when it
    has a string `inputs` (serde's untagged enum tries that first), else a chat request."""
    if isinstance(instance.get("inputs"), str):
        params = instance.get("parameters")
        return read_limit(_TGI_NATIVE_LIMIT, params if isinstance(params, dict) else {})
    return read_limit(_TGI_LIMITS[Endpoint.CHAT], instance)


# --- the prompt's size ----------------------------------------------------------------------------

# Where a value sits, for what counts in it. The server reads an object's keys as field names,
# but where it renders the object into the prompt as JSON: tools (vLLM's and TGI's chat templates
# and TGI's tool prompt), legacy functions, and RAG documents, whose keys are tokens too.
_PLAIN, _SCHEMA, _PROMPT, _REQUEST, _MESSAGES, _MESSAGE, _CONTENT, _PART, _MEDIA = range(9)
_RENDERED = frozenset({"tools", "functions", "documents"})

# A content part's media, left out as the bound's documented term (docs/budgets.md): the server
# turns it into media tokens and never tokenizes its characters. Base64 in a URL slot (a `data:`
# URL; any other URL is fetched, and its characters count) or in a raw base64 slot.
_MEDIA_OBJECTS = frozenset({"image_url", "audio_url", "video_url", "input_audio", "file"})
_MEDIA_BASE64 = frozenset({"file_data", "image_embeds"})
_MEDIA_SLOTS = frozenset({"data", "file_data"})  # in a media object: raw base64
_NOT_TEXT = frozenset({"model", "user"})  # a request's own fields that are never prompt text
_CONVERSATIONS = frozenset({"messages", "input"})  # chat's messages, the Responses API's input


def body_size(obj: object) -> tuple[int, int]:
    """(characters of every string the server may tokenize, integers inside a `prompt`): what
    the prompt can be made of, for the budget's worst case.

    Every string counts, whatever it says, and every key inside `tools`, `functions` and
    `documents` (rendered into the prompt as JSON). Left out: the top-level `model` and
    `user`, and the base64 media of a content part
    (`messages[].content[]`, the Responses API's `input[].content[]`, each of TGI's /vertex
    `instances`): a `data:` URL in `image_url`, `audio_url`, `video_url` (or in their `url`),
    `input_audio.data`, `file_data` (or `file.file_data`), `image_embeds`. Only inside a
    `prompt` member is an integer a token id. Iterative and linear: each value is visited
    once, no recursion.
    """
    if not isinstance(obj, dict):
        return 0, 0
    stack: list[tuple[int, object]] = [(_REQUEST, obj)]
    chars = ids = 0
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            chars += _members(where, value, stack)
            continue
        assert isinstance(value, list)
        inner = _MESSAGE if where == _MESSAGES else _PART if where == _CONTENT else where
        inner = _PLAIN if inner == _MEDIA else inner
        for v in value:
            if isinstance(v, str):
                chars += len(v)
            elif isinstance(v, _CONTAINERS):
                stack.append((inner, v))
            elif where == _PROMPT and type(v) is int:
                ids += 1
    return chars, ids


def _members(where: int, obj: Mapping[str, object], stack: list[tuple[int, object]]) -> int:
    """Characters of an object's strings (and of its keys, in what is rendered as JSON); its
    containers go on `stack`, each with where it sits."""
    chars = 0
    media = where == _PART or where == _MEDIA  # the only objects with a string `_is_media` skips
    for k, v in obj.items():
        if where == _SCHEMA:
            chars += len(k)
        elif where == _REQUEST and k in _NOT_TEXT:
            continue
        if isinstance(v, str):
            if not (media and _is_media(where, k, v)):
                chars += len(v)
        elif isinstance(v, _CONTAINERS):
            stack.append((_inside(where, k, v), v))
    return chars


# A tuple made once: `dict | list` in the loops would make a new union object for every value.
_CONTAINERS = (dict, list)


def _inside(where: int, key: str, value: object) -> int:
    """Where a member's value sits."""
    if where == _SCHEMA:
        return _SCHEMA
    if key == "prompt":
        return _PROMPT
    if where == _REQUEST:
        if key in _CONVERSATIONS:
            return _MESSAGES
        if key in _RENDERED:
            return _SCHEMA
        return _REQUEST if key == "instances" and isinstance(value, list) else _PLAIN
    if where == _MESSAGE and key == "content":
        return _CONTENT
    if where == _PART and key in _MEDIA_OBJECTS and isinstance(value, dict):
        return _MEDIA
    return _PLAIN


def _is_media(where: int, key: str, value: str) -> bool:
    """A string member that is base64 media (see `body_size`)."""
    if where == _PART:
        if key in _MEDIA_BASE64:
            return True
        return key in _MEDIA_OBJECTS and value.startswith("data:")
    if where == _MEDIA:  # an image_url's {"url": "data:..."}, input_audio's {"data"}, a file's
        return key in _MEDIA_SLOTS or (key == "url" and value.startswith("data:"))
    return False


def prompt_chars(obj: Mapping[str, Any]) -> int:
    """Characters of prompt text in a request (for admission estimates and audit sizes only)."""
    total = 0
    for key in _PROMPT_KEYS:
        if (value := obj.get(key)) is not None:  # most bodies have one at most: no call for none
            total += _text_len(value)
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                # a string, in the usual message: its length, without a call
                total += len(content) if isinstance(content, str) else _text_len(content)
    return total


_PROMPT_KEYS = ("prompt", "inputs", "input")


def _text_len(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_len(v.get("text") if isinstance(v, dict) else v) for v in value)
    return 0


# --- pairs: rerank and score ----------------------------------------------------------------------

# vLLM's rerank and score routes run the model on every (query, document) pair, so a query is
# tokenized once per document (vllm/entrypoints/pooling/score/serving.py; the request models in
# vllm/entrypoints/pooling/scoring/protocol.py). The score route's body is one of these shapes,
# tried in this order; rerank's is (query, documents).
RERANK_PAIR = ("query", "documents")
SCORE_PAIRS = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)


def repeated_chars(obj: Mapping[str, Any], pairs: tuple[tuple[str, str], ...]) -> int:
    """Characters the server tokenizes beyond each string once (what `body_size` counts): a
    single first input (a rerank query, a score's one `text_1`) is paired with each of the second
    inputs, so it is counted again for each pair after the first. Lists of equal length are
    scored pairwise: each already counted once."""
    for first, second in pairs:
        a, b = obj.get(first), obj.get(second)
        if a is None or b is None:
            continue
        if isinstance(a, list):
            if len(a) != 1:
                return 0
            a = a[0]
        n = len(b) if isinstance(b, list) else 1
        return (n - 1) * body_size({"input": a})[0] if n > 1 else 0
    return 0


class ReadOnly:
    """The `WireAdapter.inspect` of a wire family whose requests are never edited: `inspect`
    reads what every such request has alike (its model, the size of its text, whether the body
    is UTF-8) and ignores `inject_usage` (nothing is ever added to such a request); the
    family's `read` fills in the rest of what a JSON-object request asks for. Unless the family
    says otherwise, no call counts its prompt after a disconnect and no prompt is token ids."""

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
        info = RequestInfo(endpoint, body, True)  # by attribute, as `openai.inspect` builds it
        info.model = clean_or_none(obj.get("model"), MODEL_CHARS)
        info.utf8 = text is not None
        info.text_chars, info.prompt_ids = body_size(obj)
        self.read(info, obj)
        return info

    def read(self, info: RequestInfo, obj: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def tokenize_requests(self, info: RequestInfo) -> list[tuple[str, bytes]] | None:
        return None

    def prompt_token_ids(self, info: RequestInfo) -> int | None:
        return None
