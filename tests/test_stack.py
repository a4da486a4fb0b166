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


def test_ports() -> None:
    services = compose()["services"]
    published = {p.split(":")[0] for s in services.values() for p in s.get("ports", [])}
    assert {"8080", "9464", "9090", "9093", "3000", "16686"} <= published


def test_prometheus_scrapes_and_loads_the_rules() -> None:
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    (sd,) = jobs[DEFAULT.job]["dns_sd_configs"]  # every sidecar aliased "tollbooth"
    assert (sd["names"], sd["type"], sd["port"]) == (["tollbooth"], "A", 9464)
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


def test_fleet_profile() -> None:
    services = compose()["services"]
    fleet = {n for n, s in services.items() if s.get("profiles") == ["fleet"]}
    assert fleet == {
        "fleet-simulator",
        "redis",
        "postgres",
        "tollbooth-fleet-a",
        "tollbooth-fleet-b",
        "fleet-lb",
    }
    config = yaml.safe_load((ROOT / "deploy/tollbooth-fleet.yaml").read_text())
    assert config["budgets"]["store"].startswith("redis://redis:6379/")
    assert "@postgres:5432/" in config["ledger"]["postgres_url"]
    for name in ("tollbooth-fleet-a", "tollbooth-fleet-b"):
        svc = services[name]
        assert svc["networks"]["default"]["aliases"] == ["tollbooth"]  # scraped by dns_sd
        assert "http://fleet-simulator:8000" in svc["command"]
        assert "./deploy/tollbooth-fleet.yaml:/etc/tollbooth/tollbooth.yaml:ro" in svc["volumes"]
    # each sidecar keeps its own outbox
    data = {v for n in ("tollbooth-fleet-a", "tollbooth-fleet-b") for v in services[n]["volumes"]}
    assert len({v.split(":")[0] for v in data if v.endswith("/var/lib/tollbooth")}) == 2
    nginx = (ROOT / "deploy/nginx/fleet.conf").read_text()
    assert "server tollbooth-fleet-a:8080;" in nginx and "server tollbooth-fleet-b:8080;" in nginx
    assert "proxy_buffering off;" in nginx and "proxy_next_upstream off;" in nginx
    assert services["fleet-lb"]["ports"] == ["8090:8080"]
