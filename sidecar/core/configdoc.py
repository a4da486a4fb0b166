"""The configuration schema as a commented YAML document: `tollbooth config --print-defaults`.

Owns: rendering a `Config` (the defaults, or an effective one) with every key of every section,
taken from the dataclasses in config.py, and the comments: those written above a field in
config.py, plus the short notes below. `tollbooth.example.yaml` is this module's output, and a test
keeps the two equal, so a field added to config.py shows up with its default without more work.
Never: decides a default or a key itself; config.py is the one source of both.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

import yaml

from ..config import Config
from ..telemetry import thresholds
from .flags import field_comments, typed

HEADER = """\
# Tollbooth configuration: every key with its default. Every key is optional.
# Generated from sidecar/config.py by `tollbooth config --print-defaults`; a test keeps this file
# equal to that output. After changing config.py: make example-config"""

# Short notes shown beside a key, for what a comment in config.py does not already say.
NOTES = {
    "upstream.url": "the one vLLM or TGI server behind the sidecar",
    "server.admin_listen": "/metrics, /healthz, /readyz: keep it private",
    "server.max_request_body_bytes": "413 beyond this",
    "server.shutdown_grace_s": "SIGTERM drains in-flight requests this long",
    "metering.max_tracked_users": 'later users share user_id="__other__"; totals stay exact',
    "metering.max_tracked_teams": 'on llm_team_spend_today_usd; later teams share "__other__"',
    "metering.inject_stream_usage": "see docs/traffic.md",
    "pricing": "USD per million tokens (or: tollbooth serve --pricing FILE)",
    "pricing.models": (
        "{model: {input_per_1m, output_per_1m, cached_input_per_1m, reasoning_per_1m, "
        "audio_per_second}}"
    ),
    "pricing.default": "for unlisted models; null: their cost is unknown, never $0",
    "pricing.gpu_hour_usd": "device-time cost (needs GPU telemetry); null: none",
    "ledger.path": "SQLite file (or --ledger); null: no ledger",
    "ledger.flush_interval_s": "at most this much is lost on a hard kill",
    "ledger.max_pending_rows": "held while the file cannot be written; then the oldest drop",
    "budgets.limits": "[{scope, name, usd, window: day|month, soft}] (docs/budgets.md)",
    "budgets.global_daily_usd": "null: no global budget",
    "budgets.user_daily_usd": "null: no per-user budget",
    "budgets.users": "per-user overrides, e.g. {alice: 5.0}",
    "admission.token_budget": "estimated prompt + max tokens admitted at once",
    "admission.max_batch": "fixed-batch group size",
    "admission.chars_per_token": "for estimates only (admission, GPU split); never a count",
    "admission.default_max_tokens": "the estimate's output size when a request sets none",
    "audit.input_cost_usd": (
        f"null: the per-request alert threshold (${thresholds.DEFAULT.request_cost_usd:.2f})"
    ),
    "audit.total_cost_usd": "null: the same threshold",
    "audit.sink": "jsonl | ledger (the ledger needs ledger.path)",
    "audit.path": "relative to the working directory",
    "audit.max_bytes": "rotated beyond this, `backups` old files kept",
}
NOTE_COLUMN = 36


def render(config: Config | None = None) -> str:
    """`config` (by default: the defaults) as YAML, every key present, with comments."""
    lines = HEADER.splitlines()
    _section(lines, config if config is not None else Config(), prefix="", depth=0)
    return "\n".join(lines) + "\n"


def _section(lines: list[str], obj: Any, prefix: str, depth: int) -> None:
    cls = type(obj)
    comments = field_comments(cls)
    hints = typing.get_type_hints(cls)
    indent = "  " * depth
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        above = comments.get(f.name, [])
        lines.extend(f"{indent}# {c}".rstrip() for c in above)
        hint = hints[f.name]
        note = NOTES.get(key) or ("" if above else _choices(hint))
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a section, never None
            lines.append(_with_note(f"{indent}{f.name}:", note))
            _section(lines, value, f"{key}.", depth + 1)
        else:
            lines.append(_with_note(f"{indent}{f.name}: {_yaml(_plain(value))}", note))


def _with_note(line: str, note: str) -> str:
    if not note:
        return line
    return f"{line.ljust(NOTE_COLUMN - 1)} # {note}"


def _choices(hint: Any) -> str:
    """'a | b | c' for a Literal field (also when optional): the allowed values."""
    return " | ".join(str(v) for v in typed(hint).get("choices", ()))


def _plain(value: Any) -> Any:
    """Data YAML can write: dataclasses as mappings, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _yaml(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=sys.maxsize, sort_keys=False)
    return text.removesuffix("\n...\n").rstrip("\n")
