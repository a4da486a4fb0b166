"""A small mutation run over the billing code: one change at a time, each against its tests.

    .venv/bin/python tools/mutate.py                  # every module, sampled (see --per-module)
    .venv/bin/python tools/mutate.py --module budget  # one module
    .venv/bin/python tools/mutate.py --named          # the survivors issue 21 named, by hand
    .venv/bin/python tools/mutate.py --list           # the mutants, without running them

Operators (each applied alone, on the AST, written back into the source span it replaces):
comparison flips (< <=, > >=, == !=, is / is not, in / not in), integer constants +1 / -1,
`and` <-> `or`, a removed `not`, `return X` -> `return None`, max <-> min, + <-> -, * <-> /
(and //).  Docstrings, f-strings and logging calls are left alone.

The tree is copied once to a temporary directory; each mutant is written into the copy, the
module's test selection (MODULES below) runs there with `pytest -x` under a timeout, and the copy
is restored. A mutant is killed when the selection fails or times out. Results go to
--out (JSON) and a summary is printed. Not part of `make test`: it takes minutes.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import itertools
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
GUARDS = "tests/test_billing_guards.py"


# module (its file's name) -> its file below sidecar/, its tests, the functions to mutate (None:
# all). The packages by concern: proxy, metering, billing, telemetry, core (issue 22).
class Module(NamedTuple):
    path: str
    tests: list[str]
    functions: list[str] | None = None


MODULES: dict[str, Module] = {
    "pricing": Module("metering/pricing.py", ["tests/test_pricing.py", GUARDS]),
    "budget": Module("billing/budget.py", ["tests/test_budget.py", GUARDS]),
    # the fleet's holds in Redis: the Python around the Lua scripts; the scripts (as text) and
    # the key layout
    "redis_store": Module("billing/redis_store.py", ["tests/test_budget_redis.py", GUARDS]),
    "redis_scripts": Module("billing/redis_scripts.py", ["tests/test_budget_redis.py", GUARDS]),
    "identity": Module("proxy/identity.py", ["tests/test_identity.py", GUARDS]),
    "ledger": Module(
        "billing/ledger.py",
        [
            "tests/test_ledger.py",
            "tests/test_writers_survive.py",
            "tests/test_hostile_strings.py",
            "tests/test_report.py",
            "tests/test_budget_report.py",
            GUARDS,
        ],
    ),
    "meter": Module(
        "metering/meter.py", ["tests/test_meter.py", "tests/test_meter_counters.py", GUARDS]
    ),
    "routes": Module("proxy/routes.py", ["tests/test_routes.py", GUARDS]),
    "reqsize": Module("metering/reqsize.py", ["tests/test_hold_inputs.py", GUARDS]),
    # consumed() and priced_model()
    "exchange": Module("exchange.py", ["tests/test_meter.py", "tests/test_ledger.py", GUARDS]),
    # the OpenAI wire adapter (what was usage.py's readers)
    "openai": Module(
        "metering/openai.py",
        ["tests/test_usage.py", "tests/test_wire.py", "tests/test_budget.py", GUARDS],
    ),
    "counts": Module(
        "metering/counts.py", ["tests/test_usage.py", "tests/test_hostile_numbers.py", GUARDS]
    ),
    # bearer(): the Authorization and x-api-key headers' reading
    "credentials": Module("credentials.py", ["tests/test_identity.py", GUARDS]),
    "tgi": Module("metering/tgi.py", ["tests/test_tgi.py", GUARDS]),
}

# Flaky under load (a same-millisecond race between its ledger read and its settlement), so it
# is left out: a mutant it alone kills counts as a survivor, never the other way round.
DESELECT = [
    "tests/test_budget_redis.py::"
    "test_an_emptied_redis_is_reseeded_from_the_ledger_and_lost_holds_are_charged",
]

# The survivors issue 21 names: (module, the text as it is, the text as a change would make it).
NAMED: list[tuple[str, str, str]] = [
    # `_int` accepting negative counts: now the range check of counts.count()
    (
        "counts",
        "return v if 0 <= v <= MAX_TOKEN_COUNT else None",
        "return v if v <= MAX_TOKEN_COUNT else None",
    ),
    # more cached than prompt tokens: the clamp to the input (it also clamps at 0 now)
    (
        "pricing",
        "cached = min(max(cached or 0, 0), input_tokens)",
        "cached = max(cached or 0, 0)",
    ),
    # to_micros truncating instead of rounding up
    (
        "budget",
        "else max(0, math.ceil(micros))",
        "else max(0, int(micros))",
    ),
    # the seed script writing over a day another sidecar seeded (and has charged since)
    ("redis_scripts", "if redis.call('EXISTS', seeded) == 1 then return 0 end\n", ""),
    # a settlement for today that found Redis unseeded dropped, not kept for the reseed
    (
        "redis_store",
        'r == b"unseeded" and hold.day >= today',
        'r == b"unseeded" and hold.day > today',
    ),
    # Bearer read case-sensitively, or unstripped: bearer() moved to credentials.py
    ("credentials", 'scheme.lower() == "bearer"', 'scheme == "Bearer"'),
    ("credentials", "token = token.strip() if", "token = token if"),
    (
        "identity",
        '(headers.get(self.user_header) or "").strip()',
        "headers.get(self.user_header) or ''",
    ),
    ("identity", "return Principal(user=body_user.strip(),", "return Principal(user=body_user,"),
    ("ledger", "cost = None if consumed(ex) else 0.0", "cost = 0.0"),
    (
        "ledger",
        "        ex.user_id,\n        u.input_tokens,",
        "        ex.user,\n        u.input_tokens,",
    ),
    ("ledger", "u.model or ex.info.model or ex.model,", "ex.info.model or ex.model,"),
    ("ledger", "self.config.retention_days * 86400", "self.config.retention_days * 3600"),
    # consumed() and priced_model() moved from meter.py to exchange.py
    (
        "exchange",
        "if u.input_tokens is not None or u.output_tokens is not None or",
        "if u.input_tokens is not None and u.output_tokens is not None or",
    ),
    (
        "exchange",
        "return ex.usage.model or ex.info.model or",
        "return ex.info.model or ex.usage.model or",
    ),
    # a chat's choices each counted the shared prompt again
    (
        "openai",
        "return max(p.input_tokens or 0 for p in parts.values())",
        "return sum(p.input_tokens or 0 for p in parts.values())",
    ),
]

_FLIP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_ARITH = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
}


@dataclass
class Mutant:
    module: str
    line: int
    op: str
    before: str
    after: str
    start: tuple[int, int]  # (line, col) of the span replaced, 1-based line
    end: tuple[int, int]
    function: str
    status: str = "pending"  # killed | survived | timeout | error
    seconds: float = 0.0


def _skipped(tree: ast.AST) -> set[int]:
    """ids of nodes never mutated: docstrings, f-strings, logging calls, and all inside them."""
    out: set[int] = set()
    for node in ast.walk(tree):
        inside = False
        if isinstance(node, ast.JoinedStr):
            inside = True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            inside = isinstance(base, ast.Name) and base.id == "log"
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            inside = isinstance(node.value.value, str)
        if inside:
            out.update(id(n) for n in ast.walk(node))
    return out


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node


def _variants(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(operator name, the mutated copy) for each change this node allows."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _FLIP:
                new = copy.deepcopy(node)
                new.ops[i] = _FLIP[type(op)]()
                yield "compare", new
    elif isinstance(node, ast.BoolOp):
        boolop = copy.deepcopy(node)
        boolop.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "and_or", boolop
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "not", copy.deepcopy(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        binop = copy.deepcopy(node)
        binop.op = _ARITH[type(node.op)]()
        yield "arith", binop
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        for delta in (1, -1) if node.value != 0 else (1,):
            yield "constant", ast.Constant(node.value + delta)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("max", "min"):
            call = copy.deepcopy(node)
            call.func = ast.Name("min" if node.func.id == "max" else "max", ast.Load())
            yield "max_min", call
    elif isinstance(node, ast.Return) and node.value is not None:
        none = isinstance(node.value, ast.Constant) and node.value.value is None
        if not none:
            yield "return_none", ast.Return(ast.Constant(None))


def mutants(module: str, functions: list[str] | None) -> list[Mutant]:
    path = ROOT / "sidecar" / MODULES[module].path
    src = path.read_text()
    lines = src.splitlines(keepends=True)
    tree = ast.parse(src)
    skip = _skipped(tree)
    out: list[Mutant] = []
    seen: set[tuple[int, int, str]] = set()
    for name, fn in _functions(tree):
        if functions is not None and name not in functions:
            continue
        for node in ast.walk(fn):
            if id(node) in skip or not isinstance(node, ast.expr | ast.stmt):
                continue
            for op, new in _variants(node):
                before = _segment(lines, node)
                after = ast.unparse(new)
                if not isinstance(node, ast.stmt):
                    after = f"({after})"
                key = (node.lineno, node.col_offset, after)
                if key in seen or after.strip("()") == before:
                    continue
                seen.add(key)
                out.append(
                    Mutant(
                        module,
                        node.lineno,
                        op,
                        before,
                        after,
                        (node.lineno, node.col_offset),
                        (node.end_lineno or node.lineno, node.end_col_offset or 0),
                        name,
                    )
                )
    # module-level Lua scripts (redis_scripts): comparison flips inside the strings
    if module == "redis_scripts" and functions is None:
        out += _lua_mutants(src)
    return out


def _segment(lines: list[str], node: ast.AST) -> str:
    return ast.get_source_segment("".join(lines), node) or ""


_LUA_OPS = [
    (" <= ", " < "),
    (" < ", " <= "),
    (" >= ", " > "),
    (" > ", " >= "),
    (" == ", " ~= "),
    (" ~= ", " == "),
    (" - ", " + "),
    (" + ", " - "),
]


def _lua_mutants(src: str) -> list[Mutant]:
    """The scripts are strings: their comparisons and signs are mutated as text."""
    out: list[Mutant] = []
    start = src.index('COMMON = """')  # COMMON: the functions every day's script shares
    end = src.index("SCRIPTS = {")
    lines = src.splitlines(keepends=True)
    offset = 0
    for no, line in enumerate(lines, 1):
        at = offset
        offset += len(line)
        if not start <= at < end or line.lstrip().startswith("--"):
            continue
        for old, new in _LUA_OPS:
            col = line.find(old)
            if col >= 0:
                out.append(
                    Mutant(
                        "redis_scripts", no, "lua", old, new, (no, col), (no, col + len(old)), "lua"
                    )
                )
    return out


def apply(src: str, m: Mutant) -> str:
    lines = src.splitlines(keepends=True)
    (l0, c0), (l1, c1) = m.start, m.end
    # columns are UTF-8 byte offsets in the AST
    head = lines[l0 - 1].encode()[:c0].decode()
    tail = lines[l1 - 1].encode()[c1:].decode()
    return "".join(lines[: l0 - 1]) + head + m.after + tail + "".join(lines[l1:])


def stale_named(modules: list[str]) -> list[str]:
    """What is wrong with the NAMED entries of `modules`: a module MODULES lacks, or a text its
    file holds not exactly once (the code moved or was rewritten: the entry must follow it)."""
    problems = []
    for module, old, _ in NAMED:
        if module not in MODULES:
            problems.append(f"named mutant for {module!r}: no such module in MODULES")
        elif module in modules:
            path = f"sidecar/{MODULES[module].path}"
            found = (ROOT / path).read_text().count(old)
            if found != 1:
                times = "not found" if found == 0 else f"found {found} times, not once"
                problems.append(f"named mutant for {module} ({path}): {times}: {old!r}")
    return problems


def copy_tree(dst: Path) -> None:
    for name in ("sidecar", "tests", "pyproject.toml", "docs", "deploy", "alerts", "dashboards"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif src.exists():
            shutil.copy2(src, dst / name)
    for extra in ROOT.glob("*.yaml"):
        shutil.copy2(extra, dst / extra.name)


def run_tests(work: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    cmd += [f"--deselect={d}" for d in DESELECT]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0
    took = time.monotonic() - t0
    if proc.returncode == 0:
        return "survived", took
    if os.environ.get("MUTATE_VERBOSE"):
        print(proc.stdout.decode(errors="replace")[-3000:], flush=True)
    if proc.returncode == 1:
        return "killed", took
    return "error", took  # collection failed, or the mutant broke the import: killed too


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--module", action="append", choices=sorted(MODULES))
    ap.add_argument("--per-module", type=int, default=40, help="sample at most this many (seeded)")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--named", action="store_true", help="run the survivors issue 21 named")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--rerun", type=Path, help="run again the survivors of an earlier --out")
    ap.add_argument("--tests", nargs="+", help="run these tests for every module instead")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run side by side")
    ap.add_argument("--timeout-factor", type=float, default=3.0)
    ap.add_argument(
        "--out", type=Path, default=Path(tempfile.gettempdir()) / "tollbooth-mutants.json"
    )
    args = ap.parse_args()
    modules = args.module or list(MODULES)
    if args.tests:
        for name, entry in MODULES.items():
            MODULES[name] = entry._replace(tests=args.tests)

    if args.named:
        problems = stale_named(modules)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            return 2

    plan: list[tuple[Mutant, str]] = []  # (mutant, the mutated module's source)
    for module in modules:
        src = (ROOT / "sidecar" / MODULES[module].path).read_text()
        if args.named:
            for mod, old, new in NAMED:
                if mod == module:
                    line = src[: src.index(old)].count("\n") + 1
                    m = Mutant(module, line, "named", old, new, (0, 0), (0, 0), "")
                    plan.append((m, src.replace(old, new)))
            continue
        found = mutants(module, MODULES[module].functions)
        if args.rerun:
            alive = {
                (d["line"], tuple(d["start"]), d["after"])
                for d in json.loads(args.rerun.read_text())
                if d["module"] == module and d["status"] == "survived"
            }
            found = [m for m in found if (m.line, m.start, m.after) in alive]
        elif len(found) > args.per_module:
            found = sorted(
                random.Random(f"{args.seed}:{module}").sample(found, args.per_module),
                key=lambda m: (m.line, m.start),
            )
        for m in found:
            mutated = apply(src, m)
            try:
                ast.parse(mutated)
            except SyntaxError:
                m.status = "error"
            plan.append((m, mutated))
    if args.list:
        for m, _ in plan:
            print(f"{m.module}:{m.line} {m.function} [{m.op}] {m.before!r} -> {m.after!r}")
        print(len(plan), "mutants")
        return 0

    with tempfile.TemporaryDirectory(prefix="tollbooth-mutants-") as tmp:
        works = [Path(tmp) / f"w{j}" for j in range(args.jobs)]
        for work in works:
            work.mkdir()
            copy_tree(work)
        base: dict[str, float] = {}
        for module in sorted({m.module for m, _ in plan}):
            status, took = run_tests(works[0], MODULES[module].tests, 900)
            if status != "survived":  # once more, to show why
                os.environ["MUTATE_VERBOSE"] = "1"
                status, took = run_tests(works[0], MODULES[module].tests, 900)
                os.environ.pop("MUTATE_VERBOSE")
            if status != "survived":
                print(f"{module}: the tests fail without any mutant ({status}): fix that first")
                return 2
            base[module] = took
            print(f"{module}: tests pass unmutated in {took:.1f} s", flush=True)
        free: queue.Queue[Path] = queue.Queue()
        for work in works:
            free.put(work)
        count = itertools.count(1)

        def one(item: tuple[Mutant, str]) -> None:
            m, mutated = item
            work = free.get()
            try:
                target = work / "sidecar" / MODULES[m.module].path
                original = target.read_text()
                if m.status == "pending":
                    target.write_text(mutated)
                    try:
                        limit = max(20.0, base[m.module] * args.timeout_factor)
                        m.status, m.seconds = run_tests(work, MODULES[m.module].tests, limit)
                    finally:
                        target.write_text(original)
            finally:
                free.put(work)
            print(
                f"[{next(count)}/{len(plan)}] {m.status:8} {m.module}:{m.line} [{m.op}] "
                f"{m.before!r} -> {m.after!r} ({m.seconds:.1f} s)",
                flush=True,
            )

        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, plan))
    args.out.write_text(json.dumps([asdict(m) for m, _ in plan], indent=1))
    return report([m for m, _ in plan])


def report(done: list[Mutant]) -> int:
    print("\nmodule           killed / total")
    total = killed = 0
    for module in sorted({m.module for m in done}):
        ms = [m for m in done if m.module == module]
        k = sum(m.status != "survived" for m in ms)
        total, killed = total + len(ms), killed + k
        print(f"{module:16} {k:4} / {len(ms):<4} {100 * k / len(ms):5.1f} %")
    print(f"{'all':16} {killed:4} / {total:<4} {100 * killed / max(total, 1):5.1f} %")
    survivors = [m for m in done if m.status == "survived"]
    for m in survivors:
        print(f"SURVIVED {m.module}:{m.line} {m.function} [{m.op}] {m.before!r} -> {m.after!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
