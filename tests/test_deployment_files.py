"""The shipped deployment files agree with each other, with the config
loader and with Kubernetes's schemas: the Kubernetes manifests, the systemd
unit, the shipped config."""

from __future__ import annotations

import configparser
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from everystep.config import load

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "config" / "kubernetes"
# The schemas kubernetes-validate ships (it validates offline).
KUBERNETES_VERSION = kubernetes_validate.latest_version()


def documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def schema_errors(resource: dict) -> list[str]:
    """What Kubernetes's schema of the resource's kind says is wrong with it,
    unknown fields included."""
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.path)
        return [f"{resource['kind']} {resource['metadata']['name']}: {where}: {str(exc).splitlines()[0]}"]
    return []


@pytest.mark.parametrize("path", sorted(KUBERNETES.glob("*.yaml")), ids=lambda path: path.name)
def test_the_kubernetes_manifests_match_the_kubernetes_schemas(path):
    resources = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert resources
    assert [error for resource in resources for error in schema_errors(resource)] == []


def test_the_schema_check_finds_a_misspelt_field_and_a_wrong_type():
    statefulset = documents(KUBERNETES / "statefulset.yaml")["StatefulSet"]
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGets"] = container["readinessProbe"].pop("httpGet")
    assert len(schema_errors(statefulset)) == 1
    container["readinessProbe"]["httpGet"] = container["readinessProbe"].pop("httpGets")
    assert schema_errors(statefulset) == []
    container["ports"][0]["containerPort"] = "9117"
    (error,) = schema_errors(statefulset)
    assert "containerPort" in error and "is not of type" in error


def kubernetes_config(tmp_path, monkeypatch):
    monkeypatch.setenv("EVERYSTEP_DATABASE_URL", "postgresql://db/app")
    monkeypatch.setenv("POD_NAME", "everystep-0")
    config_map = documents(KUBERNETES / "configmap.yaml")["ConfigMap"]
    path = tmp_path / "everystep.yaml"
    path.write_text(config_map["data"]["everystep.yaml"])
    return load(path)


def test_the_configmap_is_a_valid_config_fed_by_the_pod(tmp_path, monkeypatch):
    config = kubernetes_config(tmp_path, monkeypatch)
    assert config.database.url == "postgresql://db/app"
    assert config.name == "everystep-0"
    pod = documents(KUBERNETES / "statefulset.yaml")["StatefulSet"]["spec"]["template"]["spec"]
    env = {item["name"]: item for item in pod["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["EVERYSTEP_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "everystep-database"


def test_the_pod_outlives_the_drain_and_probes_the_metrics_port(tmp_path, monkeypatch):
    config = kubernetes_config(tmp_path, monkeypatch)
    manifests = documents(KUBERNETES / "statefulset.yaml")
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= config.workers.drain + 10
    (container,) = pod["containers"]
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", config.http.port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert manifests["StatefulSet"]["spec"]["serviceName"] == manifests["Service"]["metadata"]["name"]
    # The scrape config keeps pods by this annotation and port name.
    scrape = (ROOT / "config" / "prometheus" / "scrape.yml").read_text()
    annotation = next(iter(manifests["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]))
    assert annotation.replace(".", "_").replace("/", "_") in scrape and "metrics" in scrape


def test_the_systemd_unit_outlives_the_drain_and_reloads_with_hup():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read(ROOT / "config" / "systemd" / "everystep.service")
    service = unit["Service"]
    shipped = load(ROOT / "everystep.yaml")
    assert int(service["TimeoutStopSec"]) >= shipped.workers.drain + 10
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert "-HUP" in service["ExecReload"]
    assert "everystep-supervisor -c" in service["ExecStart"]
