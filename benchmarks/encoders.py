"""Which JSON encoder writes the access-log lines and audit records: measured, not assumed.

Run: `.venv/bin/python benchmarks/encoders.py`

Encodes the dicts tollbooth writes (an access-log line of a streamed request, an audit record
with redacted headers) with the standard library and with orjson, alternating the candidates
over several rounds, and reports the median CPU time per line (thread time: other processes on
the machine do not count). Results go to benchmarks/results/encoders.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from sidecar.billing.audit import Audit
from sidecar.config import AuditConfig, PricingConfig
from sidecar.exchange import Cost, Endpoint, Exchange, RequestInfo, Usage
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry.accesslog import LOGGER, fields
from sidecar.telemetry.logs import iso_time
from sidecar.telemetry.metrics import Metrics
from sidecar.telemetry.thresholds import DEFAULT

RESULTS = Path(__file__).parent / "results"
LINES = 2000  # per round and candidate
ROUNDS = 15


def exchange(i: int) -> Exchange:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    info = RequestInfo(endpoint=Endpoint.CHAT, body=body, parsed=True, stream=True, model="m")
    headers = CIMultiDictProxy(
        CIMultiDict(
            {"Authorization": "Bearer sk-x", "Content-Type": "application/json", "Host": "h"}
        )
    )
    ex = Exchange(f"req{i:012x}", Endpoint.CHAT, info, "user-1", "user-1", "m", status=200)
    ex.request_headers, ex.upstream = headers, "http://127.0.0.1:8000"
    ex.usage = Usage(input_tokens=1200 + i, output_tokens=256, model="m", finish_reasons=("stop",))
    ex.cost = Cost(0.00024 + i * 1e-9, 0.0001536)
    ex.upstream_start, ex.first_token_at, ex.duration_s = 0.001, 0.0123 + i * 1e-7, 1.234567
    ex.bytes_in, ex.bytes_out = 95, 40_321
    return ex


def access_line(ex: Exchange) -> dict[str, Any]:
    head = {"time": iso_time(time.time()), "level": "info", "logger": LOGGER}
    return {**head, "message": "request", **fields(ex)}


def candidates() -> dict[str, Callable[[dict[str, Any]], str]]:
    encoder = json.JSONEncoder(separators=(",", ":"), default=str)
    return {
        "json.dumps": lambda d: json.dumps(d, default=str, separators=(",", ":")),
        "json.JSONEncoder (reused)": encoder.encode,
        "orjson.dumps + decode": lambda d: orjson.dumps(d, default=str).decode(),
    }


def measure(docs: list[dict[str, Any]]) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in candidates()}
    for _ in range(ROUNDS):
        for name, encode in candidates().items():
            t = time.thread_time()
            for d in docs:
                encode(d)
            runs[name].append((time.thread_time() - t) / len(docs) * 1e6)
    return {name: statistics.median(r) for name, r in runs.items()}


def main() -> None:
    exchanges = [exchange(i) for i in range(LINES)]
    audit = Audit(AuditConfig(), DEFAULT, PriceBook(PricingConfig()), Metrics())
    docs = {
        "access-log line": [access_line(ex) for ex in exchanges],
        "audit record": [audit.record(ex, ["input_cost"], 0.5) for ex in exchanges],
    }
    results = {kind: measure(d) for kind, d in docs.items()}
    for name in candidates():  # the outputs are the same JSON
        for d in docs.values():
            assert json.loads(candidates()[name](d[0])) == json.loads(json.dumps(d[0], default=str))
    doc = {
        "conditions": {
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
            "orjson": orjson.__version__,
            "lines_per_round": LINES,
            "rounds": ROUNDS,
            "measure": "median over rounds of thread CPU time per line, microseconds",
        },
        "us_per_line": results,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "encoders.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'encoder':<28}" + "".join(f"{k:>18}" for k in results))
    for name in candidates():
        print(f"{name:<28}" + "".join(f"{results[k][name]:15.2f} us" for k in results))


if __name__ == "__main__":
    main()
