"""The `tollbooth` command: serve, report, audit, simulate, make-requests, bench, demo, config.

Owns: argument parsing and turning flags into config overrides. Each subcommand's work lives in
the module that owns it; this file only wires.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from .. import __version__
from ..config import ConfigError, ServerConfig, load
from ..telemetry import logs


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is optional
        asyncio.run(coro)  # type: ignore[arg-type]


def cmd_serve(args: argparse.Namespace) -> int:
    from .app import Sidecar, serve
    from .wiring import wire

    overrides = {  # each flag overrides its key only when given
        "upstream.url": args.upstream,
        "server.listen": args.listen,
        "server.admin_listen": args.admin_listen,
        "ledger.path": args.ledger,
    }
    config = load(args.config, overrides)
    logs.setup(config.logging.level, config.logging.format)
    sc = wire(Sidecar(config, pricing_path=args.pricing))
    _run(serve(sc))
    return 0


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the metering proxy in front of vLLM or TGI")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--upstream", help="inference server base URL (overrides upstream.url)")
    server = ServerConfig()  # the defaults: each flag overrides its key only when given
    p.add_argument("--listen", help=f"HOST:PORT for clients (default {server.listen})")
    p.add_argument("--admin-listen", help=f"HOST:PORT for /metrics (default {server.admin_listen})")
    p.add_argument("--pricing", help="pricing YAML, re-read on SIGHUP")
    p.add_argument("--ledger", help="SQLite usage ledger path (overrides ledger.path)")
    p.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from . import commands

    parser = argparse.ArgumentParser(prog="tollbooth", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tollbooth {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in [_add_serve, *commands.ADDERS]:
        add(sub)
    return parser


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line read; a lab command's flags by its own parser, made only now."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    lab = getattr(args, "lab_command", None)
    if lab is not None:
        return lab.parser().parse_args(rest)  # type: ignore[no-any-return]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")  # as parse_args does
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"tollbooth: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
