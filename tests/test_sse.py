"""The SSE parser: exact bytes out, at every chunk boundary."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.metering.sse import SSEParser

STREAM = (
    b'data: {"a": 1}\n\n'
    b"event: response.completed\r\ndata: x\r\ndata: y\r\n\r\n"
    b": a comment\n\n"
    b"data:nospace\r\rdata: [DONE]\n\n"
    b"data: unterminated"
)


def parse_in_pieces(data: bytes, cuts: list[int]) -> tuple[list, bytes]:
    p = SSEParser()
    events, last = [], 0
    for c in [*sorted(set(cuts)), len(data)]:
        events += p.feed(data[last:c])
        last = c
    return events, p.finish()


def test_every_single_cut_gives_the_same_events_and_bytes() -> None:
    whole, tail = parse_in_pieces(STREAM, [])
    assert [e.data for e in whole] == ['{"a": 1}', "x\ny", None, "nospace", "[DONE]"]
    assert whole[1].event == "response.completed"
    assert tail == b"data: unterminated"
    for cut in range(len(STREAM) + 1):
        events, t = parse_in_pieces(STREAM, [cut])
        assert events == whole, cut
        assert t == tail
        assert b"".join(e.raw for e in events) + t == STREAM


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_cuts_preserve_bytes(cuts: list[int]) -> None:
    events, tail = parse_in_pieces(STREAM, cuts)
    assert b"".join(e.raw for e in events) + tail == STREAM
    assert len(events) == 5


@given(
    st.lists(
        st.text(
            alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
            max_size=20,
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_data_roundtrip_any_line_ending(payloads: list[str], eol: bytes, cuts: list[int]) -> None:
    data = b"".join(b"data: " + p.encode() + eol + eol for p in payloads)
    events, tail = parse_in_pieces(data, [c for c in cuts if c <= len(data)])
    if eol == b"\r":
        # a final lone CR may be the first half of CRLF: the parser waits, finish() returns it
        assert b"".join(e.raw for e in events) + tail == data
        assert [e.data for e in events] == payloads[: len(events)]
        assert len(events) >= len(payloads) - 1
    else:
        assert [e.data for e in events] == payloads
        assert tail == b""


# --- the `\n\n` fast path against the general line-by-line path ----------------------------------


class LinesOnly(SSEParser):
    """The general path alone: the reference the fast path must agree with."""

    def feed(self, chunk: bytes) -> list:
        return self._feed_lines(chunk)


def feed_both(data: bytes, cuts: list[int], keep_raw: bool) -> None:
    fast, ref = SSEParser(keep_raw=keep_raw), LinesOnly(keep_raw=keep_raw)
    last = 0
    for c in [*sorted(set(cuts)), len(data)]:
        piece = data[last:c]
        assert fast.feed(piece) == ref.feed(piece), (data, cuts, c)
        assert fast.pending == ref.pending
        last = c
    assert fast.finish() == ref.finish()


VLLM_LIKE = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    b'data:{"x":1}\n\n'
    b"event: e\ndata: one\ndata: two\n\n"
    b"\n\n"
    b": keep-alive\n\n"
    b"data\n\n"
    b"data:\n\n"
    b"data: \n\n"
    b"id: 3\nretry: 10\n\n"
    b"data: caf\xc3\xa9 \xff\n\n"
    b"data: [DONE]\n\n"
)


def test_fast_path_agrees_at_every_cut_and_every_pair_of_cuts_near_the_markers() -> None:
    """One cut anywhere; two cuts anywhere within 7 bytes of a `\\n\\n` or a `data:`."""
    markers = [i for i in range(len(VLLM_LIKE)) if VLLM_LIKE.startswith((b"\n\n", b"data:"), i)]
    near = sorted({p for m in markers for p in range(m - 7, m + 8) if 0 <= p <= len(VLLM_LIKE)})
    for keep_raw in (True, False):
        for a in range(len(VLLM_LIKE) + 1):
            feed_both(VLLM_LIKE, [a], keep_raw)
        for i, a in enumerate(near):
            for b in near[i:]:
                feed_both(VLLM_LIKE, [a, b], keep_raw)


@pytest.mark.parametrize(
    "data",
    [
        b"data: x\nd",  # one newline, then more: no event yet
        b"data: x\n\n",
        b"data:x\n\n",
        b"data:\n\n",
        b"data: \n\n",
        b"data: x\ndata: y\n\n",
        b"data: x\n\n\n",
        b"\n\n",
        b"data: x\n\ndata: y",
        b"event: e\n\n",
    ],
)
def test_fast_path_on_short_first_chunks(data: bytes) -> None:
    for keep_raw in (True, False):
        for cut in range(len(data) + 1):
            feed_both(data, [cut], keep_raw)
            feed_both(data + data, [cut], keep_raw)


FRAGMENTS = [
    b"data: ",
    b"data:",
    b"data",
    b"event: x",
    b": c",
    b"id: 1",
    b"\n",
    b"\n\n",
    b"\r",
    b"\r\n",
    b'{"a":"b"}',
    b"\xc3\xa9",
    b"\xff",
    b" ",
    b"[DONE]",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    st.lists(st.integers(min_value=0, max_value=200), max_size=10),
    st.booleans(),
)
def test_fast_path_agrees_with_the_general_path(
    parts: list[bytes], cuts: list[int], keep_raw: bool
) -> None:
    data = b"".join(parts)
    feed_both(data, [c for c in cuts if c <= len(data)], keep_raw)
