"""Breaks found by the hostile review of issue 23's audio routes (each test failed on b269492).

vLLM reads a transcription's form with FastAPI's `Form()`, that is Starlette's form parser
(python-multipart): every part of the body is read, and a field sent twice is the last one
(`ImmutableMultiDict`); of a part's headers the last Content-Disposition, of its parameters the
last `name`. The sidecar reads only the head before the file, and read the first of each. So a
client could name a priced (or free, or unpriced) model to the meter and have the server serve
another: the seconds were billed at the wrong price, under a budget at nothing.
The simulator reads a form as vLLM does in this respect (a later field replaces an earlier one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.metering.audio import FormHead, FormScan, LateField, boundary
from tests.conftest import StartSidecar
from tests.test_audio import (
    CONTENT_TYPE,
    MODEL,
    PER_SECOND,
    PRICE,
    TRANSCRIBE,
    B,
    _rows,
    _start,
    wav,
)
from tests.waiting import wait_for

# A second model the operator prices: its seconds are free.
PRICES = {
    "models": {
        MODEL: {**PRICE, "audio_per_second": PER_SECOND},
        "free": {**PRICE, "audio_per_second": 0.0},
    }
}
MODEL_PART = 'Content-Disposition: form-data; name="model"'
FILE_PART = (
    'Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav'
)


def part(headers: str, value: bytes) -> bytes:
    return f"--{B}\r\n{headers}\r\n\r\n".encode() + value + b"\r\n"


def end(*parts: bytes) -> bytes:
    return b"".join(parts) + f"--{B}--\r\n".encode()


UNCLEAR_HEADS = {
    "two Content-Disposition headers": MODEL_PART + '\r\nContent-Disposition: form-data; name="x"',
    "the second first": 'Content-Disposition: form-data; name="x"\r\n' + MODEL_PART,
    "two name parameters": MODEL_PART + '; name="x"',
    "two name parameters, cased": 'Content-Disposition: form-data; name="x"; NAME="model"',
}


@pytest.mark.parametrize("headers", UNCLEAR_HEADS.values(), ids=UNCLEAR_HEADS.keys())
def test_a_part_whose_name_depends_on_the_parser_makes_the_head_unused(headers: str) -> None:
    """Starlette names the part by the last header and the last parameter: `x` for the first
    and third, `model` for the second and fourth; the sidecar took the first of each."""
    head = FormHead(B.encode(), 64 * 1024)
    head.feed(end(part(headers, b"free"), part(FILE_PART, wav(0.1))))
    assert head.done and head.malformed and head.fields == {}


async def _post(run: Any, body: bytes) -> tuple[int, str]:
    headers = {**CONTENT_TYPE, "X-Tollbooth-User": "eve"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(run.url + TRANSCRIBE, data=body, headers=headers) as r,
    ):
        return r.status, await r.text()


async def test_under_a_budget_a_part_named_two_ways_is_not_billed_as_the_first_name(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: billed as `free` ($0, 200) while vLLM, reading the part as `x`, served its own
    model. Now the head is not used: a request the head does not price is refused (400)."""
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, pricing=PRICES, budgets={"user_daily_usd": 50.0}
    )
    headers = UNCLEAR_HEADS["two Content-Disposition headers"]
    status, text = await _post(run, end(part(headers, b"free"), part(FILE_PART, wav(2.0))))
    assert status == 400 and "must come before the file" in text
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][1] == "unknown" and _rows(db)[0][-1] == "400"


def _scan(body: bytes, cut: int) -> str | None:
    scan = FormScan(B.encode(), 64 * 1024)
    try:
        for i in range(0, len(body), cut):
            scan.feed(body[i : i + cut])
    except LateField as exc:
        return str(exc)
    return None


TWICE = end(part(MODEL_PART, b"free"), part(FILE_PART, wav(0.1)), part(MODEL_PART, MODEL.encode()))


@pytest.mark.parametrize("cut", [1, 2, 5, 17, 4096, len(TWICE)])
def test_a_field_sent_again_after_the_file_is_found_at_every_cut(cut: int) -> None:
    assert _scan(TWICE, cut) == "the form field 'model' comes again after the file"


@pytest.mark.parametrize("cut", [1, 3, 4096])
def test_a_form_naming_each_field_once_passes_the_scan(cut: int) -> None:
    fields = [part(MODEL_PART, MODEL.encode()), part(FILE_PART, wav(0.1))]
    after = part('Content-Disposition: form-data; name="stream"', b"false")
    # the file holds a delimiter-like line not followed by CRLF or `--`: content to both parsers
    trick = part(FILE_PART, b"RIFF\r\n--" + B.encode() + b"X\r\n" + wav(0.1))
    assert _scan(end(*fields, after), cut) is None
    assert _scan(end(part(MODEL_PART, MODEL.encode()), trick), cut) is None
    assert _scan(end(part(FILE_PART, wav(0.1)), part(MODEL_PART, MODEL.encode())), cut) is None
    # a file named twice (plain and RFC 2231), as some clients send a non-ASCII file name
    both = FILE_PART.replace('filename="a.wav"', "filename=\"e.wav\"; filename*=utf-8''%C3%A9.wav")
    assert _scan(end(part(MODEL_PART, MODEL.encode()), part(both, wav(0.1))), cut) is None


async def test_under_a_budget_a_model_named_again_after_the_file_is_refused(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: the head's `free` was billed ($0 under a budget, 200) for the audio the server
    transcribed with the later `model`. Now the upload is cut short: 400, nothing served or
    charged."""
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, pricing=PRICES, budgets={"user_daily_usd": 50.0}
    )
    later = part(MODEL_PART, MODEL.encode())
    body = end(part(MODEL_PART, b"free"), part(FILE_PART, wav(2.0)), later)
    status, text = await _post(run, body)
    assert status == 400 and "'model' comes again after the file" in text
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][1:] == ("free", TRANSCRIBE, None, None, None, 0.0, "400")
    await wait_for(lambda: not run.sc.budgets.store.holds, "the hold released")
    assert run.sc.budgets.store.spent.get("user:eve", 0) == 0


# The served model's name in UTF-7, whose `+...-` runs Starlette decodes (`bytes.decode(charset)`
# with the Content-Type's last `charset`) and UTF-8 reads as they are: `+AHc-hisper` is
# `whisper` there. The sidecar read `+AHc...` (a name with no price: $0 held, cost unknown).
UTF7_MODEL = MODEL.encode("utf-7").replace(b"w", b"+AHc-", 1)
assert UTF7_MODEL.decode("utf-7") == MODEL and UTF7_MODEL.decode() != MODEL


@pytest.mark.parametrize(
    "params",
    [
        "; charset=utf-7",
        '; charset="UTF-7"',
        "; charset=utf-8; charset=utf-7",  # Starlette takes the last
        "; charset=no-such-codec",
        "; boundary=other",  # two boundaries: Starlette takes the last, email the first
    ],
)
def test_a_form_not_read_as_utf8_or_with_two_boundaries_has_no_boundary(params: str) -> None:
    assert boundary(f"multipart/form-data; boundary={B}{params}") is None


@pytest.mark.parametrize("params", ["", "; charset=utf-8", "; charset=UTF8", '; charset="utf-8"'])
def test_a_utf8_form_keeps_its_boundary(params: str) -> None:
    assert boundary(f"multipart/form-data; boundary={B}{params}") == B.encode()


async def test_under_a_budget_a_utf7_form_is_not_billed_as_the_name_utf8_reads(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """Before: 200, priced as the unpriced `+AHc-hisper-sim` ($0 charged under a budget) while
    vLLM served `whisper-sim`. Now the head is not read: the unnamed model, refused (400)."""
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, budgets={"user_daily_usd": 50.0}
    )
    body = end(part(MODEL_PART, UTF7_MODEL), part(FILE_PART, wav(2.0)))
    headers = {"Content-Type": f"multipart/form-data; boundary={B}; charset=utf-7"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + TRANSCRIBE, data=body, headers={**headers, "X-Tollbooth-User": "eve"}
        ) as r,
    ):
        assert r.status == 400 and "must come before the file" in await r.text()
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][1] == "unknown" and _rows(db)[0][-1] == "400"


async def test_a_part_named_two_ways_is_refused_where_the_head_is_not_needed(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    """No budget, upstream.model_name set: the unused head would be priced as that model, and
    vLLM may read the part as `model`; the upload is cut instead: 400, nothing served."""
    run, db = await _start(
        start_sidecar, aiohttp_server, tmp_path, pricing=PRICES, upstream={"model_name": MODEL}
    )
    headers = UNCLEAR_HEADS["the second first"]
    status, text = await _post(run, end(part(headers, b"free"), part(FILE_PART, wav(2.0))))
    assert status == 400 and "two Content-Disposition headers" in text
    await wait_for(lambda: len(_rows(db)) == 1, "the ledger row")
    assert _rows(db)[0][3:] == (None, None, None, 0.0, "400")
