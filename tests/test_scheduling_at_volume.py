"""Bulk scheduling (`schedule_many`) and who gets notified: scheduling
notifies only when a worker is waiting for runs, once per transaction, and a
worker that starts waiting never misses a run scheduled meanwhile."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

import everystep
import everystep.db
from everystep import EverystepError, schedule, schedule_many
from tests.apps.workflows import held, quick
from tests.support.processes import wait_for


@everystep.workflow
def echo(value):
    return value


def count_runs(db) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow")


def test_schedule_many_inserts_every_run_in_order_into_the_callers_transaction(db):
    with db.connect() as conn:
        with pytest.raises(RuntimeError):
            with everystep.transaction(conn):
                schedule_many(echo, [(1,), (2,)])
                raise RuntimeError("rolled back")
        assert count_runs(db) == 0
        with everystep.transaction(conn):
            runs = schedule_many(echo, [(i,) for i in range(500)])
    assert [run.created for run in runs] == [True] * 500
    assert all(run.id.version == 7 and run.name == echo.__everystep_workflow__ for run in runs)
    assert sorted(runs, key=lambda r: r.id) == runs  # creation order is input order
    ended = db.run_pending()
    assert set(ended) == {run.id for run in runs} and set(ended.values()) == {"completed"}
    assert [db.run(run.id)["result"] for run in runs[:3]] == [0, 1, 2]
    with db.connect(autocommit=False) as conn:
        assert schedule_many(echo, [], conn=conn) == []


def test_schedule_many_honours_idempotency_keys_within_and_across_batches(db):
    with db.connect() as conn, everystep.transaction(conn):
        first = schedule(echo, "a", idempotency_key="k1")
    with db.connect() as conn, everystep.transaction(conn):
        runs = schedule_many(echo, [("x",), ("y",), ("z",), ("w",)], idempotency_keys=["k1", "k2", "k2", None])
    assert [run.created for run in runs] == [False, True, False, True]
    assert runs[0].id == first.id
    assert runs[2].id == runs[1].id
    assert count_runs(db) == 3
    assert db.run(runs[1].id)["args"] == ["y"]
    assert db.run(first.id)["args"] == ["a"]  # the existing run is kept as it was


def test_schedule_many_refuses_bad_input_before_inserting_anything(db):
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(TypeError, match="schedule_many"):
            schedule_many(print, [(1,)])
        with pytest.raises(EverystepError, match="run 1 has arguments"):
            schedule_many(echo, [(1,), 2])
        with pytest.raises(EverystepError, match="list of argument tuples"):
            schedule_many(echo, "abc")
        with pytest.raises(EverystepError):
            schedule_many(echo, [(1,), (object(),)])  # not serializable
        with pytest.raises(EverystepError, match="2 keys for 3 runs"):
            schedule_many(echo, [(1,), (2,), (3,)], idempotency_keys=["a", "b"])
        with pytest.raises(EverystepError, match="at most 255"):
            schedule_many(echo, [(1,)], idempotency_keys=["k" * 256])
    with db.connect(autocommit=True) as conn:
        with pytest.raises(EverystepError, match="autocommit"):
            schedule_many(echo, [(1,)], conn=conn)
    with pytest.raises(EverystepError, match="no transaction"):
        schedule_many(echo, [(1,)])
    assert count_runs(db) == 0


def notifications(listener: psycopg.Connection, wait: float = 0.3) -> int:
    return len(list(listener.notifies(timeout=wait)))


def test_scheduling_notifies_once_per_transaction_and_only_when_a_worker_waits(db):
    with db.connect() as listener:
        everystep.db.listen(listener)
        with db.connect() as conn:
            with everystep.transaction(conn):
                schedule(echo, 1)
            assert notifications(listener) == 0  # nobody waits: no notification, no serialised commit
            everystep.db.wait_for_runs(conn, "w1")
            with everystep.transaction(conn):
                for i in range(3):
                    schedule(echo, i)
                schedule_many(echo, [(1,), (2,)])
                assert notifications(listener, 0.1) == 0  # not before the commit
            assert notifications(listener, 2) == 1
            with everystep.transaction(conn):
                schedule_many(echo, [(1,)])
            assert notifications(listener, 2) == 1
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            everystep.db.stop_waiting(conn, "w1")
            schedule(echo, 9, conn=conn)
            conn.execute("COMMIT")
            assert notifications(listener, 2) == 1  # a fixed snapshot could miss a registration: always notify
            with everystep.transaction(conn):
                schedule(echo, 10)
            assert notifications(listener) == 0


def test_a_worker_starting_to_wait_waits_for_schedulers_in_flight_then_sees_their_runs(db):
    with db.connect() as scheduler, db.connect() as control:
        with everystep.transaction(scheduler):
            run = schedule(echo, "in flight")  # found nobody waiting: will not notify
            registered = threading.Event()
            thread = threading.Thread(target=lambda: (everystep.db.wait_for_runs(control, "w1"), registered.set()))
            thread.start()
            assert not registered.wait(0.5)  # the registration waits for this transaction
        thread.join(10)
        assert registered.is_set()
        assert [claimed.id for claimed in everystep.db.claim(control, "w1", 10)] == [run.id]


def test_a_worker_waits_for_runs_only_while_a_slot_is_free(db, start_worker, marks, tmp_path):
    release = tmp_path / "release"
    worker = start_worker("w1", threads=1, poll=60)  # a minute's poll: only a notification is fast
    worker.wait_logged("holding the lock of")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_waiting WHERE runner = 'w1'") == 1, 10,
             what="the idle worker registered as waiting")
    with db.connect() as conn, everystep.transaction(conn):
        busy = schedule(held, marks, str(release))
    wait_for(lambda: db.run(busy.id)["status"] == "running", 10, what="the run picked up at once")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_waiting") == 0, 10,
             what="the full worker no longer waiting")
    Path(release).touch()
    wait_for(lambda: db.run(busy.id)["status"] == "completed", 10, what="the held run completed")
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_waiting") == 1, 10, what="waiting again")
    with db.connect() as conn, everystep.transaction(conn):
        again = schedule(quick, marks)
    # Woken by the notification: the poll would take a minute.
    wait_for(lambda: db.run(again.id)["status"] == "completed", 10, what="the next run completed")
