"""The SSE parser: exact bytes out, at every chunk boundary."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.sse import SSEParser

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
