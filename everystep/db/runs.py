"""Runs from the outside: scheduling, messages, cancelling, and reading
runs, their steps, messages, events and children. Statements: sql/runs.sql.

The functions that write join the caller's transaction: `conn` is a psycopg
connection, or the adapter of Django's (everystep.api), which binds
parameters on the client. Those the asyncio API uses are plans
(queries.Plan): `f(conn, ...)` runs one on a connection, `af(aconn, ...)`
the same statements on an AsyncConnection.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import psycopg

from everystep.db import queries
from everystep.db.queries import Plan, Query
from everystep.db.rows import NO_DEADLINE, CancelOutcome, Deadline, EventValue, Scheduled, Sent, dicts

# ---------------------------------------------------------------- scheduling


def _invisible(idempotency_key: str) -> psycopg.errors.SerializationFailure:
    """A run of this key exists, yet this transaction's snapshot does not show
    it: only possible in REPEATABLE READ or SERIALIZABLE."""
    return psycopg.errors.SerializationFailure(
        f"a run with idempotency key {idempotency_key!r} exists but is not visible to this transaction"
    )


def insert_run(
    conn: psycopg.Connection, run_id: uuid.UUID, name: str, args_json: str, idempotency_key: str | None,
    trace_context: str | None = None, at: datetime.datetime | None = None, after: float | None = None,
    deadline: Deadline = NO_DEADLINE, priority: int | None = None, default_priority: int = 0,
    concurrency_key: str | None = None, attributes: str | None = None,
) -> Scheduled:
    """Insert a run into the caller's transaction and notify the workers
    waiting for runs, if any (delivered at commit; see everystep_wake). It is
    due `at` a time, or `after` seconds from now by the database's clock, or
    at once; a run not due yet is `waiting`. With an idempotency key, an
    existing run of the same (name, key) is returned instead.
    `trace_context`: the scheduling span's context as JSON, when tracing is on.
    `deadline`: when it must be finished by (database time). `attributes`:
    its attributes as a JSON object (None: none)."""
    return queries.run(conn, _insert_run(run_id, name, args_json, idempotency_key, trace_context, at, after,
                                         deadline, (priority, default_priority, concurrency_key), attributes))


async def ainsert_run(aconn: psycopg.AsyncConnection, run_id: uuid.UUID, name: str, args_json: str,
                      idempotency_key: str | None, trace_context: str | None = None,
                      at: datetime.datetime | None = None, after: float | None = None,
                      deadline: Deadline = NO_DEADLINE, priority: int | None = None, default_priority: int = 0,
                      concurrency_key: str | None = None, attributes: str | None = None) -> Scheduled:
    """insert_run on an AsyncConnection."""
    return await queries.arun(aconn, _insert_run(run_id, name, args_json, idempotency_key, trace_context, at, after,
                                                 deadline, (priority, default_priority, concurrency_key), attributes))


def _insert_run(run_id: uuid.UUID, name: str, args_json: str, idempotency_key: str | None,
                trace_context: str | None, at: datetime.datetime | None, after: float | None,
                deadline: Deadline, flow: tuple[int | None, int, str | None], attributes: str | None) -> Plan:
    due_now = at is None and after is None and deadline == NO_DEADLINE
    priority, default_priority, concurrency_key = flow
    row = yield Query("insert_run" if due_now else "insert_run_at", {
        "id": run_id, "name": name, "args": args_json, "key": idempotency_key, "at": at, "after": after,
        "trace": trace_context, "deadline": deadline.at, "deadline_in": deadline.in_, "timeout": deadline.timeout,
        "priority": priority, "default_priority": default_priority, "ckey": concurrency_key,
        "attributes": attributes,
    })
    if row is not None:
        return Scheduled(row[0], True)
    existing = yield Query("keyed_run", {"name": name, "key": idempotency_key})
    if existing is None:
        raise _invisible(idempotency_key)
    return Scheduled(existing[0], False)


def insert_runs(
    conn: psycopg.Connection, name: str, run_ids: list[uuid.UUID], args_jsons: list[str],
    idempotency_keys: list[str | None], timeout: float | None = None, priority: int | None = None,
    default_priority: int = 0, concurrency_key: str | None = None, attributes: list[str | None] | None = None,
) -> list[Scheduled]:
    """Insert many scheduled runs of one workflow in one statement (one
    notification at most). Returns them in input order; a key that exists
    already, or repeats within the batch, gives the first run's id. The
    arrays go in binary where psycopg binds them (no array literal for the
    server to parse), and only the ids of created runs with a key come back.
    `timeout`: their deadline is that many seconds from now. `attributes`:
    each run's as a JSON object, or None (None: no run has any)."""
    binary = isinstance(conn, psycopg.Connection)
    return queries.run(conn, _insert_runs(name, run_ids, args_jsons, idempotency_keys, binary, timeout,
                                          (priority, default_priority, concurrency_key), attributes))


async def ainsert_runs(aconn: psycopg.AsyncConnection, name: str, run_ids: list[uuid.UUID], args_jsons: list[str],
                       idempotency_keys: list[str | None], timeout: float | None = None, priority: int | None = None,
                       default_priority: int = 0, concurrency_key: str | None = None,
                       attributes: list[str | None] | None = None) -> list[Scheduled]:
    """insert_runs on an AsyncConnection."""
    return await queries.arun(aconn, _insert_runs(name, run_ids, args_jsons, idempotency_keys, True, timeout,
                                                  (priority, default_priority, concurrency_key), attributes))


def _insert_runs(name: str, run_ids: list[uuid.UUID], args_jsons: list[str], idempotency_keys: list[str | None],
                 binary: bool, timeout: float | None, flow: tuple[int | None, int, str | None],
                 attributes: list[str | None] | None) -> Plan:
    keyed_created = (yield Query("insert_runs" if binary else "insert_runs_text", {
        "name": name, "ids": run_ids, "args": args_jsons, "keys": idempotency_keys, "timeout": timeout,
        "priority": flow[0], "default_priority": flow[1], "ckey": flow[2],
        "attributes": [None] * len(run_ids) if attributes is None else attributes}))[0]
    if not keyed_created and all(key is None for key in idempotency_keys):
        return [Scheduled(run_id, True) for run_id in run_ids]
    created = set(keyed_created)
    missing = [key for run_id, key in zip(run_ids, idempotency_keys) if key is not None and run_id not in created]
    existing = {}
    if missing:
        existing = dict((yield Query("keyed_runs", {"name": name, "keys": missing}, "all")))
    runs = []
    for run_id, key in zip(run_ids, idempotency_keys):
        if key is None or run_id in created:
            runs.append(Scheduled(run_id, True))
        elif key in existing:
            runs.append(Scheduled(existing[key], False))
        else:
            raise _invisible(key)
    return runs


# ---------------------------------------------------------------- messages, cancelling


def send_message(conn: psycopg.Connection, run: uuid.UUID, topic: str, payload: str, key: str | None) -> Sent:
    """Insert a message for a run into the caller's transaction, unless the
    run has ended (or the same idempotency key sent one already); count it on
    the run, and make the run due at once if it is parked waiting for this
    topic (the notification goes out at commit)."""
    return queries.run(conn, _send_message(run, topic, payload, key))


async def asend_message(aconn: psycopg.AsyncConnection, run: uuid.UUID, topic: str, payload: str,
                        key: str | None) -> Sent:
    """send_message on an AsyncConnection."""
    return await queries.arun(aconn, _send_message(run, topic, payload, key))


def _send_message(run: uuid.UUID, topic: str, payload: str, key: str | None) -> Plan:
    row = yield Query("send_message", {
        "run": run, "topic": topic, "payload": payload, "key": key, "on": f"message:{topic}"})
    return Sent(row[0], row[1])


def cancel_run(conn: psycopg.Connection, run: uuid.UUID, reason: str | None) -> CancelOutcome:
    """Cancel a run, in the caller's transaction, with one conditional UPDATE:
    a scheduled, waiting or blocked run is `cancelled` at once; a running one
    gets a durable cancel request that its execution honours at its next step
    boundary (and that the end of the run honours, whatever ends first). A
    finished run, or one with a request already, is left as it is."""
    return queries.run(conn, _cancel_run(run, reason))


async def acancel_run(aconn: psycopg.AsyncConnection, run: uuid.UUID, reason: str | None) -> CancelOutcome:
    """cancel_run on an AsyncConnection."""
    return await queries.arun(aconn, _cancel_run(run, reason))


def _cancel_run(run: uuid.UUID, reason: str | None) -> Plan:
    row = yield Query("cancel_run", {"run": run, "reason": reason})
    if row[0] is not None:
        return CancelOutcome(row[0], True)
    row = yield Query("run_status", {"run": run})
    return CancelOutcome(None if row is None else row[0], False)


# ---------------------------------------------------------------- reads


def get_event(conn: psycopg.Connection, run: uuid.UUID, key: str) -> EventValue:
    """The run's status (None if there is no such run), whether the event is
    set, and its value as JSON data."""
    return queries.run(conn, _get_event(run, key))


async def aget_event(aconn: psycopg.AsyncConnection, run: uuid.UUID, key: str) -> EventValue:
    """get_event on an AsyncConnection."""
    return await queries.arun(aconn, _get_event(run, key))


def _get_event(run: uuid.UUID, key: str) -> Plan:
    row = yield Query("get_event", {"run": run, "key": key})
    return EventValue(None, False, None) if row is None else EventValue(*row)


def load_run(conn: psycopg.Connection, run: uuid.UUID) -> dict | None:
    return queries.run(conn, _load_run(run))


async def aload_run(aconn: psycopg.AsyncConnection, run: uuid.UUID) -> dict | None:
    """load_run on an AsyncConnection."""
    return await queries.arun(aconn, _load_run(run))


def _load_run(run: uuid.UUID) -> Plan:
    rows = yield Query("load_run", {"run": run}, "dicts")
    return rows[0] if rows else None


def load_steps(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    return dicts(conn.execute(queries.get("load_steps"), {"run": run}))


def load_messages(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    """The messages sent to a run, in delivery order."""
    return dicts(conn.execute(queries.get("load_messages"), {"run": run}))


def load_events(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    return dicts(conn.execute(queries.get("load_events"), {"run": run}))


def children(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    """The runs a run started, oldest first."""
    return dicts(conn.execute(queries.get("children"), {"run": run}))


def list_runs(conn: psycopg.Connection, status: str | None, name: str | None, limit: int,
              parent: uuid.UUID | None = None) -> list[dict]:
    """The newest runs (without their payloads), optionally of one status,
    one workflow name and one parent run. Unprepared: see runs.sql."""
    params: dict[str, Any] = {"status": status, "name": name, "limit": limit, "parent": parent}
    return dicts(conn.execute(queries.get("list_runs"), params, prepare=False))
