"""One execution per claim: execution tokens, durable claims, and fenced
writes that say why they matched nothing — real worker processes against a
real PostgreSQL, crashed where a scenario needs it.

Step executions are counted outside the database (tests/apps/workflows.py marks a
file), so a commit of the test's own cannot flush a lost claim back to disk."""

from __future__ import annotations

import psycopg
import pytest

import everystep
import everystep.db
from everystep import schedule
from tests.apps import workflows
from tests.support.engine import take_lock_from
from tests.support.processes import WorkerProcess, wait_for


def tags_of(marks, run_id) -> list[str]:
    return [tag for run, tag, _ in workflows.marks_of(marks) if run == str(run_id)]


def one_at_a_time(tags: list[str], tag: str) -> bool:
    """Every start of `tag` comes after the end of the one before: never two
    executions of the step at the same time."""
    seen = [t for t in tags if t in (tag, tag + ":end")]
    return all(t == (tag if i % 2 == 0 else tag + ":end") for i, t in enumerate(seen))


def test_a_claim_survives_a_server_crash_and_its_step_runs_once(private_server, tmp_path, marks):
    """The claim is on disk before its run starts: after a crash that loses
    every commit not flushed (and with synchronous_commit off for the whole
    database), the run is still held by its worker, which goes on with it; a
    second worker never runs the same step at the same time."""
    private_server.lose_unflushed_commits()
    release = tmp_path / "release"
    with psycopg.connect(private_server.url, autocommit=True) as conn, everystep.transaction(conn):
        run = schedule(workflows.held_once, marks, str(release))
    first = WorkerProcess(private_server.url, "w-first", tmp_path / "logs", threads=1, grace=60)
    second = None
    try:
        wait_for(lambda: tags_of(marks, run.id) == ["held"], what="the step started")
        private_server.crash()
        second = WorkerProcess(private_server.url, "w-second", tmp_path / "logs", threads=1, poll=0.2)
        second.wait_logged("holding the lock of w-second", timeout=30)
        wait_for(lambda: first.output().count("holding the lock of w-first") == 2, timeout=30,
                 what="the first worker took its lock again")
        with psycopg.connect(private_server.url, autocommit=True) as conn:
            row = conn.execute("SELECT status, claimed_by FROM everystep_workflow WHERE id = %s", (run.id,)).fetchone()
        assert row == ("running", "w-first")  # the claim was not lost with the crash
        release.touch()
        with psycopg.connect(private_server.url, autocommit=True) as conn:
            wait_for(lambda: conn.execute("SELECT status FROM everystep_workflow WHERE id = %s", (run.id,))
                     .fetchone()[0] == "completed", timeout=30, what="the run completed")
        assert tags_of(marks, run.id) == ["held", "held:end"]  # one execution, by the first worker
        assert first.alive() and second.alive()
    finally:
        first.close()
        if second is not None:
            second.close()


def test_the_engine_commits_synchronously_when_the_database_says_off(private_server):
    private_server.lose_unflushed_commits()
    with psycopg.connect(private_server.url, autocommit=True) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "off"
        everystep.db.prepare_session(conn)
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "on"
        conn.execute("SET synchronous_commit = remote_apply")
        everystep.db.prepare_session(conn)  # a stronger setting of the user's is kept
        assert conn.execute("SHOW synchronous_commit").fetchone()[0] == "remote_apply"


def control_backend(name: str) -> str:
    return f"everystep {name} control"[:63]


def test_a_run_claimed_again_by_a_retried_end_never_executes_twice_in_one_worker(db, start_worker, marks, tmp_path):
    """A run whose end statement fails on a lost connection retries it once
    the worker has its lock again; meanwhile another run of the worker (A)
    was taken away and is scheduled again, so the retried statement claims it
    as the successor of its slot, while A's abandoned execution still runs in
    the worker. The new claim waits for the old execution to be gone."""
    release_a, release_b = tmp_path / "release-a", tmp_path / "release-b"
    run_a, run_b = db.schedule_many(workflows.held_once, [(marks, str(release_a)), (marks, str(release_b))])
    name = f"w-twice-{db.schema}"
    worker = start_worker(name, threads=2, grace=60)
    wait_for(lambda: tags_of(marks, run_a.id) == ["held"] and tags_of(marks, run_b.id) == ["held"],
             what="both steps started")
    with db.connect(autocommit=False) as blocker, db.connect() as thief:
        # B's end statement waits on B's row, locked here ...
        blocker.execute("SELECT 1 FROM everystep_workflow WHERE id = %s FOR UPDATE", (run_b.id,))
        release_b.touch()
        wait_for(lambda: thief.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
            (f"everystep {name}"[:63],)).fetchone()[0] == 1, what="B's end statement waiting")
        # ... until its connection and the worker's lock connection are cut. The
        # lock is taken before the worker comes back, and A is put back in the
        # queue, as the sweep of another supervisor would.
        take_lock_from(thief, name, (control_backend(name), f"everystep {name}"))
        thief.execute("UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL WHERE id = %s",
                      (run_a.id,))
        blocker.rollback()
    worker.wait_logged("1 runs in flight were recovered elsewhere while the lock was lost; abandoning them")
    wait_for(lambda: db.run(run_b.id)["status"] == "completed", what="B ended by the retried statement")
    wait_for(lambda: db.run(run_a.id)["claimed_by"] == name, what="A claimed again")
    release_a.touch()
    wait_for(lambda: db.run(run_a.id)["status"] == "completed", what="A completed")
    tags = tags_of(marks, run_a.id)
    assert one_at_a_time(tags, "held"), tags
    assert tags == ["held", "held:end", "held", "held:end"]  # the abandoned execution, then the new claim's
    assert worker.alive() and "engine error" not in worker.output()


def insert_step_row(db, run_id, step_id: str, name: str, status: str, result=None) -> None:
    """A step row written by another execution (no token of this one)."""
    db.query("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result)"
             " VALUES (%s, %s, %s, '[]', '{}', %s, %s) RETURNING id",
             (run_id, step_id, name, status, None if result is None else psycopg.types.json.Jsonb(result)))


@pytest.mark.parametrize("workflow", [workflows.held_once, workflows.held_then_quick])
def test_a_step_row_written_by_another_execution_is_not_a_lost_claim(db, start_worker, marks, tmp_path, workflow):
    """The run is still held, but its step's row is there already: the
    execution stops, and the worker replays the run, which takes the row's
    outcome. The run ends; it is never left running under a live worker."""
    release = tmp_path / "release"
    (run,) = db.schedule_many(workflow, [(marks, str(release))])
    worker = start_worker(f"w-row-{db.schema}", threads=1, grace=60)
    wait_for(lambda: tags_of(marks, run.id) == ["held"], what="the step started")
    insert_step_row(db, run.id, "1", "tests.apps.workflows.hold_until", "done", "recorded elsewhere")
    release.touch()
    wait_for(lambda: db.run(run.id)["status"] in ("completed", "failed"), what="the run ended")
    ended = db.run(run.id)
    assert ended["status"] == "completed", ended["error"]
    first = ended["result"] if workflow is workflows.held_once else ended["result"][0]
    assert first == "recorded elsewhere"
    assert worker.alive()


def test_an_unsafe_steps_mark_from_another_execution_blocks_and_the_effect_never_runs(db, start_worker, marks,
                                                                                      tmp_path):
    release = tmp_path / "release"
    (run,) = db.schedule_many(workflows.held_then_unsafe, [(marks, str(release))])
    start_worker(f"w-unsafe-{db.schema}", threads=1, grace=60)
    wait_for(lambda: tags_of(marks, run.id) == ["held"], what="the first step started")
    # Another execution is (or was) in the effect.
    insert_step_row(db, run.id, "2", "tests.apps.workflows.unsafe_effect", "started")
    release.touch()
    wait_for(lambda: db.run(run.id)["status"] == "blocked", what="the run blocked")
    assert "effect" not in tags_of(marks, run.id)  # the effect was not started a second time
    steps = {s["step_id"]: s["status"] for s in db.steps(run.id)}
    assert steps == {"1": "done", "2": "started"}


def test_every_claim_gives_a_new_token_and_stale_tokens_write_nothing(db):
    (run,) = db.schedule_many(workflows.quick, [("/nonexistent",)])
    with db.connect() as conn:
        (first,) = everystep.db.claim(conn, "w1", 1)
        (again,) = everystep.db.reclaim_held(conn, "w1")  # as a catchup does
        assert again.id == first.id and again.token != first.token
        row = everystep.db.StepRow("1", "tests.apps.workflows.work", "[]", "{}", "started", None, None, 1.0, None)
        assert not everystep.db.record_step(conn, run.id, "w1", first.token, row)  # the stale execution writes nothing
        assert everystep.db.why_not_written(conn, run.id, "w1", first.token, "1", "started") == everystep.db.LOST
        assert everystep.db.record_step(conn, run.id, "w1", again.token, row)
        # A retry of the same write finds its own row; another execution's row is not its own.
        assert everystep.db.why_not_written(conn, run.id, "w1", again.token, "1", "started") == everystep.db.WRITTEN
        (third,) = everystep.db.reclaim_held(conn, "w1")
        assert everystep.db.why_not_written(conn, run.id, "w1", third.token, "1", "started") == everystep.db.OTHER
        assert everystep.db.reclaim_held(conn, "w1", [third.token]) == []  # held by a live execution: left alone
    token_of_row = db.value("SELECT claim_token FROM everystep_step WHERE workflow_id = %s", (run.id,))
    assert token_of_row == again.token
