"""Writes about a held run, each conditional on the run being held by the
writing execution (its status, claimer and token), and the reads an
execution makes about its own run. Statements: sql/fenced.sql.

Step rows are written under a `FOR SHARE` lock of the run row, so a
concurrent requeue either waits for the step's commit or makes the insert
match nothing: an execution that lost its claim cannot slip a write in, not
even one of the same worker. A write that matches nothing (its function
returns False, None or an empty list) is explained by `why_not_written`.
"""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import psycopg

from everystep.db import libpq, queries
from everystep.db.queries import Plan, Query
from everystep.db.rows import (
    Attempt,
    CancelDelivery,
    Parking,
    Sleep,
    StepRow,
    StepState,
    TracedExecution,
    Wait,
    Written,
)
from everystep.db.session import Executor

# Why a fenced write matched nothing (see why_not_written).
WRITTEN = "written"  # this execution's own earlier attempt wrote it (its answer was lost)
LOST = "lost"  # the run is not held by this execution any more
OTHER = "other"  # the run is held, but the row was written by another execution


def _held(run: uuid.UUID, runner: str, token: int) -> dict[str, Any]:
    """The parameters that name the execution holding a run."""
    return {"run": run, "runner": runner, "token": token}


# ---------------------------------------------------------------- steps


def complete_started_step(conn: Executor, run: uuid.UUID, runner: str, token: int, row: StepRow) -> Written | bool:
    """Update a `started` (or `retrying`) step row in place with its outcome
    (the row may be an earlier execution's, when the unsafe mark was removed
    from the code); its recorded attempts stay."""
    found = conn.execute(queries.get("complete_started_step"), {**_held(run, runner, token), **row._asdict()},
                         prepare=True).fetchone()
    return False if found is None else Written(found[0])


def begin_step_transaction(conn: psycopg.Connection) -> None:
    """The first statement of a transactional step's transaction: its commit
    waits for the WAL flush (session.sql's durable_transaction)."""
    queries.run(conn, _durable_transaction())


async def abegin_step_transaction(aconn: psycopg.AsyncConnection) -> None:
    await queries.arun(aconn, _durable_transaction())


def _durable_transaction() -> Plan:
    yield Query("durable_transaction", {})


def record_transactional_step(conn: psycopg.Connection, run: uuid.UUID, runner: str, token: int, row: StepRow,
                              update: bool) -> Written | bool:
    """A transactional step's outcome, in the step's open transaction (see
    sql/fenced.sql): inserted, or with `update` the `retrying` (or
    `started`) row completed as complete_started_step does. False: not held
    by this execution, or the row holds an outcome already."""
    return queries.run(conn, _transactional_step(run, runner, token, row, update))


async def arecord_transactional_step(aconn: psycopg.AsyncConnection, run: uuid.UUID, runner: str, token: int,
                                     row: StepRow, update: bool) -> Written | bool:
    return await queries.arun(aconn, _transactional_step(run, runner, token, row, update))


def _transactional_step(run: uuid.UUID, runner: str, token: int, row: StepRow, update: bool) -> Plan:
    found = yield Query("complete_started_step" if update else "record_transactional_step",
                        {**_held(run, runner, token), **row._asdict()})
    return False if found is None else Written(found[0])


def record_attempt(conn: Executor, run: uuid.UUID, runner: str, token: int, row: StepRow, attempt: int,
                   wait: float) -> Attempt | bool:
    """Record failed attempt number `attempt` (its error in `row.error`) of a
    step that is tried again after `wait` seconds: the step's row is
    `retrying` (inserted, or updated from an earlier attempt's `retrying` or
    an unsafe step's `started`) and the attempt, timed by the database's
    clock, is appended to its attempts. False if the run is not held by this
    execution, or the row holds an outcome or this attempt already."""
    found = conn.execute(queries.get("record_attempt"), {
        **_held(run, runner, token), "attempt": attempt, "wait": wait, **row._asdict()}).fetchone()
    return False if found is None else Attempt(found[0], found[1])


def cancel_reason(conn: Executor, run: uuid.UUID) -> str | None:
    """The reason given with a run's cancel request."""
    row = conn.execute(queries.get("cancel_reason"), {"run": run}).fetchone()
    return None if row is None else row[0]


def deliver_cancel(conn: Executor, run: uuid.UUID) -> CancelDelivery:
    """The reason of the cancel a run's body is about to get: its request's,
    or 'deadline' for a run past its deadline without one (then written as
    its request)."""
    row = conn.execute(queries.get("deliver_cancel"), {"run": run}).fetchone()
    return CancelDelivery(None, False) if row is None else CancelDelivery(*row)


def step_row(conn: Executor, run: uuid.UUID, step_id: str) -> StepState | None:
    """(name, status) of one recorded step, or None."""
    row = conn.execute(queries.get("step_row"), {"run": run, "step_id": step_id}).fetchone()
    return None if row is None else StepState(*row)


def why_not_written(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str | None,
                    status: str) -> str:
    """Explain a fenced write that matched nothing: WRITTEN, LOST or OTHER.
    For a step (`step_id`): whether its row with `status` is this execution's
    own; for the end of the run (`step_id` None): whether this execution ended
    it with `status`."""
    if step_id is None:
        row = conn.execute(queries.get("why_not_written_end"), {**_held(run, runner, token), "status": status})
        row = row.fetchone()
        return WRITTEN if row and row[0] else OTHER if row and row[1] else LOST
    held, mine = conn.execute(queries.get("why_not_written_step"), {
        **_held(run, runner, token), "step_id": step_id, "status": status}).fetchone()
    return WRITTEN if mine else OTHER if held else LOST


_START_TRACED_EXECUTION = libpq.hot("start_traced_execution")


def start_traced_execution(conn: Executor, run: uuid.UUID, runner: str, token: int) -> TracedExecution | None:
    """Count one more traced execution of a held run and return its stored
    trace context and the number of this execution, or None if the run is
    not held by this execution. On the hot path's libpq calls: it comes with
    every traced execution."""
    result = libpq.run(conn, _START_TRACED_EXECUTION, _held(run, runner, token))
    if result.ntuples == 0:
        return None
    stored = json.loads(result.get_value(0, 0).decode())
    return TracedExecution(stored, stored["executions"])


# ---------------------------------------------------------------- time


def record_sleep(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str,
                 seconds: float | None, until: datetime.datetime | None) -> Sleep | bool:
    """Record a durable sleep as the step row `step_id` (status done), its
    result the wake time: `until`, or `seconds` from now by the database's
    clock. False if not held by this execution or the row exists."""
    found = conn.execute(queries.get("record_sleep"), {
        **_held(run, runner, token), "step_id": step_id, "name": name, "seconds": seconds, "until": until,
    }).fetchone()
    return False if found is None else Sleep(float(found[0]), float(found[1]))


def park_run(conn: Executor, run: uuid.UUID, runner: str, token: int, due_at: float) -> Parking | bool:
    """End this execution of a held run and leave it `waiting` until `due_at`
    (epoch seconds), claimed by nobody, and wake the workers to recompute
    their next due time — unless the time has come already or a cancel is
    requested (then nothing changes; Parking says which). One statement.
    False if the run is not held by this execution."""
    found = conn.execute(queries.get("park_run"), {**_held(run, runner, token), "due": due_at}).fetchone()
    return False if found is None else Parking(found[0], found[1])


# ---------------------------------------------------------------- waits, children, events


def begin_wait(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, topic: str,
               timeout: float | None) -> Wait | bool:
    """Record the start of a wait: its deadline (`timeout` seconds from now by
    the database's clock; None: none) in a `started` step row. False if the
    run is not held by this execution or the row exists."""
    row = conn.execute(queries.get("begin_wait"), {
        **_held(run, runner, token), "step_id": step_id, "name": name, "topic": topic, "timeout": timeout,
    }).fetchone()
    return False if row is None else Wait(row[0], 0, float(row[1]))


def _ended_wait(row: tuple | None) -> Wait | bool:
    return False if row is None else Wait(row[0], int(row[1]), float(row[2]))


def take_message(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, topic: str,
                 deadline: float | None) -> Wait | bool:
    """End a started wait if it can end: with the oldest message on its topic
    not consumed yet (marked consumed by this wait), or with a timeout once
    `deadline` (epoch seconds, database time) has passed; the run's
    `waiting_on` is cleared. Else nothing changes (result None) and `wakes`
    says how many messages the run had been sent as of this statement's
    snapshot, the one it found no message in. False if not held."""
    return _ended_wait(conn.execute(queries.get("take_message"), {
        **_held(run, runner, token), "step_id": step_id, "topic": topic, "deadline": deadline}).fetchone())


def start_child(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, child: uuid.UUID,
                child_name: str, args: str, timeout: float | None = None) -> Any:
    """Record the start of a child run as a step row (result {"child": id})
    and schedule the child (`parent_id` = this run), in one statement: the
    child exists only if the row was written here. Its deadline is the
    earlier of this run's and `timeout` seconds from now (its workflow's).
    Returns the recorded result, or False if the run is not held by this
    execution or the row exists."""
    row = conn.execute(queries.get("start_child"), {
        **_held(run, runner, token), "step_id": step_id, "name": name, "child": child, "child_name": child_name,
        "args": args, "timeout": timeout,
    }).fetchone()
    return False if row is None else row[0]


def take_child(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, child: uuid.UUID,
               deadline: float | None) -> Wait | bool:
    """End a started wait for a child run if it can end: with the child's end
    ({"status", "result", "error"}) once the child has ended, or with a
    timeout once `deadline` has passed; the run's `waiting_on` is cleared.
    Else nothing changes (result None); `wakes` as for `take_message`.
    False if not held."""
    return _ended_wait(conn.execute(queries.get("take_child"), {
        **_held(run, runner, token), "step_id": step_id, "child": child, "deadline": deadline}).fetchone())


def park_waiting(conn: Executor, run: uuid.UUID, runner: str, token: int, due_at: float | None, waiting_on: str,
                 wakes: int) -> Parking | bool:
    """End this execution of a held run and leave it `waiting` for
    `waiting_on` until `due_at` (None: for ever), claimed by nobody — unless
    a message came since the run looked (its count is not `wakes` any more)
    or a cancel is requested: then nothing changes and Parking says which.
    One statement. False if the run is not held by this execution."""
    found = conn.execute(queries.get("park_waiting"), {
        **_held(run, runner, token), "due": due_at, "on": waiting_on, "wakes": wakes}).fetchone()
    return False if found is None else Parking(found[0], found[1])


def set_event(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, key: str,
              value: str) -> bool:
    """Record a set_event call as a step row and write the event's value (the
    last one wins), in one statement. False if the run is not held by this
    execution or the step row exists."""
    row = conn.execute(queries.get("set_event"), {
        **_held(run, runner, token), "step_id": step_id, "name": name, "key": key, "value": value}).fetchone()
    return bool(row[0])
