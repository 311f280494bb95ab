"""A claim's runs arrive before its commit (db.claim_before_commit): a
worker starts them while the commit's WAL flush goes on, and their
executions read and write nothing before it returned. A deferred trigger
on the claimed runs' table holds the claim's commit back (or fails it), so
that the order of things is seen, not guessed."""

from __future__ import annotations

import time

import psycopg
import pytest

import everystep.db
from tests.apps import workflows
from tests.benchmarks.workflows import latency_probe
from tests.support.processes import wait_for

# The commit of a transaction that claimed a run waits `seconds`, then fails
# if `fail` (only the first `fail_times` such commits: a sequence, which a
# failed commit does not roll back, counts them); at its end it notes when.
SLOW_COMMIT = """
CREATE TABLE slow_commit (seconds float8 NOT NULL, fail boolean NOT NULL, fail_times integer NOT NULL);
CREATE TABLE claim_committed (at timestamptz NOT NULL);
CREATE SEQUENCE failed_commits;
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    s slow_commit;
BEGIN
    SELECT * INTO s FROM slow_commit;
    IF FOUND THEN
        PERFORM pg_sleep(s.seconds);
        IF s.fail AND nextval('failed_commits') <= s.fail_times THEN
            RAISE EXCEPTION 'this claim may not commit';
        END IF;
    END IF;
    INSERT INTO claim_committed VALUES (clock_timestamp());
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON everystep_claimed
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();
"""


def ddl(db, sql: str) -> None:
    with db.connect() as conn:
        conn.execute(sql)


def slow_commits(db, seconds: float, fail: bool = False, fail_times: int = 1) -> None:
    ddl(db, SLOW_COMMIT)
    with db.connect() as conn:
        conn.execute("INSERT INTO slow_commit VALUES (%s, %s, %s)", (seconds, fail, fail_times))


def test_a_claims_runs_arrive_before_its_commit_and_confirm_waits_for_it(db):
    (run,) = db.schedule_many(workflows.quick, [("unused",)])
    slow_commits(db, seconds=1.0)
    with db.connect() as conn:
        began = time.monotonic()
        runs, confirm = everystep.db.claim_before_commit(conn, "early", 5)
        arrived = time.monotonic() - began
        assert [claimed.id for claimed in runs] == [run.id]
        # Another session: the claim has not committed yet.
        assert db.value("SELECT status FROM everystep_workflow WHERE id = %s", (run.id,)) == "scheduled"
        confirm()
        confirmed = time.monotonic() - began
        assert db.query("SELECT status, claimed_by, claim_token FROM everystep_workflow WHERE id = %s",
                        (run.id,)) == [("running", "early", runs[0].token)]
        # The connection is out of the pipeline: the next statement runs as usual.
        assert everystep.db.claim(conn, "early", 5) == []
    assert arrived < 0.8 <= 1.0 <= confirmed, (arrived, confirmed)


def test_a_claim_whose_commit_fails_claims_nothing_and_leaves_the_connection_usable(db):
    (run,) = db.schedule_many(workflows.quick, [("unused",)])
    slow_commits(db, seconds=0.0, fail=True)
    with db.connect() as conn:
        runs, confirm = everystep.db.claim_before_commit(conn, "early", 5)
        assert [claimed.id for claimed in runs] == [run.id]
        with pytest.raises(psycopg.errors.RaiseException, match="this claim may not commit"):
            confirm()
        assert db.value("SELECT status FROM everystep_workflow WHERE id = %s", (run.id,)) == "scheduled"
        (again,) = everystep.db.claim(conn, "early", 5)  # the second commit is let through
        assert again.id == run.id and again.token != runs[0].token


def test_an_empty_claim_confirms_at_once(db):
    with db.connect() as conn:
        runs, confirm = everystep.db.claim_before_commit(conn, "early", 5)
        assert runs == []
        confirm()
        assert everystep.db.claim(conn, "early", 5) == []


def test_a_claim_that_admits_blocked_runs_then_finds_none_leaves_the_connection_free(db):
    """The claim's second try, after it admitted blocked runs (none of
    which it may take here), confirms its commit too."""
    (run,) = db.schedule_many(workflows.quick, [("unused",)])
    with db.connect() as conn:
        conn.execute("WITH r AS (DELETE FROM everystep_ready RETURNING run_id, name, priority, ready_at)"
                     " INSERT INTO everystep_blocked (run_id, name, priority, due_at)"
                     " SELECT run_id, name, priority, ready_at FROM r")
        runs, _ = everystep.db.claim_before_commit(conn, "early", 5, everystep.db.routes_of(["elsewhere.*"]))
        assert runs == []
        assert db.value("SELECT count(*) FROM everystep_ready") == 1  # admitted by the claim's catch-up
        assert [claimed.id for claimed in everystep.db.claim(conn, "early", 5)] == [run.id]


def test_a_workers_run_starts_while_its_claim_commits_and_writes_after(db, start_worker):
    slow_commits(db, seconds=1.0)
    ddl(db, """
        CREATE TABLE step_written (at timestamptz NOT NULL);
        CREATE FUNCTION step_written() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO step_written VALUES (clock_timestamp());
            RETURN NULL;
        END $$;
        CREATE TRIGGER step_written AFTER INSERT ON everystep_step FOR EACH ROW EXECUTE FUNCTION step_written();
    """)
    start_worker("w-early", threads=2, imports=("tests.benchmarks.workflows",)).wait_logged("holding the lock")
    (run,) = db.schedule_many(latency_probe, [()])
    wait_for(lambda: db.run(run.id)["status"] == "completed", timeout=30, what="the run completed")
    body_started = float(db.run(run.id)["result"])
    (committed,) = db.query("SELECT extract(epoch FROM at)::float8 FROM claim_committed")[0]
    assert body_started < committed - 0.5  # its body ran while the claim's commit waited
    (step,) = db.steps(run.id)
    assert step["status"] == "done" and float(step["result"]) == body_started
    # The step's row was written after the claim committed, once.
    (written,) = db.query("SELECT extract(epoch FROM at)::float8 FROM step_written")
    assert written[0] >= committed


def test_a_worker_whose_claim_fails_to_commit_stops_that_execution_and_claims_the_run_again(
        db, start_worker, marks):
    slow_commits(db, seconds=0.3, fail=True)
    worker = start_worker("w-early", threads=2)
    worker.wait_logged("holding the lock")
    (run,) = db.schedule_many(workflows.quick, [(marks,)])
    wait_for(lambda: db.run(run.id)["status"] == "completed", timeout=30, what="the run completed")
    worker.wait_logged("the commit of a claim of 1 runs failed")
    assert db.value("SELECT count(*) FROM everystep_step WHERE workflow_id = %s", (run.id,)) == 1
    # Its first execution ran the step's body before the commit failed; the second ran it again.
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["q", "q:end", "q", "q:end"]
    assert worker.alive()


def test_a_worker_whose_control_session_dies_while_its_claim_commits_abandons_that_execution(
        db, start_worker, marks):
    """The claim's commit is on its way when the server ends the worker's
    control session: whether it committed is unknown to the worker, which
    takes its lock again on a new session, finds the run not held, abandons
    the execution whose body ran meanwhile, and claims the run again."""
    slow_commits(db, seconds=30.0)
    worker = start_worker("w-cut", threads=2)
    worker.wait_logged("holding the lock")
    (run,) = db.schedule_many(workflows.quick, [(marks,)])
    wait_for(lambda: [tag for _, tag, _ in workflows.marks_of(marks)] == ["q", "q:end"], timeout=20,
             what="the step's body ran while its claim commits")
    committing = db.value("SELECT pid FROM pg_stat_activity"
                          " WHERE application_name = 'everystep w-cut control' AND wait_event = 'PgSleep'")
    assert committing is not None
    with db.connect() as conn:
        conn.execute("DELETE FROM slow_commit")  # the next claim commits at once
        conn.execute("SELECT pg_terminate_backend(%s)", (committing,))
    wait_for(lambda: db.run(run.id)["status"] == "completed", timeout=60, what="the run completed")
    worker.wait_logged("lost the control connection")
    assert db.value("SELECT count(*) FROM everystep_step WHERE workflow_id = %s", (run.id,)) == 1
    assert [tag for _, tag, _ in workflows.marks_of(marks)] == ["q", "q:end", "q", "q:end"]
    assert worker.alive()
