"""The lean install: the production distribution carries no lab, plotting or dashboard library,
and the lab's subcommands say what to install when the lab is missing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidecar.core.commands import LAB_MISSING

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("matplotlib", "numpy", "grafanalib")


def requirement_names(deps: list[str]) -> set[str]:
    names = set()
    for dep in deps:
        name = dep.split(";")[0]
        for sep in "[<>=!~ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


def test_the_production_distribution_depends_on_no_plotting_or_dashboard_library() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert requirement_names(project["dependencies"]).isdisjoint(HEAVY)
    assert "grafanalib" in requirement_names(project["optional-dependencies"]["dashboards"])
    assert project["scripts"]["tollbooth"] == "sidecar.core.cli:main"


def test_the_lab_is_its_own_distribution_on_top_of_the_sidecar() -> None:
    project = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "tollbooth-lab"
    assert {"llm-tollbooth", "matplotlib"} <= requirement_names(project["dependencies"])


# `sys.modules[name] = None` makes the lab unimportable, as when it is not installed.
HIDE_LAB = (
    "import sys; sys.modules['tollbooth_lab'] = None; from sidecar.core.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "argv", [["demo"], ["simulate"], ["make-requests", "--out", "x.jsonl"], ["bench", "--out", "o"]]
)
def test_a_lab_command_without_the_lab_says_what_to_install(
    argv: list[str], tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", HIDE_LAB, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert run.returncode == 1
    assert run.stderr.strip() == LAB_MISSING.format(command=argv[0])
    assert "Traceback" not in run.stderr
