"""The background finishers: bounded in number and in time, and every one awaited at shutdown."""

from __future__ import annotations

import asyncio

from sidecar.proxy.finishers import Finishers, _count


async def test_at_the_limit_a_finisher_is_not_started() -> None:
    f = Finishers(limit=2)
    gate = asyncio.Event()
    started = [f.start(gate.wait()) for _ in range(2)]  # type: ignore[arg-type]
    coro = asyncio.sleep(0)
    assert all(started) and f.start(coro) is None and len(f) == 2
    assert coro.cr_frame is None  # closed, never left un-awaited
    gate.set()
    await asyncio.gather(*[t for t in started if t])
    assert len(f) == 0


async def test_close_waits_for_the_grace_then_cancels() -> None:
    f = Finishers()
    quick = f.start(asyncio.sleep(0.01))
    stuck = f.start(asyncio.sleep(60))
    await f.close(grace=0.2)
    assert quick is not None and quick.done() and not quick.cancelled()
    assert stuck is not None and stuck.cancelled()


def test_tokenizer_answers() -> None:
    assert _count({"count": 7, "max_model_len": 10, "tokens": []}) == 7  # vLLM
    assert _count([{"id": 1}, {"id": 2}]) == 2  # TGI /tokenize
    assert _count({"tokenize_response": [{"id": 1}], "templated_text": "x"}) == 1  # /chat_tokenize
    assert _count([[{"id": 1}, {"id": 2}]]) == 2
    assert _count({"error": "no"}) is None and _count("x") is None
