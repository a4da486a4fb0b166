"""Readiness: what /readyz answers, from state kept current off the request path.

Owns: the upstream probe (a background task: GET `upstream.probe_path` every `probe_interval_s`;
any answer below 500 means up, a 5xx, a timeout or a refused connection means down; a result
older than three intervals counts as down), and the verdict that combines it with the writers
(ledger, shipper, access log, audit) and draining. Liveness (/healthz) depends on none of this.
Never: probes on a request's path, or makes /readyz wait for the upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from ..config import UpstreamConfig
from .metrics import Metrics

log = logging.getLogger("tollbooth.health")


class Fetcher(Protocol):
    """What the probe needs of the upstream client (sidecar/proxy/upstream.py's `Upstream`)."""

    limit: int

    @property
    def saturated(self) -> bool: ...

    async def fetch(self, method: str, path: str, *, timeout: float) -> tuple[int, bytes]: ...


class Writer(Protocol):
    """What readiness needs of a writer (the ledger, the shipper, the access log, the audit
    writer): why it cannot write now, None while it can."""

    @property
    def problem(self) -> str | None: ...


class UpstreamProbe:
    def __init__(
        self,
        config: UpstreamConfig,
        metrics: Metrics,
        upstream: Callable[[], Fetcher | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = config.url.rstrip("/") + config.probe_path  # for the log
        self.path = config.probe_path
        self.interval, self.timeout_s = config.probe_interval_s, config.probe_timeout_s
        self.metrics, self.upstream, self.clock = metrics, upstream, clock
        self.up = False
        self.detail = "not probed yet"
        self.checked_at: float | None = None

    def state(self) -> tuple[bool, str]:
        """(up, why): up only when the last probe succeeded and is recent."""
        if self.checked_at is None:
            return False, self.detail
        age = self.clock() - self.checked_at
        if age > 3 * self.interval + self.timeout_s:
            return False, f"no probe for {age:.0f}s"
        return self.up, self.detail

    async def once(self) -> None:
        up, detail = await self._probe()
        if up != self.up and self.checked_at is not None:
            log.log(logging.INFO if up else logging.WARNING, "upstream %s: %s", self.url, detail)
        self.up, self.detail, self.checked_at = up, detail, self.clock()
        self.metrics.upstream_up.set(1 if up else 0)

    async def _probe(self) -> tuple[bool, str]:
        upstream = self.upstream()
        if upstream is None:
            return False, "no upstream client"
        if upstream.saturated:  # every connection is serving a request: it answers
            return True, f"busy: all {upstream.limit} connections in use"
        try:
            status, _ = await upstream.fetch("GET", self.path, timeout=self.timeout_s)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return False, f"unreachable: {type(exc).__name__}: {exc}"[:200]
        except Exception as exc:  # a bug here must not stop the probing: down, and logged
            log.exception("upstream probe failed")
            return False, f"probe failed: {type(exc).__name__}"
        if status >= 500:
            return False, f"answered {status}"
        return True, f"answered {status}"

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.once()


def readiness(
    *,
    starting: bool,
    draining: bool,
    probe: UpstreamProbe | None,
    ledger: Writer | None,
    writers: Mapping[str, Writer | None] | None = None,
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) for /readyz. `writers` (the shipper, the access log, the audit
    writer) each have a `problem`: one that cannot write makes the sidecar not ready, and only
    then appears in the checks. The shipper's `problem` is its own failure, not PostgreSQL being
    away: rows wait in SQLite then, and every sidecar of a fleet unready at once would be an
    outage for an outage of the ledger's copy (llm_ledger_ship_errors_total alerts instead)."""
    if draining or starting:
        return 503, {"status": "draining" if draining else "starting"}
    checks: dict[str, str] = {}
    ok = True
    if probe is not None:
        up, detail = probe.state()
        checks["upstream"] = detail if up else f"down: {detail}"
        ok &= up
    if ledger is not None:
        problem = ledger.problem
        checks["ledger"] = "ok" if problem is None else f"unwritable: {problem}"
        ok &= problem is None
    for name, writer in (writers or {}).items():
        if writer is not None and (problem := writer.problem) is not None:
            checks[name] = f"unwritable: {problem}"
            ok = False
    return (200 if ok else 503), {"status": "ready" if ok else "not_ready", "checks": checks}
