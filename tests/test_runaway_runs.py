"""Runs that would be lost or run away: an async step called without await
fails the run naming the step and the line; a body that loops for ever stops
at @workflow(max_steps=); a body that swallows `Cancelled` and goes on is
ended at a step call; schedule() in a body points to start()."""

from __future__ import annotations

import inspect

import everystep
from tests.apps import runaway_workflows as flows
from tests.support.processes import wait_for
from tests.support.ui_process import Client, UiProcess


def schedule(db, fn, *args):
    return db.schedule_many(fn, [args])[0].id


def error_of(db, run_id) -> dict:
    return db.run(run_id)["error"]


def test_an_async_step_never_awaited_fails_the_run_naming_the_step_and_the_line(db):
    run = schedule(db, flows.forgets_an_await)
    assert db.run_pending()[run] == "failed"
    source, first = inspect.getsourcelines(flows.forgets_an_await)
    line = first + next(i for i, text in enumerate(source) if "add(1, 2)" in text)
    assert error_of(db, run)["message"] == (
        f"step '1' (tests.apps.runaway_workflows.add) called at {inspect.getsourcefile(flows)}:{line} was never "
        "awaited, so it never ran: write `await add(...)`")
    assert db.steps(run) == []


def test_a_body_that_loops_for_ever_stops_at_max_steps_whatever_it_swallows(db):
    run = schedule(db, flows.loops_for_ever)
    assert db.run_pending()[run] == "failed"
    assert error_of(db, run)["message"] == (
        "the run went past its max_steps=50 at step '51': a body that loops for ever? (raise "
        "@workflow(max_steps=...), or None for no bound)")
    assert len(db.steps(run)) == 50


def test_a_body_that_swallows_cancelled_is_ended_cancelled(db, start_worker, tmp_path):
    start_worker("stubborn", imports=("tests.apps.runaway_workflows",))
    run = schedule(db, flows.swallows_cancel)
    wait_for(lambda: len(db.steps(run)) >= 5, what="the loop going")
    with db.connect() as conn, everystep.transaction(conn):
        assert everystep.cancel(run, "enough") == "running"
    wait_for(lambda: db.run(run)["status"] == "cancelled", what="the run ended, cancelled")
    error = error_of(db, run)
    assert error["type"] == "everystep.errors.Cancelled"
    assert error["message"].startswith("ended at step ") and error["message"].endswith(
        ": the body went on for 100 calls after its Cancelled (enough), more than a cleanup")
    statuses = [step["status"] for step in db.steps(run)]
    assert statuses.count("failed") == 1  # the Cancelled, delivered once; then 100 calls, and the next one refused
    assert statuses[statuses.index("failed") + 1:] == ["done"] * 100

    # The run page shows it: status cancelled, the reason in its error.
    ui = UiProcess(db.url, tmp_path / "ui")
    try:
        status, shown = Client(ui.url).get(f"/api/runs/{run}")
    finally:
        ui.close()
    assert status == 200 and shown["status"] == "cancelled" and shown["cancel_reason"] == "enough"
    assert "the body went on for 100 calls after its Cancelled" in shown["error"]["message"]


def test_schedule_in_a_workflow_body_points_to_start(db):
    run = schedule(db, flows.schedules_in_its_body)
    assert db.run_pending()[run] == "failed"
    assert error_of(db, run)["message"] == (
        "schedule() in a workflow body: start a child run with `everystep.start(workflow, *args)` instead "
        "(recorded once, not scheduled again by a replay); schedule() is for code outside workflows, in its own "
        "transaction")
