"""The engine's sessions: their settings, connections through a
transaction-mode pooler, liveness locks and LISTEN.

Durability: every connection the engine writes runs and steps on commits
synchronously (`prepare_session`), whatever the server, role or URL says: a
claim, a step row and a run's end are on disk before anyone acts on them (a
claim lost to a server crash would let a second worker run the same step at
the same time).
"""

from __future__ import annotations

import weakref
from typing import Any

import psycopg
from psycopg import pq, sql

from everystep.db import queries

# What the writes about a held run execute on: a connection, or a cursor of
# one (the runner reuses one cursor for all the writes of an execution).
Executor = psycopg.Connection | psycopg.Cursor

# Errors that mean "the database is away for now" (a restart, a failover to a
# server still read-only, a network cut): reconnect and retry, never give up a run.
CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction)


def prepare_session(conn: psycopg.Connection) -> None:
    """Make this session's commits wait for their WAL flush when the server,
    the role, the database or the URL turned that off. Stronger settings
    (remote_apply, ...) are kept."""
    conn.execute(queries.get("synchronous_commit"), {})


def prepare_claiming_session(conn: psycopg.Connection) -> None:
    """Plan like a session that claims runs (session.sql, claiming_settings, says why)."""
    conn.execute(queries.get("claiming_settings"), {})


def reset_claiming_session(conn: psycopg.Connection) -> None:
    """Back to the defaults, before the session goes back to a pool."""
    conn.execute(queries.get("reset_plan_cache_mode"), {})
    conn.execute(queries.get("reset_enable_bitmapscan"), {})
    conn.execute(queries.get("reset_enable_seqscan"), {})


def prepare_control_session(conn: psycopg.Connection, idle: int, interval: int, count: int) -> None:
    """Set up a worker's control connection (lock, LISTEN, claims, requeues):
    server-side TCP keepalives, so that the server drops the session of a
    vanished host, and so frees its lock, in seconds; commits synchronous like
    every engine session's (`prepare_session`); planned like a claiming
    session (`prepare_claiming_session`)."""
    user_timeout_ms = (idle + interval * count) * 1000
    conn.execute(queries.get("control_keepalives"), {
        "idle": str(idle), "interval": str(interval), "count": str(count), "user_timeout": str(user_timeout_ms)})
    prepare_session(conn)
    prepare_claiming_session(conn)


class _TransactionPooledCursor(psycopg.Cursor):
    """Every statement outside a transaction runs in one of its own that
    starts by making its commit synchronous; no statement is prepared."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> _TransactionPooledCursor:
        conn = self.connection
        if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            with conn.transaction():
                super().execute(queries.get("durable_transaction"), {}, prepare=False)
                return super().execute(query, params, prepare=False, binary=binary)
        return super().execute(query, params, prepare=False, binary=binary)


class TransactionPooledConnection(psycopg.Connection):
    """A connection through a pooler in transaction mode (PgBouncer's
    `pool_mode = transaction`): consecutive transactions may run on different
    server sessions, so nothing may rely on session state. No prepared
    statement (PgBouncer before 1.21 does not carry them across server
    sessions), and no session setting: each write sets synchronous_commit for
    its own transaction. The worker's pool uses it when the control session
    has a direct URL of its own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = _TransactionPooledCursor


def listen(conn: psycopg.Connection) -> str:
    """LISTEN for runs becoming claimable; returns the channel."""
    channel = "everystep:" + conn.execute(queries.get("current_schema"), {}).fetchone()[0]
    conn.execute(listen_statement(channel))
    return channel


# How many notifications psycopg received during its own statements on a
# connection that `notifications` reads, not yet counted by it (a notify
# handler counts them).
_received: weakref.WeakKeyDictionary[psycopg.Connection, list[int]] = weakref.WeakKeyDictionary()


def notifications(conn: psycopg.Connection) -> int:
    """How many notifications this listening connection received since the
    last call, without waiting: those psycopg read during its statements,
    those waiting in libpq's queue (the claim runs through libpq directly:
    everystep/db/libpq.py) and those on the socket. Read from libpq, not
    with psycopg's notifies(), whose set-up at every call was 40 us of a
    pickup at rest on a slow machine: the first call reads what psycopg
    kept so far and counts the later ones with a handler."""
    pgconn = conn.pgconn
    count = _received.get(conn)
    if count is None:
        received = len(list(conn.notifies(timeout=0)))
        count = _received[conn] = [0]

        def seen(_notify: psycopg.Notify) -> None:
            count[0] += 1

        conn.add_notify_handler(seen)
    else:
        pgconn.consume_input()
        received, count[0] = count[0], 0
    while pgconn.notifies() is not None:
        received += 1
    return received


def listen_statement(channel: str) -> sql.Composed:
    """LISTEN takes its channel as an identifier, which no statement parameter
    can be: the one statement composed in the data layer, from a channel name
    the database gave."""
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def ping(conn: psycopg.Connection) -> None:
    conn.execute(queries.get("ping"), {})


def try_lock(conn: psycopg.Connection, runner: str) -> bool:
    """Take the runner's session-level advisory lock if it is free."""
    return conn.execute(queries.get("try_lock"), {"runner": runner}).fetchone()[0]


def unlock(conn: psycopg.Connection, runner: str) -> None:
    conn.execute(queries.get("unlock"), {"runner": runner})
