"""Async workflows and steps: recorded and replayed like sync ones, step ids
taken at the call whatever order the loop runs things in, what a replay
could not repeat refused, and real worker processes: killed mid-gather,
an unsafe step across a kill, cancel preempting a step, a thousand runs
on one process's loop, a blocking call found out."""

from __future__ import annotations

import collections
import os
import signal

import pytest

import everystep
from everystep.liveness import DeadClaimerSweep
from tests.apps import async_workflows as flows
from tests.support.engine import schedule_one, step_ids
from tests.support.processes import wait_for


@pytest.fixture(autouse=True)
def _counters():
    flows.calls.clear()
    flows.attempts.clear()


def rows_by_id(db, run_id) -> dict:
    return {row["step_id"]: row for row in db.steps(run_id)}


# ---------------------------------------------------------------- in this process

def test_async_and_sync_steps_mix_in_one_run(db):
    run = schedule_one(db, flows.mixed, "m")
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == ["fetched m-a", "computed m-b", "fetched m-c", "fetched m-d"]
    steps = rows_by_id(db, run.id)
    assert sorted(steps) == ["1", "2", "3", "4"]
    assert [steps[i]["name"].rsplit(".", 1)[1] for i in "1234"] == ["fetch", "compute", "fetch", "fetch"]
    assert db.run_pending() == {}  # nothing runs twice
    assert set(flows.calls.values()) == {1}


def test_a_sync_workflow_calls_an_async_step(db):
    run = schedule_one(db, flows.sync_calls_async, "s")
    db.run_pending()
    assert db.run(run.id)["result"] == "fetched s"


def test_step_ids_are_taken_at_the_call_not_when_the_step_runs(db):
    run = schedule_one(db, flows.races, [0.15, 0.0, 0.07])
    db.run_pending()
    steps = rows_by_id(db, run.id)
    assert {step_id: row["args"] for step_id, row in steps.items()} == {
        "1": ["race-0", 0.15], "2": ["race-1", 0.0], "3": ["race-2", 0.07]}
    assert step_ids(db, run.id) == ["2", "3", "1"]  # recorded in the order they ended


def test_a_replay_after_a_crash_serves_the_gathered_steps_by_id(db):
    run = schedule_one(db, flows.races_then_crash, [0.15, 0.0, 0.07])
    with pytest.raises(flows.Crash):
        db.run_pending(runner="w1")
    assert db.resume_held("w1") == {run.id: "completed"}
    assert db.run(run.id)["result"] == ["fetched rc-0", "fetched rc-1", "fetched rc-2", "rc-crash"]
    assert flows.calls == {"rc-0": 1, "rc-1": 1, "rc-2": 1, "rc-crash": 2}


def test_tasks_a_body_starts_record_in_scopes_of_their_own(db):
    plain = schedule_one(db, flows.branches, [0.1, 0.0])
    gathered = schedule_one(db, flows.everystep_branches, [0.1, 0.0])
    db.run_pending()
    tags = {step_id: row["args"][0] for step_id, row in rows_by_id(db, plain.id).items()}
    assert tags == {"1.0.1": "b0-1", "1.0.2": "b0-2", "2.0.1": "b1-1", "2.0.2": "b1-2"}
    tags = {step_id: row["args"][0] for step_id, row in rows_by_id(db, gathered.id).items()}
    assert tags == {"1.0.1": "g0-1", "1.0.2": "g0-2", "1.1.1": "g1-1", "1.1.2": "g1-2"}
    assert db.run(gathered.id)["result"] == [["fetched g0-1", "fetched g0-2"], ["fetched g1-1", "fetched g1-2"]]


@pytest.mark.parametrize("workflow", [flows.waits_first, flows.as_completed_first])
def test_waiting_for_whichever_step_ends_first_is_refused(db, workflow):
    run = schedule_one(db, workflow, [0.05, 0.0])
    assert db.run_pending() == {run.id: "failed"}
    error = db.run(run.id)["error"]
    assert error["type"] == "everystep.errors.WorkflowCodeError"
    assert "asyncio.wait and asyncio.as_completed" in error["message"]


def test_parallel_in_an_async_workflow_points_to_gather(db):
    run = schedule_one(db, flows.uses_parallel)
    db.run_pending()
    assert "everystep.gather" in db.run(run.id)["error"]["message"]


def test_an_async_durable_sleep_parks_the_run(db):
    run = schedule_one(db, flows.sleeps, 1.5)
    assert db.run_pending() == {run.id: "sleeping"}
    assert db.run(run.id)["status"] == "waiting"
    wait_for(lambda: db.run_pending() == {run.id: "completed"}, timeout=10, interval=0.2)
    assert step_ids(db, run.id) == ["1", "2"]


def test_async_messages_events_children_patches_and_retries(db):
    waiting = schedule_one(db, flows.waits_for_message)
    parent = schedule_one(db, flows.parent, 3)
    retried = schedule_one(db, flows.retried, "r")
    db.run_pending()
    assert db.run(waiting.id)["status"] == "waiting"
    with db.connect() as conn, everystep.transaction(conn):
        everystep.send(waiting.id, "go", {"n": 1})
    db.run_pending()
    assert db.run(waiting.id)["result"] == {"n": 1}
    with db.connect() as conn:
        assert everystep.get_event(waiting.id, "got", conn=conn) == {"n": 1}
    for _ in range(5):  # the children, then the parent woken by each
        db.run_pending()
    assert db.run(parent.id)["result"] == [6, 8, True]
    assert step_ids(db, parent.id) == ["1", "2", "3", "4", "patch:extra"]
    assert db.run(retried.id)["result"] == "r"  # the back-off of a moment waited on the loop
    assert [len(s["attempts"] or []) for s in db.steps(retried.id)] == [2]


# ---------------------------------------------------------------- worker processes

def sweep_dead(db, grace: float = 0.0) -> list:
    """Requeue the runs of dead workers, as the maintenance child would."""
    with db.connect() as conn:
        return DeadClaimerSweep(grace, 3).sweep(conn)


def test_a_gather_killed_midway_replays_on_another_worker_with_the_same_ids(db, start_worker, marks, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    run = schedule_one(db, flows.gathered, marks, str(hold))
    first = start_worker("w-a", imports=("tests.apps.async_workflows",))
    wait_for(lambda: collections.Counter(flows.marks_of(marks)) == {"head": 1, "g0": 1, "g1": 1, "g2": 1}
             and "2" in rows_by_id(db, run.id), what="g0 recorded, g1 and g2 under way")
    first.kill()
    assert sweep_dead(db) == [run.id]
    hold.unlink()
    start_worker("w-b", imports=("tests.apps.async_workflows",))
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed on w-b")
    assert db.run(run.id)["result"] == ["head", "g0", "g1", "g2", "tail"]
    assert {step_id: row["args"][1] for step_id, row in rows_by_id(db, run.id).items()} == {
        "1": "head", "2": "g0", "3": "g1", "4": "g2", "6": "tail"}
    # Recorded steps are not run again; the two under way at the kill are (at least once).
    assert collections.Counter(flows.marks_of(marks)) == {"head": 1, "g0": 1, "g1": 2, "g2": 2, "tail": 1}


def test_an_unsafe_async_step_across_a_kill_blocks_the_run(db, start_worker, marks, tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    run = schedule_one(db, flows.unsafe_held, marks, str(hold))
    first = start_worker("w-a", imports=("tests.apps.async_workflows",))
    wait_for(lambda: flows.marks_of(marks), what="the effect started")
    first.kill()
    sweep_dead(db)
    start_worker("w-b", imports=("tests.apps.async_workflows",))
    wait_for(lambda: db.run(run.id)["status"] == "blocked", what="the run blocked")
    assert db.run(run.id)["error"]["type"] == "everystep.errors.EffectUncertain"
    assert [s["status"] for s in db.steps(run.id)] == ["started"]
    assert flows.marks_of(marks) == ["unsafe"]  # never run twice


@pytest.mark.parametrize("unsafe", [False, True])
def test_cancel_preempts_a_running_async_step(db, start_worker, marks, tmp_path, unsafe):
    hold = tmp_path / "hold"
    hold.touch()
    run = schedule_one(db, flows.held_then_more, marks, str(hold), unsafe)
    start_worker("w-a", imports=("tests.apps.async_workflows",))
    wait_for(lambda: flows.marks_of(marks), what="the step started")
    with db.connect() as conn, everystep.transaction(conn):
        assert everystep.cancel(run.id, "enough", conn=conn) == "running"
    ended = "blocked" if unsafe else "cancelled"
    wait_for(lambda: db.run(run.id)["status"] == ended, timeout=10, what=f"the run {ended}")
    assert hold.exists()  # the step never got to its end: it was cancelled at an await
    (step,) = db.steps(run.id)
    if unsafe:  # cancelled mid-effect: the effect may have happened
        assert step["status"] == "started" and db.run(run.id)["error"]["type"] == "everystep.errors.EffectUncertain"
    else:
        assert step["status"] == "failed" and step["error"]["type"] == "everystep.errors.Cancelled"
        assert db.run(run.id)["error"]["message"] == "enough"
    assert flows.marks_of(marks) == ["held"]


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_a_thousand_async_runs_on_one_process_hold_no_thread(db, start_worker):
    worker = start_worker("w-a", threads=2, async_slots=1000, imports=("tests.apps.async_workflows",))
    worker.wait_logged("holding the lock")
    idle = threads_of(worker.pid)
    napping = db.schedule_many(flows.naps, [(4.0,)] * 1000)
    running = lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running'")  # noqa: E731
    wait_for(lambda: running() == 1000, timeout=60, what="1,000 runs in flight at once")
    assert threads_of(worker.pid) <= idle + 20  # the loop, its few I/O and step threads: none per run
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'completed'") == 1000,
             timeout=90, what="the 1,000 runs completed")
    sleeping = db.schedule_many(flows.sleeps_long, [(600,)] * 1000)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'waiting'") == 1000,
             timeout=60, what="1,000 runs sleeping, parked")
    assert running() == 0  # a durable sleep gives its slot back
    assert threads_of(worker.pid) <= idle + 20
    assert len(napping) == len(sleeping) == 1000


def test_a_blocking_call_on_the_loop_is_reported_with_its_run_and_step(db, start_worker):
    worker = start_worker("w-a", imports=("tests.apps.async_workflows",))
    run = schedule_one(db, flows.blocking, 1.5)
    wait_for(lambda: db.run(run.id)["status"] == "completed", what="the run completed")
    worker.wait_logged("the event loop has been blocked for")
    line = next(line for line in worker.output().splitlines() if "the event loop has been blocked" in line)
    assert str(run.id) in line and "step 1 (tests.apps.async_workflows.blocks_the_loop)" in line
    assert "async_workflows.py" in line
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert os.path.exists(worker.log_path)
