from __future__ import annotations

import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from sidecar.config import Config, build, validate
from sidecar.core.app import PROXY_SERVER_OPTIONS, Sidecar, create_admin_app, create_app
from sidecar.core.wiring import wire
from tests.fakes import FakeUpstream, NoLibrary

ROOT = Path(__file__).parents[1]
WORK_TREE = pytest.StashKey[frozenset[str] | None]()


def git_status() -> frozenset[str] | None:
    """`git status` of the work tree (ignored files excluded); None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return frozenset(out.splitlines())


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[WORK_TREE] = git_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a test (or a command it ran) left a file in the work tree."""
    before, after = session.stash.get(WORK_TREE, None), git_status()
    if before is None or after is None or not (left := sorted(after - before)):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep(
            "=", "the tests left files in the work tree (write under tmp_path)", red=True
        )
        for line in left:
            reporter.write_line("  " + line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass
class Running:
    url: str  # the sidecar's base URL
    admin_url: str
    sc: Sidecar
    upstream: FakeUpstream | None

    def value(self, name: str, **labels: str) -> float | None:
        return self.sc.metrics.registry.get_sample_value(name, labels)


@pytest.fixture
async def upstream(aiohttp_server: Any) -> tuple[FakeUpstream, TestServer]:
    fake = FakeUpstream()
    server = await aiohttp_server(fake.app)
    return fake, server


StartSidecar = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_sidecar(
    aiohttp_server: Any, upstream: tuple[FakeUpstream, TestServer], tmp_path: Any
) -> StartSidecar:
    """Start a sidecar (proxy and admin apps) in front of the fake upstream or `upstream_url`.

    Test sidecars write their audit file under tmp_path, never into the working tree, and see no
    GPU (NVML absent) unless `wire_kwargs` passes a fake: the machine's own GPU never leaks in.
    """
    fake, up_server = upstream

    async def start(
        config: dict[str, Any] | None = None,
        *,
        upstream_url: str | None = None,
        wire_kwargs: dict[str, Any] | None = None,
        **sidecar_kwargs: Any,
    ) -> Running:
        data = dict(config or {})
        data["audit"] = {"path": str(tmp_path / "audit.jsonl"), **data.get("audit", {})}
        data["upstream"] = {
            "url": upstream_url or str(up_server.make_url("")).rstrip("/"),
            **data.get("upstream", {}),
        }
        cfg = validate(build(Config, data))
        wired = {"nvml": NoLibrary(), **(wire_kwargs or {})}
        sc = wire(Sidecar(cfg, **sidecar_kwargs), **wired)
        # TestServer cancels handlers on client disconnect, as serve() does.
        server = await aiohttp_server(create_app(sc), **PROXY_SERVER_OPTIONS)  # as serve() runs it
        admin = await aiohttp_server(create_admin_app(sc))
        return Running(
            str(server.make_url("")).rstrip("/"), str(admin.make_url("")).rstrip("/"), sc, fake
        )

    return start


@pytest.fixture
async def oai() -> Any:
    """Factory for real openai SDK clients pointed at a running sidecar; all closed at teardown."""
    import openai

    clients: list[Any] = []

    def make(run: Running, api_key: str = "k", *, sync: bool = False) -> Any:
        cls = openai.OpenAI if sync else openai.AsyncOpenAI
        client = cls(base_url=run.url + "/v1", api_key=api_key, max_retries=0)
        clients.append(client)
        return client

    yield make
    for c in clients:
        if isinstance(c, openai.AsyncOpenAI):
            await c.close()
        else:
            c.close()


# --- real Redis and PostgreSQL for the fleet tests (tests/services.py) ----------------------------


@pytest.fixture(scope="session")
def _redis_once(tmp_path_factory: Any) -> Any:
    from tests.services import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_server(_redis_once: Any) -> Any:
    """A running, empty redis-server (one per session; started again after a test stopped it)."""
    if _redis_once.proc is None or _redis_once.proc.poll() is not None:
        _redis_once.start()
    _redis_once.client().flushall()
    return _redis_once


@pytest.fixture(scope="session")
def postgres() -> Any:
    from tests.services import Postgres

    pg = Postgres().start()
    yield pg
    pg.remove()
