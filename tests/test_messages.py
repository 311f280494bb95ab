"""Messages into running workflows (send / wait_for) and events out of them
(set_event / get_event), against a real PostgreSQL and real worker processes."""

from __future__ import annotations

import signal

import psycopg
import pytest

import everystep
import everystep.db
from everystep import EverystepError
from tests.apps.flow_workflows import mailbox, publisher
from tests.apps.workflows import marks_of
from tests.support.processes import WorkerProcess, wait_for

IMPORTS = ("tests.apps.workflows", "tests.apps.flow_workflows")


def start(db, fn, *args):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args).id


def send(db, run_id, payload, topic="in", key=None):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.send(run_id, topic, payload, idempotency_key=key)


def status(db, run_id):
    return db.run(run_id)["status"]


def test_a_message_sent_before_the_wait_is_kept_and_messages_come_in_order(db, marks):
    run = start(db, mailbox, marks, 3)
    send(db, run, {"n": 1})
    send(db, run, [2])
    send(db, run, "other topic", topic="elsewhere")
    db.run_pending()
    assert status(db, run) == "waiting"  # parked in the third wait, no slot held
    assert db.run(run)["claimed_by"] is None
    send(db, run, 3)
    db.run_pending()
    row = db.run(run)
    assert row["status"] == "completed", row["error"]
    assert row["result"] == [{"n": 1}, [2], 3]
    with db.connect() as conn:
        messages = everystep.db.load_messages(conn, run)
    consumed = [(m["topic"], m["consumed_by"]) for m in messages]
    assert consumed == [("in", "1"), ("in", "3"), ("elsewhere", None), ("in", "5")]


def test_a_message_sent_in_a_rolled_back_transaction_is_never_seen(db, marks):
    run = start(db, mailbox, marks, 1, 0.5)
    with db.connect() as conn:
        with pytest.raises(RuntimeError), everystep.transaction(conn):
            everystep.send(run, "in", "never")
            raise RuntimeError("roll back")
    db.run_pending()  # a timeout of a moment is waited on the run's thread
    assert status(db, run) == "completed"
    assert db.run(run)["result"] == [None]
    assert db.value("SELECT count(*) FROM everystep_message") == 0


def test_the_same_idempotency_key_sends_once(db, marks):
    run = start(db, mailbox, marks, 2, 0.5)
    assert send(db, run, "a", key="k1") is True
    assert send(db, run, "a again", key="k1") is False
    assert send(db, run, "b", key="k2") is True
    db.run_pending()
    assert db.run(run)["result"] == ["a", "b"]


def test_bad_input_is_one_clear_error_with_nothing_written(db, marks):
    done = start(db, publisher, marks)
    db.run_pending()
    waiting = start(db, mailbox, marks, 1)
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(EverystepError, match="no run"):
            everystep.send("01890000-0000-7000-8000-000000000000", "in", 1)
        with pytest.raises(EverystepError, match="is completed"):
            everystep.send(done, "in", 1)
        with pytest.raises(EverystepError, match="cannot|not"):
            everystep.send(waiting, "in", object())
        with pytest.raises(EverystepError, match="topic"):
            everystep.send(waiting, "", 1)
        with pytest.raises(EverystepError, match="run id"):
            everystep.send("nope", "in", 1)
    with db.connect() as conn, pytest.raises(EverystepError, match="transaction"):
        everystep.send(waiting, "in", 1, conn=conn)
    assert db.value("SELECT count(*) FROM everystep_message") == 0
    with pytest.raises(EverystepError, match="workflow body"):
        everystep.wait_for("in")
    with pytest.raises(EverystepError, match="workflow body"):
        everystep.set_event("k", 1)
    with pytest.raises(EverystepError, match="seconds"):
        everystep.wait_for("in", timeout=-1)
    with db.connect() as conn, pytest.raises(EverystepError, match="no run"):
        everystep.get_event("01890000-0000-7000-8000-000000000000", "k", 0, conn=conn)


def test_events_last_value_wins_and_a_replay_does_not_write_again(db, marks):
    run = start(db, publisher, marks)
    with db.connect() as conn:
        assert everystep.get_event(run, "stage", 0, conn=conn) is None  # not set yet: no wait
    db.run_pending()
    with db.connect() as conn:
        assert everystep.get_event(run, "stage", 1, conn=conn) == "second"
        assert everystep.get_event(run, "missing", None, conn=conn) is None  # the run ended: never set
        assert [e["key"] for e in everystep.db.load_events(conn, run)] == ["stage"]
    names = [s["name"] for s in db.steps(run)]
    assert names == ["everystep.set_event", "tests.apps.workflows.work", "everystep.set_event"]


def test_a_parked_wait_is_woken_by_send_and_a_timeout_by_its_deadline(db, marks, start_worker):
    worker = start_worker("w1", imports=IMPORTS)
    waiting = start(db, mailbox, marks, 1)
    timing_out = start(db, mailbox, marks, 1, 2.0)
    wait_for(lambda: status(db, waiting) == "waiting" and status(db, timing_out) == "waiting", 20,
             what="both runs parked")
    send(db, waiting, "hello")
    wait_for(lambda: status(db, waiting) == "completed", 10, what="the woken run completed")
    assert db.run(waiting)["result"] == ["hello"]
    wait_for(lambda: status(db, timing_out) == "completed", 20, what="the timed-out run completed")
    assert db.run(timing_out)["result"] == [None]
    with db.connect() as conn:
        assert everystep.get_event(waiting, "got", 5, conn=conn) == ["hello"]
    assert worker.alive()


def test_messages_across_a_worker_sigkill_are_consumed_exactly_once(db, marks, start_worker):
    run = start(db, mailbox, marks, 3)
    first = start_worker("w1", imports=IMPORTS)
    wait_for(lambda: status(db, run) == "waiting", 20, what="the run parked")
    for i in range(3):
        send(db, run, i)
    wait_for(lambda: any(tag == "got1" for _r, tag, _p in marks_of(marks)), 20, what="the second message handled")
    first.signal(signal.SIGKILL)
    first.wait()
    start_worker("w1", imports=IMPORTS)  # its catchup replays the run
    wait_for(lambda: status(db, run) == "completed", 30, what="the run completed after the kill")
    assert db.run(run)["result"] == [0, 1, 2]
    with db.connect() as conn:
        assert [m["consumed_by"] for m in everystep.db.load_messages(conn, run)] == ["1", "3", "5"]
    handled = [tag for r, tag, _pid in marks_of(marks) if r == str(run)]
    assert handled.count("got0") >= 1 and handled[-1] == "got2:end"


def test_messages_across_a_server_crash_are_consumed_exactly_once(private_server, marks, tmp_path):
    """PostgreSQL crashes (and comes back) between two messages: the worker
    weathers it, and every message is consumed by exactly one wait."""
    url = private_server.url
    with psycopg.connect(url, autocommit=True) as conn, everystep.transaction(conn):
        run = everystep.schedule(mailbox, marks, 3).id
    worker = WorkerProcess(url, "w-crash", tmp_path / "logs", imports=IMPORTS, grace=60)
    try:
        def run_status():
            with psycopg.connect(url, autocommit=True) as conn:
                return everystep.db.load_run(conn, run)["status"]

        def send_one(payload):
            with psycopg.connect(url, autocommit=True) as conn, everystep.transaction(conn):
                everystep.send(run, "in", payload)

        wait_for(lambda: run_status() == "waiting", 20, what="the run parked")
        send_one(0)
        send_one(1)
        wait_for(lambda: any(tag == "got1:end" for _r, tag, _p in marks_of(marks)), 20,
                 what="the second message handled")
        private_server.crash()
        send_one(2)
        wait_for(lambda: run_status() == "completed", 60, what="the run completed after the crash")
        with psycopg.connect(url, autocommit=True) as conn:
            assert everystep.db.load_run(conn, run)["result"] == [0, 1, 2]
            consumed = [m["consumed_by"] for m in everystep.db.load_messages(conn, run)]
        assert len(consumed) == 3 and len(set(consumed)) == 3 and None not in consumed
        assert worker.alive()
    finally:
        worker.close()
