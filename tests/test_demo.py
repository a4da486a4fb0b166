"""`tollbooth demo` runs by itself: simulator, sidecar, load, summary."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import free_port


def test_demo_runs_and_summarises() -> None:
    ports = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sidecar.core.cli",
            "demo",
            "--duration",
            "2",
            "--listen",
            ports[0],
            "--admin-listen",
            ports[1],
            "--upstream-listen",
            ports[2],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "simulated vLLM (not a GPU)" in text
    for user in ("alice", "bob"):
        assert f"\n  {user} " in text
    for route in ("/v1/chat/completions", "/v1/messages"):  # the Anthropic client's too
        line = next(ln for ln in text.splitlines() if ln.startswith(f"  {route} "))
        assert int(line.split()[2].replace(",", "")) > 0  # its tokens were metered
    audio = next(ln for ln in text.splitlines() if ln.startswith("  audio seconds metered: "))
    assert float(audio.split()[3].replace(",", "")) > 0  # the speech-to-text client's
    assert "time to 1st token" in text and "queue: token-budget" in text
    assert f"http://{ports[1]}/metrics" in text
    assert "requests," in out.stderr  # the live progress line
