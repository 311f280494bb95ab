"""Step timeouts (@step(timeout=)) and run deadlines (schedule(deadline=),
@workflow(timeout=), inherited by children), against a real PostgreSQL and
real worker processes."""

from __future__ import annotations

import datetime
import json
import time

import pytest
from prometheus_client import REGISTRY

import everystep
import everystep.db
from everystep import EverystepError, schedule
from tests.apps import timeout_workflows as tf
from tests.apps.workflows import marks_of
from tests.support.processes import wait_for
from tests.test_roles import roles  # noqa: F401  (a fixture)

IMPORTS = ("tests.apps.workflows", "tests.apps.timeout_workflows")
STEP_TIMEOUT = "everystep.errors.StepTimeout"
CANCELLED = "everystep.errors.Cancelled"


def tags(marks, run_id=None) -> list[str]:
    return [tag for run, tag, _ in marks_of(marks) if run_id is None or run == str(run_id)]


def schedule_one(db, fn, *args, **options):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **options)


def status(db, run_id) -> str:
    return db.run(run_id)["status"]


def ended(db, run_id, timeout: float = 30) -> dict:
    wait_for(lambda: status(db, run_id) not in ("scheduled", "waiting", "running"), timeout=timeout,
             what=f"run {run_id} ended")
    return db.run(run_id)


def ready(worker):
    """A worker process once it claims: a deadline counted from a schedule
    made after this does not pass while the process starts."""
    worker.wait_logged("holding the lock", timeout=60)
    return worker


def timeouts(workflow, kind: str) -> float:
    name = workflow.__everystep_workflow__
    return REGISTRY.get_sample_value("everystep_timeouts_total", {"workflow": name, "kind": kind}) or 0.0


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "5s", True, datetime.timedelta(0)])
def test_a_bad_step_or_workflow_timeout_is_one_clear_error(timeout):
    with pytest.raises(EverystepError, match=r"timeout=...\) takes a number of seconds > 0"):
        everystep.step(timeout=timeout)
    with pytest.raises(EverystepError, match=r"timeout=...\) takes a number of seconds > 0"):
        everystep.workflow(timeout=timeout)


@pytest.mark.parametrize(("deadline", "message"), [
    (-1, "deadline=...\\) takes a number of seconds > 0"),
    (0, "deadline=...\\) takes a number of seconds > 0"),
    (float("nan"), "deadline=...\\) takes a number of seconds > 0"),
    (datetime.timedelta(seconds=-3), "deadline=...\\) takes a number of seconds > 0"),
    ("tomorrow", "deadline=...\\) takes a number of seconds > 0"),
    (True, "deadline=...\\) takes a number of seconds > 0"),
    (datetime.datetime(2030, 1, 1), "aware datetime"),
    (datetime.date(2030, 1, 1), "not the date"),
])
def test_a_bad_deadline_is_one_clear_error_before_anything_is_written(db, marks, deadline, message):
    with pytest.raises(EverystepError, match=message), db.connect() as conn, everystep.transaction(conn):
        schedule(tf.has_a_timeout, marks, deadline=deadline)
    with pytest.raises(EverystepError, match=message), db.connect() as conn, everystep.transaction(conn):
        schedule(tf.has_a_timeout, marks, after=10, deadline=deadline)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


# ---------------------------------------------------------------- step timeouts

def test_a_step_that_times_out_is_retried_and_then_succeeds(db, marks, start_worker):
    """Two attempts hang past the timeout: each fails with StepTimeout (an
    attempt under the retry policy), the third returns; the abandoned
    attempts' late results are ignored."""
    start_worker("w-timeout", threads=2, imports=IMPORTS)
    run = schedule_one(db, tf.retries_a_timeout, marks, 2)
    row = ended(db, run.id)
    assert (row["status"], row["result"]) == ("completed", "ok after 3")
    (step,) = db.steps(run.id)
    assert [a["error"]["type"] for a in step["attempts"]] == [STEP_TIMEOUT] * 2
    assert "did not finish within its timeout of 0.5 s" in step["attempts"][0]["error"]["message"]
    wait_for(lambda: "late:2" in tags(marks, run.id), timeout=10, what="the abandoned attempts ended")
    assert tags(marks, run.id).count("attempt") == 3  # the late ends started no attempt, changed no record
    assert db.steps(run.id)[0]["result"] == "ok after 3"


def test_a_step_whose_attempts_all_time_out_fails_with_step_timeout(db, marks, start_worker):
    start_worker("w-timeout", threads=2, imports=IMPORTS)
    run = schedule_one(db, tf.retries_a_timeout, marks, 99)
    row = ended(db, run.id)
    assert row["status"] == "failed" and row["error"]["type"] == STEP_TIMEOUT
    (step,) = db.steps(run.id)
    assert step["status"] == "failed" and step["error"]["type"] == STEP_TIMEOUT
    assert len(step["attempts"]) == 3  # retries=3: four attempts, the last one the failure
    assert tags(marks, run.id).count("attempt") == 4


def test_an_unsafe_step_that_times_out_blocks_and_is_never_repeated(db, marks, start_worker):
    """retry_on=TimeoutError does not make a timed-out unsafe step retried:
    its effect may have happened (its thread runs on)."""
    start_worker("w-timeout", threads=2, imports=IMPORTS)
    run = schedule_one(db, tf.unsafe_times_out, marks)
    row = ended(db, run.id)
    assert row["status"] == "blocked" and row["error"]["type"] == "everystep.errors.EffectUncertain"
    assert "timed out after 0.3 s" in row["error"]["message"]
    (step,) = db.steps(run.id)
    assert (step["status"], step["attempts"]) == ("started", None)
    time.sleep(3.5)  # the abandoned attempt has ended meanwhile
    assert tags(marks, run.id) == ["effect"]
    assert status(db, run.id) == "blocked"


def test_an_async_step_that_times_out_is_cancelled_at_its_await(db, marks, start_worker):
    start_worker("w-async", threads=1, imports=IMPORTS)
    run = schedule_one(db, tf.async_times_out, marks)
    row = ended(db, run.id)
    assert row["status"] == "completed"
    assert row["result"].startswith("gave up: step tests.apps.timeout_workflows.async_hangs did not finish")
    assert tags(marks, run.id) == ["async-attempt", "async-cancelled"] * 2  # retries=1: two attempts, both cancelled
    (step,) = db.steps(run.id)
    assert step["status"] == "failed" and step["error"]["type"] == STEP_TIMEOUT


def test_an_async_step_of_a_sync_workflow_and_a_sync_step_of_an_async_one_time_out(db, marks):
    first = schedule_one(db, tf.sync_calls_async_timeout, marks)
    second = schedule_one(db, tf.async_with_sync_timeout, marks)
    assert db.run_pending() == {first.id: "completed", second.id: "completed"}
    assert db.run(first.id)["result"] == db.run(second.id)["result"] == "timed out"
    assert tags(marks, first.id) == ["async-attempt", "async-cancelled"] * 2
    assert tags(marks, second.id) == ["sync-in-async"]


def test_step_timeouts_and_abandoned_threads_are_counted(db, marks):
    name = tf.counted.__everystep_workflow__
    before = timeouts(tf.counted, "step")
    run = schedule_one(db, tf.counted, marks)
    assert db.run_pending() == {run.id: "completed"}
    assert timeouts(tf.counted, "step") == before + 1
    abandoned = lambda: REGISTRY.get_sample_value("everystep_step_threads_abandoned", {"workflow": name})  # noqa: E731
    assert abandoned() == 1  # its thread is still sleeping
    wait_for(lambda: abandoned() == 0, timeout=10, what="the abandoned thread ended")


# ---------------------------------------------------------------- deadlines

def deadline_of(db, run_id) -> datetime.datetime | None:
    return db.value("SELECT deadline_at FROM everystep_workflow WHERE id = %s", (run_id,))


def test_deadlines_from_schedule_and_from_the_workflow_timeout(db, marks):
    now = db.value("SELECT now()")
    plain = schedule_one(db, tf.sleeps_long, marks)
    timed = schedule_one(db, tf.has_a_timeout, marks)  # @workflow(timeout=120)
    earlier = schedule_one(db, tf.has_a_timeout, marks, deadline=10)
    later = schedule_one(db, tf.has_a_timeout, marks, deadline=datetime.timedelta(hours=5))
    at = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)
    given = schedule_one(db, tf.sleeps_long, marks, deadline=at)
    delayed = schedule_one(db, tf.has_a_timeout, marks, after=1000)  # the timeout counts from its start
    with db.connect() as conn, everystep.transaction(conn):
        many = everystep.schedule_many(tf.has_a_timeout, [(marks,), (marks,)])
    assert deadline_of(db, plain.id) is None
    seconds = lambda run: (deadline_of(db, run.id) - now).total_seconds()  # noqa: E731
    assert 119 < seconds(timed) < 125
    assert 9 < seconds(earlier) < 15
    assert 119 < seconds(later) < 125  # the workflow's timeout is earlier
    assert abs((deadline_of(db, given.id) - at).total_seconds()) < 0.001
    assert 1119 < seconds(delayed) < 1125
    assert all(119 < seconds(run) < 125 for run in many)


@pytest.mark.parametrize(("workflow", "cancelled_at"), [
    (tf.sleeps_long, ("3", tf.work.__everystep_step__)),  # the sleep (2) is over: the step after it
    (tf.waits_for_a_message, ("2", "everystep.wait_for")),  # the wait itself
])
def test_a_parked_run_is_cancelled_at_its_deadline(db, marks, start_worker, workflow, cancelled_at):
    """A run sleeping or waiting for a message holds no worker: it is due at
    its deadline, claimed then, and its body gets Cancelled('deadline')."""
    ready(start_worker("w-deadline", threads=2, imports=IMPORTS))
    run = schedule_one(db, workflow, marks, deadline=3)
    wait_for(lambda: status(db, run.id) == "waiting", what="the run parked")
    row = ended(db, run.id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
    assert row["error"]["type"] == CANCELLED and row["error"]["message"] == "deadline"
    assert row["completed_at"] >= row["deadline_at"]
    steps = {s["step_id"]: s for s in db.steps(run.id)}
    step_id, name = cancelled_at
    assert (steps[step_id]["name"], steps[step_id]["error"]["type"]) == (name, CANCELLED)
    assert tags(marks, run.id) == ["before", "before:end"]  # nothing ran after the sleep or the wait


def test_a_running_run_is_cancelled_at_its_next_step_after_its_deadline(db, marks, tmp_path, start_worker):
    """The step in progress at the deadline finishes and is recorded; the next
    step call raises Cancelled('deadline'), which the body may clean up after."""
    release = tmp_path / "release"
    ready(start_worker("w-deadline", threads=2, imports=IMPORTS))
    run = schedule_one(db, tf.steps_on, marks, str(release), deadline=3)
    wait_for(lambda: "held" in tags(marks, run.id), what="the first step running")
    wait_for(lambda: db.value("SELECT deadline_at <= now() FROM everystep_workflow WHERE id = %s", (run.id,)),
             what="the deadline passed")
    assert status(db, run.id) == "running"  # nobody interrupts a sync step
    release.touch()
    row = ended(db, run.id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
    assert row["cancel_requested_at"] is not None  # written as its request when delivered
    steps = {s["step_id"]: (s["status"], s["error"] and s["error"]["type"]) for s in db.steps(run.id)}
    assert steps["1"] == ("done", None) and steps["2"] == ("failed", CANCELLED)
    assert "next" not in tags(marks, run.id) and "cleanup:deadline" in tags(marks, run.id)


def test_a_delayed_run_whose_deadline_comes_first_is_cancelled_before_it_does_anything(db, marks, start_worker):
    start_worker("w-deadline", threads=2, imports=IMPORTS)
    run = schedule_one(db, tf.has_a_timeout, marks, after=3600, deadline=1)
    assert status(db, run.id) == "waiting"
    row = ended(db, run.id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
    assert tags(marks, run.id) == []


def test_a_child_inherits_the_earlier_of_its_own_and_its_parents_deadline(db, marks, start_worker):
    own = schedule_one(db, tf.parent_of_child, marks, True)  # parent 3600 s, child 60 s: the child's own
    inherited = schedule_one(db, tf.parent_of_child, marks, False)  # a child without a timeout: the parent's
    earlier = schedule_one(db, tf.parent_of_child, marks, True, deadline=8)  # the parent's 8 s beat the child's 60
    db.run_pending()
    child = {run.id: db.value("SELECT id FROM everystep_workflow WHERE parent_id = %s", (run.id,))
             for run in (own, inherited, earlier)}
    started = db.value("SELECT created_at FROM everystep_workflow WHERE id = %s", (child[own.id],))
    assert 59 < (deadline_of(db, child[own.id]) - started).total_seconds() < 65
    assert deadline_of(db, child[inherited.id]) == deadline_of(db, inherited.id)
    assert deadline_of(db, child[earlier.id]) == deadline_of(db, earlier.id)

    start_worker("w-deadline", threads=2, imports=IMPORTS)  # both parked runs are cancelled at that deadline
    for run_id in (earlier.id, child[earlier.id]):
        row = ended(db, run_id)
        assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
    assert status(db, own.id) == "waiting" and status(db, child[own.id]) == "waiting"


def test_a_run_past_its_deadline_at_its_end_ends_cancelled_with_its_result(db, marks):
    """No step call after the deadline passed: the statement that ends the
    run finds it past its deadline, and writes `cancelled` (its result kept)."""
    run = schedule_one(db, tf.has_a_timeout, marks, deadline=30)
    with db.connect() as conn:
        (claimed,) = everystep.db.claim(conn, "test-runner", 1)
        conn.execute("UPDATE everystep_workflow SET deadline_at = now() WHERE id = %s", (run.id,))
    from everystep.runner import Runner  # noqa: PLC0415

    before = timeouts(tf.has_a_timeout, "deadline")
    engine = Runner(db.pool, "test-runner")
    try:
        assert engine.execute(claimed).outcome == "cancelled"
    finally:
        engine.close()
    row = db.run(run.id)
    assert (row["status"], row["cancel_reason"], row["result"]) == ("cancelled", "deadline", "timed")
    assert timeouts(tf.has_a_timeout, "deadline") == before + 1
    from tests.test_cli import cli, ok  # noqa: PLC0415

    assert "cancel          at its end: deadline" in ok(cli(db, "runs", "show", str(run.id)))


def test_deadline_cancels_are_counted_once(db, marks):
    before = timeouts(tf.sleeps_long, "deadline")
    run = schedule_one(db, tf.sleeps_long, marks, deadline=60)
    assert db.run_pending() == {run.id: "sleeping"}
    with db.connect() as conn:  # a minute later, as far as this run is concerned
        conn.execute("UPDATE everystep_workflow SET deadline_at = now(), due_at = now() WHERE id = %s", (run.id,))
    assert db.run_pending() == {run.id: "cancelled"}
    assert timeouts(tf.sleeps_long, "deadline") == before + 1


def test_runs_show_gives_the_deadline_and_the_timeouts(db, marks):
    from tests.test_cli import cli, ok  # noqa: PLC0415

    run = schedule_one(db, tf.retries_a_timeout, marks, 1, deadline=3600)
    assert db.run_pending() == {run.id: "completed"}
    shown = ok(cli(db, "runs", "show", str(run.id)))
    assert "deadline        " in shown and "(met)" in shown
    assert "timeouts        1 step attempt timed out (step 1)" in shown
    assert f"{STEP_TIMEOUT}: step tests.apps.timeout_workflows.hangs_at_first did not finish" in shown
    assert json.loads(ok(cli(db, "runs", "show", "--json", str(run.id))))["deadline_at"] is not None

    cancelled = schedule_one(db, tf.sleeps_long, marks, deadline=3600)
    db.run_pending()
    assert "(in 60 min)" in ok(cli(db, "runs", "show", str(cancelled.id)))
    with db.connect() as conn:  # an hour later, as far as this run is concerned
        conn.execute("UPDATE everystep_workflow SET deadline_at = now(), due_at = now() WHERE id = %s",
                     (cancelled.id,))
    assert db.run_pending() == {cancelled.id: "cancelled"}
    shown = ok(cli(db, "runs", "show", str(cancelled.id)))
    assert "deadline        " in shown and "(passed)" in shown
    assert "cancel          requested " in shown and ": deadline" in shown


@pytest.mark.parametrize("unsafe", [False, True])
def test_an_async_run_past_its_deadline_has_its_running_step_cancelled(db, marks, tmp_path, start_worker, unsafe):
    """As a cancel request does: the worker looks for its async runs past
    their deadline every poll, and cancels their steps at their next await."""
    from tests.apps import async_workflows as flows  # noqa: PLC0415

    hold = tmp_path / "hold"
    hold.touch()
    ready(start_worker("w-async", poll=0.2, imports=("tests.apps.async_workflows",)))
    run = schedule_one(db, flows.held_then_more, marks, str(hold), unsafe, deadline=3)
    wait_for(lambda: flows.marks_of(marks), what="the step started")
    row = ended(db, run.id)
    assert hold.exists()  # the step never got to its end: it was cancelled at an await
    (step,) = db.steps(run.id)
    if unsafe:  # cancelled mid-effect: the effect may have happened
        assert row["status"] == "blocked" and step["status"] == "started"
    else:
        assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
        assert step["status"] == "failed" and step["error"] == {**step["error"], "type": CANCELLED,
                                                                 "message": "deadline"}


def test_the_testing_clock_brings_a_deadline_as_it_brings_a_wake_time(everystep_db, marks):
    """advance() stops at the parked run's deadline (its due time), and the
    drain there cancels it: an hour's sleep with a minute's deadline."""
    from everystep.testing import advance, drain  # noqa: PLC0415
    from tests.support.engine import schedule_in  # noqa: PLC0415

    conn = everystep_db
    run = schedule_in(conn, tf.sleeps_long, marks, deadline=60)
    drain(conn)
    assert everystep.db.load_run(conn, run.id)["status"] == "waiting"
    advance(conn, 7200)
    row = everystep.db.load_run(conn, run.id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
    assert (row["completed_at"] - row["deadline_at"]).total_seconds() < 1  # at its deadline, not at the wake time


def test_the_producer_and_worker_roles_schedule_and_cancel_by_deadline(db, marks, roles, tmp_path):  # noqa: F811
    """Least privilege: the producer writes a run's deadline (schedule,
    schedule_many); a worker process under the worker role starts a child
    with one and cancels both by it."""
    from psycopg import conninfo  # noqa: PLC0415

    from tests.support.processes import WorkerProcess  # noqa: PLC0415
    from tests.test_roles import as_role  # noqa: PLC0415

    with as_role(db, f"{roles}producer") as conn, everystep.transaction(conn):
        parent = everystep.schedule(tf.parent_of_child, marks, False, deadline=10)
        (many,) = everystep.schedule_many(tf.has_a_timeout, [(marks,)])
    assert deadline_of(db, parent.id) is not None and deadline_of(db, many.id) is not None
    url = conninfo.make_conninfo(db.url, options=f"-c search_path={db.schema} -c role={roles}worker")
    worker = WorkerProcess(url, "role-worker", tmp_path / "logs", imports=IMPORTS)
    try:
        assert ended(db, many.id)["status"] == "completed"
        wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE parent_id = %s", (parent.id,)),
                 what="the child started")
        row = ended(db, parent.id)
        assert (row["status"], row["cancel_reason"]) == ("cancelled", "deadline")
        child = db.value("SELECT id FROM everystep_workflow WHERE parent_id = %s", (parent.id,))
        assert deadline_of(db, child) == deadline_of(db, parent.id)
        assert (ended(db, child)["status"], db.run(child)["cancel_reason"]) == ("cancelled", "deadline")
    finally:
        worker.signal(15)
        worker.proc.wait(30)


def test_a_supervisor_serves_the_timeouts_of_its_workers(db, marks, supervisors):
    """One scrape of the fleet's /metrics: everystep_timeouts_total{workflow,kind}."""
    from tests.support.scraping import get, samples, value  # noqa: PLC0415
    from tests.support.supervisor_process import config  # noqa: PLC0415

    sup = supervisors(config(db.url, "tmo", imports=list(IMPORTS)))
    sup.wait_workers({"tmo-0", "tmo-1"})
    timed = schedule_one(db, tf.counted, marks)
    late = schedule_one(db, tf.sleeps_long, marks, deadline=4)
    assert ended(db, timed.id)["status"] == "completed"
    assert ended(db, late.id)["status"] == "cancelled"

    def counts():
        status, body = get(f"http://127.0.0.1:{sup.port}/metrics")
        assert status == 200, body
        found = samples(body)
        return (value(found, "everystep_timeouts_total", workflow=tf.counted.__everystep_workflow__, kind="step"),
                value(found, "everystep_timeouts_total", workflow=tf.sleeps_long.__everystep_workflow__,
                      kind="deadline"))

    wait_for(lambda: counts() == (1.0, 1.0), timeout=20, what="both timeouts counted")


def test_the_schedule_command_takes_a_deadline(db):
    from tests.test_cli import cli, error_line, ok  # noqa: PLC0415

    out = ok(cli(db, "schedule", "tests.apps.timeout_workflows:has_a_timeout", '"m"', "--deadline", "30"))
    run_id = out.split()[2]
    seconds = db.value("SELECT extract(epoch FROM deadline_at - created_at) FROM everystep_workflow WHERE id = %s",
                       (run_id,))
    assert 29 < seconds < 31  # earlier than the workflow's timeout (120 s)
    assert db.value("SELECT details->>'deadline' FROM everystep_audit WHERE run_id = %s", (run_id,)) == "30.0"
    assert "expected a number of seconds > 0" in error_line(
        cli(db, "schedule", "tests.apps.timeout_workflows:has_a_timeout", '"m"', "--deadline", "-1"), 2)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 1
