"""Reconciliation: the engine's own token counters, read from its Prometheus endpoint.

Every engine counts the tokens it reads and generates. Read every `reconcile.interval_s` from
`upstream.metrics_path` through the one upstream client, they are exported as
`llm_engine_tokens_total{model, token_type}` beside the sidecar's `llm_tokens_total`: traffic that
reaches the engine around the sidecar is then the difference (alert LLMMeterBypassed). The
sidecar's own calls (this scrape, the readiness probe, `/tokenize`) generate no tokens, so they make
no gap; what else can is in docs/metrics.md.
Owns: the scrape task, the table of engines' counter names, parsing (off the event loop), and
`llm_engine_metrics_up` (1: the last scrape read at least one known counter).
Never: estimates a count (a counter not read is absent, the whole family when the last scrape
failed), logs every failed scrape (only a change of state), or blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..text import MODEL_CHARS, clean

log = logging.getLogger("tollbooth.reconcile")

# Sample name -> token_type, by engine (each engine's source, docs/metrics.md cites them):
# vLLM vllm/v1/metrics/loggers.py; SGLang python/sglang/srt/metrics/collector.py (with
# --enable-metrics); TGI docs/source/reference/metrics.md (histograms: their _sum); llama.cpp
# tools/server (with --metrics; prompt tokens exclude the cached prefix); TensorRT-LLM
# trtllm-serve (at /prometheus/metrics: set upstream.metrics_path).
COUNTERS: dict[str, str] = {
    "vllm:prompt_tokens_total": "input",
    "vllm:generation_tokens_total": "output",
    "sglang:prompt_tokens_total": "input",
    "sglang:generation_tokens_total": "output",
    "tgi_request_input_length_sum": "input",
    "tgi_request_generated_tokens_sum": "output",
    "llamacpp:prompt_tokens_total": "input",
    "llamacpp:tokens_predicted_total": "output",
    "trtllm_prompt_tokens_total": "input",
    "trtllm_generation_tokens_total": "output",
}
# The label that names the model, in the engines that have one (vLLM, SGLang: model_name).
MODEL_LABELS = ("model_name", "model")
# A /metrics page larger than this is not parsed (vLLM's is some 100 KB with its histograms).
MAX_PAGE_BYTES = 8 << 20
# Engines' label values are bounded like the sidecar's own model labels.
MAX_MODELS = 64

Counts = dict[tuple[str, str], float]  # (model, token_type) -> tokens


class Source(Protocol):
    """What the scrape needs of the upstream client (sidecar/proxy/upstream.py's `Upstream`)."""

    async def fetch(self, method: str, path: str, *, timeout: float) -> tuple[int, bytes]: ...


def parse(page: str, default_model: str) -> Counts:
    """The engine's token counts in a Prometheus text page, summed over other labels (vLLM's
    `engine` under data parallelism) by model. A series without a model label is
    `default_model`'s. Lines of other metrics are dropped before parsing (cheaper, and an odd
    line elsewhere in the page cannot spoil these)."""
    keep = "\n".join(_relevant(page.splitlines())) + "\n"
    counts: Counts = {}
    for family in text_string_to_metric_families(keep):
        for sample in family.samples:
            kind = COUNTERS.get(sample.name)
            value = sample.value
            if kind is None or not (value >= 0 and value != float("inf")):  # also NaN
                continue
            raw = next((sample.labels[k] for k in MODEL_LABELS if k in sample.labels), None)
            model = clean(raw, MODEL_CHARS) if raw else default_model
            key = (model, kind)
            if key not in counts and len(counts) >= 2 * MAX_MODELS:
                continue
            counts[key] = counts.get(key, 0.0) + value
    return counts


def _relevant(lines: list[str]) -> Iterator[str]:
    families = {name.rsplit("_", 1)[0] for name in COUNTERS}  # TYPE lines name the family
    for line in lines:
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "TYPE" and parts[2] in families:
                yield line
        elif line.split("{", 1)[0].split(" ", 1)[0] in COUNTERS:
            yield line


class Reconciler(Collector):
    """Scrapes the engine and, as a collector on the sidecar's registry, exports what it read."""

    def __init__(
        self,
        source: Callable[[], Source | None],
        *,
        path: str,
        interval_s: float,
        timeout_s: float,
        default_model: str,
        label: Callable[[str], str] = lambda m: m,
    ) -> None:
        self.source, self.path = source, path
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.default_model, self.label = default_model, label
        self.counts: Counts | None = None  # None: the last scrape read nothing
        self.why = "not read yet"

    async def once(self) -> None:
        counts, why = await self._read()
        if (counts is None) != (self.counts is None) or why != self.why:
            level = logging.INFO if counts is not None else logging.DEBUG
            log.log(level, "engine metrics at %s: %s", self.path, why)
        self.counts, self.why = counts, why

    async def _read(self) -> tuple[Counts | None, str]:
        source = self.source()
        if source is None:
            return None, "no upstream client"
        try:
            status, body = await source.fetch("GET", self.path, timeout=self.timeout_s)
        except Exception as exc:  # refused, timed out, closed: absent, and quiet
            return None, f"unreachable: {type(exc).__name__}"
        if status != 200:
            return None, f"answered {status}"
        if len(body) > MAX_PAGE_BYTES:
            return None, f"page of {len(body)} bytes is over {MAX_PAGE_BYTES}"
        try:
            counts = await asyncio.to_thread(self._parse, body)
        except Exception as exc:  # not the text format: absent, never a failed scrape loop
            return None, f"unparsable: {type(exc).__name__}"
        if not counts:
            return None, "no known token counter on the page"
        return counts, f"read {len(counts)} series"

    def _parse(self, body: bytes) -> Counts:
        return parse(body.decode("utf-8", "replace"), self.default_model)

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s)

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        up = GaugeMetricFamily(
            "llm_engine_metrics_up",
            "1 when the last read of the engine's own token counters succeeded, else 0.",
        )
        up.add_metric([], 0.0 if counts is None else 1.0)
        yield up
        if counts is None:
            return
        tokens = CounterMetricFamily(
            "llm_engine_tokens",
            "Tokens the engine counted itself (its /metrics), by model and token_type "
            "(input, output); compare with llm_tokens_total.",
            labels=["model", "token_type"],
        )
        merged: Counts = {}
        for (model, kind), value in counts.items():
            key = (self.label(model), kind)
            merged[key] = merged.get(key, 0.0) + value
        for (model, kind), value in sorted(merged.items()):
            tokens.add_metric([model, kind], value)
        yield tokens
