"""The harness end to end on a tiny request set, including out-of-memory then a smaller budget."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tollbooth_lab.bench import Arrival, BenchOptions, Distribution, generate, read, run, write
from tollbooth_lab.bench.output import markdown, write_all
from tollbooth_lab.simulator import EngineParams, create_simulator

from sidecar.config import PricingConfig
from tests.fakes import FakeNVML

FAST = EngineParams(step_base_s=0.0005, prefill_s_per_token=0.0, decode_s_per_seq=0.00002)


def test_request_sets_are_reproducible(tmp_path: Path) -> None:
    d = Distribution(n=10, seed=3)
    assert generate(d) == generate(d)
    assert generate(d) != generate(Distribution(n=10, seed=4))
    write(tmp_path / "r.jsonl", generate(d))
    assert read(tmp_path / "r.jsonl") == generate(d)


async def test_three_strategies_agree_and_report(tmp_path: Path) -> None:
    reqs = generate(Distribution(n=14, seed=1, prompt_words_median=30, max_tokens_max=24))
    opts = BenchOptions(
        strategies=["serial", "fixed-batch", "token-budget"],
        out_dir=tmp_path,
        arrival=Arrival("concurrency", 4),
        sim_params=FAST,
        max_batch=3,
    )
    result = await run(opts, reqs, {"test": True})
    paths = write_all(result, tmp_path)
    assert [p.name for p in paths] == ["result.json", "report.md", "latency.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(paths[0].read_text())
    assert doc["conditions"]["warmup_requests"] == 2
    assert doc["conditions"]["measured_requests"] == 12
    assert doc["conditions"]["upstream"].startswith("simulator")
    for name in ("serial", "fixed-batch", "token-budget"):
        s = doc["strategies"][name]
        assert s["requests"] == 12 and s["failures"] == 0
        assert s["outputs_consistent"] is True
        assert set(s["e2e_s"]) == {"p50", "p90", "p99"} and s["e2e_s"]["p50"] > 0
        assert s["queue_s"]["p50"] is not None and s["ttft_s"]["p50"] is not None
        assert s["cost_per_1k_tokens_usd"] is None  # no prices given: unknown, not 0
        assert s["cost_per_1k_tokens_device_usd"] is None and s["gpus"] is None  # no GPU here
        assert s["tokens_per_s"] > 0
    # serial waits longest in the queue
    assert (
        doc["strategies"]["serial"]["queue_s"]["p90"]
        > doc["strategies"]["token-budget"]["queue_s"]["p90"]
    )
    assert "| serial | 12 | 0 |" in paths[1].read_text()


async def test_outputs_agree_fails_when_batching_changes_the_text(tmp_path: Path) -> None:
    """The comparison can fail: with batch-dependent output, batched strategies diverge from
    serial (on the default simulator the column is true by construction)."""
    reqs = generate(Distribution(n=10, seed=5, prompt_words_median=20, max_tokens_max=16))
    opts = BenchOptions(
        strategies=["serial", "token-budget"],
        out_dir=tmp_path,
        arrival=Arrival("concurrency", 4),
        sim_params=replace(FAST, batch_dependent_output=True),
        warmup=0,
    )
    result = await run(opts, reqs, {})
    batched = result["strategies"]["token-budget"]
    assert batched["failures"] == 0 and batched["outputs_consistent"] is False
    assert result["strategies"]["serial"]["outputs_consistent"] is False
    assert {m["strategy"] for m in result["output_mismatches"]} == {"token-budget"}
    assert "outputs differ from the reference" in markdown(result)


async def test_device_cost_per_1k_tokens_against_a_server_with_nvml(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    """--upstream URL on a machine with NVML (the fake): device-seconds x gpu_hour_usd per 1k."""
    server = await aiohttp_server(create_simulator("vllm", FAST))
    reqs = generate(Distribution(n=8, seed=6, prompt_words_median=20, max_tokens_max=16))
    opts = BenchOptions(
        strategies=["token-budget"],
        out_dir=tmp_path,
        upstream=str(server.make_url("")).rstrip("/"),
        arrival=Arrival("concurrency", 3),
        warmup=0,
        pricing=PricingConfig(gpu_hour_usd=3.6),
        nvml=FakeNVML(gpus=2, no_energy_on=None),
    )
    result = await run(opts, reqs, {})
    s, done = result["strategies"]["token-budget"], result["requests"]["token-budget"]
    assert s["failures"] == 0 and s["gpus"] == 2
    device_s = sum(r["device_seconds"] for r in done)
    tokens = sum(r["input_tokens"] + r["output_tokens"] for r in done)
    assert device_s > 0 and tokens > 0
    expected = device_s / 3600 * 3.6 / tokens * 1000
    assert s["cost_per_1k_tokens_device_usd"] == pytest.approx(expected, abs=1e-8)
    assert s["cost_per_1k_tokens_usd"] is None  # no per-token prices: still unknown
    energy = sum(r["energy_j"] for r in done)  # read at the last poll, when the sidecar stopped
    assert s["energy_per_1k_tokens_j"] == pytest.approx(energy / tokens * 1000, abs=1e-6)
    assert 0 < energy <= 1000.0  # the fake: +500 J per GPU per read; idle time goes to no one
    # the summary's value, checked against `expected` above (a rounding of `expected` itself
    # differs in the sixth place when the two, 1e-8 apart, sit on either side of a boundary)
    assert f"{s['cost_per_1k_tokens_device_usd']:.6f}" in markdown(result)


async def test_out_of_memory_saves_decisions_and_retries_smaller(tmp_path: Path) -> None:
    reqs = generate(
        Distribution(
            n=12,
            seed=2,
            prompt_words_median=60,
            prompt_words_sigma=0.2,
            max_tokens_min=60,
            max_tokens_max=60,
        )
    )
    sim = EngineParams(
        kv_capacity_tokens=400,
        on_full="oom",
        step_base_s=0.0005,
        prefill_s_per_token=0.0,
        decode_s_per_seq=0.0,
    )
    opts = BenchOptions(
        strategies=["token-budget"],
        out_dir=tmp_path,
        warmup=0,
        arrival=Arrival("burst", 6),
        sim_params=sim,
        token_budget=4000,
        chars_per_token=8.0,
        lower_factor=0.25,
        max_attempts=3,
    )
    result = await run(opts, reqs, {})
    attempts = result["strategies"]["token-budget"]["attempts"]
    assert attempts[0]["oom_failures"] > 0 and attempts[0]["token_budget"] == 4000
    assert attempts[1]["token_budget"] == 1000
    assert attempts[-1]["oom_failures"] == 0
    report = json.loads((tmp_path / attempts[0]["oom_report"]).read_text())
    assert report["input_length_summary"]["requests"] == 12
    assert report["failed_requests"]
    assert {d["event"] for d in report["scheduling_decisions"]} >= {"admit"}
    assert all(d["in_use"] <= 4000 for d in report["scheduling_decisions"])


def test_cli_make_requests_then_bench(tmp_path: Path) -> None:
    reqs = tmp_path / "reqs.jsonl"
    cli = [sys.executable, "-m", "sidecar.core.cli"]
    subprocess.run(
        [
            *cli,
            "make-requests",
            "--out",
            str(reqs),
            "--n",
            "6",
            "--prompt-words",
            "20",
            "--max-tokens-max",
            "20",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    out = subprocess.run(
        [
            *cli,
            "bench",
            "--requests",
            str(reqs),
            "--strategies",
            "serial,token-budget",
            "--burst",
            "3",
            "--speed",
            "20",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "out" / "result.json").read_text())
    assert doc["conditions"]["request_file"] == str(reqs)
    assert doc["conditions"]["arrival"].startswith("bursts of 3")
    assert list(doc["strategies"]) == ["serial", "token-budget"]
