"""Steps unsafe to repeat: the started mark, blocked runs and resolve_step."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

import everystep
import everystep.execution
from everystep import (
    EverystepError,
    StepFailure,
    registry,
    step,
    workflow,
)
from everystep.runner import Runner
from tests.apps import chaos_unsafe
from tests.apps.engine_flows import (
    Crash,
    calls,
    seen,
)
from tests.support.engine import schedule_one

# ---------------------------------------------------------------- unsafe to repeat


@step(unsafe_to_repeat=True)
def send_money(db_url, run_marker):
    calls["send_money"] += 1
    # The started row is committed before the effect runs.
    with psycopg.connect(db_url) as conn:
        seen["row_before_effect"] = conn.execute(
            "SELECT status FROM everystep_step WHERE step_id = '1'").fetchone()
    if run_marker == "crash" and calls["send_money"] == 1:
        raise Crash()
    return "sent"


@workflow
def pays(db_url, run_marker):
    try:
        return send_money(db_url, run_marker)
    except StepFailure as exc:
        return f"failed: {exc}"


def test_unsafe_step_writes_started_first_and_updates_it_in_place(db):
    run = schedule_one(db, pays, db.url, "ok")
    db.run_pending()
    assert seen["row_before_effect"] == ("started",)
    (row,) = db.steps(run.id)
    assert row["status"] == "done" and row["result"] == "sent"
    assert db.value("SELECT max(id) FROM everystep_step") == row["id"]  # updated, not re-inserted


def _blocked_run(db):
    run = schedule_one(db, pays, db.url, "crash")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "blocked"
    assert row["error"]["type"] == "everystep.errors.EffectUncertain"
    assert calls["send_money"] == 1  # never run twice
    return run


def test_unsafe_step_found_started_blocks_the_run(db):
    run = _blocked_run(db)
    assert [s["status"] for s in db.steps(run.id)] == ["started"]


def test_resolve_with_a_result_completes_the_run(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", result="confirmed by bank")
    assert db.run(run.id)["status"] == "scheduled"
    db.run_pending()
    row = db.run(run.id)
    assert (row["status"], row["result"], row["error"]) == ("completed", "confirmed by bank", None)
    assert calls["send_money"] == 1


def test_resolve_with_an_error_raises_it_at_the_step(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", error="bank rejected it")
    db.run_pending()
    assert db.run(run.id)["result"] == "failed: bank rejected it"
    assert calls["send_money"] == 1


def test_resolve_by_discarding_runs_the_step_again(db):
    run = _blocked_run(db)
    with db.connect() as conn:
        everystep.resolve_step(conn, run.id, "1", discard=True)
    db.run_pending()
    assert db.run(run.id)["result"] == "sent"
    assert calls["send_money"] == 2


def test_resolve_refuses_what_is_not_a_blocked_runs_started_step(db):
    blocked = _blocked_run(db)
    done = schedule_one(db, pays, db.url, "ok")
    db.run_pending()
    with db.connect() as conn:
        with pytest.raises(EverystepError, match="not blocked"):
            everystep.resolve_step(conn, done.id, "1", result=1)
        with pytest.raises(EverystepError, match="no step '9'"):
            everystep.resolve_step(conn, blocked.id, "9", result=1)
        with pytest.raises(EverystepError, match="no run"):
            everystep.resolve_step(conn, uuid.uuid4(), "1", discard=True)
        with pytest.raises(EverystepError, match="exactly one"):
            everystep.resolve_step(conn, blocked.id, "1", result=1, discard=True)
    with db.connect() as conn:
        conn.execute("UPDATE everystep_step SET status = 'done' WHERE workflow_id = %s", (blocked.id,))
        conn.execute("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
                     " VALUES (%s, '2', 'x', '[]', '{}', 'done')", (blocked.id,))
        with pytest.raises(EverystepError, match="only its started step"):
            everystep.resolve_step(conn, blocked.id, "2", result=1)
    assert db.run(blocked.id)["status"] == "blocked"


def test_removing_the_unsafe_mark_lets_a_started_step_run_again(db, monkeypatch):
    run = schedule_one(db, pays, db.url, "crash")
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    safe_send = step(send_money.__wrapped__)  # the same function, no longer marked unsafe
    monkeypatch.setitem(registry.WORKFLOWS, pays.__everystep_workflow__,
                        lambda url, marker: safe_send(url, "ok"))
    db.resume_held("w1")
    row = db.run(run.id)
    assert row["status"] == "completed" and row["result"] == "sent"
    (only,) = db.steps(run.id)
    assert only["status"] == "done"
    assert calls["send_money"] == 2


# ---------------------------------------------------------------- the window of an async unsafe step

class _WriteThreads(everystep.execution.Fence):
    """Notes the thread of each write about the run."""

    def __init__(self):
        self.threads: list[str] = []

    def before_write(self, run):
        self.threads.append(threading.current_thread().name)


def test_an_async_unsafe_steps_outcome_does_not_queue_behind_other_writes(db):
    # The time from an unsafe step's `started` mark to its outcome's commit is
    # the time a crash blocks its run: an async run's outcome is written on a
    # lane of its own, not behind every other write of the async runs.
    (run,) = db.schedule_many(chaos_unsafe.apay, [(1,)])
    fence = _WriteThreads()
    engine = Runner(db.pool, "lanes", fence=fence)
    try:
        with db.connect() as conn:
            (claimed,) = everystep.db.claim(conn, "lanes", 1)
        assert engine.execute(claimed).outcome == "completed"
    finally:
        engine.close()
    lanes = [name.removeprefix("everystep-lanes-").split("_")[0] for name in fence.threads]
    assert lanes == ["io", "outcomes", "io"]  # the mark, the outcome, the end
