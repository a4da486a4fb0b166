"""Breaks found by the hostile review after issue 21's fixes: each test failed on main (ebea3b5).

TGI's `parameters.best_of` (router/src/server.rs `generate_internal`): a non-streaming /generate,
`/` or /vertex request with `best_of: N > 1` runs N generations (`generate_best_of`), but answers
`x-generated-tokens` (and `details.generated_tokens`) for the best one only; the others appear
only in `details.best_of_sequences`, when the client asked for details. Held and charged as one
sequence, N-1 of them were free (TGI caps N with `--max-best-of`, 2 by default).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sidecar.exchange import Endpoint
from sidecar.metering.usage import inspect_request, usage_from_body


def info(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return inspect_request(endpoint, json.dumps(body).encode(), inject_usage=False, api="tgi")


@pytest.mark.parametrize("endpoint", [Endpoint.TGI_GENERATE, Endpoint.TGI_COMPAT])
def test_best_of_is_held_as_that_many_sequences(endpoint: Endpoint) -> None:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": 3}}
    assert info(endpoint, body).choices == 3


def test_best_of_on_a_stream_is_refused_by_tgi_so_held_as_one() -> None:
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": 3}}
    assert info(Endpoint.TGI_GENERATE_STREAM, body).choices == 1


@pytest.mark.parametrize("best_of", [None, 1, 0, "3", 2.0, True, -4])
def test_only_an_integer_best_of_above_one_adds_sequences(best_of: object) -> None:
    """serde reads `Option<usize>`: a JSON integer; TGI refuses anything else (422)."""
    body = {"inputs": "hi", "parameters": {"max_new_tokens": 100, "best_of": best_of}}
    assert info(Endpoint.TGI_GENERATE, body).choices == 1


def test_vertex_holds_each_instance_best_of() -> None:
    body = {
        "instances": [
            {"inputs": "a", "parameters": {"max_new_tokens": 10, "best_of": 2}},
            {"inputs": "b", "parameters": {"max_new_tokens": 10}},
        ]
    }
    assert info(Endpoint.TGI_VERTEX, body).choices == 3


def _answer(best_of_sequences: object) -> bytes:
    details: dict[str, Any] = {"finish_reason": "length", "generated_tokens": 10}
    if best_of_sequences is not None:
        details["best_of_sequences"] = best_of_sequences
    return json.dumps({"generated_text": "x", "details": details}).encode()


HEADERS = {"x-prompt-tokens": "5", "x-generated-tokens": "10"}


def test_best_of_output_is_every_sequence_generated() -> None:
    seqs = [{"generated_text": "y", "finish_reason": "length", "generated_tokens": 7}]
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(seqs), HEADERS, sequences=2)
    assert (usage.input_tokens, usage.output_tokens, usage.unknown_reason) == (5, 17, None)


@pytest.mark.parametrize(
    "seqs",
    [
        None,  # no details asked: the others are not reported at all
        [],
        [{"generated_tokens": -7}],
        [{"generated_tokens": 10**30}],
        [{"generated_tokens": "7"}],
        ["seq"],
        [{"generated_tokens": 7}, {"generated_tokens": 7}],  # more than were asked for
    ],
)
def test_best_of_output_not_reported_for_every_sequence_is_unknown(seqs: object) -> None:
    """Not measured, so not a count: the budget charges at least the hold (N sequences)."""
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(seqs), HEADERS, sequences=2)
    assert usage.output_tokens is None
    assert usage.unknown_reason is not None
    assert usage.input_tokens == 5  # the prompt was measured


def test_one_sequence_reads_as_before() -> None:
    usage = usage_from_body(Endpoint.TGI_GENERATE, _answer(None), HEADERS)
    assert (usage.input_tokens, usage.output_tokens, usage.unknown_reason) == (5, 10, None)
