"""Inhibition in a fleet, with the real Alertmanager and the generated config: a replica that is
down silences its own instance's alerts, never another replica's or the fleet's pages."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from alerts.build import render_alertmanager
from tests.procs import free_port

ALERTMANAGER = shutil.which("prometheus-alertmanager")
if not ALERTMANAGER:
    if os.environ.get("CI"):
        raise RuntimeError("CI must have Debian's prometheus-alertmanager (make test installs it)")
    pytest.skip("Debian's prometheus-alertmanager not installed", allow_module_level=True)

pytestmark = pytest.mark.binaries


def alert(name: str, severity: str, **labels: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    return {
        "labels": {"alertname": name, "job": "tollbooth", "severity": severity, **labels},
        "startsAt": now.isoformat(),
        "endsAt": (now + dt.timedelta(hours=1)).isoformat(),
    }


async def test_a_down_replica_silences_only_its_own_alerts(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text(render_alertmanager(page_url="http://127.0.0.1:9/page"))
    log = (tmp_path / "am.log").open("wb")
    am = await asyncio.create_subprocess_exec(
        str(ALERTMANAGER),
        f"--config.file={config}",
        f"--storage.path={tmp_path / 'am'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
        stdout=log,
        stderr=log,
    )
    log.close()
    base = f"http://127.0.0.1:{port}/api/v2"
    expected = {
        ("LLMSidecarDown", "a:9464"): "active",
        ("LLMGPUMemoryNearFull", "a:9464"): "suppressed",  # the down replica's own
        ("LLMGPUMemoryNearFull", "b:9464"): "active",
        ("LLMDailySpendHigh", ""): "active",  # still pages
        ("LLMUpstreamErrorRateHigh", ""): "active",
    }
    try:
        async with aiohttp.ClientSession() as s:
            end = time.monotonic() + 30
            while True:
                try:
                    async with s.get(base + "/status") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    if time.monotonic() > end:
                        raise
                await asyncio.sleep(0.1)
            sent = [
                alert("LLMSidecarDown", "critical", instance="a:9464"),
                alert("LLMGPUMemoryNearFull", "warning", instance="a:9464", gpu="0"),
                alert("LLMGPUMemoryNearFull", "warning", instance="b:9464", gpu="0"),
                alert("LLMDailySpendHigh", "critical"),  # summed over the fleet: no instance
                alert("LLMUpstreamErrorRateHigh", "critical"),
            ]
            async with s.post(base + "/alerts", json=sent) as r:
                assert r.status == 200
            # Alertmanager marks inhibited alerts asynchronously, after it has taken the
            # inhibiting one in: read until the states are the expected ones, at most 10 s.
            end = time.monotonic() + 10
            while True:
                async with s.get(base + "/alerts") as r:
                    state = states(await r.json())
                if state == expected or time.monotonic() > end:
                    break
                await asyncio.sleep(0.1)
    finally:
        am.send_signal(signal.SIGTERM)
        await asyncio.wait_for(am.wait(), 20)
    assert state == expected


def states(alerts: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (a["labels"]["alertname"], a["labels"].get("instance", "")): a["status"]["state"]
        for a in alerts
    }
