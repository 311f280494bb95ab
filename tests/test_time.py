"""Time and control: delayed starts, durable sleep, cancellation and step
retries, against a real PostgreSQL and real worker processes."""

from __future__ import annotations

import datetime
import signal
import time

import psycopg
import pytest

import everystep
from everystep import EverystepError, schedule, store
from tests import time_workflows as tw
from tests.processes import wait_for
from tests.workflows import marks_of

IMPORTS = ("tests.workflows", "tests.time_workflows")


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
        ("1", "tests.workflows.work", "done"), ("2", "everystep.sleep", "done")]
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
    from tests.processes import WorkerProcess  # noqa: PLC0415

    with psycopg.connect(private_server.url, autocommit=True) as conn:
        store.migrate(conn)
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
