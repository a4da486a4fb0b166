"""The admission queue in front of the upstream: none, serial, fixed-batch or token-budget.

Owns: the FIFO of waiting requests, the rule that releases them, queue-time measurement, refusals
(never fits: 413; queue full or waited too long: 429 with Retry-After), the exported queue state,
and a bounded log of scheduling decisions (what the harness saves when the upstream runs out of
memory). Admission uses an *estimate* of each request's peak tokens; it is never reported as a
token count.
Never: reorders the queue (a request that does not fit waits at the head; nothing overtakes it
unless `allow_overtake`), leaves a future unresolved, or holds tokens for a request that left.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import AdmissionConfig
from ..exchange import Exchange, Refusal, estimate_tokens, held_output
from ..telemetry.metrics import Metrics


@dataclass(eq=False)
class Waiter:
    cost: int  # in the strategy's unit: estimated tokens (token-budget) or 1 request
    tokens: int  # the estimate, for the exported queue state
    model: str
    enqueued_at: float
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """One scheduling event, for the harness's out-of-memory report."""

    t: float
    event: str  # admit | refuse | timeout | leave
    tokens: int
    in_use: int
    queue_depth: int


class Admission:
    def __init__(self, config: AdmissionConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = time.monotonic
        self.queue: collections.deque[Waiter] = collections.deque()
        self.in_use = 0  # estimated tokens (token-budget) or requests (serial, fixed-batch)
        self.waiting_tokens = 0  # estimated tokens of the queue, kept as it changes
        self.running = 0
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=10_000)
        self._timer: asyncio.TimerHandle | None = None
        self._group_open = True  # fixed-batch: may a new group start?
        metrics.budget_limit.set(self.limit)
        self._export()

    @property
    def strategy(self) -> str:
        return self.config.strategy

    @property
    def limit(self) -> int:
        if self.strategy == "token-budget":
            return self.config.token_budget
        if self.strategy == "serial":
            return 1
        return self.config.max_batch

    # --- acquire / release

    async def acquire(self, tokens: int, model: str) -> Callable[[], None]:
        """Wait for admission. Returns the release function; raises Refusal."""
        cost = tokens if self.strategy == "token-budget" else 1  # what it takes of `in_use`
        if self.strategy == "token-budget" and tokens > self.config.token_budget:
            self._refuse("never_fits", tokens)
            raise Refusal(
                413,
                "request_too_large_for_budget",
                f"this request needs an estimated {tokens} tokens, more than the whole "
                f"admission budget of {self.config.token_budget}",
            )
        if len(self.queue) >= self.config.max_queue_length:
            self._refuse("queue_full", tokens)
            raise Refusal(
                429,
                "queue_full",
                "the admission queue is full",
                retry_after=min(5.0, self.config.max_queue_wait_s),
            )
        w = Waiter(cost, tokens, model, self.clock())
        self.queue.append(w)
        self.waiting_tokens += tokens
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(w.future), self.config.max_queue_wait_s)
        except TimeoutError:
            if not w.future.done():
                self._leave(w, "timeout")
                self.metrics.admission_rejections.labels("queue_timeout").inc()
                raise Refusal(
                    429,
                    "queue_timeout",
                    f"not admitted within {self.config.max_queue_wait_s:.0f}s",
                    retry_after=self.config.max_queue_wait_s,
                ) from None
        except asyncio.CancelledError:
            if w.future.done() and not w.future.cancelled():
                self._release(w)  # admitted just as the client left
            else:
                self._leave(w, "leave")
            raise
        waited = self.clock() - w.enqueued_at
        self.metrics.child(self.metrics.queue_wait, model).observe(waited)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(w)

        return release

    def close(self) -> None:
        """Shutdown: every waiting future is resolved (cancelled), none left hanging."""
        for w in self.queue:
            if not w.future.done():
                w.future.cancel()
        self.queue.clear()
        self.waiting_tokens = 0
        if self._timer is not None:
            self._timer.cancel()
        self._export()

    def _refuse(self, reason: str, tokens: int) -> None:
        self.metrics.admission_rejections.labels(reason).inc()
        self._log("refuse", tokens)

    def _leave(self, w: Waiter, event: str) -> None:
        if w in self.queue:
            self.queue.remove(w)
            self.waiting_tokens -= w.tokens
        if not w.future.done():
            w.future.cancel()
        self._log(event, w.tokens)
        self._dispatch()

    def _release(self, w: Waiter) -> None:
        self.in_use -= w.cost
        self.running -= 1
        if self.strategy == "fixed-batch" and self.running == 0:
            self._group_open = True
        self._dispatch()

    def _admit(self, w: Waiter) -> None:
        """`w` has just been taken off the queue."""
        self.waiting_tokens -= w.tokens
        self.in_use += w.cost
        self.running += 1
        w.future.set_result(None)
        self._log("admit", w.tokens)

    # --- the release rules

    def _dispatch(self) -> None:
        if self.strategy == "fixed-batch":
            self._dispatch_batch()
        else:
            self._dispatch_budget()
        self._export()

    def _dispatch_budget(self) -> None:
        """FIFO while the head fits; with allow_overtake, any waiter that fits may go."""
        limit = self.limit
        if not self.config.allow_overtake:
            while self.queue and self.in_use + self.queue[0].cost <= limit:
                self._admit(self.queue.popleft())
            return
        for w in list(self.queue):
            if self.in_use + w.cost <= limit:
                self.queue.remove(w)
                self._admit(w)

    def _dispatch_batch(self) -> None:
        """Release up to max_batch together once the window since the head's arrival elapsed (or
        the batch is full); the next group only after the whole group completed."""
        if not self.queue or not self._group_open:
            return
        due = self.queue[0].enqueued_at + self.config.batch_window_s
        if len(self.queue) < self.config.max_batch and self.clock() < due:
            if self._timer is None:
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(max(0.0, due - self.clock()), self._on_timer)
            return
        self._group_open = False
        for _ in range(min(self.config.max_batch, len(self.queue))):
            self._admit(self.queue.popleft())

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    # --- state

    def _log(self, event: str, tokens: int) -> None:
        self.decisions.append(Decision(self.clock(), event, tokens, self.in_use, len(self.queue)))

    def _export(self) -> None:
        m = self.metrics
        m.queue_depth.set(len(self.queue))
        m.queue_waiting_tokens.set(self.waiting_tokens)
        m.budget_in_use.set(self.in_use)

    async def gate(self, ex: Exchange) -> Callable[[], None]:
        """The proxy's gate: estimate, wait, record the queue time (also when refused)."""
        info = ex.info
        chars = info.prompt_chars if info.parsed else len(info.body)
        tokens = estimate_tokens(self.config, chars, held_output(info), info.n, ex.prompt_tokens)
        start = self.clock()
        try:
            return await self.acquire(tokens, ex.model)
        finally:
            ex.queue_s = self.clock() - start

    def snapshot(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "queue_depth": len(self.queue),
            "in_use": self.in_use,
            "limit": self.limit,
            "running": self.running,
        }
