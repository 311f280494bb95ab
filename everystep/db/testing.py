"""What everystep.testing reads and writes: the tests' schemas, the
engine's clock, the next moment something is due, and runs by workflow.
Statements: sql/testing.sql.

The clock is everystep_now() (0012_testing_clock.sql): every statement of
the engine asks it for the time. Setting it takes the owner of the schema's
functions, as a test's schema has.

A test's schema is created and dropped by name: the only statements here
with an identifier in them (as LISTEN's channel in session.py), composed
with psycopg's quoting, never from text."""

from __future__ import annotations

import datetime
import uuid

import psycopg
from psycopg import sql

from everystep.db import queries
from everystep.db.rows import dicts


def create_schema(conn: psycopg.Connection, schema: str) -> None:
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))


def drop_schema(conn: psycopg.Connection, schema: str) -> None:
    """The schema and everything in it."""
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def current_schema(conn: psycopg.Connection) -> str | None:
    """The schema a connection's unqualified names go to (session.sql's statement)."""
    return conn.execute(queries.get("current_schema"), {}).fetchone()[0]


def set_clock(conn: psycopg.Connection, at: datetime.datetime, frozen: bool | None) -> datetime.datetime:
    """The engine's clock of the schema reads `at` from now on, running on,
    or standing still (`frozen`), or as it did (None)."""
    return conn.execute(queries.get("set_clock"), {"at": at, "frozen": frozen}).fetchone()[0]


def advance_clock(conn: psycopg.Connection, seconds: float) -> datetime.datetime:
    """Move the engine's clock `seconds` forward; returns the time it reads."""
    return conn.execute(queries.get("advance_clock"), {"seconds": seconds}).fetchone()[0]


def clock_frozen(conn: psycopg.Connection) -> bool:
    """Whether the engine's clock stands still."""
    return conn.execute(queries.get("clock_frozen"), {}).fetchone()[0]


def reset_clock(conn: psycopg.Connection) -> None:
    """Back to the server's clock."""
    conn.execute(queries.get("reset_clock"), {})


def next_due_moment(conn: psycopg.Connection, until: datetime.datetime) -> datetime.datetime | None:
    """The earliest moment after the engine's now, and not after `until`, when
    a waiting run is due or a recurring schedule fires; None if none."""
    return conn.execute(queries.get("next_due_moment"), {"until": until}).fetchone()[0]


def runs_of_workflow(conn: psycopg.Connection, name: str) -> list[dict]:
    """The runs of the workflow `name`, oldest first (args, result and error as stored)."""
    return dicts(conn.execute(queries.get("runs_of_workflow"), {"name": name}))


def run_statuses(conn: psycopg.Connection, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    return dict(conn.execute(queries.get("run_statuses"), {"ids": ids}).fetchall())
