"""The operators' actions (everystep.operations), which the CLI and the UI
both call: each change commits with its audit record or not at all; an
action on several runs is all or nothing, or acts on each run it can."""

from __future__ import annotations

import uuid

import psycopg
import pytest

import everystep.db
from everystep import operations, scheduler
from tests.apps import ui_workflows
from tests.test_ui import blocked_run

ACTOR = operations.Actor("ada@host", "cli")


def audited(db) -> list[tuple]:
    return db.query("SELECT actor, source, action, run_id FROM everystep_audit ORDER BY id")


def status(db, run: uuid.UUID) -> str:
    return db.run(run)["status"]


def nightly(db) -> None:
    with db.connect() as conn:
        scheduler.apply(conn, {"nightly": scheduler.Schedule(workflow="tests.apps.ui_workflows.slow",
                                                             cron="0 3 * * *", args=(0.0,))})


def test_each_action_commits_with_its_audit_record_or_not_at_all(db):
    blocked = blocked_run(db)
    queued, orphan, old = (run.id for run in db.schedule_many(ui_workflows.slow, [(0.0,), (0.0,), (0.0,)]))
    with db.connect() as conn:
        assert [run.id for run in everystep.db.claim(conn, "gone-1", 2)] == [queued, orphan]  # nobody holds its lock
    db.query("UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL WHERE id = %s RETURNING 1",
             (queued,))
    nightly(db)
    actions = [
        lambda conn: operations.resolve_step(conn, ACTOR, blocked, "1", result="charged"),
        lambda conn: operations.requeue(conn, ACTOR, [orphan]),
        lambda conn: operations.cancel(conn, ACTOR, [queued], "not needed"),
        lambda conn: operations.reschedule(conn, ACTOR, [old]),
        lambda conn: operations.pause_schedule(conn, ACTOR, "nightly"),
        lambda conn: operations.fire_schedule(conn, ACTOR, "nightly"),
    ]
    # An audit trail that takes no record: every action fails, and changes nothing.
    with db.connect() as conn:
        conn.execute("ALTER TABLE everystep_audit ADD CONSTRAINT takes_nothing CHECK (false) NOT VALID")
        for action in actions:
            with pytest.raises(psycopg.errors.CheckViolation):
                action(conn)
    assert [status(db, run) for run in (blocked, orphan, queued)] == ["blocked", "running", "scheduled"]
    assert [s["status"] for s in db.steps(blocked)] == ["started"]
    assert db.value("SELECT count(*) FROM everystep_workflow") == 4  # no run scheduled again, none fired
    assert db.value("SELECT paused FROM everystep_schedule") is False

    with db.connect() as conn:
        conn.execute("ALTER TABLE everystep_audit DROP CONSTRAINT takes_nothing")
        results = [action(conn) for action in actions]
    assert results[0] == operations.Resolved(blocked, "1", "result", "charged")
    assert results[1] == operations.Requeued([operations.RequeuedRun(orphan, "gone-1")], [])
    assert results[2] == operations.Cancelled([operations.CancelledRun(queued, "cancelled")], [])
    [again] = results[3].done
    assert again.run == old and db.run(again.new)["args"] == [0.0]
    assert [status(db, run) for run in (blocked, orphan, queued)] == ["scheduled", "scheduled", "cancelled"]
    assert db.value("SELECT paused FROM everystep_schedule") is True
    assert audited(db) == [("ada@host", "cli", action, run) for action, run in (
        ("resolve-step", blocked), ("requeue", orphan), ("cancel", queued), ("schedule-again", again.new),
        ("schedule-pause", None), ("schedule-fire", results[5]))]


def test_all_or_nothing_refuses_the_whole_action_each_on_its_own_acts_on_the_rest(db):
    orphan, ended = (run.id for run in db.schedule_many(ui_workflows.slow, [(0.0,), (0.0,)]))
    with db.connect() as conn:
        everystep.db.claim(conn, "gone-1", 1)  # the orphan: running under a dead claimer
    db.query("UPDATE everystep_workflow SET status = 'completed', completed_at = now() WHERE id = %s RETURNING 1",
             (ended,))
    unknown = uuid.uuid4()
    with db.connect() as conn:
        refused = operations.requeue(conn, ACTOR, [orphan, ended, orphan])
        assert refused.done == [] and [(r.run, r.status) for r in refused.refused] == [(ended, "completed")]
        assert refused.refused[0].why == (
            f"run {ended} is completed: a finished run is never requeued; schedule it again")
        assert operations.cancel(conn, ACTOR, [orphan, unknown]) == operations.Cancelled(
            [], [operations.Refusal(unknown, None, f"no run {unknown}")])
        assert operations.reschedule(conn, ACTOR, [ended, unknown]).done == []
    assert (status(db, orphan), db.value("SELECT count(*) FROM everystep_workflow"), audited(db)) == (
        "running", 2, [])
    assert db.value("SELECT cancel_requested_at FROM everystep_workflow WHERE id = %s", (orphan,)) is None

    with db.connect() as conn:
        requeued = operations.requeue(conn, ACTOR, [orphan, ended], all_or_nothing=False)
        assert [r.run for r in requeued.done] == [orphan] and [r.run for r in requeued.refused] == [ended]
        cancelled = operations.cancel(conn, ACTOR, [ended, orphan, unknown], all_or_nothing=False)
        assert cancelled.done == [operations.CancelledRun(orphan, "cancelled")]
        assert [(r.run, r.status, r.why) for r in cancelled.refused] == [
            (ended, "completed", f"run {ended} is completed already"), (unknown, None, f"no run {unknown}")]
        again = operations.reschedule(conn, ACTOR, [unknown, ended], all_or_nothing=False)
        assert [r.run for r in again.done] == [ended] and [r.run for r in again.refused] == [unknown]
    assert [(action, run) for _actor, _source, action, run in audited(db)] == [
        ("requeue", orphan), ("cancel", orphan), ("schedule-again", again.done[0].new)]


def test_a_refused_single_target_action_says_why_and_writes_nothing(db):
    blocked = blocked_run(db)
    with db.connect() as conn:
        with pytest.raises(operations.NotFound, match="no run"):
            operations.resolve_step(conn, ACTOR, uuid.uuid4(), "1", discard=True)
        with pytest.raises(operations.NotFound, match="has no step '9'"):
            operations.resolve_step(conn, ACTOR, blocked, "9", discard=True)
        operations.resolve_step(conn, ACTOR, blocked, "1", error="declined")
        with pytest.raises(operations.Refused, match="not blocked") as refused:
            operations.resolve_step(conn, ACTOR, blocked, "1", discard=True)
        assert not isinstance(refused.value, operations.NotFound)
        with pytest.raises(operations.NotFound, match="no live schedule 'nope'"):
            operations.fire_schedule(conn, ACTOR, "nope")
    assert [action for _actor, _source, action, _run in audited(db)] == ["resolve-step"]
    assert db.value("SELECT details FROM everystep_audit") == {"error": "declined"}
