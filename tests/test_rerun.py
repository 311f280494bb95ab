"""Re-run from a step (everystep.rerun, `everystep rerun`, the operations
both front ends call): a new run whose steps before the chosen one are
copied from the original, so that only the chosen step and what follows
execute; refused, writing nothing, for what cannot be re-run so."""

from __future__ import annotations

import json
import uuid

import pytest

import everystep
import everystep.db
from everystep import operations, reruns
from everystep.errors import EverystepError
from tests.apps import console_workflows
from tests.apps.console_workflows import BUG, calls, pay_then_deliver
from tests.test_cli import cli, error_line, ok

ACTOR = operations.Actor("ada@host", "cli")


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()
    BUG["on"] = True
    yield
    BUG["on"] = True


def failed_on_the_bug(db, n: int = 1) -> list[uuid.UUID]:
    runs = [run.id for run in db.schedule_many(pay_then_deliver, [(f"o-{i}",) for i in range(n)])]
    db.run_pending()
    assert {db.run(run)["status"] for run in runs} == {"failed"}
    return runs


def test_a_rerun_from_the_failing_step_repeats_no_payment(db):
    [original] = failed_on_the_bug(db)
    before = [(s["step_id"], s["status"]) for s in db.steps(original)]
    assert calls.count("charge") == 1
    BUG["on"] = False  # the fix is deployed
    calls.clear()
    with db.connect() as conn, everystep.transaction(conn):
        new = everystep.rerun(original, from_step="4")
    assert db.run(new)["status"] == "scheduled"
    assert db.value("SELECT rerun_of FROM everystep_workflow WHERE id = %s", (new,)) == original
    assert sorted(s["step_id"] for s in db.steps(new)) == ["1", "2", "3.0.1", "3.1.1"]  # all but 4 and its error
    db.run_pending()
    assert db.run(new)["status"] == "completed" and db.run(new)["result"] == "shipped o-0"
    assert calls == ["deliver", "ship"]  # no reserve, no charge, no note: replay served them
    # The original keeps its row and its steps.
    assert db.run(original)["status"] == "failed"
    assert [(s["step_id"], s["status"]) for s in db.steps(original)] == before
    assert db.query("SELECT actor, source, action, run_id, step_id, target FROM everystep_audit") == [
        (db.value("SELECT actor FROM everystep_audit"), "api", "rerun", new, "4", str(original))]


def test_refusals_are_one_line_and_write_nothing(db):
    [original] = failed_on_the_bug(db)
    [waiting] = [run.id for run in db.schedule_many(pay_then_deliver, [("late",)])]
    with db.connect() as conn:
        with pytest.raises(operations.NotFound, match=r"has no step '9'"):
            operations.rerun(conn, ACTOR, original, "9")
        with pytest.raises(operations.NotFound, match="no run"):
            operations.rerun(conn, ACTOR, uuid.uuid4(), "1")
        with pytest.raises(operations.Refused, match="scheduled, still in flight"):
            operations.rerun(conn, ACTOR, waiting, "1")
        with conn.transaction(), pytest.raises(EverystepError, match="no step"):
            everystep.rerun(original, from_step="9", conn=conn)
    # An unsafe step whose outcome is unknown, before the step asked for.
    uncertain = uuid.uuid4()
    db.query("INSERT INTO everystep_workflow (id, name, args, status) VALUES (%s, %s, '[\"x\"]', 'cancelled')"
             " RETURNING 1", (uncertain, "tests.apps.console_workflows.pay_then_deliver"))
    for step_id, name, status in (("1", "reserve", "done"), ("2", "charge", "started")):
        db.query("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
                 " VALUES (%s, %s, %s, '[\"x\"]', '{}', %s, '\"r\"') RETURNING 1",
                 (uncertain, step_id, f"tests.apps.console_workflows.{name}", status))
    db.query("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
             " VALUES (%s, '3', 'tests.apps.console_workflows.deliver', '[]', '{}', 'failed') RETURNING 1",
             (uncertain,))
    with db.connect() as conn, pytest.raises(operations.Refused, match="'2' .* unsafe step whose outcome is unknown"):
        operations.rerun(conn, ACTOR, uncertain, "3")
    assert db.value("SELECT count(*) FROM everystep_workflow") == 3
    assert db.value("SELECT count(*) FROM everystep_audit") == 0
    # From the uncertain step itself: the operator chose to run it again.
    with db.connect() as conn:
        again = operations.rerun(conn, ACTOR, uncertain, "2")
    assert again.copied == ["1"] and db.value("SELECT action FROM everystep_audit") == "rerun"


def step(step_id: str, n: int, status: str = "done", started: float | None = None, finished: float | None = None,
         name: str = "app.s") -> dict:
    iso = lambda t: None if t is None else f"2026-01-01T00:00:{t:06.3f}+00:00"  # noqa: E731
    return {"id": n, "step_id": step_id, "name": name, "status": status, "started_at": iso(started),
            "finished_at": iso(finished)}


def test_which_steps_are_before_a_step_in_parallel_branches():
    run = uuid.uuid4()
    steps = [
        step("1", 1, started=0, finished=1),
        step("2.0.1", 2, started=1, finished=2),  # branch 0: done before 2.1.2 started
        step("2.1.1", 3, started=1, finished=3),
        step("2.0.2", 5, started=2, finished=9),  # branch 0, still running when 2.1.2 started
        step("2.1.2", 4, started=4, finished=5, status="failed"),
        step("3", 6, started=9, finished=10),
        step("named", 7, started=10, finished=11),
    ]
    assert reruns.steps_to_copy(run, steps, "2.1.2") == ["1", "2.0.1", "2.1.1"]
    assert reruns.steps_to_copy(run, steps, "3") == ["1", "2.0.1", "2.1.1", "2.0.2", "2.1.2"]
    assert reruns.steps_to_copy(run, steps, "1") == []
    assert reruns.steps_to_copy(run, steps, "named") == ["1", "2.0.1", "2.1.1", "2.0.2", "2.1.2", "3"]
    # An unsafe step beside it, started before it and never recorded: refused.
    uncertain = [*steps[:3], step("2.0.2", 5, status="started", started=2, name="app.pay"), steps[4]]
    with pytest.raises(reruns.RerunRefused, match="'2.0.2'"):
        reruns.steps_to_copy(run, uncertain, "2.1.2")
    # A wait that never ended is not copied: the re-run waits again.
    waiting = [steps[0], step("2", 2, status="started", started=1, name="everystep.wait_for"), step("3", 3)]
    assert reruns.steps_to_copy(run, waiting, "3") == ["1"]


def test_the_cli_reruns_many_runs_all_or_nothing(db):
    originals = failed_on_the_bug(db, 3)
    BUG["on"] = False
    bad = error_line(cli(db, "rerun", str(originals[0]), str(uuid.uuid4()), "--from-step", "4"), 2)
    assert "no run" in bad and "nothing was re-run" in bad
    assert error_line(cli(db, "rerun", str(originals[0]), "--from-step", "nope"), 2).endswith("has no step 'nope'")
    assert db.value("SELECT count(*) FROM everystep_workflow") == 3
    out = ok(cli(db, "rerun", *map(str, originals), "--from-step", "4"))
    assert out.count("new run") == 3
    new = [row[0] for row in db.query("SELECT id FROM everystep_workflow WHERE rerun_of IS NOT NULL")]
    calls.clear()
    db.run_pending()
    assert {db.run(run)["status"] for run in new} == {"completed"}
    assert "charge" not in calls and calls.count("deliver") == 3
    records = db.query("SELECT source, action, details FROM everystep_audit ORDER BY id")
    assert [(s, a) for s, a, _ in records] == [("cli", "rerun")] * 3
    assert {json.dumps(d["from_step"]) for _, _, d in records} == {'"4"'}
    # A run still in flight, from the CLI.
    [queued] = db.schedule_many(console_workflows.pay_then_deliver, [("q",)])
    assert "still in flight" in error_line(cli(db, "rerun", str(queued.id), "--from-step", "1"), 2)


def test_a_rerun_keeps_the_original_s_priority_and_concurrency_key(db):
    [original] = failed_on_the_bug(db)
    db.query("UPDATE everystep_workflow SET priority = 7, concurrency_key = 'tenant:7' WHERE id = %s RETURNING 1",
             (original,))
    with db.connect() as conn, everystep.transaction(conn):
        new = everystep.rerun(original, from_step="4")
    assert db.query("SELECT priority, concurrency_key FROM everystep_workflow WHERE id = %s", (new,)) == [
        (7, "tenant:7")]
