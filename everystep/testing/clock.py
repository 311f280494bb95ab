"""Time travel on the database clock.

Every "now" of the engine is everystep_now(), a function of the schema
(migration 0012): delayed starts, durable sleeps, the deadlines of waits,
retries' back-offs, the fire times of recurring schedules, cancel requests,
the ends of runs. Moving it moves time for every session of the schema at
once, the workers' included, in one transaction. In a deployment it is the
server's now(), and costs nothing: the planner inlines it.
"""

from __future__ import annotations

import datetime
import math

import psycopg

from everystep import db
from everystep.errors import EverystepError
from everystep.testing import draining, server

# The most moments advance() stops at on its way (each one runs a drain).
MAX_STOPS = 10_000


def now(conn: psycopg.Connection) -> datetime.datetime:
    """The engine's time in this connection's schema (as of its transaction's start)."""
    with conn.transaction():
        return db.database_now(conn)


def advance(conn: psycopg.Connection, seconds: float | datetime.timedelta, *, drain: bool = True
            ) -> datetime.datetime:
    """Let `seconds` (or a timedelta) pass on the engine's clock of the
    connection's schema; returns the time it reads then.

    Time passes as it would for a running deployment: the clock stops at
    every moment something comes due on the way — a waiting run's due time
    (a delayed start, a sleep's end, a wait's deadline, a retry's back-off),
    a recurring schedule's fire time — and stands there while everything
    due then runs (`drain()`), so a loop of hourly sleeps, or an hourly
    schedule, runs 24 times in `advance(conn, 86400)`, each at its time, and
    what it records (the next wake time) counts from that moment. At the new
    time, what is due runs too; then the clock runs on from there (or stands
    still, if it was frozen). Each move is one transaction, seen by every
    session of the schema at once.

    `drain=False`: the clock jumps at once and nothing runs; what came due
    waits for a `drain()` or a worker (a schedule then fires once for the
    missed times, as its catch-up policy says)."""
    if isinstance(seconds, datetime.timedelta):
        seconds = seconds.total_seconds()
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise EverystepError(f"advance() takes a number of seconds >= 0 or a timedelta, not {seconds!r}")
    if not drain:
        with conn.transaction():
            return db.advance_clock(conn, float(seconds))
    _outside_a_transaction(conn, "advance()")
    database = server.resolve(conn)
    with conn.transaction():
        start = db.database_now(conn)
        until = start + datetime.timedelta(seconds=seconds)
        frozen = db.clock_frozen(conn)
        db.set_clock(conn, start, True)
    draining.drain_database(database)  # what is due already runs first, at the time it is now
    for _ in range(MAX_STOPS):
        # The clock stands at each moment while what is due then runs: a sleep
        # or a wait recorded then counts from that moment exactly.
        with conn.transaction():
            moment = db.next_due_moment(conn, until) or until
            db.set_clock(conn, moment, True)
        draining.drain_database(database)
        if moment == until:
            break
    else:
        raise EverystepError(f"advance() stopped {MAX_STOPS} times on its way and is not there yet: runs that "
                             "sleep or retry this often? advance(..., drain=False) jumps at once")
    with conn.transaction():
        return db.set_clock(conn, until, frozen)


def freeze(conn: psycopg.Connection, at: datetime.datetime | None = None) -> datetime.datetime:
    """Stop the engine's clock at `at` (an aware datetime; default: its time
    now): every "now" of the engine reads that until it is moved again
    (`advance` moves a frozen clock and leaves it frozen) or reset. Nothing
    runs. Returns the time it reads."""
    if at is not None and (not isinstance(at, datetime.datetime) or at.utcoffset() is None):
        raise EverystepError(f"freeze() takes an aware datetime, not {at!r}")
    with conn.transaction():
        return db.set_clock(conn, at or db.database_now(conn), True)


def reset_clock(conn: psycopg.Connection) -> None:
    """Back to the server's clock (a test's schema is dropped after it anyway)."""
    with conn.transaction():
        db.reset_clock(conn)


def _outside_a_transaction(conn: psycopg.Connection, what: str) -> None:
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:  # a savepoint would hide the time
        raise EverystepError(f"{what} moves time for every session and runs what comes due: call it outside a "
                             "transaction (with a connection in autocommit mode, as everystep_db is)")
