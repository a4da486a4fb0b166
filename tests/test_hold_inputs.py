"""What the budget's hold reads from a request: every string the server may tokenize (only base64
media in a media part left out), and the output limit only from the fields the route's server
reads (docs/budgets.md, "What the hold reads"). Issue 21, items 1 and 2."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.exchange import Endpoint
from sidecar.metering import reqsize
from sidecar.metering.wire import inspect_request
from tests.test_budget import worst_case


def info(endpoint: Endpoint, body: dict[str, Any], api: str = "vllm") -> Any:
    return inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False, api=api)


# --- 1. the prompt's size: no text is skipped for what it says --------------------------------


def test_prompt_text_that_starts_with_data_is_held() -> None:
    """The attack: a prompt of 40,006 characters that opens with `data:` was held as 0 of them
    (ten such requests with max_tokens 1 spent $20 of a $0.20 budget)."""
    text = "data: " + "a " * 20000
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    assert info(Endpoint.CHAT, body).text_chars == len("user") + len(text)
    assert worst_case(body) == pytest.approx(len("user") + len(text) + 1)


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.COMPLETIONS, {"prompt": "T"}),
        (Endpoint.COMPLETIONS, {"prompt": ["x", "T"]}),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "T"}]}]},
        ),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": ["T"]}),
        # text in a media part's other members, and a data URL outside a media part
        (Endpoint.CHAT, {"messages": [{"content": [{"type": "image_url", "text": "T"}]}]}),
        (Endpoint.CHAT, {"messages": [{"content": [{"image_url": {"url": "x", "detail": "T"}}]}]}),
        (Endpoint.CHAT, {"messages": [{"content": "x"}], "metadata": {"image_url": "T"}}),
        (Endpoint.RESPONSES, {"input": "T", "instructions": "T"}),
        (Endpoint.RESPONSES, {"input": [{"role": "user", "content": [{"text": "T"}]}]}),
        (Endpoint.TGI_GENERATE, {"inputs": "T", "parameters": {"max_new_tokens": 1}}),
        (Endpoint.TGI_VERTEX, {"instances": [{"inputs": "T"}, {"messages": [{"content": "T"}]}]}),
    ],
)
@given(text=st.text(max_size=40) | st.sampled_from(["data:", "data:image/png;base64,AAAA"]))
def test_every_text_string_counts_whatever_it_says(
    endpoint: Endpoint, body: dict[str, Any], text: str
) -> None:
    """Each "T" replaced by any text (a data URL too) adds exactly its characters to the hold."""
    raw = json.dumps(body)
    slots = raw.count('"T"')
    with_text = json.loads(raw.replace('"T"', json.dumps(text)))
    empty = json.loads(raw.replace('"T"', '""'))
    grown = info(endpoint, with_text).text_chars - info(endpoint, empty).text_chars
    assert grown == slots * len(text)


def test_tool_schemas_count_keys_included() -> None:
    """vLLM and TGI render tools into the prompt as JSON: a schema's keys are tokens too (and
    only there: `parameters`, `stream_options` and the like are read by name)."""
    name = "p" * 5000
    schema = {"type": "object", "properties": {name: {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    chars = info(Endpoint.CHAT, body).text_chars
    assert chars >= len(name) + len("properties") + len("parameters")
    assert chars - info(Endpoint.CHAT, {**body, "tools": []}).text_chars == sum(
        len(s) for s in ("type", "function", "function", "name", "f", "parameters", "type")
    ) + sum(len(s) for s in ("object", "properties", name, "type", "string"))
    fields = {"inputs": "x", "parameters": {"max_new_tokens": 1, "stop": ["s"]}}
    assert info(Endpoint.TGI_GENERATE, fields).text_chars == 2


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUFB", "detail": ""}},
        {"type": "image_url", "image_url": "data:image/png;base64,QUFB"},
        {"type": "input_audio", "input_audio": {"data": "QUFB", "format": ""}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,QUFB"}},
        {"type": "input_image", "image_url": "data:image/png;base64,QUFB"},
        {"type": "input_file", "file_data": "QUFB", "filename": ""},
        {"type": "file", "file": {"file_data": "QUFB"}},
        {"type": "image_embeds", "image_embeds": "QUFB"},
    ],
)
def test_only_base64_media_inside_a_media_part_is_left_out(part: dict[str, Any]) -> None:
    media = {"role": "", "content": [{**part}]}
    big = json.loads(json.dumps(media).replace("QUFB", "QUFB" * 5000))
    chat = {"messages": [big]}
    assert info(Endpoint.CHAT, chat).text_chars == len(part["type"])
    responses = {"input": [big]}
    assert info(Endpoint.RESPONSES, responses).text_chars == len(part["type"])
    # the same bytes anywhere else are text the server may tokenize (a tool's schema, here)
    elsewhere = {"messages": [{"content": "x"}], "tools": [big]}
    assert info(Endpoint.CHAT, elsewhere).text_chars > 20000


_KEYS = st.sampled_from(
    [
        *("prompt", "model", "user", "messages", "input", "content", "instances", "image_url"),
        *("url", "data", "file_data", "input_audio", "file", "x", "data:", "tools"),
    ]
)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 10**20)
    | st.floats(allow_nan=False)
    | st.sampled_from(["", "hi", "data:image/png;base64,AAAA", "prompt", "data: a a"])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=30,
)

# The definition, written the obvious way (recursive): where a value sits decides what counts.
_MEDIA_OBJECTS = {"image_url", "audio_url", "video_url", "input_audio", "file"}


def _size(value: object, where: str) -> tuple[int, int]:
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, list):
        inner = {"messages": "message", "content": "part", "media": "plain"}.get(where, where)
        parts = [_size(v, inner) for v in value]
        ids = sum(1 for v in value if where == "prompt" and type(v) is int)
        return sum(c for c, _ in parts), sum(i for _, i in parts) + ids
    if not isinstance(value, dict):
        return 0, 0
    chars = ids = 0
    for k, v in value.items():
        if where == "request" and k in ("model", "user"):
            continue
        if isinstance(v, str) and _is_media(where, k, v):
            continue
        c, i = _size(v, _where(where, k, v))
        chars += c + (len(k) if where == "schema" else 0)
        ids += i
    return chars, ids


def _is_media(where: str, key: str, value: str) -> bool:
    if where == "part":
        return key in ("file_data", "image_embeds") or (
            key in _MEDIA_OBJECTS and value.startswith("data:")
        )
    return where == "media" and (
        key in ("data", "file_data") or (key == "url" and value.startswith("data:"))
    )


def _where(where: str, key: str, value: object) -> str:
    if where == "schema" or (where == "request" and key in ("tools", "functions", "documents")):
        return "schema"
    if key == "prompt":
        return "prompt"
    if where == "request" and key in ("messages", "input"):
        return "messages"
    if where == "request" and key == "instances" and isinstance(value, list):
        return "request"
    if where == "message" and key == "content":
        return "content"
    if where == "part" and key in _MEDIA_OBJECTS and isinstance(value, dict):
        return "media"
    return "plain"


@given(st.dictionaries(_KEYS, _JSON, max_size=6) | _JSON)
def test_body_size_is_its_definition(obj: object) -> None:
    expected = _size(obj, "request") if isinstance(obj, dict) else (0, 0)
    assert reqsize.body_size(obj) == expected


@given(_JSON)
def test_body_size_never_skips_a_string_outside_a_media_part(value: object) -> None:
    """In a tool, every string and every key counts; anywhere but a content part, every string."""

    def every_string(v: object) -> int:
        if isinstance(v, str):
            return len(v)
        if isinstance(v, list):
            return sum(every_string(x) for x in v)
        if isinstance(v, dict):
            return sum(len(k) + every_string(x) for k, x in v.items())
        return 0

    assert reqsize.body_size({"tools": [value]})[0] == every_string(value)

    def every_value(v: object) -> int:
        if isinstance(v, str):
            return len(v)
        if isinstance(v, list | dict):
            return sum(every_value(x) for x in (v.values() if isinstance(v, dict) else v))
        return 0

    assert reqsize.body_size({"metadata": [value], "prompt": value})[0] == 2 * every_value(value)


def test_body_size_counts_token_ids_only_inside_prompts() -> None:
    body = {
        "model": "m" * 9,
        "prompt": [[1, 2, 3], "abc", {"x": 7, "prompt": [4]}],
        "n": 5,
        "messages": [{"content": [{"image_url": "data:image/png;base64,AAAA"}, "hi"]}],
    }
    assert reqsize.body_size(body) == (5, 4)


def test_a_deeply_nested_body_is_sized_without_recursion() -> None:
    deep: object = "t" * 7
    for i in range(200_000):
        deep = [deep] if i % 2 else {"k": deep}
    assert reqsize.body_size({"tools": deep}) == (7 + 100_000, 0)


# --- 2. the output limit, only from the fields the route's server reads -------------------------


@pytest.mark.parametrize(
    ("endpoint", "api", "body", "limit", "unreadable"),
    [
        # vLLM's CompletionRequest has no max_completion_tokens: held at 1, it generated 4,000
        (Endpoint.COMPLETIONS, "vllm", {"max_completion_tokens": 1, "max_tokens": 4000}, 4000, ()),
        (Endpoint.COMPLETIONS, "vllm", {"max_output_tokens": 1}, None, ()),
        (Endpoint.COMPLETIONS, "vllm", {"max_completion_tokens": "x", "max_tokens": 9}, 9, ()),
        # chat ignores the Responses API's field
        (Endpoint.CHAT, "vllm", {"max_output_tokens": 1}, None, ()),
        (Endpoint.CHAT, "vllm", {"max_output_tokens": "x"}, None, ()),
        (Endpoint.CHAT, "vllm", {"max_completion_tokens": 5, "max_tokens": 4000}, 5, ()),
        (Endpoint.CHAT, "vllm", {"max_completion_tokens": 0, "max_tokens": 4000}, 4000, ()),
        (Endpoint.CHAT, "vllm", {"max_tokens": "x"}, None, ("max_tokens",)),
        (Endpoint.RESPONSES, "vllm", {"max_tokens": 1, "max_output_tokens": 500}, 500, ()),
        (Endpoint.RESPONSES, "vllm", {"max_completion_tokens": 1}, None, ()),
        (Endpoint.EMBEDDINGS, "vllm", {"max_tokens": 1, "max_completion_tokens": "x"}, None, ()),
        # TGI: chat's max_tokens has max_completion_tokens as its alias; completions max_tokens
        (Endpoint.CHAT, "tgi", {"max_completion_tokens": 300}, 300, ()),
        (Endpoint.CHAT, "tgi", {"max_output_tokens": 1}, None, ()),
        (Endpoint.COMPLETIONS, "tgi", {"max_completion_tokens": 1, "max_tokens": 70}, 70, ()),
        (
            Endpoint.TGI_GENERATE,
            "tgi",
            {"parameters": {"max_new_tokens": 8}, "max_tokens": 1},
            8,
            (),
        ),
        (Endpoint.TGI_COMPAT, "tgi", {"max_new_tokens": 1, "max_tokens": "x"}, None, ()),
    ],
)
def test_the_limit_is_read_from_the_fields_the_route_reads(
    endpoint: Endpoint, api: str, body: dict[str, Any], limit: int | None, unreadable: tuple
) -> None:
    shape = {"inputs": "x"} if endpoint.is_tgi_native else {"prompt": "x", "messages": []}
    got = info(endpoint, {**shape, **body}, api)
    assert (got.max_tokens, got.unreadable) == (limit, unreadable)


def test_the_completions_attack_is_held_for_every_token_it_may_generate() -> None:
    body = {"model": "m", "prompt": "hi", "max_completion_tokens": 1, "max_tokens": 4000}
    assert worst_case(body, "/v1/completions") == pytest.approx(2 + 4000)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_output_tokens": 1}
    assert worst_case(chat) == pytest.approx(len("user") + 2 + 4096)  # the default worst case


@pytest.mark.parametrize(
    ("endpoint", "body", "chars"),
    [
        ("/v1/embeddings", {"input": "abc", "max_tokens": 9}, 3),
        ("/pooling", {"input": "abc"}, 3),
        ("/classify", {"input": "abc"}, 3),
        ("/score", {"text_1": "ab", "text_2": "cd"}, 4),
        ("/v1/rerank", {"query": "ab", "documents": ["cd"]}, 4),
        ("/api/embed", {"input": "abc", "options": {"num_predict": 9}}, 3),
    ],
)
def test_a_route_that_generates_nothing_holds_no_output(
    endpoint: str, body: dict[str, Any], chars: int
) -> None:
    """Its `output_cap` is 0 (nothing is generated): the hold is the prompt alone. Before, each
    held the default 4096 output tokens (or a limit field it ignores), and one unmeasured (a
    client that left) was charged them."""
    got = info(Endpoint(endpoint), {"model": "m", **body})
    assert got.output_cap == 0
    assert worst_case({"model": "m", **body}, endpoint) == pytest.approx(chars)


def test_vertex_reads_each_instance_as_tgi_does() -> None:
    body = {
        "instances": [
            {"inputs": "a", "parameters": {"max_new_tokens": 7}, "max_tokens": 900},
            {"messages": [{"role": "user", "content": "b"}], "max_completion_tokens": 50},
        ]
    }
    assert info(Endpoint.TGI_VERTEX, body, "tgi").max_tokens == 50
    bad = {"instances": [{"inputs": "a", "parameters": {"max_new_tokens": "many"}}]}
    assert info(Endpoint.TGI_VERTEX, bad, "tgi").unreadable == ("max_new_tokens",)


_ROUTES = [
    (Endpoint.CHAT, "vllm"),
    (Endpoint.COMPLETIONS, "vllm"),
    (Endpoint.RESPONSES, "vllm"),
    (Endpoint.EMBEDDINGS, "vllm"),
    (Endpoint.CHAT, "tgi"),
    (Endpoint.COMPLETIONS, "tgi"),
    (Endpoint.TGI_GENERATE, "tgi"),
    (Endpoint.TGI_GENERATE_STREAM, "tgi"),
]
_FIELDS = ["max_completion_tokens", "max_tokens", "max_output_tokens", "max_new_tokens"]
_LIMIT_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 2**70),
    st.floats(allow_nan=True),
    st.sampled_from(["16", " 3_0 ", "+8", "1.0", "1.5", "abc", "", "0"]),
    st.lists(st.integers(), max_size=2),
)


@given(
    st.sampled_from(_ROUTES),
    st.dictionaries(st.sampled_from(_FIELDS), _LIMIT_VALUES),
    st.dictionaries(st.sampled_from(_FIELDS), _LIMIT_VALUES),
)
def test_limits_are_never_read_from_a_field_the_route_ignores(
    route: tuple[Endpoint, str], read: dict[str, Any], ignored: dict[str, Any]
) -> None:
    """Whatever the fields the route does not read hold, the limit is that of the fields it reads
    (each read alone, first positive first), and only those can be unreadable."""
    endpoint, api = route
    fields = reqsize.limit_fields(endpoint, api)
    given_read = {k: v for k, v in read.items() if k in fields}
    noise = {k: v for k, v in ignored.items() if k not in fields}
    if endpoint.is_tgi_native:
        body: dict[str, Any] = {"inputs": "x", **noise, "parameters": {**noise, **given_read}}
    else:
        body = {"messages": [], "prompt": "x", **noise, **given_read}
    got = info(endpoint, body, api)
    values = [reqsize.lax_int(given_read.get(k)) for k in fields]
    assert got.max_tokens == next((v for v in values if v is not None and v > 0), None)
    assert got.unreadable == tuple(
        k
        for k, v in zip(fields, values, strict=True)
        if v is None and given_read.get(k) is not None
    )
