"""The repository itself: a fresh clone has everything the suite reads, and holds no artefacts.

The other half of "tests leave `git status` clean" is the session check in conftest.py, which fails
a run that left a file in the work tree.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.fakes import TGI_FIXTURES

ROOT = Path(__file__).parents[1]
# Ways a test could reach outside the work tree: the checkout's parent and friends.
OUTSIDE = ("../" + "shared", "parents[" + "2]", "/work/" + "shared", "TOLLBOOTH_" + "FIXTURES")


def test_no_test_reads_outside_the_work_tree() -> None:
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        for needle in OUTSIDE:
            assert needle not in text, f"{path.name} refers to {needle!r}"
    assert TGI_FIXTURES.resolve().is_relative_to(ROOT.resolve())


def test_every_fixture_a_test_loads_is_in_the_repository() -> None:
    names = set()
    for path in (ROOT / "tests").glob("*.py"):
        names |= set(re.findall(r'"(test_[a-z0-9_]+\.json)"', path.read_text()))
    assert len(names) >= 10
    missing = sorted(n for n in names if not (TGI_FIXTURES / n).is_file())
    assert not missing
    readme = (TGI_FIXTURES / "README.md").read_text()
    assert "db931fcf" in readme and "Apache-2.0" in readme
    assert all(n in readme for n in names)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return out.stdout.splitlines()


def test_no_runtime_artefacts_are_committed() -> None:
    """Audit files hold prompt fragments and request headers; ledgers hold users and spend."""
    artefacts = [
        f
        for f in _tracked()
        if re.search(r"\.(jsonl|db|db-wal|db-shm|log)(\.\d+)?$", f) and not f.startswith("tests/")
    ]
    assert not artefacts
