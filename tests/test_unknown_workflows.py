"""A worker that cannot import a run's workflow gives the run back, claims no
more of its runs and says so (log, metric, readiness, the unserved gauge), so
that a worker that can import it runs it. Real worker processes."""

from __future__ import annotations

import json

import everystep
import everystep.db
from everystep import ids
from tests.apps import workflows
from tests.support.processes import wait_for
from tests.support.scraping import get, samples, value
from tests.support.supervisor_process import config
from tests.support.ui_process import Client, UiProcess

ELSEWHERE = "import everystep\n\n@everystep.workflow\ndef job(n):\n    return n * 2\n"


def schedule_by_name(db, name: str, *args) -> object:
    """A run of `name`, which this process need not import (as a producer of another service would)."""
    with db.connect() as conn, conn.transaction():
        return everystep.db.insert_run(conn, ids.uuid7(), name, json.dumps(list(args)), None).id


def test_a_worker_gives_back_a_run_it_cannot_import_and_one_that_can_runs_it(db, tmp_path, start_worker, marks):
    (tmp_path / "elsewhere_flows.py").write_text(ELSEWHERE)
    foreign = schedule_by_name(db, "elsewhere_flows.job", 21)

    blind = start_worker("blind")  # started in the repository: elsewhere_flows is not importable there
    blind.wait_logged("cannot import workflow elsewhere_flows.job")
    wait_for(lambda: db.value("SELECT unknown FROM everystep_route WHERE runner = 'blind'") == ["elsewhere_flows.job"],
             what="the worker saying it cannot import the workflow")
    # The run goes back once the worker claims without that workflow (so the
    # route is published first): wait for the give-back, then check it was the only claim.
    wait_for(lambda: db.run(foreign)["status"] == "scheduled", what="the run given back")
    assert db.query("SELECT claimer, outcome FROM everystep_execution WHERE run_id = %s", (foreign,)) == [
        ("blind", "unknown")]

    # The run page says why it waits.
    ui = UiProcess(db.url, tmp_path / "ui")
    try:
        status, page = Client(ui.url).get(f"/api/runs/{foreign}")
    finally:
        ui.close()
    assert status == 200 and page["status"] == "scheduled"
    assert [(e["claimer"], e["how"]) for e in page["execution_history"]] == [
        ("blind", "given back: its worker cannot import the workflow (the run waits for a worker that can)")]

    # It claims no more of that workflow's runs, and goes on running the others.
    later = schedule_by_name(db, "elsewhere_flows.job", 1)
    known = db.schedule_many(workflows.quick, [(marks,)])[0].id
    wait_for(lambda: db.run(known)["status"] == "completed", what="a run the worker can import")
    assert db.run(later)["status"] == "scheduled"
    assert db.value("SELECT count(*) FROM everystep_execution WHERE run_id = %s", (later,)) == 0
    assert "engine error" not in blind.output()

    start_worker("sighted", imports=("elsewhere_flows",), cwd=tmp_path)
    wait_for(lambda: db.run(foreign)["status"] == "completed" and db.run(later)["status"] == "completed",
             what="the runs done by the worker that can import them")
    assert db.run(foreign)["result"] == 42


def test_a_supervisor_whose_imports_miss_a_module_is_not_ready_and_shows_the_runs_waiting(db, tmp_path, supervisors):
    foreign = schedule_by_name(db, "elsewhere_flows.job", 1)
    sup = supervisors(config(db.url, "missing-imports", workers={"processes": 1}))
    sup.wait_logged("cannot import workflow elsewhere_flows.job")

    def ready() -> tuple[int, str]:
        return get(f"http://127.0.0.1:{sup.port}/readyz")

    status, body = wait_for(lambda: (answer := ready())[0] == 503 and "cannot import" in answer[1] and answer,
                            what="readiness naming the workflow")
    assert body == ("workers cannot import workflows (their runs wait for a worker that can): "
                    "missing-imports-0: elsewhere_flows.job\n")
    # The run goes back once its worker claims without that workflow (after it said so): then it waits, unserved.
    wait_for(lambda: db.run(foreign)["status"] == "scheduled", what="the run given back")
    assert db.value("SELECT count(*) FROM everystep_execution WHERE run_id = %s", (foreign,)) == 1
    exposition = samples(get(f"http://127.0.0.1:{sup.port}/metrics")[1])
    assert value(exposition, "everystep_workflows_unserved", workflow="elsewhere_flows.job") == 1
    assert value(exposition, "everystep_unknown_workflow_runs_total", runner="missing-imports-0",
                 workflow="elsewhere_flows.job") == 1
