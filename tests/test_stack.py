"""The compose stack and collector config, checked for structure (no Docker engine runs here),
and the compose Prometheus config by the real promtool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import Config
from sidecar.telemetry import tracing
from sidecar.telemetry.thresholds import DEFAULT

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


def prometheus() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())


def test_prometheus_scrapes_and_loads_the_rules() -> None:
    prom = prometheus()
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


def test_the_inference_server_is_scraped_in_both_profiles() -> None:
    """vLLM (gpu profile) or the simulator (sim profile): one job, one name on the network."""
    services = compose()["services"]
    jobs = {j["job_name"]: j for j in prometheus()["scrape_configs"]}
    (target,) = jobs[DEFAULT.engine_job]["static_configs"][0]["targets"]
    host, port = target.split(":")
    for name in ("simulator", "vllm"):
        assert services[name]["networks"]["default"]["aliases"] == [host]
        assert port in services[name]["expose"]
    assert "simulator" not in jobs  # the old job only ever found the sim profile's server


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus not installed")
def test_promtool_checks_the_compose_prometheus_config(tmp_path: Path) -> None:
    """With the promtool `make test` installs (Debian's 2.42); the compose file pins a later 2.x,
    which reads everything 2.42 does. The rule file is pointed at the repository's copy."""
    image = compose()["services"]["prometheus"]["image"]
    assert re.fullmatch(r"prom/prometheus:v2\.\d+\.\d+", image), image
    prom = prometheus()
    mounts = compose()["services"]["prometheus"]["volumes"]
    for i, rule_file in enumerate(prom["rule_files"]):
        local = next(v.split(":")[0] for v in mounts if v.split(":")[1] == rule_file)
        prom["rule_files"][i] = str(ROOT / local)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(prom))
    out = subprocess.run(
        ["promtool", "check", "config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_grafana_step_follows_the_scrape_interval() -> None:
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/datasources.yml").read_text()
    )["datasources"]
    prom_ds = next(d for d in ds if d["uid"] == DEFAULT.datasource_uid)
    assert prom_ds["jsonData"]["timeInterval"] == prometheus()["global"]["scrape_interval"]


def test_access_log_reaches_loki_with_links_to_traces() -> None:
    """tollbooth writes the access log on its data volume; the collector reads it (read-only),
    sets each record's trace context and sends it to Loki over OTLP; Grafana links both ways."""
    services = compose()["services"]
    tb_cfg = yaml.safe_load((ROOT / "deploy/tollbooth.yaml").read_text())
    log_path = tb_cfg["logging"]["access_log"]
    data_mount = next(v for v in services["tollbooth-sim"]["volumes"] if v.startswith("tollbooth-"))
    volume, path = data_mount.split(":")[:2]
    assert log_path.startswith(path + "/")
    assert f"{volume}:{path}:ro" in services["otel-collector"]["volumes"]

    cfg = yaml.safe_load((ROOT / "otel-collector.yaml").read_text())
    receiver = cfg["receivers"]["filelog/access"]
    assert receiver["include"] == [log_path]
    assert receiver["resource"]["service.name"] == "tollbooth"
    ops = {op["type"]: op for op in receiver["operators"]}
    assert ops["json_parser"]["timestamp"]["parse_from"] == "attributes.time"
    assert ops["trace_parser"]["trace_id"]["parse_from"] == "attributes.trace_id"
    assert ops["trace_parser"]["span_id"]["parse_from"] == "attributes.span_id"
    logs = cfg["service"]["pipelines"]["logs"]
    assert "filelog/access" in logs["receivers"] and logs["processors"][0] == "memory_limiter"
    (exporter,) = logs["exporters"]
    url = cfg["exporters"][exporter]["endpoint"]
    m = re.fullmatch(r"http://(\w+):(\d+)/otlp", url)
    assert m, url
    loki = services[m.group(1)]
    loki_cfg_mount = next(v for v in loki["volumes"] if v.startswith("./"))
    loki_cfg = yaml.safe_load((ROOT / loki_cfg_mount.split(":")[0]).read_text())
    assert str(loki_cfg["server"]["http_listen_port"]) == m.group(2)
    assert m.group(2) in loki["expose"]
    assert loki_cfg["limits_config"]["allow_structured_metadata"] is True
    assert {c["schema"] for c in loki_cfg["schema_config"]["configs"]} == {"v13"}
    assert loki["command"] == [f"-config.file={loki_cfg_mount.split(':')[1]}"]

    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/datasources.yml").read_text()
    )["datasources"]
    uids = {d["uid"]: d for d in ds}
    logs_ds, traces_ds = uids[DEFAULT.logs_datasource_uid], uids[DEFAULT.traces_datasource_uid]
    assert logs_ds["type"] == "loki" and logs_ds["url"] == f"http://{m.group(1)}:{m.group(2)}"
    (field,) = logs_ds["jsonData"]["derivedFields"]  # log line -> trace
    assert field["matcherType"] == "label" and field["matcherRegex"] == "trace_id"
    assert field["datasourceUid"] == DEFAULT.traces_datasource_uid
    assert field["url"] == "$${__value.raw}"  # $$: not an environment variable to provisioning
    to_logs = traces_ds["jsonData"]["tracesToLogsV2"]  # trace -> its log line
    assert to_logs["datasourceUid"] == DEFAULT.logs_datasource_uid
    assert 'service_name="tollbooth"' in to_logs["query"]
    assert 'trace_id="$${__trace.traceId}"' in to_logs["query"]


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


def test_every_sidecar_exports_spans_and_genai_metrics_to_the_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collector's metrics pipeline takes the GenAI metrics: each sidecar's environment turns
    both signals on and names the collector for both (a traces endpoint alone sent the metrics
    to the container's own localhost)."""
    sidecars = {n: s for n, s in compose()["services"].items() if "serve" in s.get("command", [])}
    assert {"tollbooth-sim", "tollbooth-gpu"} <= set(sidecars)
    for name, svc in sidecars.items():
        env = {k: str(v) for k, v in svc["environment"].items() if k.startswith("OTEL_")}
        for var in [k for k in os.environ if k.startswith("OTEL_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        assert tracing.enabled(Config(), "trace") and tracing.enabled(Config(), "metric"), name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318", name
        assert not {k for k in env if k.endswith(("TRACES_ENDPOINT", "METRICS_ENDPOINT"))}, name
