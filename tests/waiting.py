"""Bounded waits on a condition, in place of fixed sleeps: a test waits as long as the condition
takes (a loaded machine only makes it slower) and fails, naming what it waited for, when the
condition never comes. Never a sleep "long enough"."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

POLL_S = 0.01
TIMEOUT_S = 10.0


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str,
    timeout: float = TIMEOUT_S,
) -> None:
    """Return once `condition()` (a function or a coroutine function) is true; after `timeout`
    seconds without it, fail with `what`."""
    end = time.monotonic() + timeout
    while True:
        got = condition()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def wait_for_sync(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    """`wait_for` outside an event loop (a thread's work, a subprocess)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)
