"""The shipped deployment files agree with each other, with the config
loader, with Kubernetes's schemas and with the custom resources' schemas: the
Kubernetes manifests (a kustomize base, components and overlays, each
rendered by `kubectl kustomize`), the systemd unit, the shipped config.

Core kinds are checked with kubernetes-validate, offline; KEDA's ScaledObject
and the Prometheus operator's ServiceMonitor and PrometheusRule against the
JSON schemas of config/kubernetes/schemas/ (subsets of their CRDs). Unknown
fields are refused by both. Without kubectl the rendering tests skip, with the
reason printed, unless EVERYSTEP_REQUIRE_KUBECTL=1."""

from __future__ import annotations

import configparser
import copy
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from psycopg import conninfo

import everystep.db
from everystep.config import load
from tests.apps import workflows
from tests.support.processes import wait_for
from tests.support.supervisor_process import SupervisorProcess

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "config" / "kubernetes"
SCHEMAS = KUBERNETES / "schemas"
# The schemas kubernetes-validate ships (it validates offline).
KUBERNETES_VERSION = kubernetes_validate.latest_version()
KUSTOMIZATIONS = ["base", *sorted(f"overlays/{path.name}" for path in (KUBERNETES / "overlays").iterdir())]
KUBECTL = shutil.which("kubectl")


def needs_kubectl() -> None:
    if KUBECTL is None:
        if os.environ.get("EVERYSTEP_REQUIRE_KUBECTL") == "1":
            pytest.fail("kubectl is not installed and EVERYSTEP_REQUIRE_KUBECTL=1")
        print("SKIPPED: kubectl is not installed (it renders the kustomizations)")
        pytest.skip("kubectl is not installed (it renders the kustomizations)")


@functools.cache
def _rendered(kustomization: str) -> str:
    result = subprocess.run([KUBECTL, "kustomize", str(KUBERNETES / kustomization)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def rendered(kustomization: str) -> list[dict]:
    """The objects `kubectl kustomize` renders of a kustomization (fresh copies)."""
    needs_kubectl()
    return [doc for doc in yaml.safe_load_all(_rendered(kustomization)) if doc]


def by_kind(objects: list[dict]) -> dict[str, dict]:
    found = {}
    for obj in objects:
        assert obj["kind"] not in found, f"two {obj['kind']} objects: see the tests that take one per kind"
        found[obj["kind"]] = obj
    return found


@functools.cache
def _crd_schema(api_version: str, kind: str) -> dict | None:
    group, _, version = api_version.rpartition("/")
    path = SCHEMAS / group / f"{kind.lower()}_{version}.json"
    return json.loads(path.read_text()) if path.exists() else None


def schema_errors(resource: dict) -> list[str]:
    """What the schema of the resource's kind says is wrong with it, unknown
    fields included: Kubernetes's own for core kinds, ours for custom ones."""
    name = f"{resource['kind']} {resource['metadata']['name']}"
    group = resource["apiVersion"].rpartition("/")[0]
    if "." in group and not group.endswith(".k8s.io"):
        schema = _crd_schema(resource["apiVersion"], resource["kind"])
        if schema is None:
            return [f"{name}: no schema for {resource['apiVersion']} in {SCHEMAS.relative_to(ROOT)}"]
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{name}: {'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
                for error in validator.iter_errors(resource)]
    try:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.path)
        return [f"{name}: {where}: {str(exc).splitlines()[0]}"]
    return []


def test_the_crd_schemas_are_valid_json_schemas():
    paths = sorted(SCHEMAS.rglob("*.json"))
    assert [str(path.relative_to(SCHEMAS)) for path in paths] == [
        "keda.sh/scaledobject_v1alpha1.json", "monitoring.coreos.com/prometheusrule_v1.json",
        "monitoring.coreos.com/servicemonitor_v1.json"]
    for path in paths:
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_matches_its_schema(kustomization):
    objects = rendered(kustomization)
    assert objects
    assert [error for obj in objects for error in schema_errors(obj)] == []


def test_the_example_secret_matches_its_schema_and_names_every_node():
    (secret,) = [doc for doc in yaml.safe_load_all((KUBERNETES / "secret.example.yaml").read_text()) if doc]
    assert schema_errors(secret) == []
    for url in secret["stringData"].values():
        params = conninfo.conninfo_to_dict(url)
        assert len(params["host"].split(",")) == 2 and params["target_session_attrs"] == "read-write"


def misspelt(resource: dict, path: tuple, wrong: str) -> dict:
    """A copy of `resource` whose field at `path` (keys and indexes) is renamed `wrong`."""
    resource = copy.deepcopy(resource)
    *parents, key = path
    holder = functools.reduce(lambda node, part: node[part], parents, resource)
    holder[wrong] = holder.pop(key)
    return resource


@pytest.mark.parametrize(("kind", "path", "wrong"), [
    ("ScaledObject", ("spec", "maxReplicaCount"), "maxReplicasCount"),
    ("ScaledObject", ("spec", "scaleTargetRef", "name"), "nmae"),
    ("ScaledObject", ("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown"), "scaledown"),
    ("ScaledObject", ("spec", "triggers", 0, "metadata", "targetQueryValue"), "targetValue"),
    ("ServiceMonitor", ("spec", "endpoints", 0, "interval"), "intervall"),
    ("ServiceMonitor", ("spec", "selector", "matchLabels"), "matchLabel"),
    ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "annotations"), "anotations"),
    ("PrometheusRule", ("metadata", "labels"), "label"),
    ("StatefulSet", ("spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet"), "httpGets"),
])
def test_the_schema_check_finds_a_misspelt_field(kind, path, wrong):
    resource = by_kind(rendered("overlays/autoscaling"))[kind]
    assert schema_errors(resource) == []
    errors = schema_errors(misspelt(resource, path, wrong))
    assert errors and all(wrong in error or path[-1] in error for error in errors), errors


def test_the_schema_check_finds_a_wrong_type():
    objects = by_kind(rendered("overlays/autoscaling"))
    statefulset, scaled_object = objects["StatefulSet"], objects["ScaledObject"]
    statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9117"
    (error,) = schema_errors(statefulset)
    assert "containerPort" in error and "is not of type" in error
    scaled_object["spec"]["triggers"][0]["metadata"]["targetQueryValue"] = 16
    (error,) = schema_errors(scaled_object)
    assert "targetQueryValue" in error and "is not of type 'string'" in error


def pod_config(objects: list[dict], tmp_path, monkeypatch, direct: bool = False):
    """The config a pod of the rendered `objects` loads."""
    monkeypatch.setenv("EVERYSTEP_DATABASE_URL", "postgresql://db/app")
    if direct:
        monkeypatch.setenv("EVERYSTEP_DIRECT_DATABASE_URL", "postgresql://db-direct/app")
    monkeypatch.setenv("POD_NAME", "everystep-0")
    path = tmp_path / "everystep.yaml"
    path.write_text(by_kind(objects)["ConfigMap"]["data"]["everystep.yaml"])
    return load(path)


def container_env(objects: list[dict]) -> dict[str, dict]:
    pod = by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]
    return {item["name"]: item for item in pod["containers"][0]["env"]}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_configmap_is_a_valid_config_fed_by_the_pod(kustomization, tmp_path, monkeypatch):
    objects = rendered(kustomization)
    env = container_env(objects)
    config = pod_config(objects, tmp_path, monkeypatch, direct="EVERYSTEP_DIRECT_DATABASE_URL" in env)
    assert config.database.url == "postgresql://db/app"
    assert config.name == "everystep-0"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["EVERYSTEP_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "everystep-database", "key": "url"}
    if "EVERYSTEP_DIRECT_DATABASE_URL" in env:
        assert config.database.direct_url == "postgresql://db-direct/app"
        assert env["EVERYSTEP_DIRECT_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"] == "direct-url"
    else:
        assert config.database.direct_url == ""
    # The pods mount the ConfigMap rendered with them (its name carries a hash).
    objects = by_kind(objects)
    volumes = {v["name"]: v for v in objects["StatefulSet"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_pod_outlives_the_drain_and_probes_the_metrics_port(kustomization, tmp_path, monkeypatch):
    objects = rendered(kustomization)
    config = pod_config(objects, tmp_path, monkeypatch)
    manifests = by_kind(objects)
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.workers.drain + 10  # the supervisor's own kill comes first
    (container,) = pod["containers"]
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", config.http.port)
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert manifests["StatefulSet"]["spec"]["serviceName"] == manifests["Service"]["metadata"]["name"]
    # The Service, the PodDisruptionBudget and the StatefulSet select this fleet's pods, and only them.
    labels = manifests["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    for selector in (manifests["Service"]["spec"]["selector"],
                     manifests["StatefulSet"]["spec"]["selector"]["matchLabels"],
                     manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items() and "app.kubernetes.io/instance" in selector
    # The scrape config keeps pods by this annotation and port name.
    scrape = (ROOT / "config" / "prometheus" / "scrape.yml").read_text()
    annotation = next(iter(manifests["StatefulSet"]["spec"]["template"]["metadata"]["annotations"]))
    assert annotation.replace(".", "_").replace("/", "_") in scrape and "metrics" in scrape


def test_the_fleets_do_not_select_each_others_pods():
    main, gpu = (by_kind(rendered(k))["StatefulSet"] for k in ("overlays/autoscaling", "overlays/routed"))
    assert main["metadata"]["name"] != gpu["metadata"]["name"]
    for one, other in ((main, gpu), (gpu, main)):
        selector = one["spec"]["selector"]["matchLabels"]
        assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()


# ---------------------------------------------------------------- autoscaling

SCALED = [k for k in KUSTOMIZATIONS if k != "base"]
QUERY_PARTS = re.compile(r"LIKE ANY \((ARRAY\[[^]]*\])::text\[\]\).*?LIMIT (\d+)\)", re.S)


def fleet_query(scaled_object: dict) -> tuple[str, str, int]:
    """The trigger's query, its patterns (an SQL array literal) and its bound;
    the query must be the data layer's fleet_load with those two written in."""
    (trigger,) = scaled_object["spec"]["triggers"]
    assert trigger["type"] == "postgresql"
    query = trigger["metadata"]["query"]
    patterns, bound = QUERY_PARTS.search(query).groups()
    assert query == everystep.db.queries.get("fleet_load") % {"patterns": patterns, "bound": bound}
    return query, patterns, int(bound)


@pytest.mark.parametrize("kustomization", SCALED)
def test_the_scaled_object_scales_the_fleet_on_the_load_of_its_routes(kustomization, tmp_path, monkeypatch, db):
    objects = rendered(kustomization)
    config = pod_config(objects, tmp_path, monkeypatch)
    manifests = by_kind(objects)
    scaled = manifests["ScaledObject"]["spec"]
    target = scaled["scaleTargetRef"]
    statefulset = manifests["StatefulSet"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1", "StatefulSet", statefulset["metadata"]["name"])
    assert target["envSourceContainerName"] == statefulset["spec"]["template"]["spec"]["containers"][0]["name"]
    assert scaled["minReplicaCount"] >= 1  # a pod's supervisor runs the sweep and the recurring schedules
    metadata = scaled["triggers"][0]["metadata"]
    slots = config.workers.processes * config.workers.threads
    assert metadata["targetQueryValue"] == str(slots)
    env = container_env(objects)
    expected_env = "EVERYSTEP_DIRECT_DATABASE_URL" if "EVERYSTEP_DIRECT_DATABASE_URL" in env else \
        "EVERYSTEP_DATABASE_URL"
    assert metadata["connectionFromEnv"] == expected_env  # never through PgBouncer: its driver prepares statements
    _, patterns, bound = fleet_query(manifests["ScaledObject"])
    assert bound == scaled["maxReplicaCount"] * slots  # a larger count would add no pod
    with db.connect() as conn:
        expected = everystep.db.routes_of(config.workers.workflows) or ["%"]
        assert conn.execute(f"SELECT {patterns}::text[]").fetchone()[0] == expected


def add_runs(db, name: str, status: str, count: int, due: str = "now() - interval '1 second'") -> None:
    db.query("INSERT INTO everystep_workflow (id, name, args, status, claimed_by, due_at)"
             f" SELECT gen_random_uuid(), %s, '[]', %s, CASE WHEN %s = 'running' THEN 'w-0' END, {due}"
             " FROM generate_series(1, %s) RETURNING 1", (name, status, status, count))


def test_the_fleet_load_counts_running_and_due_runs_of_its_routes_up_to_its_bound(db):
    add_runs(db, "myapp.gpu.train", "running", 3)
    add_runs(db, "myapp.gpu.train", "scheduled", 4)
    add_runs(db, "myapp.video.render", "waiting", 2)  # a sleep that is over: due
    add_runs(db, "myapp.video.render", "waiting", 5, due="now() + interval '1 hour'")  # still asleep
    add_runs(db, "myapp.gpu.train", "scheduled", 6, due="now() + interval '1 hour'")  # delayed
    add_runs(db, "myapp.mail.send", "scheduled", 7)
    add_runs(db, "myapp.mail.send", "running", 1)
    add_runs(db, "myapp.mail.send", "completed", 50)
    with db.connect() as conn:
        assert everystep.db.fleet_load(conn, None, 160) == 3 + 4 + 2 + 7 + 1
        routes = everystep.db.routes_of(["myapp.gpu.*", "myapp.video.render"])
        assert everystep.db.fleet_load(conn, routes, 160) == 3 + 4 + 2
        assert everystep.db.fleet_load(conn, everystep.db.routes_of(["myapp.gpu.*"]), 5) == 5
        for kustomization, expected in (("overlays/autoscaling", 17), ("overlays/routed", 9)):
            query, _, _ = fleet_query(by_kind(rendered(kustomization))["ScaledObject"])
            assert conn.execute(query).fetchone()[0] == expected  # the text KEDA runs


def scans(plan: dict) -> list[tuple[str, str]]:
    found = [(plan["Node Type"], plan.get("Relation Name", ""))]
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


def test_the_fleet_load_reads_only_the_runs_in_flight_up_to_its_bound(db):
    """Many ended runs, many runs asleep: the query never reads the run
    table, only the narrow tables of the runs held and ready (0032_ready.sql),
    and stops at its bound (docs/running.md)."""
    db.query("INSERT INTO everystep_workflow (id, name, args, status, due_at) SELECT gen_random_uuid(),"
             " 'myapp.flow_' || (g %% 20), '[]', CASE WHEN g %% 10 = 0 THEN 'waiting' ELSE 'completed' END,"
             " now() + CASE WHEN g %% 10 = 0 THEN interval '1 day' ELSE interval '-1 day' END"
             " FROM generate_series(1, 50000) g RETURNING 1")
    add_runs(db, "myapp.flow_1", "scheduled", 3000)
    add_runs(db, "myapp.flow_1", "running", 50)
    with db.connect() as conn:
        conn.execute("ANALYZE")
        query = everystep.db.queries.get("fleet_load") % {"patterns": "ARRAY['%']", "bound": 160}
        (plan,) = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query).fetchone()[0]
    read = {relation for _, relation in scans(plan["Plan"]) if relation}
    assert read == {"everystep_claimed", "everystep_ready"}, read
    assert plan["Plan"]["Actual Rows"] == 1
    # The answer: 50 running and 110 of the 3000 due (the bound), in a few buffers.
    assert plan["Plan"]["Shared Hit Blocks"] + plan["Plan"].get("Shared Read Blocks", 0) < 100


def test_the_prometheus_rule_carries_the_alert_rules_and_the_service_monitor_scrapes_every_fleet():
    objects = by_kind(rendered("overlays/autoscaling"))
    rules = yaml.safe_load((ROOT / "config" / "prometheus" / "everystep.rules.yml").read_text())
    assert objects["PrometheusRule"]["spec"]["groups"] == rules["groups"]
    monitor = objects["ServiceMonitor"]["spec"]
    (endpoint,) = monitor["endpoints"]
    for kustomization in ("overlays/autoscaling", "overlays/routed"):
        service = by_kind(rendered(kustomization))["Service"]
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_a_scale_down_drains_within_the_pods_termination_grace_period(db, tmp_path, monkeypatch, marks):
    """What the kubelet does to a pod removed by a scale-down — SIGTERM, then
    SIGKILL after terminationGracePeriodSeconds — to a supervisor with the
    manifest's config (its drain, its workers): with steps still running,
    and one held past the drain, it exits 0 before the SIGKILL would come,
    every step that finished is recorded, and nothing stays claimed."""
    objects = rendered("overlays/autoscaling")
    grace_period = by_kind(objects)["StatefulSet"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    config = yaml.safe_load(by_kind(objects)["ConfigMap"]["data"]["everystep.yaml"])
    config.update(database={"url": db.url}, name="scale-down", imports=["tests.apps.workflows"],
                  http={"bind": "127.0.0.1", "port": 0})
    sup = SupervisorProcess(config, tmp_path / "supervisor")
    try:
        wait_for(lambda: len(sup.workers()) == config["workers"]["processes"], timeout=30, what="the workers")
        runs = db.schedule_many(workflows.timed_steps, [(marks, 40, 0.25)] * 8)
        (held,) = db.schedule_many(workflows.held, [(marks, str(tmp_path / "never"))])
        wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running'") == 9,
                 what="runs in flight")
        terminated = time.monotonic()
        sup.signal(signal.SIGTERM)
        assert sup.wait(grace_period) == 0
        took = time.monotonic() - terminated
    finally:
        sup.close()
    print(f"\nSIGTERM to exit: {took:.1f} s (drain {config['workers']['drain']} s, "
          f"terminationGracePeriodSeconds {grace_period})")
    assert took < grace_period
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running' OR claimed_by IS NOT NULL") == 0
    assert db.run(held.id)["status"] == "scheduled"  # its step outlived the drain: back in the queue
    finished = {(run, tag[:-4]) for run, tag, _ in workflows.marks_of(marks) if tag.endswith(":end")}
    recorded = {(str(w), f"s{int(s) - 1}") for w, s in db.query(
        "SELECT workflow_id, step_id FROM everystep_step WHERE workflow_id = ANY(%s)", ([run.id for run in runs],))}
    assert finished == recorded  # every step that ended was recorded: nothing lost


def test_the_systemd_unit_outlives_the_drain_and_reloads_with_hup():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read(ROOT / "config" / "systemd" / "everystep.service")
    service = unit["Service"]
    shipped = load(ROOT / "everystep.yaml")
    assert int(service["TimeoutStopSec"]) >= shipped.workers.drain + 10
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert "-HUP" in service["ExecReload"]
    assert "everystep-supervisor -c" in service["ExecStart"]
