"""GPU telemetry through a fake NVML module (NVML's units and error classes), the real loading path
where there is no GPU driver, and the device-time/energy attribution with a fake clock. The suite
passes on a machine with a GPU too: no test sidecar reaches the real NVML."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from sidecar.config import AdmissionConfig, GpuConfig, PricingConfig
from sidecar.exchange import Endpoint, Exchange, RequestInfo
from sidecar.metering.pricing import PriceBook
from sidecar.telemetry import gpu
from sidecar.telemetry.gpu import Attribution, GpuCollector
from sidecar.telemetry.metrics import Metrics
from tests.conftest import StartSidecar
from tests.fakes import MODEL, FakeNVML, NoLibrary


def value(m: Metrics, metric: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(metric, labels)


def test_units_and_unsupported_fields() -> None:
    m = Metrics()
    c = GpuCollector(GpuConfig(poll_interval_s=3600), m, FakeNVML())
    assert c.start()
    c.poll()
    gpu0 = {"gpu": "0", "uuid": "GPU-0000-0", "name": "NVIDIA H200"}
    gpu1 = {**gpu0, "gpu": "1", "uuid": "GPU-0000-1"}
    assert value(m, "llm_gpu_telemetry_up") == 1
    assert value(m, "llm_gpu_power_watts", **gpu0) == 612.5
    assert value(m, "llm_gpu_utilization_ratio", **gpu0) == 0.87
    assert value(m, "llm_gpu_memory_used_bytes", **gpu0) == 120e9
    assert value(m, "llm_gpu_temperature_celsius", **gpu0) == 61
    assert value(m, "llm_gpu_energy_joules_total", **gpu0) == 500.0  # mJ converted, delta only
    assert value(m, "llm_gpu_energy_joules_total", **gpu1) is None  # not supported: absent
    assert value(m, "llm_gpu_power_watts", **gpu1) == 612.5
    c.stop()


def test_device_selection_by_uuid() -> None:
    m = Metrics()
    c = GpuCollector(GpuConfig(devices=("GPU-0000-1",), poll_interval_s=3600), m, FakeNVML())
    assert c.start()
    assert [d.index for d in c.devices] == [1]
    c.stop()


def test_no_library_turns_telemetry_off() -> None:
    m = Metrics()
    assert not GpuCollector(GpuConfig(), m, NoLibrary()).start()
    assert value(m, "llm_gpu_telemetry_up") == 0
    assert not [
        s
        for fam in m.registry.collect()
        if fam.name.startswith("llm_gpu_") and fam.name != "llm_gpu_telemetry_up"
        for s in fam.samples
    ]


def test_real_nvml_path_on_this_machine() -> None:
    """The real nvidia-ml-py loader; on a machine without a GPU driver telemetry must go off."""
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; the off-path is not reachable here")
    except pynvml.NVMLError:
        pass
    m = Metrics()
    assert not GpuCollector(GpuConfig(), m).start()
    assert value(m, "llm_gpu_telemetry_up") == 0


def exchange(
    prompt_chars: int,
    max_tokens: int | None,
    model: str = "m",
    user: str = "u",
    n: int | None = None,
) -> Exchange:
    info = RequestInfo(
        endpoint=Endpoint.CHAT,
        body=b"",
        parsed=True,
        prompt_chars=prompt_chars,
        max_tokens=max_tokens,
        n=n,
    )
    return Exchange(
        request_id="r", endpoint=Endpoint.CHAT, info=info, user=user, user_id=user, model=model
    )


def test_attribution_splits_by_tokens_and_sums_to_gpu_time() -> None:
    now = [100.0]
    m = Metrics()
    prices = PriceBook(PricingConfig(gpu_hour_usd=3.6))
    a = Attribution(m, prices, clock=lambda: now[0])
    a.enable(n_gpus=2)
    big = exchange(prompt_chars=1200, max_tokens=300, user="big")  # weight 1200 / 4 + 300 = 600
    small = exchange(prompt_chars=0, max_tokens=200, user="small")  # weight 0 + 200 = 200
    a.begin(big)
    now[0] += 1.0  # 1 s alone: 2 GPU-s to big
    a.begin(small)
    now[0] += 3.0  # 3 s together: 6 GPU-s split 600:200 = 3:1
    a.poll_energy(800.0)  # 800 J over the 4 s since enable
    assert small.energy_j is None  # not ended yet
    a.end(small)
    assert small.energy_j == pytest.approx(150.0)  # its segments were all read already
    now[0] += 1.0
    a.end(big)
    assert big.device_seconds == pytest.approx(2 + 4.5 + 2)
    assert small.device_seconds == pytest.approx(1.5)
    total = value(m, "llm_device_seconds_total", model="m", user_id="big") + value(
        m, "llm_device_seconds_total", model="m", user_id="small"
    )
    assert total == pytest.approx(2 * 5.0)  # the GPU-seconds elapsed while anything ran
    assert value(m, "llm_device_cost_usd_total", model="m", user_id="small") == pytest.approx(
        1.5 / 3600 * 3.6
    )
    # energy: 200 J/s; first second all big (200 J), then 600 J split 3:1
    assert value(m, "llm_energy_joules_total", model="m") == pytest.approx(800.0)
    assert big.energy_j is None  # its last second is not read yet
    a.poll_energy(100.0)  # the last second, big alone
    assert value(m, "llm_energy_joules_total", model="m") == pytest.approx(900.0)
    assert big.energy_j == pytest.approx(200 + 450 + 100)


def test_energy_of_a_request_is_unknown_when_a_poll_could_not_read_it() -> None:
    now = [0.0]
    a = Attribution(Metrics(), PriceBook(PricingConfig()), clock=lambda: now[0])
    a.enable(n_gpus=1)
    blind, later = exchange(0, 10), exchange(0, 10)
    a.begin(blind)
    now[0] += 1.0
    a.poll_energy(None)  # a GPU without energy counters
    a.begin(later)
    now[0] += 1.0
    a.poll_energy(40.0)
    a.end(blind)
    a.end(later)
    now[0] += 1.0
    a.poll_energy(10.0)
    assert blind.energy_j is None and blind.device_seconds == pytest.approx(1.5)
    assert later.energy_j == pytest.approx(20.0)


def test_the_split_uses_the_configured_estimate_and_n() -> None:
    cfg = AdmissionConfig(chars_per_token=2.0, default_max_tokens=100)
    a = Attribution(Metrics(), PriceBook(PricingConfig()), cfg)
    assert a.weight(exchange(prompt_chars=200, max_tokens=None)) == 100 + 100
    assert a.weight(exchange(prompt_chars=200, max_tokens=None, n=3)) == 100 + 3 * 100
    assert a.weight(exchange(prompt_chars=200, max_tokens=50, n=2)) == 100 + 2 * 50


async def test_sidecar_with_fake_gpu_exports_attribution(
    aiohttp_server: Any, upstream: Any
) -> None:
    from sidecar.config import Config, build
    from sidecar.core.app import Sidecar, create_admin_app, create_app
    from sidecar.core.wiring import wire

    _, up = upstream
    cfg = build(
        Config,
        {
            "upstream": {"url": str(up.make_url("")).rstrip("/")},
            "gpu": {"poll_interval_s": 0.05},
            "pricing": {"gpu_hour_usd": 2.0},
        },
    )
    sc = wire(Sidecar(cfg), nvml=FakeNVML())
    server = await aiohttp_server(create_app(sc))
    await aiohttp_server(create_admin_app(sc))
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            str(server.make_url("/v1/chat/completions")),
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Tollbooth-User": "gpu-user", "X-Fake": "sleep:0.2"},
        ) as r,
    ):
        await r.read()
    seconds = sc.metrics.registry.get_sample_value(
        "llm_device_seconds_total", {"model": MODEL, "user_id": "gpu-user"}
    )
    assert seconds is not None and 0.2 * 2 <= seconds < 2 * 2  # two GPUs, ~0.2 s in flight
    assert sc.metrics.registry.get_sample_value(
        "llm_device_cost_usd_total", {"model": MODEL, "user_id": "gpu-user"}
    ) == pytest.approx(seconds / 3600 * 2.0)


async def test_time_in_the_admission_queue_takes_no_gpu_share(
    start_sidecar: StartSidecar,
) -> None:
    """Serial admission, two requests at once: the second waits ~0.3 s in the queue. Each gets the
    GPU time of its own upstream phase, none of the other's while it waited."""
    run = await start_sidecar(
        {"admission": {"strategy": "serial"}, "gpu": {"poll_interval_s": 0.05}},
        wire_kwargs={"nvml": FakeNVML(gpus=2)},
    )
    done: list[Exchange] = []
    run.sc.meter.add_sink("test", done.append)

    async def one(s: aiohttp.ClientSession, user: str) -> None:
        async with s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Tollbooth-User": user, "X-Fake": "sleep:0.3"},
        ) as r:
            await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(one(s, "first"), one(s, "second"))
    assert len(done) == 2 and max(ex.queue_s or 0 for ex in done) > 0.2
    for ex in done:
        assert ex.duration_s is not None and ex.queue_s is not None
        upstream_phase = ex.duration_s - ex.queue_s
        assert ex.device_seconds == pytest.approx(2 * upstream_phase, abs=0.05)


async def test_gpu_series_absent_when_telemetry_is_off(
    start_sidecar: StartSidecar, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a machine with a GPU (the real loader would find NVML): a test sidecar sees none."""
    monkeypatch.setattr(gpu, "load_nvml", FakeNVML)
    run = await start_sidecar()  # NVML absent by default: the machine's GPU never leaks in
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            run.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        ) as r,
    ):
        await r.read()
    assert run.value("llm_gpu_telemetry_up") == 0
    names = {fam.name for fam in run.sc.metrics.registry.collect() if fam.samples}
    assert "llm_device_seconds" not in names and "llm_energy_joules" not in names
    assert not any(n.startswith("llm_gpu_") and n != "llm_gpu_telemetry_up" for n in names)
