"""Run attributes: setting them from a held run, finding runs by them, and
the progress of the bulk actions on the runs a filter finds. Statements:
sql/attributes.sql."""

from __future__ import annotations

import datetime
import uuid
from typing import Any, NamedTuple

import psycopg

from everystep.db import queries
from everystep.db.fenced import _held
from everystep.db.rows import dicts
from everystep.db.session import Executor


class AttributeFilter(NamedTuple):
    """Which runs a search or a bulk action takes; None: no condition."""

    workflow: str | None = None
    statuses: list[str] | None = None
    contains: str | None = None  # JSON object the attributes contain (@>, indexed)
    since: datetime.datetime | None = None  # created at or after
    until: datetime.datetime | None = None  # created before


def _params(f: AttributeFilter, after: uuid.UUID | None, upto: uuid.UUID | None) -> dict[str, Any]:
    return {**f._asdict(), "after": after, "upto": upto}


class TooManyAttributes(Exception):
    """set_attributes would leave the run with more attributes than allowed; nothing was written."""


def set_attributes(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str,
                   attributes: str, max_keys: int) -> bool:
    """Record a set_attributes call as a step row and merge `attributes` (a
    JSON object) into the run's, in one statement. False if the run is not
    held by this execution or the row exists; TooManyAttributes if the merge
    would pass `max_keys` keys."""
    written, fits = conn.execute(queries.get("set_attributes"), {
        **_held(run, runner, token), "step_id": step_id, "name": name, "attributes": attributes,
        "max_keys": max_keys}).fetchone()
    if fits is False:
        raise TooManyAttributes(f"the run would have more than {max_keys} attributes")
    return bool(written)


# How far back find_runs looks for a page of runs with attributes, in turn:
# the runs created within each window of the newest (or of the page's
# cursor), then all of them. A common attribute fills its page from the
# newest runs; a rare one costs a few index probes more.
SEARCH_WINDOWS = (datetime.timedelta(hours=1), datetime.timedelta(days=1), datetime.timedelta(days=7),
                  datetime.timedelta(days=30), datetime.timedelta(days=365), None)


def find_runs(conn: psycopg.Connection, f: AttributeFilter, limit: int, after: uuid.UUID | None = None,
              upto: uuid.UUID | None = None) -> list[dict]:
    """One page of the runs `f` finds, newest first (by id), below `after`
    and at or below `upto`. With attributes, through their index, window
    by window (SEARCH_WINDOWS). Unprepared: see attributes.sql."""
    params = {**_params(f, after, upto), "limit": limit}
    if f.contains is None:
        return dicts(_unprepared(conn, queries.get("find_runs"), params))
    anchor = _moment_of(after or upto) or datetime.datetime.now(datetime.UTC)
    for window in SEARCH_WINDOWS if anchor.year > 1971 else (None,):
        rows = dicts(_unprepared(conn, queries.get("find_runs_by_attributes"),
                                 {**params, "from_at": None if window is None else anchor - window}))
        if len(rows) >= limit:
            break
    return rows


def runs_in_order(conn: psycopg.Connection, f: AttributeFilter, limit: int, after: uuid.UUID | None = None,
                  upto: uuid.UUID | None = None) -> list[dict]:
    """find_runs as one statement, whatever the filter: what a bulk action's
    chunks take, one after the other below the last one's oldest run, so
    that the runs are walked once in all (through the primary key, newest
    first, where the filter finds many)."""
    return dicts(_unprepared(conn, queries.get("find_runs"), {**_params(f, after, upto), "limit": limit}))


def _moment_of(run: uuid.UUID | None) -> datetime.datetime | None:
    """When a UUIDv7 was made (its first 48 bits: Unix milliseconds)."""
    if run is None:
        return None
    try:
        return datetime.datetime.fromtimestamp((run.int >> 80) / 1000, datetime.UTC)
    except (OverflowError, ValueError, OSError):  # not a UUIDv7 of these times: no window, all runs
        return None


def count_runs(conn: psycopg.Connection, f: AttributeFilter, after: uuid.UUID | None = None,
               upto: uuid.UUID | None = None) -> int:
    """How many runs `f` finds (below `after`, at or below `upto`)."""
    return _unprepared(conn, queries.get("count_runs"), _params(f, after, upto)).fetchone()[0]


def _unprepared(conn: Any, text: str, params: dict) -> Any:
    """Execute a finding statement planned with its values (Django's
    adapter, which binds on the client, never prepares)."""
    if isinstance(conn, psycopg.Connection):
        return conn.execute(text, params, prepare=False)
    return conn.execute(text, params)


class BulkProgress(NamedTuple):
    id: int
    total: int  # the runs the filter found at the start
    upto: uuid.UUID | None  # the newest of them
    cursor: uuid.UUID | None  # the oldest run acted on so far
    done: int
    refused: int
    resumed: bool  # an unfinished action of the same key was found


def open_bulk(conn: psycopg.Connection, key: str, action: str, filter_json: str, actor: str, source: str,
              total: int, upto: uuid.UUID | None) -> BulkProgress:
    """Start a bulk action, or find the unfinished one of the same key."""
    return BulkProgress(*conn.execute(queries.get("open_bulk"), {
        "key": key, "action": action, "filter": filter_json, "actor": actor[:255], "source": source,
        "total": total, "upto": upto}).fetchone())


class BulkCursor(NamedTuple):
    cursor: uuid.UUID | None
    done: int
    refused: int
    finished: bool


def lock_bulk(conn: psycopg.Connection, bulk: int) -> BulkCursor:
    """A bulk action's progress, locked to the end of the transaction."""
    return BulkCursor(*conn.execute(queries.get("lock_bulk"), {"id": bulk}).fetchone())


def advance_bulk(conn: psycopg.Connection, bulk: int, cursor: uuid.UUID, done: int, refused: int) -> None:
    """A chunk done: the cursor at its oldest run, the counts grown."""
    conn.execute(queries.get("advance_bulk"), {"id": bulk, "cursor": cursor, "done": done, "refused": refused})


def finish_bulk(conn: psycopg.Connection, bulk: int) -> tuple[int, int]:
    """Mark a bulk action finished: its (done, refused) counts."""
    done, refused = conn.execute(queries.get("finish_bulk"), {"id": bulk}).fetchone()
    return done, refused
