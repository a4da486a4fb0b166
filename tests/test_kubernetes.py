"""deploy/kubernetes/: every built-in object valid against the Kubernetes schemas (offline, with
kubernetes-validate), the custom resources checked for what their operators need, and the parts
agreeing with each other and with the sidecar's own config."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import promql_parser
import pytest
import yaml

from alerts.build import render_prometheus_rule
from sidecar.config import load
from sidecar.proxy.identity import read_keys
from sidecar.telemetry.thresholds import DEFAULT

K8S = Path(__file__).parents[1] / "deploy" / "kubernetes"
VERSION = "1.30.0"  # native sidecars (init containers with restartPolicy: Always) are on by 1.29
CUSTOM = {"PodMonitor", "PrometheusRule", "ScaledObject"}


def docs() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        (doc,) = list(yaml.safe_load_all(path.read_text()))
        out[path.name] = doc
    return out


def by_kind(kind: str) -> dict[str, Any]:
    """The one object of `kind` that kustomization.yaml applies."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    (doc,) = [d for n, d in docs().items() if d["kind"] == kind and n in kust]
    return doc


def deployment() -> dict[str, Any]:
    return by_kind("Deployment")


def sidecar() -> dict[str, Any]:
    (c,) = deployment()["spec"]["template"]["spec"]["initContainers"]
    return c


@pytest.mark.parametrize("name", [n for n, d in docs().items() if d["kind"] not in CUSTOM])
def test_built_in_objects_are_valid(name: str) -> None:
    kubernetes_validate.validate(docs()[name], VERSION, strict=True)


def test_a_schema_violation_is_caught() -> None:
    bad = deployment()
    bad["spec"]["template"]["spec"]["initContainers"][0]["restartPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_the_kustomization_lists_files_that_exist() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).exists(), res
    # HPA and KEDA never both: KEDA makes an HPA of its own
    assert "hpa.yaml" in kust["resources"] and "keda-scaledobject.yaml" not in kust["resources"]


def test_tollbooth_is_a_native_sidecar_in_front_of_vllm_on_loopback(tmp_path: Path) -> None:
    c, pod = sidecar(), deployment()["spec"]["template"]["spec"]
    assert c["restartPolicy"] == "Always"
    assert "--upstream=http://127.0.0.1:8000" in c["args"]
    (vllm,) = pod["containers"]
    assert "--host=127.0.0.1" in vllm["args"] and "--port=8000" in vllm["args"]
    svc = by_kind("Service")
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"]  # never vLLM, never admin
    assert {p["name"] for p in c["ports"]} == {"http", "admin"}
    assert svc["spec"]["selector"].items() <= pod_labels().items()
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > load(config_file(tmp_path)).server.shutdown_grace_s


def pod_labels() -> dict[str, str]:
    return dict(deployment()["spec"]["template"]["metadata"]["labels"])


def config_file(tmp: Path) -> Path:
    path = tmp / "tollbooth.yaml"
    path.write_text(by_kind("ConfigMap")["data"]["tollbooth.yaml"])
    return path


def test_the_config_map_is_a_valid_config_and_the_secret_feeds_it(tmp_path: Path) -> None:
    cfg = load(config_file(tmp_path))
    assert cfg.budgets.store and cfg.ledger.postgres_url and cfg.ledger.path
    secret = by_kind("Secret")["stringData"]
    env = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in sidecar()["env"]
        if "valueFrom" in e
    }
    for name in (cfg.upstream.api_key_env, cfg.budgets.store_password_env, "PGPASSWORD"):
        assert name in env and env[name] in secret
    keys = tmp_path / "keys.yaml"
    keys.write_text(secret["keys.yaml"])
    assert read_keys(str(keys))  # the format `identity.keys_file` reads
    mounts = {m["name"]: m["mountPath"] for m in sidecar()["volumeMounts"]}
    assert cfg.identity.keys_file == mounts["keys"] + "/keys.yaml"
    assert any(a == f"--config={mounts['config']}/tollbooth.yaml" for a in sidecar()["args"])
    assert Path(cfg.ledger.path).parent == Path(mounts["data"])


def test_the_pod_monitor_scrapes_the_admin_port_as_the_alerts_job() -> None:
    pm = by_kind("PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels().items()
    assert pod_labels()[pm["spec"]["jobLabel"]] == DEFAULT.job
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] == "admin" and ep["path"] == "/metrics"


def test_the_prometheus_rule_is_generated_from_the_thresholds() -> None:
    assert (K8S / "prometheusrule.yaml").read_text() == render_prometheus_rule(DEFAULT)
    rule = by_kind("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    promtool = shutil.which("promtool")
    if promtool:
        groups = Path(__file__).parent / ".." / "alerts" / "tollbooth.rules.yml"
        assert yaml.safe_load(groups.read_text()) == rule["spec"]
        out = subprocess.run([promtool, "check", "rules", str(groups)], capture_output=True)
        assert out.returncode == 0, out.stderr


def adapter_rules() -> list[dict[str, Any]]:
    cm = docs()["prometheus-adapter.yaml"]
    kubernetes_validate.validate(cm, VERSION, strict=True)
    return list(yaml.safe_load(cm["data"]["config.yaml"])["rules"])


def test_the_hpa_reads_metrics_the_adapter_serves() -> None:
    served = {r["name"]["as"]: r for r in adapter_rules()}
    hpa = by_kind("HorizontalPodAutoscaler")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert (
        wanted
        == set(served)
        == {
            "llm_queue_depth",
            "llm_budget_tokens_in_use_ratio",
            "llm_gpu_utilization_ratio",
        }
    )
    for rule in served.values():
        query = (
            rule["metricsQuery"]
            .replace("<<.GroupBy>>", "pod")
            .replace("<<.LabelMatchers>>", 'namespace="x",pod=~"a|b"')
        )
        promql_parser.parse(query)
        promql_parser.parse(rule["seriesQuery"])
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_keda_alternative_queries_the_same_series() -> None:
    so = docs()["keda-scaledobject.yaml"]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["spec"]["scaleTargetRef"]["name"] == deployment()["metadata"]["name"]
    names = set()
    for trigger in so["spec"]["triggers"]:
        assert trigger["type"] == "prometheus"
        promql_parser.parse(trigger["metadata"]["query"])
        float(trigger["metadata"]["threshold"])
        names |= set(re.findall(r"llm_[a-z_]+", trigger["metadata"]["query"]))
    assert names == {
        "llm_queue_depth",
        "llm_budget_tokens_in_use",
        "llm_budget_tokens_limit",
        "llm_gpu_utilization_ratio",
    }
