"""The compose stack and collector config, checked for structure (no Docker engine runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sidecar.thresholds import DEFAULT

ROOT = Path(__file__).parents[1]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_profiles() -> None:
    services = compose()["services"]
    assert {
        "simulator",
        "tollbooth-sim",
        "vllm",
        "tollbooth-gpu",
        "prometheus",
        "alertmanager",
        "grafana",
        "otel-collector",
        "jaeger",
    } <= set(services)
    assert services["simulator"]["profiles"] == ["sim"] == services["tollbooth-sim"]["profiles"]
    assert services["vllm"]["profiles"] == ["gpu"] == services["tollbooth-gpu"]["profiles"]
    assert "COMPOSE_PROFILES=sim" in (ROOT / ".env").read_text()  # the simulator by default
    # both sidecars answer as "tollbooth", so Prometheus scrapes whichever runs
    for name in ("tollbooth-sim", "tollbooth-gpu"):
        assert services[name]["networks"]["default"]["aliases"] == ["tollbooth"]
    gpu = services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    nvml = services["tollbooth-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert nvml["driver"] == "nvidia" and "utility" in nvml["capabilities"]
    assert "http://vllm:8000" in services["tollbooth-gpu"]["command"]
    assert "http://simulator:8000" in services["tollbooth-sim"]["command"]


def test_mounted_files_exist() -> None:
    for name, svc in compose()["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name} mounts missing {src}"


def published(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each `ports:` entry; address "" is all."""
    out = []
    for entry in service.get("ports", []):
        *host, container = str(entry).split(":")
        address, port = (host[0], host[1]) if len(host) == 2 else ("", host[0])
        out.append((address, port, container))
    return out


def test_ports() -> None:
    services = compose()["services"]
    ports = {port: address for s in services.values() for address, port, _ in published(s)}
    assert {"8080", "9090", "9093", "3000", "16686"} <= set(ports)
    for unauthenticated in ("9090", "9093", "16686"):  # Prometheus, Alertmanager, Jaeger
        assert ports[unauthenticated] == "127.0.0.1"


def test_the_admin_listener_is_published_nowhere() -> None:
    """/metrics carries user ids and key hashes: reachable on the compose network only."""
    services = compose()["services"]
    for name, svc in services.items():
        assert "9464" not in {c for _, _, c in published(svc)}, name
    for name in ("tollbooth-sim", "tollbooth-gpu"):
        svc = services[name]
        assert "9464" in [str(e) for e in svc["expose"]]
        command = svc["command"]
        assert command[command.index("--admin-listen") + 1] == "0.0.0.0:9464"
    dockerfile = (ROOT / "Dockerfile").read_text()
    expose = next(ln for ln in dockerfile.splitlines() if ln.startswith("EXPOSE"))
    assert "9464" not in expose
    assert '"--admin-listen", "127.0.0.1:9464"' in dockerfile
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`/metrics` carries user ids and API-key hashes" in readme


def test_prometheus_scrapes_and_loads_the_rules() -> None:
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs[DEFAULT.job]["static_configs"][0]["targets"] == ["tollbooth:9464"]
    mounts = compose()["services"]["prometheus"]["volumes"]
    rule_mount = next(v for v in mounts if "tollbooth.rules.yml" in v).split(":")[1]
    assert prom["rule_files"] == [rule_mount]
    assert prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [
        "alertmanager:9093"
    ]


def test_grafana_provisioning_matches_dashboards() -> None:
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/datasources.yml").read_text()
    )["datasources"]
    uids = {d["uid"]: d for d in ds}
    assert DEFAULT.datasource_uid in uids and DEFAULT.traces_datasource_uid in uids
    dest = uids[DEFAULT.datasource_uid]["jsonData"]["exemplarTraceIdDestinations"][0]
    assert dest == {"name": "trace_id", "datasourceUid": DEFAULT.traces_datasource_uid}
    prov = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/dashboards.yml").read_text()
    )
    path = prov["providers"][0]["options"]["path"]
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./dashboards/generated:{path}:ro" in mounts


def test_collector_pipelines_reference_defined_components() -> None:
    cfg = yaml.safe_load((ROOT / "otel-collector.yaml").read_text())
    defined = {
        kind: set(cfg.get(kind, {}))
        for kind in ("receivers", "processors", "exporters", "connectors")
    }
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].startswith("0.0.0.0:")
    pipelines = cfg["service"]["pipelines"]
    for name, p in pipelines.items():
        for r in p["receivers"]:
            assert r in defined["receivers"] | defined["connectors"], (name, r)
        for x in p.get("processors", []):
            assert x in defined["processors"], (name, x)
        for e in p["exporters"]:
            assert e in defined["exporters"] | defined["connectors"], (name, e)
        if name.startswith("traces"):
            assert p["processors"][0] == "memory_limiter" and "batch" in p["processors"]
    # a connector must be an exporter of one pipeline and a receiver of another
    for c in defined["connectors"]:
        assert any(c in p["exporters"] for p in pipelines.values())
        assert any(c in p["receivers"] for p in pipelines.values())
    assert cfg["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert "jaeger" in compose()["services"]


def test_dockerfile_runs_the_console_script() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tollbooth"]' in text and "pip install" in text
