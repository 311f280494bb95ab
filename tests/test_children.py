"""Child workflows: start / result / call, ChildFailed, cancel cascade, fan-out."""

from __future__ import annotations

import pytest

import everystep
import everystep.db
from everystep import EverystepError
from tests.apps import flow_workflows
from tests.apps.flow_workflows import fan_out, parent_calls, parent_of_failure, parent_of_held
from tests.support.processes import wait_for

IMPORTS = ("tests.apps.workflows", "tests.apps.flow_workflows")


def start(db, fn, *args):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args).id


def test_a_child_runs_once_and_the_parent_gets_its_result(db):
    run = start(db, parent_calls, 5)
    db.run_pending()
    row = db.run(run)
    assert row["status"] == "completed", row["error"]
    child_id, first, second = row["result"]
    assert (first, second) == (10, 12)
    with db.connect() as conn:
        kids = everystep.db.children(conn, run)
        assert [k["status"] for k in kids] == ["completed", "completed"]
        assert str(kids[0]["id"]) == child_id
        assert everystep.db.load_run(conn, kids[0]["id"])["parent_id"] == run
    names = [s["name"] for s in db.steps(run)]
    assert names == ["everystep.start", "everystep.result", "everystep.start", "everystep.result"]


def test_a_failed_child_raises_child_failed_with_its_error(db):
    run = start(db, parent_of_failure, "boom")
    db.run_pending()
    assert db.run(run)["result"] == ["failed", "ValueError", "boom"]


def test_cancelling_a_parent_cancels_its_unfinished_children(db, marks, start_worker):
    release = f"{marks}/release"
    run = start(db, parent_of_held, marks, release)
    start_worker("w1", imports=IMPORTS)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE parent_id = %s AND status = 'running'",
                              (run,)) == 1, 20, what="the child running")
    # The parent parks (no slot) once it waits for the child's result, which may be a moment after the child starts.
    wait_for(lambda: db.run(run)["status"] == "waiting", 20, what="the parent parked")
    with db.connect() as conn, everystep.transaction(conn):
        assert everystep.cancel(run, "no longer needed") == "cancelled"
    child = db.value("SELECT id FROM everystep_workflow WHERE parent_id = %s", (run,))
    open(release, "w").close()  # the child's step returns; its next boundary sees the cancel
    wait_for(lambda: db.run(child)["status"] == "cancelled", 20, what="the child cancelled")
    assert db.run(run)["status"] == "cancelled"


def test_a_thousand_children_complete_and_the_parent_resumes_without_holding_a_slot(db, start_worker):
    flow_workflows.PARENT_BODIES.clear()
    run = start(db, fan_out, 1000)
    db.run_pending(limit=50)
    row = db.run(run)
    assert row["status"] == "completed", row["error"]
    assert row["result"] == sum(i * 2 for i in range(1000))
    assert db.value("SELECT count(*) FROM everystep_workflow WHERE parent_id = %s AND status = 'completed'",
                    (run,)) == 1000
    # The first execution started the children and parked; the children's
    # ends, claimed before the woken parent (earlier due), leave one resume.
    assert len(flow_workflows.PARENT_BODIES) == 2


def test_start_and_result_outside_a_workflow_are_clear_errors():
    with pytest.raises(EverystepError, match="workflow body"):
        everystep.start(flow_workflows.child_double, 1)
    with pytest.raises(TypeError, match="@workflow"):
        everystep.start(print, 1)


def test_runs_show_links_parent_and_children(db, capsys):
    from everystep import cli  # noqa: PLC0415

    run = start(db, parent_calls, 1)
    db.run_pending()
    child = db.value("SELECT id FROM everystep_workflow WHERE parent_id = %s ORDER BY created_at, id LIMIT 1", (run,))
    assert cli.main(["--database-url", db.url, "runs", "show", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "children" in shown and str(child) in shown
    assert cli.main(["--database-url", db.url, "runs", "show", str(child)]) == 0
    assert f"parent          {run}" in capsys.readouterr().out
    assert cli.main(["--database-url", db.url, "runs", "list", "--parent", str(run), "--json"]) == 0
    assert '"status": "completed"' in capsys.readouterr().out
