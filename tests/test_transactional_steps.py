"""@step(transactional=True): the step's database writes and its recorded
outcome commit together or not at all — exactly once for the database part,
across SIGKILLs of the worker before and after the commit, failed attempts,
and executions that lost their claim."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import everystep
from everystep import EverystepError, history
from everystep import db as store
from everystep.testing import assert_ended, drain, replay, server
from tests.apps import transactional_flows as flows
from tests.support.processes import wait_for

BOOKING = "CREATE TABLE booking (order_id text NOT NULL, line int NOT NULL)"


@pytest.fixture(autouse=True)
def _fresh_calls():
    flows.calls.clear()


@pytest.fixture
def booking(everystep_db):
    everystep_db.execute(BOOKING)
    return everystep_db


def booked(conn, order: str) -> list:
    return conn.execute("SELECT line FROM booking WHERE order_id = %s ORDER BY line", (order,)).fetchall()


def schedule(conn, fn, *args):
    with everystep.transaction(conn):
        return everystep.schedule(fn, *args)


@pytest.mark.parametrize("workflow", [flows.order, flows.aorder, flows.aorder_sync_step, flows.order_async_step])
def test_the_steps_writes_and_its_outcome_commit_together(booking, workflow):
    run = schedule(booking, workflow, "o-1")
    assert drain() == {"completed": 1}
    assert booked(booking, "o-1") == [(1,), (2,)]
    (step,) = [s for s in store.load_steps(booking, run.id) if s["name"].endswith("book")]
    assert (step["status"], step["result"]) == ("done", "booked o-1")
    assert assert_ended(run.id).result in (["booked o-1", "after"], "booked o-1")


def test_a_failed_attempt_rolls_its_writes_back(booking):
    run = schedule(booking, flows.flaky, "o-2")
    drain()
    assert assert_ended(run.id).result == "booked"
    assert flows.calls["o-2"] == 3
    assert booked(booking, "o-2") == [(1,)]  # the two failed attempts' inserts were rolled back
    (step,) = store.load_steps(booking, run.id)
    assert len(step["attempts"]) == 2


def test_an_outcome_that_cannot_be_stored_rolls_the_writes_back(booking):
    run = schedule(booking, flows.unstorable, "o-3")
    drain()
    assert "cannot store a value of type builtins.set" in str(assert_ended(run.id, "failed").error)
    assert booked(booking, "o-3") == []


def test_an_execution_that_lost_its_claim_commits_nothing(booking):
    # The run is requeued while the step runs: its outcome's fenced write
    # matches nothing, so the step's own insert is rolled back with it.
    run = schedule(booking, flows.losing_claim, "o-4", server.resolve(booking).url)
    assert drain(recursive=False) == {"scheduled": 1}  # abandoned, as the requeue left it
    assert booked(booking, "o-4") == []
    assert drain() == {"completed": 1}
    assert flows.calls["o-4"] == 2
    assert booked(booking, "o-4") == [(1,)]
    assert_ended(run.id)


@pytest.mark.parametrize("workflow", [flows.order_with_session, flows.aorder_with_session])
def test_a_sqlalchemy_session_writes_in_the_steps_transaction(booking, workflow):
    run = schedule(booking, workflow, "o-5")
    drain()
    assert assert_ended(run.id).result == "booked"
    assert flows.calls["o-5"] == 2
    assert booked(booking, "o-5") == [(1,), (2,)]  # the failed attempt's rows were rolled back
    # Sessions of this test's steps: a transaction left open on them touched
    # this schema's tables (other tests' sessions, other schemas', are theirs).
    idle = booking.execute("SELECT query FROM pg_stat_activity WHERE state LIKE 'idle in transaction%' "
                           "AND (query ILIKE '%booking%' OR query ILIKE '%savepoint%') AND pid IN ("
                           " SELECT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                           " WHERE c.relnamespace = current_schema()::regnamespace)")
    assert idle.fetchall() == []  # no session of the steps left in a transaction


def test_a_run_with_a_transactional_step_replays_in_the_replay_check(booking):
    run = schedule(booking, flows.order, "o-6")
    drain()
    checked = replay(history.export(booking, [run.id]))
    assert checked.ok and [c.replayed for c in checked] == [2]
    assert booked(booking, "o-6") == [(1,), (2,)]  # the check ran no step


def test_bad_options_and_calls_are_refused():
    with pytest.raises(EverystepError, match="transactional must be True or False"):
        everystep.step(transactional="yes")
    with pytest.raises(EverystepError, match="is exactly once for its database writes already"):
        everystep.step(transactional=True, unsafe_to_repeat=True)
    with pytest.raises(EverystepError, match="takes no timeout="):
        everystep.step(transactional=True, timeout=5)
    with pytest.raises(EverystepError, match=r"step_connection\(\) is for the body of a @step\(transactional=True\)"):
        everystep.step_connection()
    with pytest.raises(EverystepError, match=r"step_session\(\) is for the body of a @step\(transactional=True\)"):
        everystep.step_session()


def test_called_outside_a_run_it_uses_the_bound_connection(booking):
    with everystep.transaction(booking):
        assert flows.book("plain") == "booked plain"
    assert booked(booking, "plain") == [(1,), (2,)]


# ---------------------------------------------------------------- SIGKILLs of a real worker

def _kill_and_recover(db, start_worker, tmp_path, workflow, hold: str) -> None:
    with db.connect() as conn:
        conn.execute(BOOKING)
    marks = tmp_path / "marks"
    marks.mkdir()
    (run,) = db.schedule_many(workflow, [("o-kill", str(marks), hold)])
    worker = start_worker("w-tx", threads=2, imports=("tests.apps.transactional_flows",))
    wait_for(lambda: (marks / f"reached-{hold}").exists(), what=f"the step reaching {hold}")
    rows_before = db.value("SELECT count(*) FROM booking")
    worker.signal(signal.SIGKILL)
    assert worker.wait(10) == -signal.SIGKILL
    assert rows_before == (0 if hold == "before-commit" else 2)  # what another session saw at the kill
    start_worker("w-tx", threads=2, imports=("tests.apps.transactional_flows",))  # its catchup replays the run
    wait_for(lambda: db.run(run.id)["status"] == "completed", timeout=30, what="the run completed")
    assert db.query("SELECT line FROM booking WHERE order_id = 'o-kill' ORDER BY line") == [(1,), (2,)]
    pids = {Path(p).read_text() for p in marks.glob("reached-*")}
    assert len(pids) == 1 or hold == "before-commit"


@pytest.mark.parametrize("hold", ["before-commit", "after-commit"])
@pytest.mark.parametrize("workflow", [flows.order, flows.aorder], ids=["sync", "async"])
def test_a_sigkill_before_or_after_the_commit_leaves_exactly_one_set_of_rows(db, start_worker, tmp_path, workflow,
                                                                             hold):
    _kill_and_recover(db, start_worker, tmp_path, workflow, hold)
