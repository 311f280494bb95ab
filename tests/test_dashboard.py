"""The Grafana dashboard (config/grafana/) and the alert rules against a real
Prometheus scraping a real supervisor that ran a workload: every PromQL
expression parses, and returns series (no misspelt metric or label)."""

from __future__ import annotations

import json
import re
import urllib.parse

import yaml

import everystep
from tests.apps import tracing_workflows as flows
from tests.apps import workflows
from tests.support.processes import ROOT, wait_for
from tests.support.scraping import Prometheus, get, needs_prometheus
from tests.support.supervisor_process import config

DASHBOARD = ROOT / "config" / "grafana" / "everystep-dashboard.json"
RULES = ROOT / "config" / "prometheus" / "everystep.rules.yml"
# A metric selector of ours, with its label matchers if any.
SELECTOR = re.compile(r"\beverystep_[a-z_]+(?:\{[^}]*\})?")


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def rule_expressions() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def as_query(expr: str) -> str:
    """Grafana's range macros, as Prometheus alone reads them."""
    return expr.replace("$__rate_interval", "1m").replace("$__range", "5m")


def test_the_dashboard_is_importable_as_is():
    dashboard = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in dashboard and dashboard["uid"] == "everystep"
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
    titles = " ".join(p["title"] for p in panels).lower()
    for wanted in ("pending", "running", "blocked", "oldest pending", "slots in use", "restarts", "claims lost",
                   "database up", "step failures", "duration", "per second"):
        assert wanted in titles, wanted


@needs_prometheus("prometheus")
def test_every_expression_of_the_dashboard_and_the_rules_returns_series(db, supervisors, tmp_path):
    sup = supervisors(config(db.url, "dash", imports=["tests.apps.tracing_workflows"],
                             workers={"workflows": ["tests.apps.tracing_workflows.*"]}))
    # The workload: completed runs, a failing step, a retried step, a run no
    # worker serves, a worker restarted.
    with db.connect() as conn, everystep.transaction(conn):
        for i in range(5):
            everystep.schedule(flows.fan_out, i)
        everystep.schedule(flows.fails, "out of stock")
        everystep.schedule(flows.retried_once, "rates")  # a step retried once
        everystep.schedule(workflows.quick, str(tmp_path))  # routed nowhere: unserved
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status IN ('completed', 'failed')")
             == 7, timeout=60, what="the workload's runs to end")
    sup.kill_worker("dash-0")
    # A step attempt abandoned at its timeout, on a worker that stays up (its
    # gauge of abandoned threads is the live processes').
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule(flows.timed_out_once, "slow")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status IN ('completed', 'failed')")
             == 8, timeout=60, what="the timed-out run to end")

    scrape = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "everystep", "static_configs": [{"targets": [f"127.0.0.1:{sup.port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape))
    prometheus = Prometheus(tmp_path / "prometheus.yml", tmp_path / "tsdb", tmp_path / "prometheus.log")
    try:
        def answer(expr: str) -> list:
            status, body = get(f"{prometheus.base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
            assert status == 200, f"{expr}: {body}"  # 400: does not parse
            return json.loads(body)["data"]["result"]

        # The dashboard's expressions return series once a few scrapes are in (rates need two).
        for expr in dashboard_expressions():
            wait_for(lambda expr=expr: answer(as_query(expr)), timeout=30, what=f"series for {expr}")
        # The rules' expressions parse; their thresholds keep them empty on a healthy
        # fleet, so each metric selector in them must return series.
        for expr in rule_expressions():
            answer(expr)
            for selector in SELECTOR.findall(expr):
                wait_for(lambda s=selector: answer(s), timeout=30, what=f"series for {selector} (in {expr})")
        # And a misspelt metric would be noticed.
        assert answer("everystep_workflows_pendin") == []
    finally:
        prometheus.stop()
