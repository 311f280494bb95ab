"""Routing: `workers.workflows` patterns restrict what a worker claims; runs of
a workflow nobody serves stay scheduled and show in a metric."""

from __future__ import annotations

import json

import pytest
import yaml

import everystep.db
from everystep import config
from everystep.config import ConfigError
from supervisor.http_server import Database, QueueCollector
from tests.apps.flow_workflows import cpu_job, gpu_job, unlimited
from tests.apps.workflows import marks_of
from tests.support.engine import most_at_once
from tests.support.processes import wait_for
from tests.support.supervisor_process import config as supervisor_config

IMPORTS = ("tests.apps.workflows", "tests.apps.flow_workflows")


def unserved_gauge(db) -> dict[str, float]:
    families = {f.name: f for f in QueueCollector(Database(db.url)).collect()}
    return {s.labels["workflow"]: s.value for s in families["everystep_workflows_unserved"].samples}


def test_workers_claim_only_the_workflows_they_serve(db, marks, start_worker):
    gpu = db.schedule_many(gpu_job, [(marks,) for _ in range(4)])
    cpu = db.schedule_many(cpu_job, [(marks,) for _ in range(4)])
    nobody = db.schedule_many(unlimited, [(marks, 0)])
    assert unserved_gauge(db) == {n: c for n, c in (
        (gpu_job.__everystep_workflow__, 4), (cpu_job.__everystep_workflow__, 4),
        (unlimited.__everystep_workflow__, 1))}  # no live worker at all
    gpu_worker = start_worker("gpu-1", imports=IMPORTS, workflows=("tests.apps.flow_workflows.gpu_*",))
    cpu_worker = start_worker("cpu-1", imports=IMPORTS, workflows=("tests.apps.flow_workflows.cpu?job", "other.*"))
    done = [r.id for r in gpu + cpu]
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s) AND status = 'completed'",
                              (done,)) == 8, 60, what="the routed runs completed")
    claimers = dict(db.query("SELECT id, claimed_by FROM everystep_workflow WHERE id = ANY(%s)", (done,)))
    assert {claimers[r.id] for r in gpu} == {"gpu-1"}
    assert {claimers[r.id] for r in cpu} == {"cpu-1"}
    pids = {tag: {pid for _run, t, pid in marks_of(marks) if t == tag} for tag in ("gpu", "cpu")}
    assert pids == {"gpu": {gpu_worker.pid}, "cpu": {cpu_worker.pid}}
    assert db.run(nobody[0].id)["status"] == "scheduled"
    assert unserved_gauge(db) == {unlimited.__everystep_workflow__: 1}
    # A worker serving everything picks it up; the gauge empties.
    start_worker("any-1", imports=IMPORTS)
    wait_for(lambda: db.run(nobody[0].id)["status"] == "completed", 30, what="the unserved run completed")
    assert unserved_gauge(db) == {}


def test_a_worker_started_with_a_config_file_runs_as_the_supervisors_workers_do(db, marks, start_worker, tmp_path):
    """`everystep worker -c FILE` takes what the supervisor gives its workers
    from the file: the imports, workers.workflows (routing), workers.threads,
    and the log format; an option given on the command line still wins."""
    config = tmp_path / "everystep.yaml"
    config.write_text(yaml.safe_dump({
        "imports": list(IMPORTS), "logging": {"format": "json"},
        "workers": {"threads": 2, "workflows": ["tests.apps.flow_workflows.gpu_*", unlimited.__everystep_workflow__]},
    }))
    cpu = db.schedule_many(cpu_job, [(marks,) for _ in range(2)])
    gpu = db.schedule_many(gpu_job, [(marks,) for _ in range(2)])
    slow = db.schedule_many(unlimited, [(marks, 0.3) for _ in range(6)])
    worker = start_worker("cfg-1", config=config, imports=(), threads=None)
    done = [r.id for r in gpu + slow]
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s) AND status = 'completed'",
                              (done,)) == 8, 60, what="the routed runs completed")
    assert {db.run(r.id)["status"] for r in cpu} == {"scheduled"}  # not in workers.workflows
    assert most_at_once(db, slow) <= 2  # two threads, not the default eight
    lines = [line for line in worker.output().splitlines() if line.strip()]
    assert lines and all(json.loads(line)["message"] for line in lines)  # logging.format: json


def test_routes_are_like_patterns_with_their_wildcards_escaped(db):
    assert everystep.db.routes_of(["a.b_c*", "x?y"]) == ["a.b\\_c%", "x_y"]
    assert everystep.db.routes_of(None) is None
    db.schedule_many(gpu_job, [("m",)])
    db.schedule_many(cpu_job, [("m",)])
    with db.connect() as conn:
        # "_" in a pattern is no wildcard; "?" is.
        assert everystep.db.claim(conn, "w", 10, everystep.db.routes_of(["tests.apps.flow_workflows.gpu?job_"])) == []
        routes = everystep.db.routes_of(["tests.apps.flow_workflows.gpu_job", "nothing.*"])
        claimed = everystep.db.claim(conn, "w", 10, routes)
    assert [r.name for r in claimed] == [gpu_job.__everystep_workflow__]


def write(tmp_path, text):
    path = tmp_path / "everystep.yaml"
    path.write_text(text)
    return path


def test_the_config_reads_routing_and_limits(tmp_path):
    loaded = config.load(write(tmp_path, (
        "workers:\n  workflows: [myapp.gpu.*, myapp.render]\n"
        "workflows:\n  myapp.render:\n    concurrency: 2\n  myapp.other:\n    concurrency: null\n"
    )))
    assert loaded.workers.workflows == ("myapp.gpu.*", "myapp.render")
    assert loaded.workflows == {"myapp.render": config.WorkflowConfig(2), "myapp.other": config.WorkflowConfig(None)}
    assert config.load(write(tmp_path, "")).workers.workflows is None


def test_a_workers_options_come_from_the_config_for_the_supervisor_and_the_cli_alike(tmp_path):
    loaded = config.load(write(tmp_path, (
        "workers: {threads: 3, async_slots: 50, poll: 0.5, drain: 5, workflows: [a.*]}\n"
        "recovery: {grace: 2, max_crashes: 4}\n"
        "workflows: {a.b: {concurrency: 2}, a.c: {concurrency: null}}\n"
    )))
    assert config.worker_options(loaded) == {"threads": 3, "async_slots": 50, "poll": 0.5, "drain": 5, "grace": 2,
                                             "max_crashes": 4, "workflows": ("a.*",),
                                             "limits": {"a.b": 2, "a.c": None}, "per_key_limits": {},
                                             "priorities": {}, "rate_limits": {}}
    assert config.worker_options(None) == {"threads": 8, "async_slots": 100, "poll": 1.0, "drain": 30.0,
                                           "grace": 10.0, "max_crashes": 3, "workflows": None, "limits": {},
                                           "per_key_limits": {}, "priorities": {}, "rate_limits": {}}
    assert config.maintenance_options(loaded) == {"interval": 5.0, "grace": 2, "max_crashes": 4, "retention": {}}


@pytest.mark.parametrize(("text", "message"), [
    ("workers: {workflows: []}", "workers.workflows: must list at least one pattern"),
    ("workers: {workflows: 'a.*'}", "workers.workflows: must be a list"),
    ("workers: {workflows: ['a b']}", "workers.workflows[0]: must be a workflow name pattern"),
    ("workflows: {render: {concurrency: 2}}", "workflows: the key 'render' must be the module.qualname"),
    ("workflows: {a.b: {concurrency: 0}}", "workflows.a.b.concurrency: must be an integer >= 1, got 0"),
    ("workflows: {a.b: {concurency: 2}}", "workflows.a.b.concurency: unknown key (did you mean 'concurrency'?)"),
    ("workflows: [a.b]", "workflows: must be a mapping of workflow names"),
])
def test_routing_and_limit_mistakes(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        config.load(write(tmp_path, text))
    assert message in str(error.value)


def test_a_supervisor_runs_only_its_configured_workflows(db, marks, supervisors):
    gpu = db.schedule_many(gpu_job, [(marks,) for _ in range(3)])
    cpu = db.schedule_many(cpu_job, [(marks,) for _ in range(2)])
    sup = supervisors(supervisor_config(db.url, "gpu-node", imports=list(IMPORTS),
                                        workers={"workflows": ["tests.apps.flow_workflows.gpu_*"]}))
    sup.wait_workers({"gpu-node-0", "gpu-node-1"})
    ids = [r.id for r in gpu]
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s) AND status = 'completed'",
                              (ids,)) == 3, 60, what="the GPU runs completed")
    assert {db.run(r.id)["status"] for r in cpu} == {"scheduled"}  # nobody here serves them
    assert unserved_gauge(db) == {cpu_job.__everystep_workflow__: 2}
