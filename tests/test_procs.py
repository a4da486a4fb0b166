"""The test harness's own guarantees: a port taken between choosing and binding is chosen again."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import pytest

import tests.procs as procs
from tests.test_ledger import config


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {procs.free_port() for _ in range(50)}
    assert all(1024 <= p < low for p in ports)


async def test_a_port_taken_before_tollbooth_binds_it_is_chosen_again(
    upstream: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server = upstream
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = procs.free_port
        chosen = iter([busy, free(), free(), free()])
        monkeypatch.setattr(procs, "free_port", lambda: next(chosen))
        tb = await procs.start_tollbooth(tmp_path, config(server, tmp_path / "l.db"))
        try:
            assert tb.url != f"http://127.0.0.1:{busy}"
        finally:
            await tb.stop(signal.SIGTERM)
    # ports given by the caller are not changed
    with pytest.raises(procs.PortTaken), socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        await procs.start_tollbooth(
            tmp_path, config(server, tmp_path / "m.db"), ports=(busy, free())
        )
