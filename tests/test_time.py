"""Time and control: delayed starts, durable sleep, cancellation and step
retries, against a real PostgreSQL and real worker processes."""

from __future__ import annotations

import datetime
import json
import signal
import time

import psycopg
import pytest

import everystep
import everystep.db
from everystep import EverystepError, schedule
from tests.apps import time_workflows as tw
from tests.apps.workflows import marks_of
from tests.support.processes import wait_for

IMPORTS = ("tests.apps.workflows", "tests.apps.time_workflows")


def tags(marks, run_id=None) -> list[str]:
    return [tag for run, tag, _ in marks_of(marks) if run_id is None or run == str(run_id)]


def status(db, run_id) -> str:
    return db.run(run_id)["status"]


def db_now(db) -> datetime.datetime:
    return db.value("SELECT now()")


def schedule_one(db, fn, *args, **options):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **options)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize(("options", "message"), [
    ({"at": datetime.datetime(2030, 1, 1)}, "aware datetime"),
    ({"after": -1}, "number of seconds >= 0"),
    ({"after": float("nan")}, "number of seconds >= 0"),
    ({"after": datetime.timedelta(seconds=-5)}, "number of seconds >= 0"),
    ({"after": 1, "at": datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)}, "not both"),
])
def test_bad_times_are_one_clear_error_before_anything_is_written(db, marks, options, message):
    with pytest.raises(EverystepError, match=message), db.connect() as conn, everystep.transaction(conn):
        schedule(tw.started_at, marks, **options)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"retries": -1}, "retries must be a whole number >= 0"),
    ({"retries": 1.5}, "retries must be a whole number >= 0"),
    ({"retries": 2, "backoff": -1}, "Backoff initial must be a finite number >= 0"),
    ({"retries": 2, "backoff": "1s"}, "backoff must be a number of seconds"),
    ({"retries": 2, "retry_on": "ValueError"}, "retry_on must be an Exception class"),
])
def test_bad_retry_options_are_one_clear_error(options, message):
    with pytest.raises(EverystepError, match=message):
        everystep.step(**options)


def test_bad_sleeps_and_cancels_are_one_clear_error(db):
    with pytest.raises(EverystepError, match="aware datetime"):
        everystep.sleep_until(datetime.datetime(2030, 1, 1))
    with pytest.raises(EverystepError, match="number of seconds >= 0"):
        everystep.sleep(-1)
    with db.connect() as conn:
        with pytest.raises(EverystepError, match="needs an open transaction"):
            everystep.cancel("0190e1f4-0000-7000-8000-000000000000", conn=conn)
        with pytest.raises(EverystepError, match="takes a run id"), everystep.transaction(conn):
            everystep.cancel("not-a-run")
        with pytest.raises(EverystepError, match="no run"), everystep.transaction(conn):
            everystep.cancel("0190e1f4-0000-7000-8000-000000000000")


# ---------------------------------------------------------------- delayed start

def test_a_delayed_run_waits_for_its_time_by_the_database_clock(db, marks):
    run = schedule_one(db, tw.started_at, marks, after=1.5)
    row = db.run(run.id)
    assert row["status"] == "waiting"
    assert 1.4 < (row["due_at"] - row["created_at"]).total_seconds() < 1.6
    assert db.run_pending() == {}  # not claimable before its time
    wait_for(lambda: db_now(db) >= row["due_at"], timeout=5)
    assert db.run_pending() == {run.id: "completed"}


def test_a_run_due_in_the_past_is_scheduled_at_once(db, marks):
    run = schedule_one(db, tw.started_at, marks, at=datetime.datetime(2001, 1, 1, tzinfo=datetime.UTC))
    assert status(db, run.id) == "scheduled"
    assert db.run_pending() == {run.id: "completed"}


def test_a_delayed_run_does_not_start_early_and_starts_on_time(db, marks, start_worker):
    worker = start_worker("w-delay", threads=2, poll=30, imports=IMPORTS)  # no polling: it must wake by itself
    worker.wait_logged("holding the lock of w-delay")
    runs = [schedule_one(db, tw.started_at, marks, after=delay) for delay in (1.0, 2.0)]
    wait_for(lambda: all(status(db, r.id) == "completed" for r in runs), timeout=20)
    for r in runs:
        row = db.run(r.id)
        started = datetime.datetime.fromtimestamp(row["result"], datetime.UTC)
        late = (started - row["due_at"]).total_seconds()
        assert 0 <= late < 0.5, late  # the worker's and the server's clocks are this machine's


# ---------------------------------------------------------------- durable sleep

def test_a_sleep_is_recorded_and_a_replay_after_its_time_returns_at_once(db, marks):
    run = schedule_one(db, tw.sleeper, marks, 1.5)
    assert db.run_pending() == {run.id: "sleeping"}
    row = db.run(run.id)
    assert (row["status"], row["claimed_by"]) == ("waiting", None)
    steps = db.steps(run.id)
    assert [(s["step_id"], s["name"], s["status"]) for s in steps] == [
        ("1", "tests.apps.workflows.work", "done"), ("2", "everystep.sleep", "done")]
    assert abs(steps[1]["result"] - row["due_at"].timestamp()) < 0.001
    assert db.run_pending() == {}
    wait_for(lambda: db_now(db) >= row["due_at"], timeout=5)
    assert db.run_pending() == {run.id: "completed"}
    assert tags(marks, run.id) == ["before", "before:end", "after", "after:end"]


def test_a_short_sleep_waits_on_the_thread(db, marks):
    run = schedule_one(db, tw.sleeper, marks, 0.2)
    started = time.monotonic()
    assert db.run_pending() == {run.id: "completed"}
    assert time.monotonic() - started >= 0.2


def test_sleep_until_a_time_past_returns_at_once(db, marks):
    run = schedule_one(db, tw.sleeps_until, marks, "2001-01-01T00:00:00+00:00")
    assert db.run_pending() == {run.id: "completed"}


def test_a_sleeping_run_holds_no_slot(db, marks, start_worker):
    """A one-thread worker runs other runs while one sleeps, then wakes it."""
    worker = start_worker("w-sleep", threads=1, poll=30, imports=IMPORTS)
    worker.wait_logged("holding the lock of w-sleep")
    sleeping = schedule_one(db, tw.sleeper, marks, 3)
    wait_for(lambda: status(db, sleeping.id) == "waiting", timeout=10)
    others = [schedule_one(db, tw.started_at, marks) for _ in range(3)]
    wait_for(lambda: all(status(db, r.id) == "completed" for r in others), timeout=10)
    assert status(db, sleeping.id) == "waiting"
    wait_for(lambda: status(db, sleeping.id) == "completed", timeout=10)
    row = db.run(sleeping.id)
    assert (row["completed_at"] - row["due_at"]).total_seconds() < 1.0


def test_a_sleep_survives_a_worker_kill(db, marks, start_worker):
    first = start_worker("w-a", threads=1, imports=IMPORTS)
    run = schedule_one(db, tw.sleeper, marks, 3)
    wait_for(lambda: status(db, run.id) == "waiting", timeout=10)
    first.signal(signal.SIGKILL)
    first.wait()
    start_worker("w-b", threads=1, poll=0.2, imports=IMPORTS)
    wait_for(lambda: status(db, run.id) == "completed", timeout=20)
    assert db.run(run.id)["claimed_by"] == "w-b"
    assert tags(marks, run.id) == ["before", "before:end", "after", "after:end"]  # no step ran twice


def test_a_sleep_survives_a_server_restart(private_server, tmp_path, marks):
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    with psycopg.connect(private_server.url, autocommit=True) as conn:
        everystep.db.migrate(conn)
        with everystep.transaction(conn):
            run = schedule(tw.sleeper, marks, 4)
    worker = WorkerProcess(private_server.url, "w-restart", tmp_path / "logs", threads=1, imports=IMPORTS)
    try:
        def state():
            with psycopg.connect(private_server.url, autocommit=True) as conn:
                return conn.execute("SELECT status FROM everystep_workflow WHERE id = %s", (run.id,)).fetchone()[0]
        wait_for(lambda: state() == "waiting", timeout=20)
        private_server.restart()
        wait_for(lambda: state() == "completed", timeout=40)
        assert tags(marks, run.id) == ["before", "before:end", "after", "after:end"]
    finally:
        worker.close()


# ---------------------------------------------------------------- cancellation

def cancel(db, run_id, reason=None) -> str:
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.cancel(run_id, reason)


def test_cancel_a_scheduled_a_waiting_and_a_blocked_run_at_once(db, marks, tmp_path):
    waiting = schedule_one(db, tw.started_at, marks, after=3600)
    sleeping = schedule_one(db, tw.sleeper, marks, 3600)
    assert db.run_pending() == {sleeping.id: "sleeping"}
    blocked = schedule_one(db, tw.unsafe_retries, marks, "listed", "other")
    with db.connect() as conn:  # an unsafe step started, its worker gone: blocked on replay
        conn.execute("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
                     " VALUES (%s, '1', 'tests.apps.time_workflows.unsafe_retry_on', '[]', '{}', 'started')",
                     (blocked.id,))
    assert db.run_pending() == {blocked.id: "blocked"}
    scheduled = schedule_one(db, tw.started_at, marks)
    for run in (scheduled, waiting, sleeping, blocked):
        assert cancel(db, run.id, "not needed") == "cancelled"
        row = db.run(run.id)
        assert (row["status"], row["cancel_reason"]) == ("cancelled", "not needed")
        assert row["completed_at"] is not None
    assert cancel(db, scheduled.id) == "cancelled"  # again: nothing changes
    assert db.run_pending() == {}


def test_cancel_in_the_callers_transaction_rolls_back_with_it(db, marks):
    run = schedule_one(db, tw.started_at, marks)
    with db.connect() as conn:
        with pytest.raises(RuntimeError), everystep.transaction(conn):
            everystep.cancel(run.id)
            raise RuntimeError("rolled back")
    assert status(db, run.id) == "scheduled"


@pytest.mark.parametrize("cleanup", [False, True])
def test_cancel_a_running_run_at_its_next_step(db, marks, tmp_path, start_worker, cleanup):
    """The step in progress finishes and is recorded; the body gets Cancelled
    at its next step call; the run ends cancelled (a cleanup step included)."""
    release = tmp_path / "release"
    worker = start_worker("w-cancel", threads=1, imports=IMPORTS)
    run = schedule_one(db, tw.cancellable, marks, str(release), cleanup)
    wait_for(lambda: "held" in tags(marks, run.id), timeout=20)
    assert cancel(db, run.id, "operator") == "running"  # requested
    release.touch()
    wait_for(lambda: status(db, run.id) not in ("running", "scheduled"), timeout=20)
    row = db.run(run.id)
    assert row["status"] == "cancelled"
    steps = {s["step_id"]: (s["status"], s["error"] and s["error"]["type"]) for s in db.steps(run.id)}
    assert steps["1"] == ("done", None)  # the step in progress finished and is recorded
    assert steps["2"] == ("failed", "everystep.errors.Cancelled")
    assert "next" not in tags(marks, run.id)
    if cleanup:
        assert "cleanup:operator" in tags(marks, run.id)
        assert (row["result"], row["error"]["type"]) == ("cleaned up", "everystep.errors.Cancelled")
    else:
        assert row["error"]["type"] == "everystep.errors.Cancelled" and row["error"]["message"] == "operator"
    assert worker.alive()


def test_a_cancel_racing_the_end_of_the_run_has_exactly_one_winner(db, marks, tmp_path, start_worker):
    """A run whose last step is held: the cancel request lands before its end
    (the run ends cancelled, its result kept) or after (the run completed and
    the cancel changes nothing) — never both, never neither."""
    start_worker("w-race", threads=4, imports=IMPORTS)
    outcomes = set()
    for i in range(6):
        release = tmp_path / f"release-{i}"
        run = schedule_one(db, tw.finishes_after_hold, marks, str(release))
        wait_for(lambda run=run: "held" in tags(marks, run.id), timeout=20)
        release.touch()
        time.sleep(0.01 * i)
        answer = cancel(db, run.id)
        wait_for(lambda run=run: status(db, run.id) in ("completed", "cancelled"), timeout=20)
        final = db.run(run.id)
        assert answer in ("running", "completed")
        assert final["status"] == ("cancelled" if answer == "running" else "completed")
        assert final["result"] == "finished"
        outcomes.add(final["status"])


def test_a_cancel_survives_a_worker_kill_and_a_drain(db, marks, tmp_path, start_worker):
    release = tmp_path / "release"
    first = start_worker("w-k1", threads=1, imports=IMPORTS)
    killed = schedule_one(db, tw.cancellable, marks, str(release), False)
    wait_for(lambda: "held" in tags(marks, killed.id), timeout=20)
    assert cancel(db, killed.id, "kill") == "running"
    first.kill()  # the request is on the run's row, not in the worker
    drained = schedule_one(db, tw.cancellable, marks, str(release), True)
    second = start_worker("w-k2", threads=2, imports=IMPORTS)
    wait_for(lambda: "held" in tags(marks, drained.id), timeout=30)
    assert cancel(db, drained.id, "drain") == "running"
    second.signal(signal.SIGTERM)  # drains: the held step goes on until released
    time.sleep(0.3)
    release.touch()
    second.wait()
    start_worker("w-k3", threads=2, poll=0.2, imports=IMPORTS)  # recovers the killed worker's run
    with db.connect() as conn:
        everystep.db.requeue_claimer(conn, "w-k1")  # the dead worker's runs, as the sweep would
    wait_for(lambda: status(db, killed.id) == "cancelled" and status(db, drained.id) == "cancelled", timeout=30)
    assert db.run(killed.id)["error"]["message"] == "kill"
    assert "cleanup:drain" in tags(marks, drained.id)


# ---------------------------------------------------------------- retries

def test_a_step_is_retried_with_its_attempts_recorded(db, marks):
    run = schedule_one(db, tw.retrying, marks, 2)
    assert db.run_pending() == {run.id: "completed"}
    (step,) = db.steps(run.id)
    assert (step["status"], step["result"]) == ("done", "ok")
    assert [a["attempt"] for a in step["attempts"]] == [1, 2]
    assert [a["error"]["type"] for a in step["attempts"]] == ["tests.apps.time_workflows.Flaky"] * 2
    waits = [a["retry_at"] - a["at"] for a in step["attempts"]]
    assert waits == pytest.approx([0.05, 0.1])  # exponential, no jitter here
    assert tags(marks, run.id).count("flaky") == 3


def test_after_the_last_attempt_the_failure_is_raised(db, marks):
    run = schedule_one(db, tw.retrying, marks, 10)
    assert db.run_pending() == {run.id: "failed"}
    (step,) = db.steps(run.id)
    assert step["status"] == "failed" and len(step["attempts"]) == 3  # 4 attempts in all
    assert tags(marks, run.id).count("flaky") == 4


def test_unsafe_steps_retry_only_on_the_types_listed(db, marks):
    not_listed = schedule_one(db, tw.unsafe_retries, marks, "none")
    listed = schedule_one(db, tw.unsafe_retries, marks, "listed", "flaky")
    other = schedule_one(db, tw.unsafe_retries, marks, "listed", "other")
    assert db.run_pending() == {not_listed.id: "failed", listed.id: "failed", other.id: "failed"}
    assert tags(marks, not_listed.id).count("unsafe") == 1
    assert tags(marks, listed.id).count("unsafe") == 3
    assert tags(marks, other.id).count("unsafe") == 1
    assert len(db.steps(listed.id)[0]["attempts"]) == 2


def test_a_long_back_off_parks_the_run_and_outlives_a_worker_crash(db, marks, start_worker):
    run = schedule_one(db, tw.retrying_slowly, marks, 2)
    first = start_worker("w-r1", threads=1, imports=IMPORTS)
    wait_for(lambda: status(db, run.id) == "waiting", timeout=20)  # the 2 s back-off parks it
    (step,) = db.steps(run.id)
    assert step["status"] == "retrying" and len(step["attempts"]) == 1
    first.kill()
    start_worker("w-r2", threads=1, poll=0.2, imports=IMPORTS)
    wait_for(lambda: status(db, run.id) == "completed", timeout=30)
    (step,) = db.steps(run.id)
    assert [a["attempt"] for a in step["attempts"]] == [1, 2]
    assert tags(marks, run.id).count("slow") == 3
    gaps = [b["at"] - a["retry_at"] for a, b in zip(step["attempts"], step["attempts"][1:])]
    assert all(gap >= 0 for gap in gaps)  # no attempt before its back-off was over


# ---------------------------------------------------------------- the CLI

def test_the_cancel_command_and_the_listings(db, marks, tmp_path):
    from tests.test_cli import cli, error_line, ok  # noqa: PLC0415

    waiting = schedule_one(db, tw.started_at, marks, after=3600)
    sleeping = schedule_one(db, tw.sleeper, marks, 3600)
    retried = schedule_one(db, tw.retrying, marks, 1)
    assert db.run_pending() == {sleeping.id: "sleeping", retried.id: "completed"}
    shown = ok(cli(db, "runs", "show", str(sleeping.id)))
    assert "status          waiting" in shown and "due             " in shown and "wakes at " in shown
    shown = ok(cli(db, "runs", "show", str(retried.id)))
    assert "step 1 attempt 1 failed at " in shown and "tests.apps.time_workflows.Flaky: transient failure 1" in shown
    assert "waiting for its time" in error_line(cli(db, "requeue", str(waiting.id)), 1)

    assert error_line(cli(db, "cancel", str(waiting.id), str(retried.id)), 1) == (
        f"everystep: run {retried.id} is completed already; nothing was cancelled")
    assert status(db, waiting.id) == "waiting"  # all or nothing
    out = ok(cli(db, "cancel", str(waiting.id), str(sleeping.id), "--reason", "no longer needed"))
    assert out == f"cancelled run {waiting.id}\ncancelled run {sleeping.id}\n"
    audited = db.query("SELECT run_id FROM everystep_audit WHERE action = 'cancel' ORDER BY id")
    assert audited == [(waiting.id,), (sleeping.id,)]  # the refused attempt left no record
    assert "cancel          requested " in ok(cli(db, "runs", "show", str(waiting.id)))
    listed = json.loads(ok(cli(db, "runs", "list", "--status", "cancelled", "--json")))
    assert {run["id"] for run in listed} == {str(waiting.id), str(sleeping.id)}
    assert "no run" in error_line(cli(db, "cancel", "0190e1f4-0000-7000-8000-000000000000"), 2)


def test_a_cancel_learnt_at_the_claim_of_a_retried_step_ends_it(db, marks):
    """A run claimed again for its next attempt, with a cancel request on it:
    the body gets Cancelled at that step, recorded over its `retrying` row."""
    from everystep.runner import Runner  # noqa: PLC0415

    run = schedule_one(db, tw.retrying_slowly, marks, 5)
    assert db.run_pending() == {run.id: "sleeping"}  # the 2 s back-off parks it
    wait_for(lambda: db_now(db) >= db.run(run.id)["due_at"], timeout=10)
    with db.connect() as conn:
        (claimed,) = everystep.db.claim(conn, "w-manual", 1)
        with everystep.transaction(conn):
            assert everystep.cancel(run.id, "stop retrying") == "running"
        (claimed,) = everystep.db.reclaim_held(conn, "w-manual")  # the claim carries the request
    assert claimed.cancel_requested
    engine = Runner(db.pool, "w-manual")
    assert engine.execute(claimed).outcome == "cancelled"
    engine.close()
    (step,) = db.steps(run.id)
    assert (step["status"], step["error"]["type"], len(step["attempts"])) == (
        "failed", "everystep.errors.Cancelled", 1)
    assert tags(marks, run.id).count("slow") == 1  # no second attempt
    assert db.run(run.id)["error"]["message"] == "stop retrying"
