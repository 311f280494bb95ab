"""The history's upkeep: moving finished runs out of the hot tables, the
history's weekly partitions, retention by end status. Statements:
sql/history.sql (and the functions of 0017_history.sql)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import NamedTuple

import psycopg

from everystep.db import queries

LOCK_TIMEOUT = "2s"  # the longest a history transaction waits for a lock (then tries again later)


class Week(NamedTuple):
    week: datetime.date  # the Monday (UTC) the partition's runs were created from
    estimated_runs: int  # the planner's estimate (-1: never counted)


def history_ahead(conn: psycopg.Connection, weeks: int) -> int:
    """Create the partitions of this week and the `weeks` after it where
    missing; how many tables were created."""
    with conn.transaction():
        conn.execute(queries.get("history_lock"), {"timeout": LOCK_TIMEOUT})
        return conn.execute(queries.get("history_ahead"), {"weeks": weeks}).fetchone()[0]


class Moved(NamedTuple):
    candidates: int  # runs found to move (at most the limit)
    moved: int  # of them, the runs moved (the others were locked by someone else)
    cursor: datetime.datetime | None  # the creation time of the last candidate: where the next batch starts


def archive_batch(conn: psycopg.Connection, status: str, limit: int, after: float,
                  since: datetime.datetime | None = None) -> Moved:
    """Move up to `limit` runs of `status` that ended at least `after`
    seconds ago and were created at or after `since` (with their steps,
    messages and events) to the history, in one transaction. Keyed runs
    move only under the keys lock: when it is not had within LOCK_TIMEOUT (a
    long transaction that scheduled a keyed run holds it shared), this
    batch moves runs without a key only."""
    try:
        return _archive(conn, status, limit, after, since, keyed=True)
    except psycopg.errors.LockNotAvailable:
        return _archive(conn, status, limit, after, since, keyed=False)


def _archive(conn: psycopg.Connection, status: str, limit: int, after: float, since: datetime.datetime | None,
             keyed: bool) -> Moved:
    with conn.transaction():
        conn.execute(queries.get("history_lock"), {"timeout": LOCK_TIMEOUT})
        if keyed:
            conn.execute(queries.get("keys_lock"), {})
        ids, cursor, _created = conn.execute(queries.get("archive_candidates"), {
            "status": status, "since": since, "after": after, "keyed": keyed, "limit": limit}).fetchone()
        if not ids:
            return Moved(0, 0, since)
        return Moved(len(ids), conn.execute(queries.get("archive_batch"), {"ids": ids}).fetchone()[0], cursor)


def history_weeks(conn: psycopg.Connection) -> list[Week]:
    """The weeks the history has partitions for, oldest first."""
    return [Week(*row) for row in conn.execute(queries.get("history_weeks"), {})]


def _retention_params(retention: Mapping[str, float], terminal: tuple[str, ...]) -> dict:
    statuses = [status for status in terminal if status in retention]
    return {"kept": [status for status in terminal if status not in retention], "statuses": statuses,
            "seconds": [float(retention[status]) for status in statuses]}


def week_expired(conn: psycopg.Connection, week: datetime.date, retention: Mapping[str, float],
                 terminal: tuple[str, ...]) -> bool:
    """Whether every run of `week`'s partition is past the retention of its
    end status (`retention`: seconds by status; a terminal status left out
    is kept for ever), and the week is over."""
    return conn.execute(queries.get("week_expired"),
                        {"week": week, **_retention_params(retention, terminal)}).fetchone()[0]


def drop_week(conn: psycopg.Connection, week: datetime.date, retention: Mapping[str, float],
              terminal: tuple[str, ...]) -> int | None:
    """Drop `week`'s partitions if every run in them is expired (checked
    again under the history lock), with the schedules' records of their
    runs: how many runs they held, None when not dropped. A lock not had
    within LOCK_TIMEOUT (a reader of the history in a long transaction)
    leaves them for a later pass."""
    try:
        with conn.transaction():
            conn.execute(queries.get("history_lock"), {"timeout": LOCK_TIMEOUT})
            if not week_expired(conn, week, retention, terminal):
                return None
            runs = conn.execute(queries.get("week_runs"), {"week": week}).fetchone()[0]
            conn.execute(queries.get("drop_week_records"), {"week": week})
            conn.execute(queries.get("drop_week"), {"week": week})
            return runs
    except psycopg.errors.LockNotAvailable:
        return None


def retention_batch(conn: psycopg.Connection, status: str, seconds: float, limit: int) -> int:
    """Delete up to `limit` runs of `status` in the history that ended more
    than `seconds` ago, with their steps, messages, events and schedule
    records, in one transaction; how many runs."""
    with conn.transaction():
        conn.execute(queries.get("history_lock"), {"timeout": LOCK_TIMEOUT})
        return conn.execute(queries.get("retention_batch"),
                            {"status": status, "seconds": float(seconds), "limit": limit}).fetchone()[0]


def retention_batch_hot(conn: psycopg.Connection, status: str, seconds: float, limit: int) -> int:
    """Delete up to `limit` runs of `status` still in the hot table that
    ended more than `seconds` ago, in one transaction; how many runs."""
    with conn.transaction():
        return conn.execute(queries.get("retention_batch_hot"),
                            {"status": status, "seconds": float(seconds), "limit": limit}).fetchone()[0]


def count_expired(conn: psycopg.Connection, status: str, seconds: float) -> int:
    """How many runs of `status`, hot or in the history, ended more than `seconds` ago."""
    return conn.execute(queries.get("count_expired"), {"status": status, "seconds": float(seconds)}).fetchone()[0]
