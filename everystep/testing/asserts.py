"""What a test asserts on: the runs of a workflow, how a run ended, what a
step returned, the messages sent to a run. Each assertion fails with an
AssertionError that says what was found instead.

Every function reads with `conn` when given (inside the caller's
transaction, its uncommitted runs included), else with a connection of the
everystep_db fixture's schema.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import psycopg

from everystep import db, registry, serde
from everystep.schema import TERMINAL, RunStatus, StepStatus
from everystep.testing import server


class Run(NamedTuple):
    """A run as a test sees it: its arguments, result and error decoded."""
    id: uuid.UUID
    workflow: str  # module.qualname
    args: tuple
    status: str
    result: Any  # what the body returned (completed runs)
    error: BaseException | None  # what it raised (failed, stopped, blocked, cancelled runs)
    due_at: datetime.datetime
    created_at: datetime.datetime
    completed_at: datetime.datetime | None
    parent_id: uuid.UUID | None
    idempotency_key: str | None

    def __str__(self) -> str:
        return f"{self.id} {self.status:<9} {call_text(self.workflow, self.args)}"


class Message(NamedTuple):
    """A message sent to a run (everystep.send), in delivery order."""
    topic: str
    payload: Any
    consumed_by: str | None  # the step id of the wait that took it; None while none did
    idempotency_key: str | None
    created_at: datetime.datetime


@contextlib.contextmanager
def reading(conn: psycopg.Connection | None) -> Iterator[psycopg.Connection]:
    """`conn`, or a connection of the current test's schema."""
    if conn is not None:
        yield conn
        return
    with server.resolve(None).pool.connection() as pooled:
        yield pooled


def workflow_name(wf: Callable | str) -> str:
    name = wf if isinstance(wf, str) else registry.workflow_name(wf)
    if name is None:
        raise TypeError(f"expected an @workflow function or a workflow name, not {wf!r}")
    return name


def call_text(name: str, args: tuple) -> str:
    shown = ", ".join(repr(arg) for arg in args)
    return f"{name}({shown if len(shown) <= 200 else shown[:197] + '...'})"


def _run(row: dict) -> Run:
    args = serde.from_json(row["args"])
    return Run(row["id"], row["name"], tuple(args) if isinstance(args, list) else (args,), row["status"],
               serde.from_json(row["result"]) if row["result"] is not None else None,
               serde.decode_exception(row["error"]) if isinstance(row["error"], dict) else None,
               row["due_at"], row["created_at"], row["completed_at"], row["parent_id"], row["idempotency_key"])


def _statuses(status: str | tuple[str, ...] | None) -> tuple[str, ...] | None:
    return (status,) if isinstance(status, str) else status


def scheduled_runs(wf: Callable | str, *, conn: psycopg.Connection | None = None,
                   status: str | tuple[str, ...] | None = None) -> list[Run]:
    """The runs of a workflow (an @workflow function or its name), oldest
    first, whatever their status, or only of `status` (one or a tuple)."""
    name = workflow_name(wf)
    wanted = _statuses(status)
    with reading(conn) as c:
        runs = [_run(row) for row in db.runs_of_workflow(c, name)]
    return [run for run in runs if wanted is None or run.status in wanted]


def _matching(wf: Callable | str, args: tuple, conn: psycopg.Connection | None,
              status: str | tuple[str, ...] | None) -> tuple[str, list[Run], list[Run]]:
    name = workflow_name(wf)
    runs = scheduled_runs(name, conn=conn, status=status)
    wanted = serde.encode(list(args))
    return name, runs, [run for run in runs if not args or serde.encode(list(run.args)) == wanted]


def _description(name: str, args: tuple, status: str | tuple[str, ...] | None) -> str:
    what = call_text(name, args) if args else f"{name}(...)"
    statuses = _statuses(status)
    return what + (f" with status {' or '.join(statuses)}" if statuses else "")


def _listing(runs: list[Run], limit: int = 10) -> str:
    lines = [f"  {run}" for run in runs[:limit]]
    if len(runs) > limit:
        lines.append(f"  ... and {len(runs) - limit} more")
    return "\n".join(lines)


def assert_scheduled(wf: Callable | str, *args: Any, conn: psycopg.Connection | None = None,
                     status: str | tuple[str, ...] | None = None, count: int | None = None) -> list[Run]:
    """Assert that a run of the workflow with exactly these arguments was
    scheduled (any arguments when none are given): at least one such run, or
    exactly `count`, whatever its status or of `status`. Returns them."""
    name, runs, found = _matching(wf, args, conn, status)
    if (not found if count is None else len(found) != count):
        expected = "a run" if count is None else f"{count} run{'s' if count != 1 else ''}"
        message = f"expected {expected} of {_description(name, args, status)}, found {len(found)}"
        others = [run for run in runs if run not in found]
        if others:
            message += f"; the other runs of {name}:\n{_listing(others)}"
        elif found:
            message += f":\n{_listing(found)}"
        else:
            with reading(conn) as c:
                names = sorted({row["name"] for row in db.list_runs(c, None, None, 200)})
            message += (f"; no run of {name} at all" +
                        (f" (runs of: {', '.join(names)})" if names else " (no run in this schema)"))
        raise AssertionError(message)
    return found


def assert_not_scheduled(wf: Callable | str, *args: Any, conn: psycopg.Connection | None = None,
                         status: str | tuple[str, ...] | None = None) -> None:
    """Assert that no run of the workflow with these arguments (any, when
    none are given) was scheduled, or none of `status`."""
    name, _, found = _matching(wf, args, conn, status)
    if found:
        raise AssertionError(f"expected no run of {_description(name, args, status)}, found {len(found)}:\n"
                             f"{_listing(found)}")


def _load(conn: psycopg.Connection, run_id: uuid.UUID | str) -> tuple[dict, list[dict]]:
    run_id = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    row = db.load_run(conn, run_id)
    if row is None:
        raise AssertionError(f"no run {run_id} in this schema")
    return row, db.load_steps(conn, run_id)


def assert_ended(run_id: uuid.UUID | str, status: str = RunStatus.COMPLETED, *,
                 conn: psycopg.Connection | None = None) -> Run:
    """Assert that the run has ended with `status` (completed, failed,
    stopped, blocked or cancelled); returns it. The message says where a run
    that has not is, and why one ended otherwise."""
    if status not in (*TERMINAL, RunStatus.BLOCKED):
        raise ValueError(f"a run ends completed, failed, stopped, blocked or cancelled, not {status!r}")
    with reading(conn) as c:
        row, steps = _load(c, run_id)
        now = db.database_now(c) if row["status"] == RunStatus.WAITING else None
    run = _run(row)
    if run.status != status:
        raise AssertionError(f"run {run.id} ({run.workflow}) is {run.status}, not {status}: "
                             f"{_where(run, steps, now)}")
    return run


def _where(run: Run, steps: list[dict], now: datetime.datetime | None) -> str:
    """Why a run is where it is, in a few words."""
    last = steps[-1] if steps else None
    if run.status == RunStatus.WAITING:
        due = (run.due_at - now).total_seconds() if now is not None else 0
        what = "a delayed start" if not steps else _waiting_on(last)
        return (f"waiting for {what}, due at {run.due_at.astimezone(datetime.UTC):%Y-%m-%d %H:%M:%S}Z, "
                f"{due:.1f} s from the engine's now (move the clock: everystep.testing.advance)")
    if run.status == RunStatus.SCHEDULED:
        return "not run yet (drain it: everystep.testing.drain)"
    if run.status == RunStatus.RUNNING:
        return "held by an execution that has not ended (an injected crash? the next drain replays it)"
    if run.status == RunStatus.BLOCKED:
        started = [s for s in steps if s["status"] == StepStatus.STARTED]
        step = f"step {started[0]['step_id']} ({started[0]['name']})" if started else "a step"
        return f"{step} is unsafe to repeat and was started without a recorded outcome"
    if run.status == RunStatus.COMPLETED:
        return f"it returned {run.result!r}"
    failed = [s for s in steps if s["status"] == StepStatus.FAILED]
    error = f"{type(run.error).__name__}: {run.error}" if run.error is not None else "no error recorded"
    if failed and failed[-1]["error"]:
        return f"{error} (step {failed[-1]['step_id']}, {failed[-1]['name']}, failed)"
    return error


def _waiting_on(step: dict) -> str:
    if step["name"] == "everystep.sleep":
        return "the end of a sleep"
    if step["name"] == "everystep.wait_for" and step["status"] == StepStatus.STARTED:
        return f"a message on {step['result'].get('topic')!r}"
    if step["name"] == "everystep.result" and step["status"] == StepStatus.STARTED:
        return "a child run to end"
    if step["status"] == StepStatus.RETRYING:
        return f"the next attempt of step {step['step_id']} ({step['name']})"
    return "its time"


def step_result(run_id: uuid.UUID | str, step_id: str | Callable, *, conn: psycopg.Connection | None = None
                ) -> Any:
    """What the step with this id (or the first step of this @step function)
    returned in the run, as the replay would serve it. Fails if the step has
    no recorded result: not reached, failed (the message has its error),
    started without an outcome, or retrying."""
    with reading(conn) as c:
        _, steps = _load(c, run_id)
    name = getattr(step_id, "__everystep_step__", None)
    if name is None and not isinstance(step_id, str):
        raise TypeError(f"expected a step id or an @step function, not {step_id!r}")
    found = [s for s in steps if (s["name"] == name if name is not None else s["step_id"] == step_id)]
    if not found:
        recorded = ", ".join(f"{s['step_id']} ({s['name']})" for s in steps) or "none"
        raise AssertionError(f"run {run_id} has no step {name or step_id!r}; its recorded steps: {recorded}")
    step = found[0]
    if step["status"] == StepStatus.DONE:
        return serde.from_json(step["result"])
    if step["status"] == StepStatus.FAILED:
        error = step["error"] or {}
        raise AssertionError(f"step {step['step_id']} ({step['name']}) of run {run_id} failed: "
                             f"{error.get('type')}: {error.get('message')}")
    raise AssertionError(f"step {step['step_id']} ({step['name']}) of run {run_id} has no outcome yet: it is "
                         f"{step['status']}")


def messages_sent(run_id: uuid.UUID | str, *, conn: psycopg.Connection | None = None) -> list[Message]:
    """The messages sent to the run (everystep.send), in delivery order."""
    run_id = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    with reading(conn) as c:
        rows = db.load_messages(c, run_id)
    return [Message(row["topic"], serde.from_json(row["payload"]), row["consumed_by"], row["idempotency_key"],
                    row["created_at"]) for row in rows]
