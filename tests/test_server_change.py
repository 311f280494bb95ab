"""The dead-claimer sweep across a change of database server: a restarted
server, or a standby promoted by a failover, holds none of the workers'
advisory locks, so until the live workers have reconnected every one of them
looks dead. The sweep notices the change (`everystep.db.server`) and takes nobody
for dead before `grace` seconds after it; what it saw on the previous server
does not count. On a server in recovery it judges nobody."""

from __future__ import annotations

import logging
import time

import psycopg
import pytest

import everystep
import everystep.db
from everystep import liveness
from tests.apps import workflows
from tests.support.processes import wait_for

GRACE = 2.0


@pytest.fixture
def held_run(private_server):
    """A run held by the claimer `w-live`, as a worker's claim leaves it."""
    with psycopg.connect(private_server.url, autocommit=True) as conn:
        with everystep.transaction(conn):
            run = everystep.schedule(workflows.quick, "/nonexistent")
        (claimed,) = everystep.db.claim(conn, "w-live", 1)
    assert claimed.id == run.id
    return run


def connect(server) -> psycopg.Connection:
    return psycopg.connect(server.url, autocommit=True)


def status(server, run) -> tuple:
    with connect(server) as conn:
        return conn.execute("SELECT status, claimed_by FROM everystep_workflow WHERE id = %s", (run.id,)).fetchone()


def test_the_server_of_a_session_changes_with_a_restart_not_with_a_new_session(private_server):
    with connect(private_server) as first, connect(private_server) as second:
        before = everystep.db.server(first)
        assert everystep.db.server(second) == before
    assert before.timeline == 1
    private_server.restart()
    with connect(private_server) as conn:
        after = everystep.db.server(conn)
    assert after.started_at > before.started_at
    assert (after.system_identifier, after.timeline) == (before.system_identifier, before.timeline)


def test_locks_seen_free_before_a_restart_do_not_count_after_it(private_server, held_run, caplog):
    """The claimer's lock is free when the sweep looks (its worker lost its
    session), then the server restarts. The worker takes its lock again a
    little after the grace since that first look, but within the grace since
    the sweep first saw the restarted server: it is alive, and keeps its run.
    A claimer that really is dead is still recovered, a grace after the
    sweep saw the new server."""
    sweep = liveness.DeadClaimerSweep(grace=GRACE, max_crashes=3)
    with connect(private_server) as conn:
        assert sweep.sweep(conn) == []  # w-live's lock is free: a suspect
    first_look = time.monotonic()
    private_server.restart()
    time.sleep(max(0.0, first_look + GRACE + 0.2 - time.monotonic()))
    caplog.set_level(logging.WARNING, logger="everystep")
    with connect(private_server) as conn:
        # The grace since the first look is over, but that look was on another server.
        assert sweep.sweep(conn) == []
        assert "the database server changed" in caplog.text
        with connect(private_server) as worker:
            assert everystep.db.try_lock(worker, "w-live")  # the worker is back
            time.sleep(GRACE)
            assert sweep.sweep(conn) == []
            assert status(private_server, held_run) == ("running", "w-live")
            worker_backend = worker.info.backend_pid
        # Now its session ends for good: dead a grace after the sweep sees its
        # lock free (the server ends the backend a moment after the client closes).
        wait_for(lambda: not conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                          (worker_backend,)).fetchone(), 10, what="the worker's backend gone")
        assert sweep.sweep(conn) == []
        time.sleep(GRACE)
        assert sweep.sweep(conn) == [held_run.id]
    assert status(private_server, held_run) == ("scheduled", None)


def test_a_standby_judges_nobody_and_its_promotion_starts_the_grace_again(private_server, held_run, caplog):
    """On a server in recovery every lock is free and nothing can be written:
    the sweep takes nobody for dead there. Promoted under the sweep's open
    session (same postmaster, a new timeline), it is a server of its own:
    the grace starts when the sweep sees it promoted."""
    private_server.become_standby()
    sweep = liveness.DeadClaimerSweep(grace=GRACE, max_crashes=3)
    caplog.set_level(logging.WARNING, logger="everystep")
    with connect(private_server) as conn:
        assert everystep.db.server(conn).timeline is None
        assert sweep.sweep(conn) == []
        time.sleep(GRACE + 0.2)
        assert sweep.sweep(conn) == []  # w-live's lock was free all along: nobody is judged on a standby
        private_server.promote()
        promoted = everystep.db.server(conn)
        assert promoted.timeline == 2
        assert sweep.sweep(conn) == []
        assert "the database server changed (in recovery -> timeline 2)" in caplog.text
        promoted_at = time.monotonic()
        requeued = wait_for(lambda: sweep.sweep(conn), timeout=GRACE + 10, interval=0.1,
                            what="the dead claimer recovered")
        assert time.monotonic() - promoted_at >= GRACE
    assert requeued == [held_run.id]
