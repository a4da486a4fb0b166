"""Real redis-server and PostgreSQL (Debian's packages) on free loopback ports, for fleet tests.

PostgreSQL refuses to run as root: as root its data directory belongs to the `postgres` user and
its binaries run as that user (setpriv). Every server is stopped and its files removed at the end.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.procs import free_port

REDIS_SERVER = shutil.which("redis-server")


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _version(path: str) -> int:
    part = Path(path).parts[4]
    return int(part) if part.isdigit() else 0


PG_BIN = _pg_bin()


def require(what: str, present: object) -> None:
    """Skip (with the reason) where the package is missing; CI must have it (`make test`
    installs it)."""
    if present:
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must have Debian's {what} (make test installs it)")
    pytest.skip(f"Debian's {what} not installed (make debs installs it)")


def _wait(check: object, what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start: {last}")


class RedisServer:
    def __init__(self, tmp: Path) -> None:
        require("redis-server", REDIS_SERVER)
        self.dir = tmp
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> object:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self) -> RedisServer:
        log = (self.dir / f"redis-{self.port}.log").open("ab")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"]
        self.proc = subprocess.Popen([str(REDIS_SERVER), *args], stdout=log, stderr=log)
        log.close()
        _wait(lambda: self.client().ping(), "redis-server")  # type: ignore[attr-defined]
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


class Postgres:
    """One cluster (initdb once); each test gets a database of its own."""

    def __init__(self) -> None:
        require("postgresql", PG_BIN)
        self.root = Path(tempfile.mkdtemp(prefix="tollbooth-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._as = ["setpriv", "--reuid", "postgres", "--regid", "postgres", "--init-groups"]
        self._names = 0
        self._run(PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync")

    def _run(self, *cmd: object) -> None:
        out = subprocess.run(
            [*self._as, *map(str, cmd)], capture_output=True, text=True, timeout=120, check=False
        )
        if out.returncode:
            raise RuntimeError(f"{cmd[0]} failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")

    def start(self) -> Postgres:
        log = (self.root / "postgres.log").open("ab")
        opts = ["-c", "fsync=off", "-c", "full_page_writes=off", "-c", "synchronous_commit=off"]
        where = ["-D", str(self.data), "-p", str(self.port), "-k", str(self.root)]
        where += ["-h", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*self._as, str(PG_BIN / "postgres"), *where, *opts],
            stdout=log,
            stderr=log,
        )
        log.close()
        _wait(self._ready, "postgres")
        return self

    def _ready(self) -> bool:
        import psycopg

        with psycopg.connect(self.url("postgres"), connect_timeout=2):
            return True

    def url(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def database(self) -> str:
        """A new, empty database; its URL."""
        import psycopg

        self._names += 1
        name = f"t{os.getpid()}_{self._names}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: a clean checkpoint
            self.proc.wait(30)
        self.proc = None

    def remove(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
