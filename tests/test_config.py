"""Configuration: typed, frozen, and every mistake is one line that names the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

from sidecar.billing.report import chargeback
from sidecar.config import Config, ConfigError, load
from sidecar.core import configdoc

ROOT = Path(__file__).parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_example_config_is_the_defaults_and_is_frozen() -> None:
    cfg = load(ROOT / "tollbooth.example.yaml")
    assert cfg == Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.listen = "x"  # type: ignore[misc]


def test_example_config_is_generated_from_the_dataclasses() -> None:
    committed = (ROOT / "tollbooth.example.yaml").read_text()
    assert committed == configdoc.render(), (
        "tollbooth.example.yaml is out of date with sidecar/config.py: run `make example-config` "
        "(tollbooth config --print-defaults > tollbooth.example.yaml)"
    )


def test_every_key_and_default_is_in_the_example() -> None:
    example = yaml.safe_load((ROOT / "tollbooth.example.yaml").read_text())

    def walk(obj: object, node: dict[str, object], prefix: str) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            value = getattr(obj, f.name)
            assert f.name in node, f"{prefix}{f.name} is missing"
            if dataclasses.is_dataclass(value):
                walk(value, node[f.name], f"{prefix}{f.name}.")  # type: ignore[arg-type]
            else:
                assert node[f.name] == (list(value) if isinstance(value, tuple) else value)

    walk(Config(), example, "")
    assert set(configdoc.NOTES) <= keys(Config())  # no note for a key that does not exist


def keys(obj: object, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        out.add(prefix + f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out |= keys(value, f"{prefix}{f.name}.")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class _NewSection:
    # Comments above a field become its comment in the example.
    limit_s: float = 1.5
    mode: Literal["a", "b"] = "a"
    names: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Extended(Config):
    new: _NewSection = dataclasses.field(default_factory=_NewSection)


def test_a_field_added_to_the_schema_appears_with_its_default_and_comment() -> None:
    text = configdoc.render(_Extended())
    assert text.startswith(configdoc.render().rstrip("\n"))
    tail = text.split("\nnew:\n")[1]
    assert tail.splitlines() == [
        "  # Comments above a field become its comment in the example.",
        "  limit_s: 1.5",
        "  mode: a" + " " * 27 + "# a | b",
        "  names: []",
    ]


def test_cli_prints_the_defaults_and_a_files_effective_config(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "sidecar.core.cli", "config"]
    out = subprocess.run(
        [*cli, "--print-defaults"], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout == (ROOT / "tollbooth.example.yaml").read_text()
    path = write(tmp_path, "pricing:\n  models:\n    m: {input_per_1m: 1, output_per_1m: 2}\n")
    out = subprocess.run(
        [*cli, "--config", str(path)], capture_output=True, text=True, timeout=60, check=True
    )
    assert (
        "  models: {m: {input_per_1m: 1.0, output_per_1m: 2.0, cached_input_per_1m: null,"
        " reasoning_per_1m: null, audio_per_second: null}}" in (out.stdout)
    )
    assert load(write(tmp_path, out.stdout)) == load(path)


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
        (
            "upstream:\n  url: ftp://host\n",
            "config 'upstream.url' must be an http:// or https:// URL",
        ),
        (
            "upstream:\n  url: http://host:99999\n",
            "config 'upstream.url': the port is not a number in 0-65535",
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
        (
            "metering:\n  free_routes: [tokenize]\n",
            "config 'metering.free_routes' has value 'tokenize': each route must start with '/'",
        ),
        ("metering:\n  unknown_routes: allow\n", "expected one of forward, refuse"),
        (
            "upstream:\n  sglang_messages_usage: whole\n",
            "config 'upstream.sglang_messages_usage' has value 'whole': expected one of "
            "anthropic, prompt",
        ),
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
        [sys.executable, "-m", "sidecar.core.cli", "serve", "--config", str(path)],
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


@pytest.mark.parametrize(
    ("key", "value", "refused"),
    [
        ("ledger.postgres_url", "host=db dbname=t user=u password=S3CRET", "a password"),
        ("ledger.postgres_url", "postgresql://u@db/t?sslmode=on&password=S3CRET", "a password"),
        ("ledger.postgres_url", "PostgreSQL://u:S3CRET@db/t", "a password"),
        ("ledger.postgres_url", "postgresql+psycopg://u:S3CRET@db/t", "a password"),
        ("ledger.postgres_url", "db.example:5432/S3CRET", "expected a URL"),
        ("budgets.store", "redis://db:6379/0?password=S3CRET", "a password"),
        ("budgets.store", "unix:///run/redis.sock?password=S3CRET", "a password"),
        ("budgets.store", "unix:///run/S3CRET.sock", "expected a URL"),
    ],
)
def test_store_urls_with_a_password_are_refused_and_never_echoed(
    tmp_path: Path, key: str, value: str, refused: str
) -> None:
    overrides = {key: value, "ledger.path": str(tmp_path / "l.db")}
    with pytest.raises(ConfigError) as err:
        load(None, overrides)
    assert refused in str(err.value) and "S3CRET" not in str(err.value)
    good = "PostgreSQL://u@db/t?sslmode=require" if key.startswith("ledger") else "REDIS://db/0"
    assert load(None, {**overrides, key: good})  # the scheme in any case


def test_a_report_from_a_postgresql_url_in_any_case_never_echoes_it() -> None:
    for url, message in (
        ("PostgreSQL://u:S3CRET@127.0.0.1:9/t", "the PostgreSQL ledger cannot be read"),
        ("postgresq://u:S3CRET@127.0.0.1:9/t", "a URL must start with postgresql://"),
    ):
        with pytest.raises(ValueError) as err:
            chargeback(url, 0.0, "user")
        assert message in str(err.value) and "S3CRET" not in str(err.value)
