"""The formatted traceback of each failed step attempt is kept (its last
16 kB) for the console: by the execution holding the run, one per attempt,
none for a deliberate `Terminal`."""

from __future__ import annotations

import time

from everystep import Terminal, serde, step, workflow
from tests.apps import console_workflows
from tests.support.processes import wait_for


@step
def explode(size: int) -> None:
    _deeper(size)


def _deeper(size: int) -> None:
    raise ValueError("x" * size)


@workflow
def fails(size: int) -> None:
    explode(size)


@step
def hand_off() -> None:
    raise Terminal("handed to a human")


@workflow
def stops() -> None:
    hand_off()


def tracebacks(db, run_id) -> list[tuple]:
    return db.query("SELECT step_id, attempt, traceback FROM everystep_step_traceback WHERE workflow_id = %s"
                    " ORDER BY step_id, attempt", (run_id,))


def test_a_failed_step_keeps_its_traceback(db):
    [run] = db.schedule_many(fails, [(10,)])
    db.run_pending()
    assert db.run(run.id)["status"] == "failed"
    [(step_id, attempt, text)] = tracebacks(db, run.id)
    assert (step_id, attempt) == ("1", 1)
    assert text.startswith("Traceback (most recent call last):")
    assert "in _deeper" in text and text.rstrip().endswith("ValueError: xxxxxxxxxx")
    assert "everystep/runner.py" not in text  # from the step's own frame: the engine's are left out
    assert text.splitlines()[1].strip().startswith(f'File "{__file__}"')


def test_each_retried_attempt_keeps_its_own(db):
    console_workflows.calls.clear()
    [run] = db.schedule_many(console_workflows.retried, [("r-1",)])
    deadline = time.monotonic() + 20
    while db.run(run.id)["status"] != "completed" and time.monotonic() < deadline:
        db.run_pending()
        time.sleep(0.02)
    assert db.run(run.id)["status"] == "completed"
    kept = tracebacks(db, run.id)
    assert [(s, a) for s, a, _ in kept] == [("1", 1), ("1", 2)]
    assert kept[0][2].rstrip().endswith("RuntimeError: try 1 failed")
    assert kept[1][2].rstrip().endswith("RuntimeError: try 2 failed")


def test_a_long_traceback_keeps_its_last_16_kb(db):
    [run] = db.schedule_many(fails, [(100_000,)])
    db.run_pending()
    [(_, _, text)] = wait_for(lambda: tracebacks(db, run.id), 5)
    assert len(text.encode()) <= serde.TRACEBACK_LIMIT + 100
    assert text.startswith("[the first ") and text.rstrip().endswith("x" * 100)


def test_a_terminal_is_a_stop_not_a_fault(db):
    [run] = db.schedule_many(stops, [()])
    db.run_pending()
    assert db.run(run.id)["status"] == "stopped"
    assert tracebacks(db, run.id) == []
