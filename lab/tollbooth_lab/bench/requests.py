"""Fixed request sets for the harness: generated from seeded distributions, stored as JSONL.

Each line: {"id", "prompt", "max_tokens", "arrival_s", "seed"}. The same file replays the same
load against every strategy.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

WORDS = [
    "inference",
    "budget",
    "token",
    "queue",
    "kernel",
    "tensor",
    "batch",
    "cache",
    "memory",
    "latency",
    "stream",
    "prompt",
    "model",
    "weight",
    "layer",
    "attention",
    "decode",
    "prefill",
    "throughput",
    "schedule",
    "request",
    "server",
    "gpu",
]


@dataclass(frozen=True)
class BenchRequest:
    id: str
    prompt: str
    max_tokens: int
    arrival_s: float
    seed: int


@dataclass(frozen=True)
class Distribution:
    """Prompt words ~ lognormal(mean, sigma), clipped; max_tokens ~ uniform; arrivals Poisson."""

    n: int = 64
    seed: int = 0
    prompt_words_median: int = 120
    prompt_words_sigma: float = 0.9
    prompt_words_max: int = 3000
    max_tokens_min: int = 16
    max_tokens_max: int = 192
    rate_per_s: float = 8.0


def generate(d: Distribution) -> list[BenchRequest]:
    rng = random.Random(d.seed)
    t = 0.0
    out = []
    for i in range(d.n):
        words = int(
            min(
                d.prompt_words_max,
                max(1, rng.lognormvariate(math.log(d.prompt_words_median), d.prompt_words_sigma)),
            )
        )
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(
            BenchRequest(
                id=f"r{i:05d}",
                prompt=prompt,
                max_tokens=rng.randint(d.max_tokens_min, d.max_tokens_max),
                arrival_s=round(t, 6),
                seed=rng.randrange(2**31),
            )
        )
        t += rng.expovariate(d.rate_per_s)
    return out


def write(path: str | Path, reqs: list[BenchRequest]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(asdict(r)) + "\n")


def read(path: str | Path) -> list[BenchRequest]:
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(
                BenchRequest(
                    id=str(obj.get("id", f"r{n:05d}")),
                    prompt=str(obj["prompt"]),
                    max_tokens=int(obj["max_tokens"]),
                    arrival_s=float(obj.get("arrival_s", 0.0)),
                    seed=int(obj.get("seed", 0)),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a request line ({exc})") from None
    return out
