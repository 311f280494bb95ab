"""Recurring schedules: the scheduler's lock and tick, the definitions and
their state. Statements: sql/schedules.sql."""

from __future__ import annotations

import datetime
import uuid

import psycopg

from everystep.db import queries
from everystep.db.rows import dicts
from everystep.schema import TERMINAL


class ScheduleRefused(Exception):
    """An operation on a schedule that does not apply to it (unknown, already retired)."""


def try_lock_scheduler(conn: psycopg.Connection) -> bool:
    """Take the scheduler's lock until the transaction ends, if no other scheduler holds it."""
    return conn.execute(queries.get("try_lock_scheduler"), {}).fetchone()[0]


def lock_scheduler(conn: psycopg.Connection) -> None:
    """Wait for the scheduler's lock and hold it until the transaction ends."""
    conn.execute(queries.get("lock_scheduler"), {})


def database_now(conn: psycopg.Connection) -> datetime.datetime:
    """The server's time (the transaction's start): the only clock schedules use."""
    return conn.execute(queries.get("database_now"), {}).fetchone()[0]


def load_schedules(conn: psycopg.Connection) -> list[dict]:
    """Every schedule, retired ones included, by key, with its last run's status."""
    return dicts(conn.execute(queries.get("load_schedules"), {}))


def due_schedules(conn: psycopg.Connection) -> list[dict]:
    """Live schedules whose next fire time has come (database time), locked
    until the transaction ends."""
    return dicts(conn.execute(queries.get("due_schedules"), {}))


def load_schedule(conn: psycopg.Connection, key: str, lock: bool = False) -> dict | None:
    """One schedule (retired or not) with its last run's status, or None;
    with `lock`, its row stays locked until the transaction ends."""
    rows = dicts(conn.execute(queries.get("load_schedule_for_update" if lock else "load_schedule"), {"key": key}))
    return rows[0] if rows else None


def put_schedule(conn: psycopg.Connection, key: str, definition: dict, next_fire_at: datetime.datetime,
                 source: str) -> None:
    """Write a schedule's definition (workflow, args as JSON text, cron,
    timezone, catchup, max_catchup, overlap, max_lateness_seconds, paused,
    auto_pause_after), its owner and its next fire time, adding the schedule
    or reviving a retired one. Every write is a new version."""
    conn.execute(queries.get("put_schedule"), {**definition, "key": key, "source": source,
                                               "next_fire_at": next_fire_at})


def retire_schedule(conn: psycopg.Connection, key: str, source: str | None = None) -> datetime.datetime:
    """Retire a live schedule: it never fires again (its row stays). Only
    its owner may, unless `source` is None (forced). Returns when. One
    statement, so it joins the caller's transaction or is its own."""
    row = conn.execute(queries.get("retire_schedule"), {"key": key, "source": source}).fetchone()
    if row is not None:
        return row[0]
    row = conn.execute(queries.get("schedule_owner"), {"key": key}).fetchone()
    if row is None:
        raise ScheduleRefused(f"no schedule {key!r}")
    if row[0] is not None:
        raise ScheduleRefused(f"schedule {key!r} was already retired at {row[0].isoformat(timespec='seconds')}")
    raise ScheduleRefused(f"schedule {key!r} belongs to source {row[1]!r}, not {source!r}: it is left alone")


def set_schedule_paused(conn: psycopg.Connection, key: str, paused: bool, next_fire_at: datetime.datetime | None,
                        reason: str | None = None) -> None:
    """Pause (with the reason, when the schedule paused itself) or resume a
    schedule, as a new version; resuming sets its next fire time."""
    conn.execute(queries.get("set_schedule_paused"),
                 {"paused": paused, "reason": reason, "next_fire_at": next_fire_at, "key": key})


def record_schedule_run(conn: psycopg.Connection, key: str, fire_at: datetime.datetime, run_id: uuid.UUID) -> None:
    """Remember the run a schedule made for a fire time."""
    conn.execute(queries.get("record_schedule_run"), {"key": key, "fire_at": fire_at, "run": run_id})


def schedules_failing(conn: psycopg.Connection) -> list[dict]:
    """Live, unpaused schedules with auto-pause whose latest `auto_pause_after`
    ended runs, made since their definition last changed, all failed: key,
    auto_pause_after and the latest failed run. Locked until the transaction ends."""
    return dicts(conn.execute(queries.get("schedules_failing"), {"ended": list(TERMINAL)}))


def auto_paused_schedules(conn: psycopg.Connection) -> int:
    """How many live schedules are paused because their runs kept failing."""
    return conn.execute(queries.get("auto_paused_schedules"), {}).fetchone()[0]


def advance_schedule(
    conn: psycopg.Connection,
    key: str,
    next_fire_at: datetime.datetime,
    fired_at: datetime.datetime | None,
    run_id: uuid.UUID | None,
) -> None:
    """Move a schedule past the fire times just decided, remembering the
    latest run it made (if any), and clear its error."""
    conn.execute(queries.get("advance_schedule"),
                 {"next_fire_at": next_fire_at, "fired_at": fired_at, "run": run_id, "key": key})


def set_schedule_error(conn: psycopg.Connection, key: str, error: str) -> None:
    """Record why a due schedule did not fire (its next fire time stays)."""
    conn.execute(queries.get("set_schedule_error"), {"error": error, "key": key})


def fire_schedule_now(conn: psycopg.Connection, key: str, new_id: uuid.UUID) -> uuid.UUID:
    """Schedule a run of a live schedule's workflow with its args now, outside
    its cron times; it becomes the schedule's last run."""
    with conn.transaction():
        lock_scheduler(conn)
        row = conn.execute(queries.get("fire_schedule_now"), {"key": key, "id": new_id}).fetchone()
    if row is None:
        raise ScheduleRefused(f"no live schedule {key!r}")
    return row[0]
