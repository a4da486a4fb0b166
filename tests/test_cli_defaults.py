"""Each knob declared once: a command-line default is its dataclass field's default
(sidecar/config.py, or the lab's options); the bench's own values are the ones named in
tollbooth_lab.bench.runner."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from typing import Literal

import pytest
from tollbooth_lab.bench import BenchOptions, Distribution
from tollbooth_lab.bench.runner import BENCH_ADMISSION, BENCH_REQUESTS
from tollbooth_lab.simulator import EngineParams

from sidecar.config import AdmissionConfig, BudgetConfig, ServerConfig, UpstreamConfig
from sidecar.core import cli, commands
from sidecar.core.flags import default_of, field_help, option

# The bench's deliberate exceptions, (command, dest) -> default: named in the runner, not here.
DELIBERATE = {("bench", "n"): BENCH_REQUESTS}

# Flags that must be made from a field (a literal default in their place would make the walk
# below check nothing about them).
FROM_FIELDS = {
    ("report", "day_start_hour_utc"),
    ("simulate", "kv_capacity"),
    ("simulate", "on_full"),
    ("make-requests", "n"),
    ("make-requests", "prompt_words"),
    ("make-requests", "arrival_rate"),
    ("bench", "token_budget"),
    ("bench", "max_batch"),
    ("bench", "warmup"),
    ("bench", "lower_factor"),
    ("bench", "max_attempts"),
    ("bench", "api"),
    ("bench", "n"),
    ("demo", "listen"),
    ("demo", "admin_listen"),
}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser: the lab's are made by their own `parser()`."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices) | {c.name: c.parser() for c in commands.LAB_COMMANDS}


def test_every_flag_made_from_a_field_has_the_fields_default() -> None:
    seen = set()
    for command, parser in subparsers().items():
        for action in parser._actions:
            made_from = getattr(action, "field", None)
            if made_from is None:
                continue
            seen.add((command, action.dest))
            expected = DELIBERATE.get((command, action.dest), default_of(*made_from))
            assert action.default == expected, (command, action.dest)
    assert seen >= FROM_FIELDS


def test_the_flags_defaults_are_the_dataclasses_defaults() -> None:
    """Read back as a user gets them: what each command would run with, given no flag."""
    bench = cli.parse(["bench", "--out", "o"])
    assert (bench.token_budget, bench.max_batch) == (16_384, 8)
    assert bench.token_budget == BenchOptions([], "o").token_budget == BENCH_ADMISSION.token_budget
    assert bench.max_batch == AdmissionConfig().max_batch
    assert bench.n == BENCH_REQUESTS
    assert commands.engine_params(bench) == EngineParams()  # at --speed 1, the engine's own
    made = cli.parse(["make-requests", "--out", "x"])
    assert commands._distribution(made) == Distribution()
    report = cli.parse(["report", "--ledger", "l"])
    assert report.day_start_hour_utc == BudgetConfig().day_start_hour_utc
    demo = cli.parse(["demo"])
    assert (demo.listen, demo.admin_listen) == (ServerConfig().listen, ServerConfig().admin_listen)
    simulate = cli.parse(["simulate"])
    assert f"http://{simulate.listen}" == UpstreamConfig().url == f"http://{demo.upstream_listen}"


def test_the_bench_departs_from_the_production_admission_in_the_two_named_knobs_only() -> None:
    production = AdmissionConfig()
    differ = {
        f.name
        for f in dataclasses.fields(AdmissionConfig)
        if getattr(BENCH_ADMISSION, f.name) != getattr(production, f.name)
    }
    assert differ == {"token_budget", "batch_window_s"}
    assert (production.token_budget, production.batch_window_s) == (32_768, 0.05)
    assert (BENCH_ADMISSION.token_budget, BENCH_ADMISSION.batch_window_s) == (16_384, 0.02)
    assert BenchOptions([], "o").batch_window_s == BENCH_ADMISSION.batch_window_s


def test_serve_help_names_the_configs_listen_defaults() -> None:
    text = subparsers()["serve"].format_help()
    assert f"(default {ServerConfig().listen})" in text
    assert f"(default {ServerConfig().admin_listen})" in text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knobs:
    # Rows per batch: the comment above
    # a field, both lines.
    rows: int = 3
    mode: Literal["a", "b"] = "a"  # the comment beside it, 100% of it
    path: str | None = None
    loud: bool = False


def test_an_option_takes_type_choices_default_and_help_from_its_field() -> None:
    p = argparse.ArgumentParser()
    for name in ("rows", "mode", "path", "loud"):
        option(p, Knobs, name)
    assert vars(p.parse_args([])) == {"rows": 3, "mode": "a", "path": None, "loud": False}
    got = p.parse_args(["--rows", "5", "--mode", "b", "--path", "x", "--loud"])
    assert vars(got) == {"rows": 5, "mode": "b", "path": "x", "loud": True}
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "c"])
    assert field_help(Knobs, "rows") == "Rows per batch: the comment above a field, both lines."
    assert p.format_help().count("100% of it") == 1  # a % in a comment is not a format
    assert field_help(Knobs, "path") is None


@pytest.mark.parametrize("argv", [["bench", "--out", "o", "--no-such-flag"], ["config", "--x"]])
def test_an_unknown_flag_is_still_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse(argv)
    assert exc.value.code == 2


def test_serving_makes_no_lab_flags_so_imports_no_lab() -> None:
    code = (
        "import sys; from sidecar.core.cli import parse; parse(['serve', '--listen', 'h:1']);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tollbooth_lab'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"
