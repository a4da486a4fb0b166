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


def engine_params(args: argparse.Namespace) -> object:
    from .simulator import EngineParams

    speed = args.speed
    return EngineParams(
        kv_capacity_tokens=args.kv_capacity,
        on_full=args.on_full,
        step_base_s=0.004 / speed,
        prefill_s_per_token=0.00002 / speed,
        decode_s_per_seq=0.0002 / speed,
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-capacity", type=int, default=65536, help="simulated KV cache, tokens")
    p.add_argument(
        "--on-full",
        choices=["preempt", "oom"],
        default="preempt",
        help="what the simulated engine does when its KV cache is full",
    )
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 = twice as fast")


def cmd_simulate(args: argparse.Namespace) -> int:
    import asyncio

    from aiohttp import web

    from . import logs
    from .config import parse_hostport
    from .simulator import create_simulator

    logs.setup("INFO", "text")
    host, port = parse_hostport("--listen", args.listen)
    app = create_simulator(args.api, engine_params(args), args.model)  # type: ignore[arg-type]
    print(f"simulated {args.api} server (not a GPU) on http://{host}:{port}", flush=True)
    web.run_app(
        app, host=host, port=port, access_log=None, print=None, loop=asyncio.new_event_loop()
    )
    return 0


def add_simulate(sub: Sub) -> None:  # type: ignore[valid-type]
    p = sub.add_parser("simulate", help="run the simulated vLLM/TGI server")  # type: ignore[attr-defined]
    p.add_argument("--listen", default="127.0.0.1:8000")
    p.add_argument("--api", choices=["vllm", "tgi"], default="vllm")
    p.add_argument("--model", default="sim-llama-3-8b")
    add_engine_flags(p)
    p.set_defaults(func=cmd_simulate)


ADDERS: list[Adder] = [add_report, add_simulate]
