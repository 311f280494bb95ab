"""everystep.testing in this process: drain() through the real claim,
replay and commit code, the assertions and their messages, and the faults
a test injects into user code."""

from __future__ import annotations

import pytest

import everystep
from everystep import db
from everystep.testing import (
    DrainTimeout,
    advance,
    assert_ended,
    assert_not_scheduled,
    assert_scheduled,
    crash_after_step,
    crash_before_effect,
    drain,
    messages_sent,
    scheduled_runs,
    step_result,
)
from tests.apps import testing_flows as flows
from tests.support.engine import schedule_in as schedule

# ---------------------------------------------------------------- drain

def test_drain_runs_children_and_the_parents_they_wake(everystep_db):
    runs = [schedule(everystep_db, flows.spawner, 3), schedule(everystep_db, flows.parent, 4)]
    drained = drain()
    assert drained == {"completed": 9}  # the two parents and their seven children
    assert drained.executions > 9  # the spawner parked for each child, and was claimed again
    assert assert_ended(runs[0].id).result == [0, 10, 20]
    assert assert_ended(runs[1].id).result == [0, 10, 20, 30]  # children awaited in parallel branches


def test_drain_not_recursive_runs_only_what_was_runnable(everystep_db):
    run = schedule(everystep_db, flows.spawner, 1)
    assert drain(recursive=False) == {"waiting": 1}  # parked on its child, which did not run
    assert_scheduled(flows.child, 0, status="scheduled")
    assert drain() == {"completed": 2}
    assert_ended(run.id)


def test_drain_leaves_runs_waiting_for_their_time(everystep_db):
    schedule(everystep_db, flows.hourly, 2)
    assert drain() == {"waiting": 1}
    assert not drain()


def test_drain_gives_up_after_its_timeout_and_the_run_is_requeued(everystep_db):
    run = schedule(everystep_db, flows.slow_run, 0.6, 3)
    with pytest.raises(DrainTimeout, match=rf"1 runs still executing: {run.id} \(tests.apps.testing_flows.slow_run\)"):
        drain(timeout=0.2)
    assert db.load_run(everystep_db, run.id)["status"] == "scheduled"  # stopped at its next step, requeued
    assert drain() == {"completed": 1}


# ---------------------------------------------------------------- assertions

def test_assert_scheduled_and_its_messages(everystep_db):
    schedule(everystep_db, flows.later, "ann")
    schedule(everystep_db, flows.later, "bob", after=60)
    assert [run.args for run in assert_scheduled(flows.later)] == [("ann",), ("bob",)]
    [bob] = assert_scheduled(flows.later, "bob", status="waiting")
    assert bob.status == "waiting"
    assert_scheduled("tests.apps.testing_flows.later", "ann", count=1)
    with pytest.raises(AssertionError) as failed:
        assert_scheduled(flows.later, "cid")
    assert str(failed.value).splitlines()[0] == (
        "expected a run of tests.apps.testing_flows.later('cid'), found 0; "
        "the other runs of tests.apps.testing_flows.later:")
    assert "scheduled tests.apps.testing_flows.later('ann')" in str(failed.value)
    with pytest.raises(AssertionError, match=r"found 0; no run of tests.apps.testing_flows.report at all "
                                             r"\(runs of: tests.apps.testing_flows.later\)"):
        assert_scheduled(flows.report)
    with pytest.raises(AssertionError, match=r"expected 2 runs of .*later\('ann'\), found 1"):
        assert_scheduled(flows.later, "ann", count=2)
    assert_not_scheduled(flows.report)
    assert_not_scheduled(flows.later, "ann", status="completed")
    with pytest.raises(AssertionError, match=r"expected no run of .*later\('bob'\), found 1:\n  .* waiting "):
        assert_not_scheduled(flows.later, "bob")


def test_assert_scheduled_sees_the_callers_transaction(everystep_db):
    with everystep.transaction(everystep_db):
        everystep.schedule(flows.later, "inside")
        assert_scheduled(flows.later, "inside", conn=everystep_db)  # not committed yet: only conn sees it
    assert_scheduled(flows.later, "inside")


def test_assert_ended_says_where_a_run_is(everystep_db):
    waiting = schedule(everystep_db, flows.hourly, 1)
    fails = schedule(everystep_db, flows.retried, "never")
    drain()
    with pytest.raises(AssertionError, match=r"is waiting, not completed: waiting for the end of a sleep, due at "
                                             r".*Z, 3\d\d\d\.\d s from the engine's now \(move the clock"):
        assert_ended(waiting.id)
    with pytest.raises(AssertionError, match=r"is waiting, not completed: waiting for the next attempt of step 1"):
        assert_ended(fails.id)
    with pytest.raises(AssertionError, match="is scheduled, not completed: not run yet"):
        assert_ended(schedule(everystep_db, flows.later, "x").id)
    with pytest.raises(ValueError, match="not 'waiting'"):
        assert_ended(waiting.id, "waiting")


def test_step_results_and_messages(everystep_db):
    run = schedule(everystep_db, flows.approval, "ann")
    drain()
    with everystep.transaction(everystep_db):
        everystep.send(run.id, "approval", {"amount": 5}, idempotency_key="once")
    drain()
    assert step_result(run.id, "1") == "asked ann"
    assert step_result(run.id, flows.charge) == "ch_ann_5"
    assert step_result(run.id, "2") == {"message": {"amount": 5}}
    [message] = messages_sent(run.id)
    assert (message.topic, message.payload, message.consumed_by, message.idempotency_key) == (
        "approval", {"amount": 5}, "2", "once")
    with pytest.raises(AssertionError, match=r"has no step '9'; its recorded steps: 1 \(tests.apps.testing_flows"
                                             r".note\), 2 \(everystep.wait_for\), 3 \(tests.apps.testing_flows"
                                             r".charge\)"):
        step_result(run.id, "9")


def test_a_failed_step_result_says_its_error(everystep_db):
    run = schedule(everystep_db, flows.retried, "boom")
    drain()
    with pytest.raises(AssertionError, match="has no outcome yet: it is retrying"):
        step_result(run.id, "1")


# ---------------------------------------------------------------- faults

def test_a_crash_before_a_step_outcome_runs_it_again_at_the_replay(everystep_db):
    run = schedule(everystep_db, flows.pay, "ann")
    with crash_after_step(flows.note, before_outcome=True) as crash:
        drained = drain()
    assert (drained, drained.crashed, crash.fired) == ({"running": 1}, 1, 1)  # left as a SIGKILL leaves it
    assert flows.calls["order ann"] == 1
    assert drain() == {"completed": 1}  # the next drain's catchup replays it
    assert flows.calls["order ann"] == 2  # at least once: the outcome was not written yet
    assert flows.calls["charge"] == 1
    assert step_result(run.id, flows.note) == "order ann"


def test_a_crash_after_a_step_serves_its_committed_outcome_at_the_replay(everystep_db):
    run = schedule(everystep_db, flows.pay, "ann")
    with crash_after_step(flows.note) as crash:
        drained = drain()
    assert (drained, drained.crashed, crash.fired) == ({"running": 1}, 1, 1)
    [note] = [step for step in db.load_steps(everystep_db, run.id) if step["step_id"] == "1"]
    assert note["status"] == "done"  # committed before the crash
    assert drain() == {"completed": 1}
    assert flows.calls["order ann"] == 1  # served, not run again
    with crash_after_step("1"):
        schedule(everystep_db, flows.pay, "ann")
        drain()
    drain()
    assert flows.calls["order ann"] == 2  # a step id as the target: the same


def test_a_crash_before_the_effect_of_an_unsafe_step_blocks_the_run(everystep_db):
    run = schedule(everystep_db, flows.pay, "bob")
    with crash_before_effect(flows.charge, run=run.id):
        drain()
    assert drain() == {"blocked": 1}
    assert flows.calls["charge"] == 0  # the effect never happened, and nobody could tell
    with pytest.raises(AssertionError, match=r"is blocked, not completed: step 2 \(tests.apps.testing_flows.charge\) "
                                             "is unsafe to repeat and was started without a recorded outcome"):
        assert_ended(run.id)
    with pytest.raises(ValueError, match="is not an @step\\(unsafe_to_repeat=True\\)"):
        crash_before_effect(flows.note)


def test_a_run_that_keeps_crashing_fails_as_a_poison_run(everystep_db):
    run = schedule(everystep_db, flows.pay, "cid")
    with crash_after_step(flows.note, before_outcome=True, times=3):
        for _ in range(3):
            drain()
        assert drain() == {"failed": 1}
    assert_ended(run.id, "failed")
    assert "the worker died during 3 claims" in db.load_run(everystep_db, run.id)["error"]["message"]


def test_advance_runs_the_crashed_run_again_at_its_next_stop(everystep_db):
    run = schedule(everystep_db, flows.hourly, 2)
    drain()
    with crash_after_step(flows.note, before_outcome=True):
        advance(everystep_db, 2 * 3600)  # crashes at 1 h, replayed by the drain at 2 h: it sleeps from then
    assert flows.calls["hour 0"] == 2
    assert db.load_run(everystep_db, run.id)["status"] == "waiting"
    advance(everystep_db, 3600)
    assert assert_ended(run.id).result == ["hour 0", "hour 1"]


def test_scheduled_runs_decodes_what_it_returns(everystep_db):
    run = schedule(everystep_db, flows.child, 4)
    drain()
    [found] = scheduled_runs(flows.child, status=("completed", "failed"))
    assert (found.id, found.args, found.result, found.error, found.parent_id) == (run.id, (4,), 40, None, None)
