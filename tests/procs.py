"""Running `tollbooth` as a real process for tests that need signals (SIGTERM, SIGKILL, SIGHUP)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from sidecar.bench.runner import free_port

__all__ = ["Tollbooth", "free_port", "start_tollbooth"]


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
    tmp: Path, config: dict[str, Any], *args: str, ready_path: str = "/readyz"
) -> Tollbooth:
    """Start `tollbooth serve` and wait until `ready_path` on the admin port answers 200.

    Like the in-process sidecars, it writes its audit file under `tmp` and sees no GPU unless
    `config` says otherwise: a test's outcome never depends on the machine's GPU or working tree.
    """
    port, admin = free_port(), free_port()
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
        "sidecar.cli",
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
                raise RuntimeError("tollbooth exited: " + log.read_text()[-2000:])
            try:
                async with s.get(tb.admin + ready_path) as r:
                    if r.status == 200:
                        return tb
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("tollbooth did not become ready: " + log.read_text()[-2000:])
