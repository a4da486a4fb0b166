"""Running `tollbooth` as a real process for tests that need signals (SIGTERM, SIGKILL, SIGHUP)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from tollbooth_lab.bench.runner import free_port

__all__ = [
    "Prometheus",
    "Tollbooth",
    "free_port",
    "require_prometheus",
    "start_prometheus",
    "start_tollbooth",
]


class Tollbooth:
    def __init__(
        self, proc: asyncio.subprocess.Process, url: str, admin: str, log: Path, handle: Any
    ):
        self.proc, self.url, self.admin, self.log, self._handle = proc, url, admin, log, handle

    async def stop(self, sig: int) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            return await asyncio.wait_for(self.proc.wait(), 30)
        finally:
            self._handle.close()


async def start_tollbooth(
    tmp: Path,
    config: dict[str, Any],
    *args: str,
    ports: tuple[int, int] | None = None,
    ready_path: str = "/readyz",
) -> Tollbooth:
    """Start `tollbooth serve` and wait until `ready_path` on the admin port answers 200; `ports`
    (proxy, admin) to come back where a scraper looks.

    Like the in-process sidecars, it writes its audit file under `tmp` and sees no GPU unless
    `config` says otherwise: a test's outcome never depends on the machine's GPU or working tree.
    """
    for attempt in range(3):
        try:
            chosen = ports or (free_port(), free_port())
            return await _start_tollbooth(tmp, config, args, chosen, ready_path)
        except PortTaken:
            if ports is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """The free port chosen was bound by someone else before tollbooth bound it."""


async def _start_tollbooth(
    tmp: Path,
    config: dict[str, Any],
    args: tuple[str, ...],
    ports: tuple[int, int],
    ready_path: str,
) -> Tollbooth:
    port, admin = ports
    config = {
        **config,
        "audit": {"path": str(tmp / f"audit-{port}.jsonl"), **config.get("audit", {})},
        "gpu": {"enabled": False, **config.get("gpu", {})},
    }
    cfg = tmp / f"tollbooth-{port}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    log = tmp / f"tollbooth-{port}.log"
    handle = log.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sidecar.core.cli",
        "serve",
        "--config",
        str(cfg),
        "--listen",
        f"127.0.0.1:{port}",
        "--admin-listen",
        f"127.0.0.1:{admin}",
        *args,
        stdout=handle,
        stderr=asyncio.subprocess.STDOUT,
    )
    tb = Tollbooth(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", log, handle)
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if proc.returncode is not None:
                handle.close()
                text = log.read_text()
                if "address already in use" in text.lower():
                    raise PortTaken(text[-2000:])
                raise RuntimeError("tollbooth exited: " + text[-2000:])
            try:
                async with s.get(tb.admin + ready_path) as r:
                    if r.status == 200:
                        return tb
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("tollbooth did not become ready: " + log.read_text()[-2000:])


PROMETHEUS = shutil.which("prometheus")


def require_prometheus() -> None:
    """At a test module's top: skip it where Debian's prometheus is missing; fail it in CI."""
    if PROMETHEUS is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI must have Debian's prometheus (make test installs it)")
        pytest.skip("Debian's prometheus is not installed", allow_module_level=True)


class Prometheus:
    """Debian's prometheus binary on a free loopback port, its data under the test's tmp dir."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url

    async def query(self, expr: str, at: float | None = None) -> list[Any]:
        params = {"query": expr} | ({"time": repr(at)} if at is not None else {})
        return await self._get("/api/v1/query", params)

    async def query_range(self, expr: str, start: float, end: float, step: float) -> list[Any]:
        params = {"query": expr, "start": repr(start), "end": repr(end), "step": repr(step)}
        return await self._get("/api/v1/query_range", params)

    async def _get(self, path: str, params: dict[str, str]) -> list[Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + path, params=params) as r:
            body = await r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{params['query']}: {body}")
        return list(body["data"]["result"])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(self.proc.wait(), 20)


async def start_prometheus(tmp: Path, name: str, config: dict[str, Any]) -> Prometheus:
    assert PROMETHEUS, "Debian's prometheus package is not installed"
    port = free_port()
    (tmp / f"{name}.yml").write_text(yaml.safe_dump(config))
    with (tmp / f"{name}.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={tmp / f'{name}.yml'}",
            f"--storage.tsdb.path={tmp / f'{name}-tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            stdout=log,
            stderr=log,
        )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            if proc.returncode is not None:
                raise RuntimeError(f"{name} exited: " + (tmp / f"{name}.log").read_text()[-2000:])
            try:
                async with s.get(prom.url + "/-/ready") as r:
                    if r.status == 200:
                        return prom
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    await prom.stop()
    raise RuntimeError(f"{name} did not become ready")
