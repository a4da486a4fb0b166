"""GPU telemetry through a fake NVML module (NVML's units and error classes), the real loading path
where there is no GPU driver, and the device-time/energy attribution with a fake clock. The suite
passes on a machine with a GPU too: no test sidecar reaches the real NVML."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from sidecar import gpu
from sidecar.config import GpuConfig, PricingConfig
from sidecar.gpu import Attribution, GpuCollector
from sidecar.meter import Exchange
from sidecar.metrics import Metrics
from sidecar.pricing import PriceBook
from sidecar.usage import Endpoint, RequestInfo
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


def exchange(prompt_chars: int, max_tokens: int, model: str = "m", user: str = "u") -> Exchange:
    info = RequestInfo(
        endpoint=Endpoint.CHAT,
        body=b"",
        parsed=True,
        prompt_chars=prompt_chars,
        max_tokens=max_tokens,
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
    big = exchange(prompt_chars=1200, max_tokens=500, user="big")  # weight 300 + 500 + 1 = 801
    small = exchange(prompt_chars=0, max_tokens=266, user="small")  # weight 0 + 266 + 1 = 267
    a.begin(big)
    now[0] += 1.0  # 1 s alone: 2 GPU-s to big
    a.begin(small)
    now[0] += 3.0  # 3 s together: 6 GPU-s split 801:267 = 3:1
    a.poll_energy(800.0)  # 800 J over the 4 s since enable
    a.end(small)
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
    a.poll_energy(100.0)  # the last second, big alone
    assert value(m, "llm_energy_joules_total", model="m") == pytest.approx(900.0)


async def test_sidecar_with_fake_gpu_exports_attribution(
    aiohttp_server: Any, upstream: Any
) -> None:
    from sidecar.app import Sidecar, create_admin_app, create_app
    from sidecar.config import Config, build
    from sidecar.wiring import wire

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
