"""Honest vLLM streams of several choices (n >= 2, a completion's prompt list), with running
usage (`continuous_usage_stats`) and without, read on the fast path and the reference path, the
wire cut at every byte and read event by event: measured exactly wherever a client leaves,
and the two paths alike. Shaped as vLLM writes them (serving_chat.py, serving_completion.py)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sidecar.exchange import Endpoint
from sidecar.metering.wire import open_stream


def _compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + _compact(obj) + b"\n\n"


def _usage(prompt: int, out: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + out, "completion_tokens": out}


def _chunk(
    kind: str, part: tuple[str, Any], index: int, finish: str | None, usage: dict | None
) -> bytes:
    """vLLM's chunk of one choice (serving_chat.py, serving_completion.py:
    `model_dump_json(exclude_unset=True)`): compact, usage last when continuous_usage_stats is
    on. `kind` its object, `part` the choice's ("delta", {...}) or ("text", "...")."""
    choice: dict[str, Any] = {"index": index, part[0]: part[1], "logprobs": None}
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = None
    prefix = "chatcmpl" if kind == "chat.completion.chunk" else "cmpl"
    obj: dict[str, Any] = {
        "id": f"{prefix}-r5",
        "object": kind,
        "created": 1,
        "model": "m",
        "choices": [choice],
    }
    if usage is not None:
        obj["usage"] = usage
    return _event(obj)


def _chat_chunk(
    index: int, delta: dict[str, Any], finish: str | None, usage: dict[str, int] | None
) -> bytes:
    return _chunk("chat.completion.chunk", ("delta", delta), index, finish, usage)


def _vllm_n2_chat(continuous: bool, lengths: tuple[int, int] = (6, 2), prompt: int = 5):
    """vLLM's n=2 chat stream: both role chunks first (completion_tokens 0), then each choice's
    tokens interleaved, choice 1 stopping early, each finish chunk, one usage-only chunk of the
    totals, [DONE]. Returns the events and, after each, the exact (input, output) so far when
    every choice has been seen (None before)."""
    events: list[bytes] = []
    exact: list[tuple[int, int] | None] = []
    done = [0, 0]

    def u(i: int) -> dict[str, int] | None:
        return _usage(prompt, done[i]) if continuous else None

    for i in (0, 1):
        events.append(_chat_chunk(i, {"role": "assistant", "content": ""}, None, u(i)))
        exact.append(None if i == 0 else (prompt, 0))
    for step in range(max(lengths)):
        for i in (0, 1):
            if step < lengths[i]:
                done[i] += 1
                events.append(_chat_chunk(i, {"content": f"t{step}"}, None, u(i)))
                exact.append((prompt, sum(done)))
            if step == lengths[i] - 1:
                events.append(_chat_chunk(i, {"content": ""}, "stop", u(i)))
                exact.append((prompt, sum(done)))
    events.append(_event({"id": "chatcmpl-r5", "choices": [], "usage": _usage(prompt, sum(done))}))
    exact.append((prompt, sum(done)))
    events.append(b"data: [DONE]\n\n")
    exact.append((prompt, sum(done)))
    return events, exact


@pytest.mark.parametrize("fast", [True, False])
def test_vllm_n2_running_totals_measure_exactly_at_every_leave(fast: bool) -> None:
    """FINDING (9e85f5f): honest vLLM n=2 chat with continuous_usage_stats (injected, both
    stripped): after any event from the second role chunk on, the usage so far is exactly what
    every choice made (vLLM's running totals are each choice's own `previous_num_tokens[i]`).
    Fails at one event: vLLM's one usage-only chunk of the totals, read before [DONE], makes the
    usage `incomplete_usage` (1 part < 2 choices, not done), though every choice's running
    totals, (5, 8), were a measurement one event earlier and still are: an upstream that ends
    there (or a drain that times out before [DONE]) is charged the hold, not 5 in / 8 out.
    Passes on 9e85f5f^."""
    events, exact = _vllm_n2_chat(continuous=True)
    meter = open_stream(
        Endpoint.CHAT, fast=fast, choices=2, strip_usage=True, strip_chunk_usage=True
    )
    seen = []
    for ev, want in zip(events, exact, strict=True):
        meter.feed(ev)
        u = meter.usage_so_far()
        seen.append(((u.input_tokens, u.output_tokens), want))
    wrong = [(i, got, want) for i, (got, want) in enumerate(seen) if want and got != want]
    assert wrong == []
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (*exact[-1], None)


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("strip", [False, True])
def test_vllm_n2_chat_fast_and_reference_agree_at_every_cut(continuous: bool, strip: bool) -> None:
    """The same honest n=2 stream cut in two at every byte: both paths give the client the same
    bytes and the same usage so far after each piece, and the same finish."""
    events, _ = _vllm_n2_chat(continuous=continuous)
    wire = b"".join(events)
    opts = {"choices": 2, "strip_usage": strip, "strip_chunk_usage": strip and continuous}
    assert _cuts_where_paths_differ(Endpoint.CHAT, wire, opts) == []


def _cuts_where_paths_differ(endpoint: Endpoint, wire: bytes, opts: dict[str, Any]) -> list[int]:
    """The bytes at which `wire` cut in two makes the fast and the reference path differ: in
    what the client gets or the usage so far after a piece, or in the finish."""
    bad = []
    for cut in range(len(wire) + 1):
        f = open_stream(endpoint, fast=True, **opts)
        r = open_stream(endpoint, fast=False, **opts)
        for piece in (wire[:cut], wire[cut:]):
            if f.feed(piece) != r.feed(piece) or f.usage_so_far() != r.usage_so_far():
                bad.append(cut)
        if f.finish() != r.finish():
            bad.append(cut)
    return bad


@pytest.mark.parametrize("continuous", [True, False])
def test_vllm_n2_chat_fast_and_reference_agree_event_by_event(continuous: bool) -> None:
    """Read by read as aiohttp hands them (one event a read), then all events in one read."""
    events, _ = _vllm_n2_chat(continuous=continuous)
    opts = {"choices": 2, "strip_usage": True, "strip_chunk_usage": continuous}
    f = open_stream(Endpoint.CHAT, fast=True, **opts)
    r = open_stream(Endpoint.CHAT, fast=False, **opts)
    for i, ev in enumerate(events):
        assert f.feed(ev) == r.feed(ev), i
        assert f.usage_so_far() == r.usage_so_far(), i
    assert f.finish() == r.finish()


def _completion_chunk(index: int, text: str, finish: str | None, usage: dict | None) -> bytes:
    return _chunk("text_completion", ("text", text), index, finish, usage)


def _vllm_batched_completion(prompts: tuple[int, ...], n: int, steps: int):
    """vLLM's /v1/completions, a list of prompts times n with continuous_usage_stats: choice
    `prompt * n + k`, each chunk's usage that prompt's size and that choice's own output so far
    (serving_completion.py: `num_prompt_tokens[prompt_idx]`, `previous_num_tokens[i]`); the one
    usage-only chunk: the prompts' sum and every choice's output."""
    choices = len(prompts) * n
    done = [0] * choices
    events, exact = [], []
    for step in range(steps):
        for i in range(choices):
            done[i] += 1
            fin = "length" if step == steps - 1 else None
            u = _usage(prompts[i // n], done[i])
            events.append(_completion_chunk(i, f"t{step}", fin, u))
            seen_all = step > 0 or i == choices - 1
            exact.append((sum(prompts), sum(done)) if seen_all else None)
    total = _usage(sum(prompts), sum(done))
    events.append(_event({"id": "cmpl-r5", "choices": [], "usage": total}))
    exact.append((sum(prompts), sum(done)))
    events.append(b"data: [DONE]\n\n")
    exact.append((sum(prompts), sum(done)))
    return events, exact


@pytest.mark.parametrize("fast", [True, False])
def test_vllm_batched_completion_running_totals_exact_at_every_leave(fast: bool) -> None:
    """FINDING (9e85f5f), /v1/completions: two prompts (3 and 7 tokens) x n=2, continuous usage:
    once every choice sent its running usage, the usage so far is each prompt once and every
    choice's output so far, exactly. Fails at the usage-only chunk before [DONE]:
    `incomplete_usage` where the running totals said (10, 16). Passes on 9e85f5f^."""
    events, exact = _vllm_batched_completion((3, 7), 2, 4)
    meter = open_stream(
        Endpoint.COMPLETIONS,
        fast=fast,
        choices=4,
        per_prompt=2,
        strip_usage=True,
        strip_chunk_usage=True,
    )
    wrong = []
    for i, (ev, want) in enumerate(zip(events, exact, strict=True)):
        meter.feed(ev)
        u = meter.usage_so_far()
        if want is not None and (u.input_tokens, u.output_tokens) != want:
            wrong.append((i, (u.input_tokens, u.output_tokens, u.unknown_reason), want))
    assert wrong == []
    u = meter.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (*exact[-1], None)


def test_vllm_batched_completion_fast_and_reference_agree_at_every_cut() -> None:
    events, _ = _vllm_batched_completion((3, 7), 2, 3)
    wire = b"".join(events)
    opts = {"choices": 4, "per_prompt": 2, "strip_usage": True, "strip_chunk_usage": True}
    assert _cuts_where_paths_differ(Endpoint.COMPLETIONS, wire, opts) == []


@pytest.mark.parametrize("lengths", [(5, 1), (1, 5), (3, 3)])
@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_vllm_n2_chat_paths_agree_in_three_random_reads(
    lengths: tuple[int, int], continuous: bool, seed: int
) -> None:
    """A choice stopping after one token, or both alike; the wire in three reads cut anywhere
    (reads holding both choices' chunks): the same bytes and usage so far on both paths."""

    events, _ = _vllm_n2_chat(continuous=continuous, lengths=lengths)
    wire = b"".join(events)
    rng = random.Random(seed)
    a, b = sorted(rng.randrange(len(wire) + 1) for _ in range(2))
    opts = {"choices": 2, "strip_usage": True, "strip_chunk_usage": continuous}
    f = open_stream(Endpoint.CHAT, fast=True, **opts)
    r = open_stream(Endpoint.CHAT, fast=False, **opts)
    for piece in (wire[:a], wire[a:b], wire[b:]):
        assert f.feed(piece) == r.feed(piece), (a, b)
        assert f.usage_so_far() == r.usage_so_far(), (a, b)
    assert f.finish() == r.finish()
    u = f.usage_so_far()
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, sum(lengths), None)


@pytest.mark.parametrize("fast", [True, False])
def test_vllm_n2_chat_without_running_totals_measured_after_done(fast: bool) -> None:
    """No continuous_usage_stats, choice 1 stopping after one token: unknown until the one
    usage-only chunk and [DONE], then exactly the totals; `finished` once both finish reasons
    came, so a client that left there is read on to [DONE] (`finishers.stream_usage`)."""
    events, _ = _vllm_n2_chat(continuous=False, lengths=(4, 1))
    meter = open_stream(Endpoint.CHAT, fast=fast, choices=2, strip_usage=True)
    for ev in events[:-2]:
        meter.feed(ev)
        assert meter.usage_so_far().output_tokens is None
    assert meter.finished and not meter.done
    for ev in events[-2:]:
        meter.feed(ev)
    u = meter.usage_so_far()
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (5, 5, None)


def _vllm_completion_unset(index: int, text: str, finish: str | None, usage: Any) -> bytes:
    """vLLM's completion chunk is dumped with `exclude_unset=False` (serving_completion.py): every
    field written, `"usage":null` without running totals, and the running usage with
    `"prompt_tokens_details":null`."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    obj = {
        "id": "cmpl-r5",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage,
    }
    return _event(obj)


@pytest.mark.parametrize("continuous", [True, False])
def test_vllm_unset_completion_chunks_of_two_prompts_agree_and_measure(continuous: bool) -> None:
    prompts, n, steps = (3, 7), 1, 4
    done = [0, 0]
    events = []
    for step in range(steps):
        for i in (0, 1):
            done[i] += 1
            u = None
            if continuous:
                u = {**_usage(prompts[i], done[i]), "prompt_tokens_details": None}
            fin = "length" if step == steps - 1 else None
            events.append(_vllm_completion_unset(i, f"w{step}", fin, u))
    total = {**_usage(sum(prompts), sum(done))}
    events.append(
        _event({"id": "cmpl-r5", "object": "text_completion", "choices": [], "usage": total})
    )
    events.append(b"data: [DONE]\n\n")
    wire = b"".join(events)
    opts = {"choices": 2, "per_prompt": n, "strip_usage": True, "strip_chunk_usage": continuous}
    assert _cuts_where_paths_differ(Endpoint.COMPLETIONS, wire, opts) == []
    r = open_stream(Endpoint.COMPLETIONS, fast=False, **opts)
    r.feed(wire)
    u = r.finish()[1]
    assert (u.input_tokens, u.output_tokens, u.unknown_reason) == (10, 8, None)


def _billed_at_every_cut(endpoint: Endpoint, wire: bytes, opts: dict[str, Any]) -> set[Any]:
    """(input, output, unknown reason) at the end of `wire` cut in two at every byte, on each
    path (the paths checked alike at every piece first)."""
    assert _cuts_where_paths_differ(endpoint, wire, opts) == []
    got = set()
    for cut in range(len(wire) + 1):
        for fast in (True, False):
            meter = open_stream(endpoint, fast=fast, **opts)
            meter.feed(wire[:cut])
            meter.feed(wire[cut:])
            u = meter.finish()[1]
            got.add((u.input_tokens, u.output_tokens, u.unknown_reason))
    return got


@pytest.mark.parametrize("sent", [2, 3])
@pytest.mark.parametrize("continuous", [True, False])
def test_vllm_n2_totals_sent_again_are_billed_once_at_every_cut(
    sent: int, continuous: bool
) -> None:
    """vLLM sends one usage-only chunk of the totals, after every choice's finish chunk
    (serving_chat.py: `final_usage_chunk` after the loop over the outputs). Sent twice (an
    upstream or a proxy before us repeating it), it was read as llama.cpp's parts, one per
    choice, and added up: 5 in / 16 out for 5 / 8; sent three times, invalid usage (the hold).
    With no choice finished since the one before, a usage-only chunk repeats it: the last wins,
    as with one choice (3b3c617)."""
    events, exact = _vllm_n2_chat(continuous=continuous)
    wire = b"".join(events[:-1]) + events[-2] * (sent - 1) + events[-1]
    opts = {"choices": 2, "strip_usage": True, "strip_chunk_usage": continuous}
    assert _billed_at_every_cut(Endpoint.CHAT, wire, opts) == {(*exact[-1], None)}


def _llama_cpp_n_chat(outs: tuple[int, ...], prompt: int = 5) -> bytes:
    """llama.cpp's chat stream of len(outs) completions (server-task.cpp
    `to_json_oaicompat_chat_stream`): each completion's final result is its finish chunk and
    then a usage-only chunk of its own counts, the shortest first; then [DONE]."""
    wire = b""
    for step in range(max(outs)):
        for i, out in enumerate(outs):
            if step < out:
                wire += _chat_chunk(i, {"content": f"t{step}"}, None, None)
            if step == out - 1:
                wire += _chat_chunk(i, {}, "stop", None)
                wire += _event({"id": "chatcmpl-l", "choices": [], "usage": _usage(prompt, out)})
    return wire + b"data: [DONE]\n\n"


@pytest.mark.parametrize("outs", [(6, 2), (3, 1, 2), (2, 2)])
def test_llama_cpps_usage_chunk_per_completion_adds_up_at_every_cut(outs: tuple[int, ...]) -> None:
    """Each of llama.cpp's usage-only chunks follows its own completion's finish chunk: they
    are parts, added up (the prompt once), wherever the wire is cut, on both paths."""
    wire = _llama_cpp_n_chat(outs)
    opts = {"choices": len(outs), "strip_usage": True}
    assert _billed_at_every_cut(Endpoint.CHAT, wire, opts) == {(5, sum(outs), None)}
