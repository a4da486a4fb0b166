"""Subcommands other than `serve`, each delegating to the module that owns the work."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias
from urllib.parse import urlsplit

from ..config import BudgetConfig, ServerConfig, UpstreamConfig
from .flags import option

if TYPE_CHECKING:
    from tollbooth_lab.bench import Distribution
    from tollbooth_lab.simulator import EngineParams

Sub: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

# HOST:PORT of the sidecar's default upstream: where the simulator listens.
SIMULATOR_LISTEN = urlsplit(UpstreamConfig().url).netloc

LAB_MISSING = (
    "tollbooth {command}: needs the lab (the simulator, bench harness and demo), a separate "
    "distribution that the production install leaves out. From a clone of the repository: "
    "pip install ./lab (or run `make demo`)."
)


@dataclass(frozen=True)
class LabCommand:
    """A subcommand of the lab. Its flags, whose defaults the lab's dataclasses hold, are made
    only when it is the command run (sidecar/core/cli.py `parse`): no other command, `serve`
    least of all, imports the lab, and without the lab it says what to install."""

    name: str
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    def add(self, sub: Sub) -> None:
        """A placeholder in the main parser; `parser()` reads the flags, --help included."""
        p = sub.add_parser(self.name, help=self.help, add_help=False)
        p.set_defaults(lab_command=self)

    def parser(self) -> argparse.ArgumentParser:
        if importlib.util.find_spec("tollbooth_lab") is None:
            raise SystemExit(LAB_MISSING.format(command=self.name))
        p = argparse.ArgumentParser(prog=f"tollbooth {self.name}", description=self.help)
        self.add_flags(p)
        p.set_defaults(func=self.run, command=self.name)
        return p


def cmd_report(args: argparse.Namespace) -> int:
    from ..billing import chargeback, report

    try:
        hour = args.day_start_hour_utc
        if args.month:
            since, until = report.month_bounds(args.month, hour)
        else:
            since, until = report.parse_since(args.since), None
        rep = chargeback.build(
            args.ledger,
            since,
            until,
            args.by,
            hour,
            book=chargeback.price_book(args.pricing, args.config),
            gpus=chargeback.capacity(args.gpus, args.config),
            spread_idle=args.spread_idle,
        )
    except ValueError as exc:  # ConfigError is one
        raise SystemExit(f"tollbooth report: {exc}") from None
    text = chargeback.render(rep, args.format)
    text += "" if text.endswith("\n") else "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def add_report(sub: Sub) -> None:
    from ..billing.report import DIMENSIONS

    p = sub.add_parser("report", help="spend, tokens and latency from the usage ledger")
    p.add_argument(
        "--ledger", required=True, help="ledger SQLite file, or the fleet's postgresql:// URL"
    )
    p.add_argument("--since", default="24h", help="24h, 7d, 30m, or a date (UTC)")
    p.add_argument("--by", default="user", choices=DIMENSIONS)
    p.add_argument("--month", help="YYYY-MM: that budget month instead of --since")
    option(
        p,
        BudgetConfig,
        "day_start_hour_utc",
        help="days and months start at this hour (budgets.day_start_hour_utc)",
    )
    p.add_argument("--format", default="table", choices=["table", "csv", "json", "html"])
    p.add_argument("--output", "-o", help="write the report to this file instead of stdout")
    p.add_argument(
        "--pricing", help="the price book the sidecar served with (named in the report by digest)"
    )
    p.add_argument(
        "--config", help="the sidecar's YAML config: its pricing section and gpu.devices"
    )
    p.add_argument(
        "--gpus",
        type=int,
        help="GPUs the engine held through the period: the idle GPU time is theirs less the "
        "requests' device-seconds (default: the config's gpu.devices, else unknown)",
    )
    p.add_argument(
        "--spread-idle",
        action="store_true",
        help="share the idle GPU cost over the groups by their device-seconds",
    )
    p.set_defaults(func=cmd_report)


def engine_params(args: argparse.Namespace) -> EngineParams:
    from tollbooth_lab.simulator import EngineParams

    speed, base = args.speed, EngineParams()
    return EngineParams(
        kv_capacity_tokens=args.kv_capacity,
        on_full=args.on_full,
        step_base_s=base.step_base_s / speed,
        prefill_s_per_token=base.prefill_s_per_token / speed,
        decode_s_per_seq=base.decode_s_per_seq / speed,
        batch_dependent_output=args.batch_dependent_output,
    )


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from tollbooth_lab.simulator import EngineParams

    option(p, EngineParams, "kv_capacity_tokens", "--kv-capacity")
    option(p, EngineParams, "on_full")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 = twice as fast")
    option(p, EngineParams, "batch_dependent_output")


def cmd_simulate(args: argparse.Namespace) -> int:
    import asyncio

    from aiohttp import web
    from tollbooth_lab.simulator import create_simulator

    from ..config import parse_hostport
    from ..telemetry import logs

    logs.setup("INFO", "text")
    host, port = parse_hostport("--listen", args.listen)
    app = create_simulator(args.api, engine_params(args), args.model)
    print(f"simulated {args.api} server (not a GPU) on http://{host}:{port}", flush=True)
    web.run_app(
        app, host=host, port=port, access_log=None, print=None, loop=asyncio.new_event_loop()
    )
    return 0


def simulate_flags(p: argparse.ArgumentParser) -> None:
    import inspect

    from tollbooth_lab.simulator import create_simulator

    given = inspect.signature(create_simulator).parameters
    p.add_argument("--listen", default=SIMULATOR_LISTEN)
    p.add_argument("--api", choices=["vllm", "tgi"], default=given["api"].default)
    p.add_argument("--model", default=given["model"].default)
    add_engine_flags(p)


def _distribution(args: argparse.Namespace) -> Distribution:
    from tollbooth_lab.bench import Distribution

    return Distribution(
        n=args.n,
        seed=args.seed,
        prompt_words_median=args.prompt_words,
        max_tokens_min=args.max_tokens_min,
        max_tokens_max=args.max_tokens_max,
        rate_per_s=args.arrival_rate,
    )


def _add_distribution_flags(p: argparse.ArgumentParser, n: int | None = None) -> None:
    from tollbooth_lab.bench import Distribution

    n_flag = option(p, Distribution, "n", help="number of requests")
    if n is not None:  # the bench's own number (BENCH_REQUESTS), not the file generator's
        n_flag.default = n
    option(p, Distribution, "seed")
    option(
        p, Distribution, "prompt_words_median", "--prompt-words", help="median prompt length, words"
    )
    option(p, Distribution, "max_tokens_min")
    option(p, Distribution, "max_tokens_max")
    option(
        p,
        Distribution,
        "rate_per_s",
        "--arrival-rate",
        help="Poisson rate for the arrival offsets written to the file",
    )


def cmd_make_requests(args: argparse.Namespace) -> int:
    from tollbooth_lab.bench import generate, write

    reqs = generate(_distribution(args))
    write(args.out, reqs)
    print(f"wrote {len(reqs)} requests to {args.out}")
    return 0


def make_requests_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    _add_distribution_flags(p)


# The bench's flags made from BenchOptions fields, under the fields' names.
BENCH_KNOBS = ("warmup", "token_budget", "max_batch", "lower_factor", "max_attempts")


def cmd_bench(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import asdict

    from tollbooth_lab.bench import Arrival, BenchOptions, generate, read, run
    from tollbooth_lab.bench.output import write_all

    from ..config import AdmissionConfig, ConfigError, load
    from ..metering.pricing import load_pricing_file

    if args.requests:
        reqs, source = read(args.requests), {"request_file": args.requests}
    else:
        dist = _distribution(args)
        reqs, source = generate(dist), {"generated": asdict(dist)}
    arrival = Arrival("file", 0) if args.requests else Arrival()
    for kind in ("concurrency", "rate", "burst"):  # mutually exclusive flags
        if getattr(args, kind):
            arrival = Arrival(kind, getattr(args, kind))
    pricing = load_pricing_file(args.pricing) if args.pricing else load().pricing
    if args.config:
        pricing = load(args.config).pricing
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    known = typing.get_args(typing.get_type_hints(AdmissionConfig)["strategy"])
    for s in strategies:
        if s not in known:
            raise ConfigError(f"--strategies: '{s}' is not one of {', '.join(known)}")
    opts = BenchOptions(
        strategies=strategies,
        out_dir=Path(args.out),
        upstream=args.upstream,
        model=args.model,
        arrival=arrival,
        pricing=pricing,
        sim_api=args.api,
        sim_params=engine_params(args),
        seed=args.seed,
        **{name: getattr(args, name) for name in BENCH_KNOBS},
    )
    result = asyncio.run(run(opts, reqs, source))
    for path in write_all(result, opts.out_dir):
        print(f"wrote {path}")
    for name, s in result["strategies"].items():
        e2e = s["e2e_s"]["p50"]
        print(
            f"  {name:<13} failures={s['failures']:<3} e2e p50="
            f"{'unknown' if e2e is None else f'{e2e * 1000:.0f} ms'} "
            f"attempts={len(s['attempts'])}"
        )
    return 0


def bench_flags(p: argparse.ArgumentParser) -> None:
    from tollbooth_lab.bench import BenchOptions
    from tollbooth_lab.bench.runner import BENCH_REQUESTS

    p.add_argument("--requests", help="request set (JSONL); default: a generated set")
    p.add_argument("--strategies", default="serial,fixed-batch,token-budget")
    p.add_argument("--upstream", help="vLLM/TGI base URL; default: start the simulator")
    p.add_argument("--model", help="model name (default: asked from the upstream)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, help="closed loop with N in flight")
    g.add_argument("--rate", type=float, help="Poisson arrivals at R requests/s")
    g.add_argument("--burst", type=int, help="bursts of N")
    p.add_argument("--out", required=True, help="output directory")
    for name in BENCH_KNOBS:
        option(p, BenchOptions, name)
    p.add_argument("--pricing", help="pricing YAML for cost per 1k tokens")
    p.add_argument("--config", help="tollbooth config whose pricing to use")
    option(p, BenchOptions, "sim_api", "--api", choices=["vllm", "tgi"], help="simulator API")
    add_engine_flags(p)
    _add_distribution_flags(p, BENCH_REQUESTS)


def cmd_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("tollbooth_lab") is None:  # its flags are the sidecar's own
        raise SystemExit(LAB_MISSING.format(command=args.command))
    from tollbooth_lab import demo

    from ..telemetry import logs

    logs.setup("WARNING", "text")
    demo.main(
        args.duration, args.keep_running, args.listen, args.admin_listen, args.upstream_listen
    )
    return 0


def add_demo(sub: Sub) -> None:
    p = sub.add_parser("demo", help="simulator + sidecar + a short mixed load, then a summary")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of traffic")
    p.add_argument("--keep-running", action="store_true", help="stay up after the summary")
    option(p, ServerConfig, "listen", help="HOST:PORT for clients (server.listen)")
    option(p, ServerConfig, "admin_listen", help="HOST:PORT for /metrics (server.admin_listen)")
    p.add_argument(
        "--upstream-listen",
        default=SIMULATOR_LISTEN,
        help="HOST:PORT for the simulator (upstream.url's)",
    )
    p.set_defaults(func=cmd_demo)


def cmd_audit(args: argparse.Namespace) -> int:
    from ..billing import audit, report
    from ..config import load

    path, ledger = args.path, args.ledger
    if not path and not ledger:
        cfg = load(args.config)
        if cfg.audit.sink == "ledger":  # the fleet's rows when they are shipped
            ledger = cfg.ledger.postgres_url or cfg.ledger.path
        else:
            path = cfg.audit.path
    records = audit.read_records(report.parse_since(args.since), path=path, ledger=ledger)
    print(audit.render(records, args.format))
    return 0


def add_audit(sub: Sub) -> None:
    p = sub.add_parser("audit", help="list audit records of expensive requests")
    p.add_argument("--since", default="24h")
    p.add_argument("--format", default="table", choices=["table", "json"])
    p.add_argument("--path", help="audit JSONL file (rotated files beside it are read too)")
    p.add_argument(
        "--ledger",
        help="ledger with the audit table (audit.sink: ledger): SQLite file or postgresql:// URL",
    )
    p.add_argument("--config", help="tollbooth config to read audit.path / ledger.path from")
    p.set_defaults(func=cmd_audit)


def cmd_keys_add(args: argparse.Namespace) -> int:
    from ..proxy.identity import add_key

    key = add_key(args.file, args.user, args.team, args.project, args.tag or [])
    print(key)  # the only time the key exists outside the client: the file keeps its hash
    return 0


def add_keys(sub: Sub) -> None:
    p = sub.add_parser("keys", help="manage the API keys file (identity.keys_file)")
    keys = p.add_subparsers(dest="keys_command", required=True)
    a = keys.add_parser("add", help="create a key, print it once, store only its SHA-256")
    a.add_argument("--file", required=True, help="the keys file (created if missing)")
    a.add_argument("--user", required=True, help="the principal billed for this key")
    a.add_argument("--team", help="the principal's team (team budgets)")
    a.add_argument("--project", help="the principal's project or cost centre (chargeback)")
    a.add_argument("--tag", action="append", help="a chargeback tag (repeatable)")
    a.set_defaults(func=cmd_keys_add)


def cmd_config(args: argparse.Namespace) -> int:
    from ..config import load
    from . import configdoc

    config = load(args.config) if args.config and not args.print_defaults else None
    print(configdoc.render(config), end="")
    return 0


def add_config(sub: Sub) -> None:
    p = sub.add_parser("config", help="print every config key with its default, or a file's")
    p.add_argument(
        "--print-defaults",
        action="store_true",
        help="every key with its default: what tollbooth.example.yaml holds (the default)",
    )
    p.add_argument("--config", help="print this file's effective config (checked) instead")
    p.set_defaults(func=cmd_config)


LAB_COMMANDS = [
    LabCommand("simulate", "run the simulated vLLM/TGI server", simulate_flags, cmd_simulate),
    LabCommand(
        "make-requests",
        "generate a fixed request set (JSONL)",
        make_requests_flags,
        cmd_make_requests,
    ),
    LabCommand(
        "bench", "compare scheduling strategies on a fixed request set", bench_flags, cmd_bench
    ),
]

ADDERS: list[Callable[[Sub], None]] = [
    add_report,
    *(c.add for c in LAB_COMMANDS),
    add_demo,
    add_audit,
    add_keys,
    add_config,
]
