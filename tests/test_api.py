"""The API: schedule() and its transaction, idempotency, notification;
everything outside a workflow is plain Python; current(); the exported errors."""

from __future__ import annotations

import threading
import uuid

import pytest

import everystep
import everystep.db
from everystep import (
    EffectUncertain,
    EverystepError,
    WorkflowCodeError,
    parallel,
    schedule,
    step,
    workflow,
)
from tests.apps.engine_flows import (
    VALUES,
    boom,
    echo_workflow,
    record,
    round_trip,
    seen,
)
from tests.support.engine import schedule_one

# ---------------------------------------------------------------- scheduling


def test_schedule_rolled_back_leaves_nothing_and_committed_is_claimable(db):
    with db.connect() as conn:
        with pytest.raises(RuntimeError):
            with everystep.transaction(conn):
                schedule(echo_workflow, 1)
                raise RuntimeError("order failed")
        assert conn.execute("SELECT count(*) FROM everystep_workflow").fetchone()[0] == 0
        with everystep.transaction(conn):
            run = schedule(echo_workflow, 2)
            assert isinstance(run.id, uuid.UUID) and run.id.version == 7
    assert db.run(run.id)["status"] == "scheduled"
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == 2


def test_schedule_writes_into_an_explicit_or_bound_connection_only(db):
    with pytest.raises(EverystepError, match="no transaction"):
        schedule(echo_workflow, 1)
    with db.connect(autocommit=True) as conn:
        with pytest.raises(EverystepError, match="autocommit"):
            schedule(echo_workflow, 1, conn=conn)
    with db.connect(autocommit=False) as conn:
        schedule(echo_workflow, 3, conn=conn)
        with everystep.use(conn):
            schedule(echo_workflow, 4)
        conn.rollback()
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_schedule_refuses_a_function_that_is_not_a_workflow(db):
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(TypeError):
            schedule(record, "x")
        with pytest.raises(TypeError):
            schedule(print)
    assert db.value("SELECT count(*) FROM everystep_workflow") == 0


def test_schedule_notifies_listeners_at_commit(db):
    with db.connect() as listener:
        everystep.db.listen(listener)
        everystep.db.wait_for_runs(listener, "a listener")  # scheduling notifies only when a worker waits
        with db.connect() as conn, everystep.transaction(conn):
            schedule(echo_workflow, 1)
            assert list(listener.notifies(timeout=0.2)) == []  # not before commit
        assert [n.channel for n in listener.notifies(timeout=2, stop_after=1)] == [f"everystep:{db.schema}"]


def test_idempotency_under_eight_concurrent_schedulers(db):
    barrier = threading.Barrier(8)
    ids = []

    def one():
        with db.connect() as conn, everystep.transaction(conn):
            barrier.wait()
            ids.append(schedule(echo_workflow, "once", idempotency_key="order:42"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.id for r in ids}) == 1
    assert sum(r.created for r in ids) == 1
    assert db.value("SELECT count(*) FROM everystep_workflow") == 1
    # Another workflow may use the same key.
    with db.connect() as conn, everystep.transaction(conn):
        assert schedule(round_trip, VALUES, idempotency_key="order:42").created


# ---------------------------------------------------------------- outside a workflow


def test_outside_a_workflow_everything_is_plain_python():
    assert everystep.current() is None
    assert record("plain", everystep_id="ignored") == "plain"
    assert echo_workflow(5) == 5
    barrier = threading.Barrier(2, timeout=5)
    assert parallel(lambda: barrier.wait() is not None and "a",
                    [lambda: barrier.wait() is not None and "b", lambda: "c"]) == ("a", ("b", "c"))
    assert parallel() == ()
    with pytest.raises(ExceptionGroup):
        parallel(lambda: boom("p"), lambda: boom("q"))


@step
def look_around():
    ctx = everystep.current()
    seen["in_step"] = (ctx.workflow_id, ctx.workflow_name)
    return 1


@workflow
def introspect():
    look_around()
    ctx = everystep.current()
    seen["outcomes"] = dict(ctx.outcomes)
    seen["in_body"] = ctx.workflow_id


def test_current_gives_the_running_workflow(db):
    run = schedule_one(db, introspect)
    db.run_pending()
    assert seen["in_step"] == (run.id, "tests.test_api.introspect")
    assert seen["in_body"] == run.id
    assert seen["outcomes"]["1"].status == "done" and seen["outcomes"]["1"].result == 1


def test_errors_are_exported():
    assert issubclass(WorkflowCodeError, EverystepError)
    assert issubclass(EffectUncertain, EverystepError)
    assert issubclass(everystep.LostClaim, EverystepError)
