"""Replay: recorded steps served, outcomes written, divergence, failures,
Terminal and errors in parallel branches — executed in this process against a
real PostgreSQL."""

from __future__ import annotations

import threading

import psycopg
import pytest

import everystep
import everystep.db
from everystep import (
    Terminal,
    parallel,
    registry,
    step,
    workflow,
)
from tests.apps.engine_flows import (
    Crash,
    boom,
    calls,
    crash_once,
    record,
    seen,
)
from tests.support.engine import schedule_one, step_ids
from tests.support.processes import wait_for

# ---------------------------------------------------------------- replay


@workflow
def three_steps():
    a = record("one")
    b = crash_once("two")
    c = record("three")
    return [a, b, c]


def test_replay_serves_recorded_steps_without_running_them(db):
    run = schedule_one(db, three_steps)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    assert db.run(run.id)["status"] == "running"
    assert step_ids(db, run.id) == ["1"]
    assert db.resume_held("w1") == {run.id: "completed"}
    assert calls == {"one": 1, "two": 2, "three": 1}
    row = db.run(run.id)
    assert row["result"] == ["one", "two", "three"]
    assert row["completed_at"] is not None and row["claimed_by"] == "w1"


@step
def recorded_so_far():
    """The step ids of this run recorded when this step starts."""
    with psycopg.connect(seen["url"]) as conn:
        rows = conn.execute("SELECT step_id FROM everystep_step WHERE workflow_id = %s ORDER BY step_id",
                            (everystep.current().workflow_id,)).fetchall()
    return [row[0] for row in rows]


@workflow
def looks_back():
    record("x")
    record("y")
    return recorded_so_far()


def test_a_steps_outcome_is_written_before_the_next_step_starts(db):
    seen["url"] = db.url
    run = schedule_one(db, looks_back)
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == ["1", "2"]
    assert step_ids(db, run.id) == ["1", "2", "3"]  # the last one with the end of the run


def test_the_end_of_a_run_claims_the_next_one_with_its_recorded_steps(db):
    first, second, third = (schedule_one(db, three_steps) for _ in range(3))
    with db.connect() as conn:
        claims = everystep.db.claim(conn, "w1", 2)
        assert [run.id for run in claims] == [first.id, second.id]
        assert claims[1].token != claims[0].token  # a new execution token for every claim
        assert everystep.db.record_step(conn, second.id, "w1", claims[1].token, everystep.db.StepRow(
            "1", "tests.apps.engine_flows.record", "[]", "{}", "done", '"one"', None, 1.0, 2.0))
        # second: scheduled again, one step recorded
        assert everystep.db.requeue_held(conn, "w1", [everystep.db.Claim(second.id, claims[1].token)]) == [second.id]
        last_step = everystep.db.StepRow("1", "tests.apps.engine_flows.record", '["one"]', "{}", "done", '"one"', None,
                                  1.0, 2.0)
        ended = everystep.db.finish_run(conn, first.id, "w1", claims[0].token, "completed", '"ok"', None, last_step,
                                 claim=True)
        assert ended.status == "completed"
        claimed = ended.claimed
        assert [(run.id, run.steps) for run in claimed] == [
            (second.id, [["1", "tests.apps.engine_flows.record", "done", "one", None, None]])
        ]
        assert claimed[0].token not in (claims[0].token, claims[1].token)
        # Not held any more: nothing is written, nothing claimed.
        assert everystep.db.finish_run(conn, first.id, "w1", claims[0].token, "failed", None, None, claim=True) is None
        # Held, but by another execution (a stale token): nothing is written.
        assert everystep.db.finish_run(conn, second.id, "w1", claims[1].token, "failed", None, None) is None
    assert (db.run(first.id)["status"], db.run(second.id)["claimed_by"]) == ("completed", "w1")
    assert step_ids(db, first.id) == ["1"]
    assert db.run(third.id)["status"] == "scheduled"


@step
def other_step(tag):
    return tag


@workflow
def diverging():
    record("first")
    crash_once("second")


def diverged():
    other_step("first")  # same id "1", another function


def test_divergence_fails_the_run_with_workflow_code_error(db, monkeypatch):
    run = schedule_one(db, diverging)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    monkeypatch.setitem(registry.WORKFLOWS, diverging.__everystep_workflow__, diverged)
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "failed"
    assert row["error"]["type"] == "everystep.errors.WorkflowCodeError"
    assert "other_step" in row["error"]["message"]


class CardDeclined(Exception):
    pass


@step
def charge(amount):
    calls["charge"] += 1
    raise CardDeclined(f"declined {amount}")


@step
def refund_hold():
    calls["refund_hold"] += 1
    return "released"


@workflow
def durable_cleanup():
    try:
        charge(10)
    except CardDeclined as exc:
        released = refund_hold()
        crash_once("after")
        return {"error": str(exc), "cleanup": released}


def test_failures_are_recorded_and_re_raised_with_their_type_on_replay(db):
    run = schedule_one(db, durable_cleanup)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed"
    assert row["result"] == {"error": "declined 10", "cleanup": "released"}
    assert calls == {"charge": 1, "refund_hold": 1, "after": 2}
    failed = db.steps(run.id)[0]
    assert failed["status"] == "failed"
    assert failed["error"] == {
        "type": "tests.test_replay.CardDeclined", "message": "declined 10", "args": ["declined 10"]
    }


def _local_failure():
    class NotImportable(Exception):
        pass

    raise NotImportable("gone")


@step
def fails_with_local_class():
    calls["local"] += 1
    _local_failure()


@workflow
def catches_step_failure():
    try:
        fails_with_local_class()
    except Exception as exc:
        seen.setdefault("types", []).append(type(exc).__name__)
    crash_once("crash")


def test_a_failure_whose_class_cannot_be_imported_replays_as_step_failure(db):
    schedule_one(db, catches_step_failure)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    assert seen["types"] == ["NotImportable", "StepFailure"]
    assert calls["local"] == 1


@workflow
def unhandled_failure():
    charge(5)


def test_an_unhandled_step_failure_fails_the_run(db):
    run = schedule_one(db, unhandled_failure)
    db.run_pending()
    row = db.run(run.id)
    assert row["status"] == "failed"
    assert row["error"]["type"] == "tests.test_replay.CardDeclined"
    assert row["completed_at"] is not None


pause = threading.Event()


@workflow
def waits_between_steps():
    record("before")
    pause.wait(20)  # the body, not a step, waits: the outcome above must not wait with it
    record("after")


def test_a_step_outcome_is_written_while_the_body_waits(db):
    pause.clear()
    run = schedule_one(db, waits_between_steps)
    executing = threading.Thread(target=db.run_pending)
    executing.start()
    try:
        wait_for(lambda: step_ids(db, run.id) == ["1"], timeout=5, what="the first outcome written")
    finally:
        pause.set()
        executing.join(30)
    assert db.run(run.id)["status"] == "completed"
    assert step_ids(db, run.id) == ["1", "2"]


# ---------------------------------------------------------------- Terminal


@step
def hand_off(order):
    calls["hand_off"] += 1
    raise Terminal("handed to a human", {"order": order})


@workflow
def stops():
    record("before")
    try:
        hand_off(7)
    except Terminal:
        record("swallowed")  # a Terminal cannot be swallowed: this never runs
    record("after")


def test_terminal_stops_the_run_before_any_further_step(db):
    run = schedule_one(db, stops)
    db.run_pending()
    row = db.run(run.id)
    assert row["status"] == "stopped"
    assert row["error"] == {"type": "everystep.errors.Terminal", "message": "handed to a human",
                            "args": ["handed to a human", {"order": 7}]}
    assert calls == {"before": 1, "hand_off": 1}
    assert [(s["step_id"], s["status"]) for s in db.steps(run.id)] == [("1", "done"), ("2", "failed")]


# ---------------------------------------------------------------- parallel errors


@workflow
def two_failures():
    try:
        parallel(lambda: boom("x"), lambda: record("ok"), lambda: boom("y"))
    except ExceptionGroup as group:
        return sorted(str(e) for e in group.exceptions)


@workflow
def one_failure():
    try:
        parallel(lambda: boom("x"), lambda: record("ok"))
    except ValueError as exc:
        return str(exc)


# The branches of terminal_in_branch meet inside their steps, so that every
# step has started before the Terminal halts the run (a step called after the
# halt is not run at all, which thread timing would otherwise decide).
branches_met = threading.Barrier(3, timeout=20)


@step
def boom_with_the_others(tag):
    branches_met.wait()
    raise ValueError(tag)


@step
def hand_off_with_the_others(order):
    branches_met.wait()
    raise Terminal("handed to a human", {"order": order})


@workflow
def terminal_in_branch():
    parallel(lambda: boom_with_the_others("x"), lambda: hand_off_with_the_others(1),
             lambda: boom_with_the_others("y"))


def test_parallel_errors(db):
    two = schedule_one(db, two_failures)
    one = schedule_one(db, one_failure)
    term = schedule_one(db, terminal_in_branch)
    db.run_pending()
    assert db.run(two.id)["result"] == ["x", "y"]
    assert db.run(one.id)["result"] == "x"
    assert db.run(term.id)["status"] == "stopped"
    # Every branch ran to completion and was recorded.
    assert sorted((s["step_id"], s["status"]) for s in db.steps(term.id)) == [
        ("1.0.1", "failed"), ("1.1.1", "failed"), ("1.2.1", "failed")]
    assert sorted(s["step_id"] for s in db.steps(two.id)) == ["1.0.1", "1.1.1", "1.2.1"]
