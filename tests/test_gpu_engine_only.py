"""Only the engine's GPUs are read and attributed (sidecar/telemetry/gpu.py, gpu.devices_file).

A node with eight GPUs (fake NVML, as in tests/test_gpu.py), of which the engine's container was
given one: its NVIDIA_VISIBLE_DEVICES, written to the file the sidecar reads. Guards: one GPU
read and attributed (a request's device-seconds are one GPU's time, not eight), and a file that
names no GPU turns telemetry off rather than falling back to every visible GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sidecar.config import GpuConfig
from sidecar.telemetry.gpu import GpuCollector
from sidecar.telemetry.metrics import Metrics
from tests.conftest import StartSidecar
from tests.fakes import MODEL, FakeNVML
from tests.test_reconcile import chat


def test_eight_visible_gpus_and_the_engine_uses_one(tmp_path: Path) -> None:
    listed = tmp_path / "engine-gpus"
    listed.write_text("GPU-0000-3\n")  # the device plugin's UUID for the engine's container
    m = Metrics()
    c = GpuCollector(GpuConfig(devices_file=str(listed), poll_interval_s=3600), m, FakeNVML(gpus=8))
    assert c.start()
    try:
        assert [d.uuid for d in c.devices] == ["GPU-0000-3"]
        gpus = {
            s.labels["gpu"]
            for fam in m.registry.collect()
            for s in fam.samples
            if s.name == "llm_gpu_power_watts"
        }
        assert gpus == {"3"}
    finally:
        c.stop()


@pytest.mark.parametrize("text", ["", "all", "GPU-not-here"])
def test_a_file_naming_no_gpu_of_the_engine_turns_telemetry_off(tmp_path: Path, text: str) -> None:
    listed = tmp_path / "engine-gpus"
    listed.write_text(text)
    m = Metrics()
    cfg = GpuConfig(devices_file=str(listed), devices_file_wait_s=0.05, poll_interval_s=3600)
    c = GpuCollector(cfg, m, FakeNVML(gpus=8))
    assert not c.start() and m.registry.get_sample_value("llm_gpu_telemetry_up") == 0


async def test_a_requests_device_seconds_are_one_gpus_time(
    start_sidecar: StartSidecar, aiohttp_server: Any, tmp_path: Path
) -> None:
    from tests.test_reconcile import FakeVllm

    listed = tmp_path / "engine-gpus"
    listed.write_text("GPU-0000-5")
    engine = await aiohttp_server(FakeVllm().app)
    run = await start_sidecar(
        {"gpu": {"devices_file": str(listed), "poll_interval_s": 0.05}},
        upstream_url=str(engine.make_url("")).rstrip("/"),
        wire_kwargs={"nvml": FakeNVML(gpus=8)},
    )
    assert run.sc.attribution is not None
    await chat(run.url, 3, 4)
    assert run.sc.attribution.n_gpus == 1
    seconds = run.value("llm_device_seconds_total", model=MODEL, user_id="anonymous")
    assert seconds is not None and seconds > 0


def test_the_kubernetes_pod_gives_the_sidecar_the_engines_gpus_only() -> None:
    import yaml

    root = Path(__file__).parents[1] / "deploy" / "kubernetes"
    pod = yaml.safe_load((root / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    config = yaml.safe_load(yaml.safe_load((root / "configmap.yaml").read_text())["data"][
        "tollbooth.yaml"
    ])  # fmt: skip
    path = config["gpu"]["devices_file"]
    folder = str(Path(path).parent)
    [sidecar] = pod["initContainers"]
    [engine] = pod["containers"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert f'echo "$NVIDIA_VISIBLE_DEVICES" > {path}' in " ".join(engine["command"])
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert mounts[folder]["readOnly"] is True
    assert folder in {m["mountPath"] for m in engine["volumeMounts"]}
