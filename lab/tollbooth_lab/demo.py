"""`tollbooth demo`: the simulator, the sidecar in front of it, and a short mixed load.

Owns: starting both in one process, driving several users' traffic (chat and completions,
streaming and not), a live progress line, and the closing summary (spend by user and model,
latency phases, queue state, where to scrape). The prices are demo prices, and the upstream is a
simulator: nothing here is a measurement of a GPU.
"""

from __future__ import annotations

import asyncio
import io
import random
import signal
import sys
import tempfile
import time
import wave
from collections import defaultdict
from pathlib import Path

import aiohttp
from aiohttp import web

from sidecar.billing.report import percentile
from sidecar.config import (
    AdmissionConfig,
    AuditConfig,
    Config,
    GpuConfig,
    LedgerConfig,
    LoggingConfig,
    ModelPrice,
    PricingConfig,
    ServerConfig,
    UpstreamConfig,
    parse_hostport,
)
from sidecar.core.app import Sidecar, create_admin_app, create_app
from sidecar.core.wiring import wire
from sidecar.exchange import Exchange

from .simulator import EngineParams, create_simulator

MODEL = "sim-llama-3-8b"
AUDIO_MODEL = "sim-whisper"  # the simulator answers /v1/audio/* for any model name
DEMO_PRICES = PricingConfig(
    models={
        MODEL: ModelPrice(input_per_1m=0.20, output_per_1m=0.60, cached_input_per_1m=0.05),
        AUDIO_MODEL: ModelPrice(input_per_1m=0.20, output_per_1m=0.60, audio_per_second=0.0001),
    }
)
USERS = {"alice": 3, "bob": 2, "carol": 1, "batch-job": 2}  # relative request rates
TOPICS = [
    "cost",
    "tokens",
    "latency",
    "queue",
    "budget",
    "cache",
    "gpu",
    "batching",
    "streaming",
    "throughput",
]


async def _site(app: web.Application, listen: str, key: str) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    host, port = parse_hostport(key, listen)
    await web.TCPSite(runner, host, port).start()
    return runner


async def run_demo(
    duration: float, keep_running: bool, listen: str, admin: str, upstream_listen: str
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="tollbooth-demo-"))
    ledger = workdir / "ledger.db"
    sim = await _site(
        create_simulator("vllm", EngineParams(kv_capacity_tokens=32768), MODEL),
        upstream_listen,
        "--upstream-listen",
    )
    cfg = Config(
        upstream=UpstreamConfig(url=f"http://{upstream_listen}"),
        server=ServerConfig(listen=listen, admin_listen=admin),
        pricing=DEMO_PRICES,
        ledger=LedgerConfig(path=str(ledger)),
        admission=AdmissionConfig(strategy="token-budget", token_budget=6000),
        logging=LoggingConfig(level="WARNING", access_log="off"),
        audit=AuditConfig(path=str(workdir / "audit.jsonl")),  # never into the working directory
        gpu=GpuConfig(enabled=False),  # the simulator runs on no GPU: nothing to attribute
    )
    sc = wire(Sidecar(cfg))
    done: list[Exchange] = []
    sc.meter.add_sink("demo", done.append)
    proxy = await _site(create_app(sc), listen, "--listen")
    admin_runner = await _site(create_admin_app(sc), admin, "--admin-listen")
    print(
        f"simulated vLLM (not a GPU) on http://{upstream_listen}\n"
        f"tollbooth on http://{listen} -> metrics on http://{admin}/metrics\n"
        f"driving {duration:.0f}s of traffic from {', '.join(USERS)} ...",
        flush=True,
    )
    try:
        await _load(f"http://{listen}", duration, done, sc)
        print("\n" + summary(done, sc, workdir, listen, admin), flush=True)
        if keep_running:
            print("running until Ctrl-C (point your own client at the URL above)", flush=True)
            await _until_signal()
    finally:
        for r in (proxy, admin_runner, sim):
            await r.cleanup()


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _load(url: str, duration: float, done: list[Exchange], sc: Sidecar) -> None:
    rng = random.Random(7)
    users = [u for u, w in USERS.items() for _ in range(w)]
    stop_at = time.monotonic() + duration
    async with aiohttp.ClientSession() as s:

        async def worker(i: int) -> None:
            while time.monotonic() < stop_at:
                if i == 1 and rng.random() < 0.3:  # a speech-to-text client
                    await _audio(s, url, rng.choice(users), rng)
                else:
                    await _one(s, url, rng.choice(users), rng, messages=i == 0)
                await asyncio.sleep(rng.expovariate(4.0))

        async def progress() -> None:
            start = time.monotonic()
            while time.monotonic() < stop_at:
                await asyncio.sleep(0.5)
                spent = sum(e.cost.total_usd for e in done if e.cost)
                toks = sum((e.usage.input_tokens or 0) + (e.usage.output_tokens or 0) for e in done)
                q = sc.admission.snapshot() if sc.admission else {}
                sys.stderr.write(
                    f"\r[{time.monotonic() - start:5.1f}s] {len(done)} requests, "
                    f"{toks:,} tokens, ${spent:.6f}, queue {q.get('queue_depth', 0)}"
                    f", budget {q.get('in_use', 0)}/{q.get('limit', 0)}   "
                )
                sys.stderr.flush()

        await asyncio.gather(progress(), *(worker(i) for i in range(6)))


async def _one(
    s: aiohttp.ClientSession, url: str, user: str, rng: random.Random, *, messages: bool
) -> None:
    """One request; `messages`: as an Anthropic Messages client (Claude Code, the SDKs) sends."""
    words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(20, 600)))
    stream = rng.random() < 0.6
    kind = rng.random()
    body: dict[str, object] = {"model": MODEL, "max_tokens": rng.randint(16, 256), "stream": stream}
    if messages:
        path = "/v1/messages"
        body["system"] = "You summarise."
        body["messages"] = [{"role": "user", "content": f"Summarise: {words}"}]
    elif kind < 0.7:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Summarise: {words}"}]
    else:
        path = "/v1/completions"
        body["prompt"] = words
    if path == "/v1/chat/completions" and rng.random() < 0.2:  # an Ollama client (NDJSON)
        limit = body.pop("max_tokens")
        body["options"], path = {"num_predict": limit}, "/api/chat"
    try:
        async with s.post(url + path, json=body, headers={"X-Tollbooth-User": user}) as r:
            await r.read()
    except aiohttp.ClientError:
        pass


async def _audio(s: aiohttp.ClientSession, url: str, user: str, rng: random.Random) -> None:
    """One transcription or translation of a few seconds of silence, as the openai SDK sends it
    (multipart: the fields, then the file)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:  # mono, 16 bits, 8 kHz
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\0\0" * int(rng.uniform(1.0, 20.0) * 8000))
    wav = out.getvalue()
    form = aiohttp.FormData()
    form.add_field("model", AUDIO_MODEL)
    form.add_field("response_format", rng.choice(["json", "verbose_json"]))
    form.add_field("file", wav, filename="speech.wav", content_type="audio/wav")
    path = "/v1/audio/" + rng.choice(["transcriptions", "transcriptions", "translations"])
    try:
        async with s.post(url + path, data=form, headers={"X-Tollbooth-User": user}) as r:
            await r.read()
    except aiohttp.ClientError:
        pass


def summary(done: list[Exchange], sc: Sidecar, workdir: Path, listen: str, admin: str) -> str:
    by_user: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    by_model: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    by_route: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    unknown = 0
    for e in done:
        for key, table in ((e.user_id, by_user), (e.model, by_model), (e.endpoint.label, by_route)):
            row = table[key]
            row[0] += 1
            row[1] += (e.usage.input_tokens or 0) + (e.usage.output_tokens or 0)
            row[2] += e.cost.total_usd if e.cost else 0.0
        unknown += e.cost is None
    lines = [
        "spend (demo prices, simulated upstream):",
        f"  {'user':<12} {'requests':>8} {'tokens':>10} {'USD':>12}",
    ]
    lines += [
        f"  {k:<12} {int(v[0]):>8} {int(v[1]):>10,} {v[2]:>12.6f}"
        for k, v in sorted(by_user.items(), key=lambda kv: -kv[1][2])
    ]
    lines += [f"  {'model':<12} {'requests':>8} {'tokens':>10} {'USD':>12}"]
    lines += [
        f"  {k:<12} {int(v[0]):>8} {int(v[1]):>10,} {v[2]:>12.6f}" for k, v in by_model.items()
    ]
    lines += [f"  {'route':<26} {'requests':>8} {'tokens':>10} {'USD':>12}"]
    lines += [
        f"  {k:<26} {int(v[0]):>8} {int(v[1]):>10,} {v[2]:>12.6f}"
        for k, v in sorted(by_route.items())
    ]
    audio = [e.usage.audio_seconds for e in done if e.usage.audio_seconds is not None]
    if audio:
        lines.append(f"  audio seconds metered: {sum(audio):,.1f} in {len(audio)} requests")
    if unknown:
        lines.append(f"  {unknown} requests with unknown cost (not counted as $0)")
    lines.append("latency (ms)        p50      p90      p99")
    for name, vals in (
        ("queue wait", [e.queue_s for e in done]),
        ("time to 1st token", [e.ttft_s for e in done]),
        ("total", [e.duration_s for e in done]),
    ):
        known = [v for v in vals if v is not None]
        cells = [percentile(known, p) for p in (50, 90, 99)]
        lines.append(
            f"  {name:<17}"
            + "".join(f"{'n/a':>9}" if c is None else f"{c * 1000:9.1f}" for c in cells)
        )
    if sc.admission:
        q = sc.admission.snapshot()
        lines.append(
            f"queue: {q['strategy']}, budget {q['in_use']}/{q['limit']} tokens "
            f"(estimates), {q['queue_depth']} waiting"
        )
    lines += [
        f"metrics: http://{admin}/metrics   proxy: http://{listen}",
        f"ledger:  {workdir / 'ledger.db'}  (tollbooth report --ledger "
        f"{workdir / 'ledger.db'} --by user)",
    ]
    return "\n".join(lines)


def main(duration: float, keep_running: bool, listen: str, admin: str, upstream: str) -> None:
    asyncio.run(run_demo(duration, keep_running, listen, admin, upstream))
