"""Configuration: typed, frozen, and every mistake is one line that names the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import Config, ConfigError, load

ROOT = Path(__file__).parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_example_config_loads_and_is_frozen() -> None:
    cfg = load(ROOT / "tollbooth.example.yaml")
    assert cfg.pricing.models["llama-3-8b"].cached_input_per_1m == 0.05
    assert cfg.server.listen == "127.0.0.1:8080"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.listen = "x"  # type: ignore[misc]


def test_defaults_without_a_file() -> None:
    assert load() == Config()


@pytest.mark.parametrize(
    "text,message",
    [
        ("upstream:\n  urll: http://x\n", "config 'upstream.urll' is not a known key"),
        (
            "admission:\n  token_budget: abc\n",
            "config 'admission.token_budget' has value 'abc': not an integer",
        ),
        (
            "pricing:\n  models:\n    llama: {input_per_1m: abc, output_per_1m: 1}\n",
            "config 'pricing.models.llama.input_per_1m' has value 'abc': not a number",
        ),
        (
            "pricing:\n  models:\n    llama: {output_per_1m: 1}\n",
            "config 'pricing.models.llama.input_per_1m' is required",
        ),
        ("upstream:\n  url: ftp://host\n", "config 'upstream.url' has value 'ftp://host'"),
        (
            "upstream:\n  url: http://host:99999\n",
            "config 'upstream.url' has value 'http://host:99999'",
        ),
        (
            "server:\n  listen: nowhere\n",
            "config 'server.listen' has value 'nowhere': expected HOST:PORT",
        ),
        (
            "admission:\n  strategy: fastest\n",
            "expected one of none, serial, fixed-batch, token-budget",
        ),
        ("gpu:\n  enabled: 'yes'\n", "config 'gpu.enabled' has value 'yes': not a boolean"),
        ("- a list\n", "must hold a mapping"),
        ("upstream: [\n", "is not valid YAML"),
    ],
)
def test_bad_lines_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, text))
    assert message in str(err.value)
    assert "\n" not in str(err.value).split(" is not valid YAML")[0]


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "upstream:\n  url: http://a:1\n")
    cfg = load(path, {"upstream.url": "http://b:2", "server.listen": None})
    assert cfg.upstream.url == "http://b:2"


def test_cli_stops_with_one_clear_line(tmp_path: Path) -> None:
    path = write(tmp_path, "metering:\n  max_tracked_users: lots\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "tollbooth: config 'metering.max_tracked_users' has value 'lots': not an integer"
    )


def test_audit_into_a_ledger_needs_a_ledger(tmp_path: Path) -> None:
    path = write(tmp_path, "audit:\n  sink: ledger\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == (
        "config 'audit.sink' has value 'ledger': there is no ledger (set ledger.path or --ledger)"
    )
    assert load(path, {"ledger.path": str(tmp_path / "l.db")}).audit.sink == "ledger"
    off = write(tmp_path, "audit:\n  sink: ledger\n  enabled: false\n")
    assert load(off).audit.enabled is False
