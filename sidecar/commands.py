"""Subcommands other than `serve`, each delegating to the module that owns the work."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Sub = "argparse._SubParsersAction[argparse.ArgumentParser]"
Adder = Callable[[Sub], None]


def cmd_report(args: argparse.Namespace) -> int:
    from . import report

    try:
        rows = report.summarize(args.ledger, report.parse_since(args.since), args.by)
    except ValueError as exc:
        raise SystemExit(f"tollbooth report: {exc}") from None
    print(report.render(rows, args.format))
    return 0


def add_report(sub: Sub) -> None:  # type: ignore[valid-type]
    p = sub.add_parser("report", help="spend, tokens and latency from the usage ledger")  # type: ignore[attr-defined]
    p.add_argument("--ledger", required=True, help="ledger SQLite file")
    p.add_argument("--since", default="24h", help="24h, 7d, 30m, or a date (UTC)")
    p.add_argument("--by", default="user", choices=["user", "model", "day"])
    p.add_argument("--format", default="table", choices=["table", "csv", "json"])
    p.set_defaults(func=cmd_report)


ADDERS: list[Adder] = [add_report]
